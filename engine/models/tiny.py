"""A deterministic random-weight mlx-lm **llama** model with a locally trained byte-level BPE tokenizer.

``build(out_dir, size, seed)`` writes a standard mlx-lm directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML + tools ``chat_template``) without any hub access.
Same ``size`` and ``seed`` → byte-identical files. The tokenizer is trained on a fixed generated corpus
(English-ish prose, Python, JSON, ChatML tool calls), so every size and seed shares one tokenizer.

Sizes: ``test`` (2 layers, hidden 64) loads and prefills in milliseconds; ``bench`` (8 layers, hidden 512,
head_dim 64, float32) is slow enough on a CPU that skipping a cached prefix is measurable. ``test-llama3`` is
``test`` with Llama 3's RoPE scaling, whose frequencies mlx-lm keeps as a lazy array made at load time: a
model that fails when evaluated on a thread other than the one that loaded it (as every GPU request did).
``1b`` / ``8b`` are Llama-3.2-1B / Llama-3.1-8B shapes in bfloat16 (KV 32 / 128 KiB per token) for GPU
benchmarks; their random weights are drawn with MLX (fast on a GPU), not NumPy. ``gemma3-*`` are
gemma3_text models (sliding-window layers) with the same tokenizer (:data:`GEMMA3`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.models.publish import publish

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
VOCAB_SIZE = 4096
CORPUS_SEED = 1234  # fixed: the tokenizer is the same for every model size and weight seed
MAX_POSITIONS = 32768

# Qwen2.5-style ChatML: tools listed in the system turn, Hermes-style <tool_call> JSON, tool results as
# <tool_response> blocks inside a user turn. ``arguments`` may be a dict or an already-encoded JSON string.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@dataclass(frozen=True)
class Shape:
    """The llama hyper-parameters that differ between sizes."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


SIZES: dict[str, Shape] = {
    "test": Shape(2, 64, 4, 2, 16, 176),
    "test-llama3": Shape(2, 64, 4, 2, 16, 176),
    "bench": Shape(8, 512, 8, 4, 64, 1408),
    "1b": Shape(16, 2048, 32, 8, 64, 8192),
    "8b": Shape(32, 4096, 32, 8, 128, 14336),
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
#: config.json keys that differ from the float32 llama defaults, per size
_EXTRA: dict[str, dict] = {
    "test-llama3": {"rope_scaling": _LLAMA3_ROPE},
    "1b": {"rope_scaling": _LLAMA3_ROPE, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
           "max_position_embeddings": 131072},
    "8b": {"rope_scaling": _LLAMA3_ROPE, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
           "max_position_embeddings": 131072},
}  # fmt: skip
_MLX_WEIGHTS = ("1b", "8b")  # too large for NumPy's generator: drawn with MLX in bfloat16

#: gemma3_text shapes: sliding-window layers (mlx-lm's RotatingKVCache) with one global layer in
#: six; weights drawn by mlx-lm's own gemma3_text classes (MLX, seeded). ``gemma3-test`` is tiny
#: (float32, window 16); the others are Gemma-3-1B / 4B shapes in bfloat16, for GPU benchmarks.
GEMMA3: dict[str, dict[str, Any]] = {
    "gemma3-test": dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                        num_attention_heads=4, head_dim=16, num_key_value_heads=2,
                        sliding_window=16, query_pre_attn_scalar=16, torch_dtype="float32"),
    "gemma3-1b": dict(hidden_size=1152, num_hidden_layers=26, intermediate_size=6912,
                      num_attention_heads=4, head_dim=256, num_key_value_heads=1,
                      sliding_window=512, query_pre_attn_scalar=256, torch_dtype="bfloat16"),
    "gemma3-4b": dict(hidden_size=2560, num_hidden_layers=34, intermediate_size=10240,
                      num_attention_heads=8, head_dim=256, num_key_value_heads=4,
                      sliding_window=1024, query_pre_attn_scalar=256, torch_dtype="bfloat16"),
}  # fmt: skip
ALL_SIZES = (*SIZES, *GEMMA3)


class TinyModelError(ValueError):
    """Bad arguments to :func:`build` (unknown size, unusable output directory)."""


# --- corpus -------------------------------------------------------------------------------------------

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but "
    "they their one all were can has more when there been if some would will other into time only "
    "cache memory disk model token prompt server request block layer key value store load write read "
    "file index hash queue thread budget system user assistant tool call result weather city price "
    "order search function argument number string list object error retry batch stream chunk prefix "
    "paris london tokyo berlin river mountain garden music letter window table water light night"
).split()
_NAMES = ("get_weather", "search_web", "read_file", "run_python", "list_orders", "send_email")
_KEYS = ("id", "name", "city", "query", "path", "limit", "unit", "status", "items", "count")


_SYLLABLES = (
    "ba be bi bo ca co de di do fa fe fi ga go ha he hi ho ka ke la le li lo lu ma me mi mo na ne ni "
    "no pa pe pi po ra re ri ro sa se si so ta te ti to va ve vi wa we ya yo za ar er in on or an en "
    "str ing tion ment ous ly al ed est ble pre con dis"
).split()


def _lexicon(rng: random.Random, n: int = 1500) -> list[str]:
    """Pseudo-English words from syllables, so BPE finds a few thousand merges."""
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def _word(rng: random.Random, lexicon: Sequence[str]) -> str:
    return rng.choice(lexicon) if lexicon and rng.random() < 0.4 else rng.choice(_WORDS)


def _sentence(rng: random.Random, lexicon: Sequence[str] = ()) -> str:
    words = [_word(rng, lexicon) for _ in range(rng.randint(4, 16))]
    return " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!"))


def _json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randint(0, 5 if depth < 2 else 3)
    if kind == 0:
        return rng.randint(-1000, 100000)
    if kind == 1:
        return round(rng.uniform(-100, 100), rng.randint(1, 4))
    if kind in (2, 3):
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))
    if kind == 4:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(_KEYS): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}


def _code(rng: random.Random) -> str:
    fn, arg, key = rng.choice(_NAMES), rng.choice(_KEYS), rng.choice(_KEYS)
    n = rng.randint(0, 64)
    return (
        f"def {fn}({arg}, {key}={n}):\n"
        f'    """{_sentence(rng)}"""\n'
        f"    result = []\n"
        f"    for i in range({arg}):\n"
        f"        if i % {rng.randint(2, 9)} == 0:\n"
        f"            result.append({{'{key}': i, 'value': {key} * i}})\n"
        f"    return result\n"
    )


def _chat(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    args = json.dumps({rng.choice(_KEYS): _json_value(rng, 1)})
    return (
        f"<|im_start|>user\n{_sentence(rng)}<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        f'{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\n{json.dumps(_json_value(rng))}\n</tool_response><|im_end|>\n"
    )


def corpus(seed: int = CORPUS_SEED, documents: int = 6000) -> list[str]:
    """Seeded English-ish prose, Python, JSON and ChatML tool-call documents (pure; no I/O)."""
    rng = random.Random(seed)
    lexicon = _lexicon(rng)
    makers = (
        lambda: " ".join(_sentence(rng, lexicon) for _ in range(rng.randint(2, 6))),
        lambda: _code(rng),
        lambda: json.dumps(_json_value(rng), indent=rng.choice((None, 2))),
        lambda: _chat(rng),
    )
    return [makers[i % len(makers)]() for i in range(documents)]


# --- tokenizer ----------------------------------------------------------------------------------------


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) trained on :func:`corpus`; special tokens get ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


# --- weights ------------------------------------------------------------------------------------------


def model_config(shape: Shape, vocab_size: int) -> dict:
    """config.json contents for mlx-lm's llama model (float32, tied embeddings)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(shape),
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def _llama_weights(shape: Shape, vocab_size: int, linear: Any, ones: Any, scale: Any) -> dict:
    """mlx-lm llama weight names → arrays, drawn in a fixed order: ``linear(out, in)`` draws one
    N(0, 1/fan_in) matrix, ``scale(w, gain)`` multiplies, ``ones`` is the norm weight."""
    h, hd, ff = shape.hidden_size, shape.head_dim, shape.intermediate_size
    weights = {"model.embed_tokens.weight": scale(linear(vocab_size, h), np.sqrt(h) * 0.5)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = linear(shape.num_attention_heads * hd, h)
        weights[p + "self_attn.k_proj.weight"] = linear(shape.num_key_value_heads * hd, h)
        weights[p + "self_attn.v_proj.weight"] = linear(shape.num_key_value_heads * hd, h)
        weights[p + "self_attn.o_proj.weight"] = linear(h, shape.num_attention_heads * hd)
        weights[p + "mlp.gate_proj.weight"] = linear(ff, h)
        weights[p + "mlp.up_proj.weight"] = linear(ff, h)
        weights[p + "mlp.down_proj.weight"] = linear(h, ff)
        weights[p + "input_layernorm.weight"] = ones
        weights[p + "post_attention_layernorm.weight"] = ones
    weights["model.norm.weight"] = ones
    return weights


def random_weights(shape: Shape, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Fixed-seed float32 weights; linear layers ~ N(0, 1/fan_in) so activations stay O(1)."""
    rng = np.random.default_rng(seed)

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim), dtype=np.float32) / np.sqrt(in_dim)).astype(
            np.float32
        )

    ones = np.ones(shape.hidden_size, dtype=np.float32)
    return _llama_weights(shape, vocab_size, linear, ones, lambda w, g: w * np.float32(g))


def _save_mlx_weights(path: Path, shape: Shape, vocab_size: int, seed: int) -> None:
    """bfloat16 random weights of a large shape, drawn and written with MLX (same names, order and
    scales as :func:`random_weights`): NumPy's generator is far too slow for 8B parameters."""
    import mlx.core as mx

    mx.random.seed(seed)

    def evaluated(w: mx.array) -> mx.array:
        mx.eval(w)
        return w

    def linear(out_dim: int, in_dim: int) -> mx.array:
        w = mx.random.normal((out_dim, in_dim), dtype=mx.bfloat16) * (1.0 / float(np.sqrt(in_dim)))
        return evaluated(w)

    ones = mx.ones((shape.hidden_size,), dtype=mx.bfloat16)
    weights = _llama_weights(shape, vocab_size, linear, ones, lambda w, g: evaluated(w * float(g)))
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def gemma3_config(size: str, vocab_size: int) -> dict:
    """config.json contents for mlx-lm's gemma3_text model of ``size``."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **GEMMA3[size],
        "vocab_size": vocab_size,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "bos_token_id": 0,
        "eos_token_id": 2,
    }


def _save_gemma3_weights(path: Path, config: dict, seed: int) -> None:
    """Random weights made by mlx-lm's gemma3_text ``Model`` itself (its own initialisation,
    seeded), in the config's dtype, linear layers halved so activations stay finite."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16 if config["torch_dtype"] == "bfloat16" else mx.float32)
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = {k: v * 0.5 if v.ndim == 2 else v for k, v in params}
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


# --- directory ----------------------------------------------------------------------------------------


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build(out_dir: Path, size: str = "test", seed: int = 0) -> Path:
    """Write the tiny model directory ``out_dir`` (replacing a previous one) and return it.

    Built in a temp directory beside ``out_dir`` and moved into place with ``os.replace``, so a crash
    never leaves a half-written model. Raises :class:`TinyModelError` for an unknown size or an
    unusable ``out_dir``.
    """
    if size not in ALL_SIZES:
        raise TinyModelError(f"unknown size {size!r}; choose one of {', '.join(ALL_SIZES)}")

    def write(tmp: Path) -> None:
        tok = train_tokenizer()
        vocab = tok.get_vocab_size()
        tok.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config())
        if size in GEMMA3:
            config = gemma3_config(size, vocab)
            _write_json(tmp / "config.json", config)
            _save_gemma3_weights(tmp / "model.safetensors", config, seed)
            return
        config = {**model_config(SIZES[size], vocab), **_EXTRA.get(size, {})}
        _write_json(tmp / "config.json", config)
        if size in _MLX_WEIGHTS:
            _save_mlx_weights(tmp / "model.safetensors", SIZES[size], vocab, seed)
        else:
            weights = random_weights(SIZES[size], vocab, seed)
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "mlx"})

    return publish(Path(out_dir), write, TinyModelError)
