"""Rebuild a Hugging Face ``tokenizer.json`` + ``tokenizer_config.json`` from GGUF ``tokenizer.ggml.*`` metadata.

Supports the GPT-2 byte-level BPE family (``tokenizer.ggml.model == "gpt2"``). The pre-tokenizer splits
digits individually before the GPT-2 regex, as SmolLM2's (``pre == "smollm"``) does; other ``pre`` values
fall back to the plain GPT-2 split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types
CONTROL, USER_DEFINED = 3, 4
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "qwen2", "deepseek-llm")


class TokenizerConvertError(ValueError):
    """The GGUF tokenizer metadata is missing or of an unsupported kind."""


def _int(meta: dict[str, Any], key: str) -> int | None:
    v = meta.get(key)
    return None if v is None else int(np.asarray(v).item())


def build(meta: dict[str, Any]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equal to the one llama.cpp embedded (vocab ids preserved)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerConvertError(f"unsupported GGUF tokenizer model {kind!r} (need 'gpt2')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = np.array(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens))))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = _int(meta, "tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty == CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    if tok.get_vocab_size() != len(tokens):
        raise TokenizerConvertError(
            f"rebuilt vocab has {tok.get_vocab_size()} ids, GGUF {len(tokens)}"
        )
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: bos/eos/unk/pad by GGUF ids, the GGUF chat template, no automatic BOS."""
    tokens = meta["tokenizer.ggml.tokens"]

    def name(key: str) -> str | None:
        i = _int(meta, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id") or name("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(add_bos.item()) if isinstance(add_bos, mx.array) else bool(add_bos),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _int(meta, "llama.context_length") or 8192,
    }
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def write(meta: dict[str, Any], out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    build(meta).save(str(Path(out_dir) / "tokenizer.json"))
    text = json.dumps(tokenizer_config(meta), indent=2, sort_keys=True, ensure_ascii=False)
    (Path(out_dir) / "tokenizer_config.json").write_text(text + "\n")
