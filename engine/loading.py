"""Load an mlx-lm model directory and describe it for the cache fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import make_prompt_cache

from tiered_kv import layers


class ModelDirError(ValueError):
    """The model directory is missing or is not an mlx-lm model directory."""


def load_model(model_dir: Path) -> tuple[nn.Module, Any]:
    """``mlx_lm.load`` on a local directory (never a hub id)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelDirError(f"{model_dir}: not an mlx-lm model directory (no config.json)")
    model, tokenizer = mlx_load(str(model_dir))
    return model, tokenizer


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "-"


def fingerprint_parts(model_dir: Path, model: nn.Module, kv_bits: int, salt: str) -> dict[str, str]:
    """What must match for a stored KV entry to be valid for this model.

    Model identity is cheap: config.json's bytes plus each weight file's name, size and mtime.
    Tokenizer and chat template by content hash. Layout: the per-layer cache classes.
    """
    weights = sorted(model_dir.glob("*.safetensors"))
    ident = hashlib.sha256((model_dir / "config.json").read_bytes())
    for w in weights:
        st = w.stat()
        ident.update(f"{w.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    tok = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        tok.update(_file_digest(model_dir / name).encode())
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "model": ident.hexdigest(),
        "tokenizer": tok.hexdigest(),
        "dtype": str(config.get("torch_dtype", config.get("dtype", "?"))),
        "kv_bits": str(kv_bits),
        "layout": layers.layout(make_prompt_cache(model)),
        "salt": salt,
    }


def context_length(model_dir: Path, tokenizer: Any) -> int:
    """Longest prompt + completion the model accepts."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("max_position_embeddings", "max_seq_len", "n_ctx", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    limit = getattr(tokenizer, "model_max_length", 0) or 0
    return int(limit) if 0 < limit < 10**7 else 32768


#: when a tokenizer does not list its vocabulary: a generous characters-per-token ceiling
FALLBACK_TOKEN_CHARS = 256
#: normalisers may compose characters (NFKC: "e" + U+0301 -> "é"): room for that in the bound
_COMPOSE_SLACK = 2


def max_token_chars(tokenizer: Any) -> int:
    """A ceiling on the characters one token can cover: twice the longest vocabulary entry.

    Vocabulary strings spell each byte as at least one character (byte-level BPE maps a byte to
    one character, sentencepiece "▁" stands for a space), so a text of N characters needs at
    least N / ceiling tokens: the server rejects longer texts without tokenising them."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=0)
    except Exception:  # a tokenizer without get_vocab (a GGUF wrapper...): the fallback
        longest = 0
    return _COMPOSE_SLACK * longest if longest > 0 else FALLBACK_TOKEN_CHARS
