"""layers.py: each cache-class codec's ``cut`` with real mlx-lm cache classes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ConcatenateKVCache

from tests.tiered_kv.conftest import cold_logits, feed, make_llama, tokens
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache


class _Fails:
    """A decoder layer that raises: a failure in the middle of a forward pass (a fault)."""

    use_sliding = False

    def __call__(self, *args, **kwargs):
        raise RuntimeError("injected failure mid-forward")


def test_store_after_a_failed_forward_cuts_a_concatenate_cache_to_its_offset():
    """ConcatenateKVCache must never be trimmed (its trim() keeps the tail in the arrays): after a
    failure mid-forward the stored arrays are exactly as long as the offset, and a continuation
    that takes the entry over equals a cold prefill."""
    model = make_llama(seed=5)
    tc = TieredCache(
        Config(tiers=("hot",), min_continuation_tokens=8),
        lambda: [ConcatenateKVCache() for _ in model.layers],
    )
    p = tokens(41, 30)
    lease = tc.fetch(p)
    feed(model, lease.caches, p[:20])
    inner = model.model.layers
    saved, inner[1] = inner[1], _Fails()
    try:
        with pytest.raises(RuntimeError):
            model(mx.array([p[20:]]), cache=lease.caches)  # layer 0 took 10 more tokens
    finally:
        inner[1] = saved
    assert [c.offset for c in lease.caches] == [30, 20]
    tc.store(lease, p[:20])
    (entry,) = tc.hot.entries.values()
    assert [(c.offset, c.keys.shape[2], c.values.shape[2]) for c in entry.caches] == [(20, 20, 20)] * 2
    lease = tc.fetch(p[:20] + [3, 4])
    assert lease.hit.tokens == 20 and lease.taken is not None  # a continuation: taken over
    got = feed(model, lease.caches, lease.remaining)
    np.testing.assert_allclose(got, cold_logits(model, p[:20] + [3, 4]), rtol=1e-4, atol=1e-4)
