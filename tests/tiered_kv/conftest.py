"""Real mlx-lm models with tiny random weights, built in memory (no tokenizer needed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

VOCAB = 256


def make_llama(seed: int = 0, layers: int = 2) -> llama.Model:
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def small_model() -> llama.Model:
    return make_llama()


def feed(model, caches, ids) -> np.ndarray:
    """Run ``ids`` through the model on ``caches``; next-token logits after the last id."""
    out = model(mx.array([list(ids)]), cache=caches)
    mx.eval(out, [c.state for c in caches])
    return np.array(out[0, -1, :])


def cold_logits(model, ids) -> np.ndarray:
    return feed(model, make_prompt_cache(model), ids)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()
