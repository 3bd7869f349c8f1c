"""tiered_kv/layers.py: what each mlx-lm cache class supports, with real cache classes (every cache
type through the tiers: test_cache_types.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from tests.fixtures import EOS, checkpointed_turn, cold_logits, gemma, tokens
from tiered_kv import layers
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache


def test_wrapped_rotating_cache_is_never_served_at_a_wrong_length():
    m = gemma()
    caches = make_prompt_cache(m)
    m(mx.array([tokens(7, 40)]), cache=caches)
    assert not layers.can_trim(caches)
    assert layers.view(caches, 30, 40) is None
    assert layers.view(caches, 40, 40) is not None
    tc = TieredCache(Config(tiers=("hot",)), lambda: make_prompt_cache(m))
    p = [t if t != EOS else 3 for t in tokens(8, 40)]  # checkpoints at 16, 32 and 40 only
    checkpointed_turn(tc, m, p)
    got, hit = checkpointed_turn(tc, m, p[:30] + [5, 6])
    assert hit == 16  # the window at 30 was overwritten: fall back to the checkpoint at 16
    np.testing.assert_allclose(got, cold_logits(m, p[:30] + [5, 6]), rtol=2e-4, atol=2e-4)
