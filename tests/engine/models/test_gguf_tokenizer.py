"""engine/models/gguf_tokenizer.py: only GPT-2-style BPE tokenizers are rebuilt from GGUF metadata
(the whole conversion is tested with SmolLM2 in test_smollm2.py)."""

from __future__ import annotations

import pytest

from engine.models import gguf_tokenizer


def test_non_gpt2_tokenizer_is_rejected() -> None:
    with pytest.raises(gguf_tokenizer.TokenizerConvertError):
        gguf_tokenizer.build({"tokenizer.ggml.model": "llama"})
