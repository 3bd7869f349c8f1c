"""Real chat templates of the model families people drive agents with, and tiny model dirs wearing them.

The templates are the ones llama.cpp keeps for its template tests (``models/templates/*.jinja``, copied
from each model's Hugging Face repository). They reach us through a package registry, not the hub: the
pinned ``llama-cpp-python`` sdist on PyPI vendors llama.cpp whole. ``fetch(out_dir)`` runs ``pip download``
once, checks the sdist's sha256, and extracts only the templates named in :data:`FAMILIES` into
``out_dir`` (published with one ``os.replace``). Nothing here is committed to this repository.

``family_dir(tiny_dir, family, templates_dir, out)`` copies the tiny model directory and gives it the
family's template and the family's marker strings as added tokens, so mlx-lm's ``TokenizerWrapper`` infers
the family's tool parser and think markers exactly as it does for the real model. The embedding table
grows by one random row per added token, so the directory also runs (a tiny random model that happens to
speak through the family's template).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.models.publish import publish

SDIST_REQUIREMENT = "llama-cpp-python==0.3.36"
SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBER_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
SOURCE_FILE = "tiered_kv_source.json"
DEFAULT_NAME = "chat-templates"


class FetchError(RuntimeError):
    """Fetching the templates failed; the message is one line meant for the user."""


@dataclass(frozen=True)
class Family:
    """One model family: its template file (in llama.cpp's ``models/templates/``), the marker strings
    its real tokenizer holds as single tokens, and its BOS string (templates print ``bos_token``)."""

    template: str
    tokens: tuple[str, ...]
    bos: str = ""
    parser: str | None = None  # the mlx-lm tool parser its template selects (None: mlx-lm has none)
    eos: str = "<|im_end|>"  # what the model writes to end its turn (never fed back into the cache)
    special: bool = False  # its real tokenizer marks the markers special (grammars name them so)


_QWEN = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
         "<tool_response>", "</tool_response>")  # fmt: skip
_GLM = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
        "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
        "</arg_value>", "<tool_response>", "</tool_response>")  # fmt: skip
_KIMI = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
         "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>")  # fmt: skip
_MISTRAL = ("<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]",
            "[CALL_ID]")  # fmt: skip
# Mistral Nemo's (Tekken v3): no [ARGS] / [CALL_ID] yet, its calls a JSON list
_MISTRAL_V3 = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
               "[TOOL_RESULTS]", "[/TOOL_RESULTS]")  # fmt: skip
_GEMMA4 = ("<bos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
           "<tool_response|>", "<|tool>", "<tool|>", '<|"|>', "<|channel>", "<channel|>",
           "<|think|>")  # fmt: skip

_COHERE = ("<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>",
           "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_ACTION|>", "<|END_ACTION|>", "<|START_THINKING|>",
           "<|END_THINKING|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>")  # fmt: skip

_HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

FAMILIES: dict[str, Family] = {
    "qwen3-coder": Family("Qwen3-Coder.jinja", _QWEN, parser="qwen3_coder"),
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", _QWEN, parser="json_tools"),
    "glm-4.6": Family("GLM-4.6.jinja", _GLM, parser="glm47", eos="<|observation|>"),
    "glm-4.7": Family("GLM-4.7-Flash.jinja", _GLM, parser="glm47", eos="<|observation|>"),
    "kimi-k2": Family("moonshotai-Kimi-K2.jinja", _KIMI, parser="kimi_k2"),
    "kimi-k2-thinking": Family(
        "Kimi-K2-Thinking.jinja", _KIMI + ("<think>", "</think>"), parser="kimi_k2"
    ),
    # its tags after a namespace token (]<]minimax[>[<invoke name="NAME">), <mm:think>: neither known to
    # mlx-lm (which takes the template for a JSON one)
    "minimax-m3": Family("MiniMax-M3.jinja", ("]~!b[", "]~b]", "[e~[", "]<]minimax[>[", "<mm:think>", "</mm:think>"),
                         eos="[e~["),  # fmt: skip
    # every tag ending :opensource (<tool_call:opensource>NAME<tool_sep:opensource>, GLM-like keys and
    # values), its think markers too: neither known to mlx-lm
    "hy3": Family("tencent-Hy3.jinja", tuple(f"<{t}:opensource>" for t in (
        "think", "/think", "tool_calls", "/tool_calls", "tool_call", "/tool_call", "tool_sep", "arg_key", "/arg_key",
        "arg_value", "/arg_value", "tool_responses", "/tool_responses", "tool_response", "/tool_response")) + tuple(
        f"<｜hy_{t}:opensource｜>" for t in ("begin_of_sentence", "User", "Assistant", "eos")), eos="<｜hy_eos:opensource｜>"),  # fmt: skip
    # XTML markup (<|open|>NAME ATTRS<|sep|> … <|close|>NAME<|sep|>): mlx-lm finds its think and call
    # markers and its answer's structural markers by these four tokens
    "kimi-k3": Family("Kimi-K3.jinja", ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"), parser="kimi_k3",
                      eos="<|end_of_msg|>"),  # fmt: skip
    "minimax-m2": Family(
        "MiniMax-M2.jinja",
        (
            "]~!b[",
            "]~b]",
            "[e~[",
            "<think>",
            "</think>",
            "<minimax:tool_call>",
            "</minimax:tool_call>",
        ),  # fmt: skip
        parser="minimax_m2",
        eos="[e~[",
    ),
    "devstral": Family(
        "unsloth-mistral-Devstral-Small-2507.jinja",
        _MISTRAL,
        bos="<s>",
        parser="mistral",
        eos="</s>",
    ),
    "mistral-small-3.2": Family(
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        _MISTRAL,
        bos="<s>",
        parser="mistral",
        eos="</s>",
    ),
    "mistral-nemo": Family(
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        _MISTRAL_V3,
        bos="<s>",
        parser="mistral",
        eos="</s>",
    ),
    "gemma-4": Family(
        "google-gemma-4-31B-it.jinja", _GEMMA4, bos="<bos>", parser="gemma4", eos="<turn|>"
    ),
    # no tools in its template (they are injected, Hermes-style) and no system turn: it raises on one
    "gemma-2": Family(
        "google-gemma-2-2b-it.jinja", ("<bos>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>",
        eos="<end_of_turn>",
    ),
    "lfm2.5": Family(
        "LFM2.5-8B-A1B.jinja",
        (
            "<|startoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "<think>",
            "</think>",
        ),  # fmt: skip
        bos="<|startoftext|>",
        parser="pythonic",
    ),
    # LFM2's Python calls (mlx-lm's pythonic parser, by the template's <|tool_list_start|>); its template
    # renders each message's content alone, so calls go back into it
    "lfm2-8b": Family("LFM2-8B-A1B.jinja", ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>",
                      "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>",
                      "<|tool_response_end|>"), bos="<|startoftext|>", parser="pythonic"),  # fmt: skip
    "llama-3.3": Family(
        "meta-llama-Llama-3.3-70B-Instruct.jinja",
        (
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),  # fmt: skip
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "deepseek-r1-distill": Family(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        (
            "<｜begin▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜end▁of▁sentence｜>",
            "<think>",
            "</think>",
        ),  # fmt: skip
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
    ),
    "gpt-oss": Family("openai-gpt-oss-120b.jinja", _HARMONY, eos="<|return|>", special=True),
    # calls in its DSML markup (``<｜DSML｜function_calls>``): mlx-lm has no parser, ours reads them
    # calls as JSON between markers of their own (mlx-lm has no parser; ours finds the markers by
    # rendering a call, chat.template_call_block): a list of {"name", "arguments"}
    "nemotron-nano-v2": Family(
        "NVIDIA-Nemotron-Nano-v2.jinja",
        ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>",
         "<TOOL_RESPONSE>", "</TOOL_RESPONSE>", "<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>"),
        eos="<SPECIAL_12>",
    ),  # fmt: skip
    # ... a list of {"tool_call_id", "tool_name", "parameters"}
    "command-r7b": Family(
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
        (*_COHERE, "<|START_RESPONSE|>", "<|END_RESPONSE|>"),
        bos="<BOS_TOKEN>",
        eos="<|END_OF_TURN_TOKEN|>",
    ),
    # ... as Command R7B's, its text in <|START_TEXT|> (every role's), thinking on by default
    "cohere2-moe": Family(
        "Cohere2MoE.jinja",
        (*_COHERE, "<|START_TEXT|>", "<|END_TEXT|>"),
        bos="<BOS_TOKEN>",
        eos="<|END_OF_TURN_TOKEN|>",
    ),
    # ... a list of {"name", "arguments", "id"}; its reasoning ends at the text [BEGIN FINAL RESPONSE]
    "apriel-1.6": Family("Apriel-1.6-15b-Thinker-fixed.jinja", ("<|begin_system|>", "<|begin_user|>",
                         "<|begin_assistant|>", "<|begin_tool_result|>", "<|begin_content|>", "<|end|>"), eos="<|end|>"),  # fmt: skip
    # ... a list of {"name", "arguments"} after <|tool_call|>, which its instructions name and its
    # template never writes back (it renders each message's content alone)
    "granite-3.3": Family("ibm-granite-granite-3.3-2B-Instruct.jinja", ("<|start_of_role|>", "<|end_of_role|>",
                          "<|end_of_text|>", "<|tool_call|>", "<|start_of_cite|>", "<|end_of_cite|>"),
                          eos="<|end_of_text|>"),  # fmt: skip
    # ... a list of {NAME: ARGUMENTS}
    "apertus": Family(
        "Apertus-8B-Instruct.jinja",
        ("<s>", "<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>",
         "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>", "<|inner_prefix|>",
         "<|inner_suffix|>", "<|tools_prefix|>", "<|tools_suffix|>"),
        bos="<s>",
        eos="<|assistant_end|>",
    ),  # fmt: skip
    # ... one {"name", "arguments"} after its opener, to the turn's end
    "gigachat-3.1": Family(
        "GigaChat3.1-10B-A1.8B.jinja", ("<s>", "<|message_sep|>", "<|role_sep|>", "<|function_call|>"),
        bos="<s>",
        eos="<|message_sep|>",
    ),
    # Qwen3-Coder's XML calls in a block of its own (<seed:tool_call>), its own think markers: neither
    # known to mlx-lm; its template sets its own bos / eos strings
    "seed-oss": Family(
        "ByteDance-Seed-OSS.jinja",
        ("<seed:bos>", "<seed:eos>", "<seed:think>", "</seed:think>", "<seed:tool_call>", "</seed:tool_call>",
         "<seed:cot_budget_reflect>", "</seed:cot_budget_reflect>"),
        eos="<seed:eos>",
    ),  # fmt: skip
    # no tools in its template (the server writes DeepSeek's instructions into the system turn), calls
    # written back in its own markup: mlx-lm has no parser, ours reads them
    "deepseek-v3.1": Family(
        "deepseek-ai-DeepSeek-V3.1.jinja",
        ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>",
         "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
         "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
    ),  # fmt: skip
    "deepseek-v3.2": Family(
        "deepseek-ai-DeepSeek-V3.2.jinja",
        ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>"),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
    ),
}


def default_dir(models_dir: Path) -> Path:
    return Path(models_dir) / DEFAULT_NAME


def is_complete(out_dir: Path) -> bool:
    """Fetched, and holding every template :data:`FAMILIES` names (the list may have grown)."""
    out_dir = Path(out_dir)
    return (out_dir / SOURCE_FILE).is_file() and all(
        (out_dir / f.template).is_file() for f in FAMILIES.values()
    )


def _download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--quiet", SDIST_REQUIREMENT, "-d", str(dest)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sdist = dest / SDIST_NAME
    if proc.returncode != 0 or not sdist.is_file():
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise FetchError(f"pip download {SDIST_REQUIREMENT} failed: {lines[-1] if lines else '?'}")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise FetchError(f"{SDIST_NAME}: sha256 {digest} is not the pinned {SDIST_SHA256}")
    return sdist


def _extract(sdist: Path, out: Path) -> None:
    wanted = {MEMBER_DIR + f.template: f.template for f in FAMILIES.values()}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            name = wanted.pop(member.name, None)
            if name is None or not member.isfile():
                continue
            src = tar.extractfile(member)
            assert src is not None
            (out / name).write_bytes(
                src.read()
            )  # our own file name: nothing in the archive is a path
    if wanted:
        raise FetchError(f"{SDIST_NAME} lacks {', '.join(sorted(wanted.values()))}")


def fetch(out_dir: Path) -> Path:
    """The family templates in ``out_dir`` (a no-op when already there). Raises :class:`FetchError`."""
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir

    def build(tmp: Path) -> None:
        work = tmp / ".download"
        work.mkdir()
        _extract(_download(work), tmp)
        shutil.rmtree(work)
        source = {"sdist": SDIST_REQUIREMENT, "sha256": SDIST_SHA256, "members": MEMBER_DIR}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))

    return publish(out_dir, build, FetchError, lambda: is_complete(out_dir))


def read_template(templates_dir: Path, family: str) -> str:
    return (Path(templates_dir) / FAMILIES[family].template).read_text(encoding="utf-8")


def _grow_vocab(model_dir: Path, vocab: int) -> None:
    """Embedding rows (tied with the output layer) for the added tokens: deterministic random values."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"]
    extra = vocab - emb.shape[0]
    if extra <= 0:
        return
    rows = np.random.default_rng(extra).standard_normal((extra, emb.shape[1])).astype(emb.dtype)
    weights["model.embed_tokens.weight"] = np.concatenate([emb, rows * emb.std()])
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "mlx"})
    cfg["vocab_size"] = vocab
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def family_dir(tiny_dir: Path, family: str, templates_dir: Path, out: Path) -> Path:
    """A copy of ``tiny_dir`` whose tokenizer wears ``family``'s chat template and marker tokens."""
    from tokenizers import AddedToken, Tokenizer

    spec = FAMILIES[family]
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    for f in Path(tiny_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, tmp / f.name)
    tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False, special=spec.special) for t in spec.tokens])
    tok.save(str(tmp / "tokenizer.json"))
    _grow_vocab(tmp, tok.get_vocab_size())
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = read_template(templates_dir, family)
    cfg.pop("added_tokens_decoder", None)  # the added tokens live in tokenizer.json
    if spec.bos:
        cfg["bos_token"] = spec.bos
    cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2))
    (tmp / "chat_template.jinja").unlink(missing_ok=True)
    os.replace(tmp, out)
    return out
