"""Find and load an mlx-lm model (a local directory or a hub id); its cache identity is
``tiered_kv.model_identity``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm import load as mlx_load


class ModelDirError(ValueError):
    """The model directory is missing or is not an mlx-lm model directory."""


def looks_like_hub_id(spec: str) -> bool:
    """``owner/name`` (what ``mlx_lm.load`` and ``huggingface_hub`` accept), not a path."""
    parts = str(spec).split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not str(spec).startswith((".", "~"))
        and not any(p in (".", "..") for p in parts)
    )


def resolve_model(spec: str | Path) -> Path:
    """A local mlx-lm directory, or a hub id resolved the way mlx-lm resolves it.

    An existing path is used as is. Otherwise ``owner/name`` goes through ``mlx_lm.utils._download``
    (what ``mlx_lm.load`` calls): the Hugging Face hub cache under ``HF_HOME`` / ``HF_HUB_CACHE``, and a
    download only when the hub is reachable and ``HF_HUB_OFFLINE`` is unset. Raises ModelDirError with
    one line for the user.
    """
    path = Path(spec).expanduser()
    if path.exists() or not looks_like_hub_id(str(spec)):
        if not (path / "config.json").is_file():
            raise ModelDirError(f"{spec}: not an mlx-lm model directory (no config.json)")
        return path
    from mlx_lm.utils import _download  # private, but it is exactly mlx_lm.load's resolution

    try:
        path = Path(_download(str(spec)))
    except Exception as e:  # huggingface_hub's errors: offline miss, unknown repo, no network
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelDirError(
            f"{spec}: not a local directory, and not in the Hugging Face hub cache "
            f"({type(e).__name__}: {first})"
        ) from None
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{spec} -> {path}: not an mlx-lm model (no config.json)")
    return path


def load_model(model_dir: Path) -> tuple[nn.Module, Any]:
    """``mlx_lm.load`` on a local directory (:func:`resolve_model` turns a hub id into one)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelDirError(f"{model_dir}: not an mlx-lm model directory (no config.json)")
    model, tokenizer = mlx_load(str(model_dir))
    return model, tokenizer


def context_length(model_dir: Path, tokenizer: Any) -> int:
    """Longest prompt + completion the model accepts."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("max_position_embeddings", "max_seq_len", "n_ctx", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    limit = getattr(tokenizer, "model_max_length", 0) or 0
    return int(limit) if 0 < limit < 10**7 else 32768


def vocab_size(model_dir: Path, tokenizer: Any) -> int:
    """Width of the model's logits: token ids a request may name (``logit_bias``) are below it."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for conf in (config, config.get("text_config")):
        if isinstance(conf, dict) and isinstance(conf.get("vocab_size"), int) and conf["vocab_size"] > 0:
            return int(conf["vocab_size"])
    try:
        return len(tokenizer.get_vocab())
    except Exception:  # a tokenizer without get_vocab: no id can be checked, none is accepted
        return 0


def xtc_keep(tokenizer: Any) -> tuple[int, ...]:
    """Tokens XTC sampling never cuts: a newline's and the end-of-sequence tokens, as
    mlx_lm.server keeps them."""
    return tuple(dict.fromkeys([*tokenizer.encode("\n"), *tokenizer.eos_token_ids]))


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
