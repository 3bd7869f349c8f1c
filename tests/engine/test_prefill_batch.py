"""engine/prefill_batch.py: prompt chunks of requests at different lengths through one forward give
each request the caches and logits it gets alone; which leases may share a forward.

A real mlx-lm llama with tiny random weights; real mlx-lm caches.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine import prefill_batch
from tests.fixtures import QuantizedLlama, gemma, make_llama, tokens
from tiered_kv import HitInfo, Lease


def lease_at(model, ids: list[int]) -> Lease:
    """A lease whose caches hold ``ids`` (fed alone)."""
    caches = make_prompt_cache(model)
    if ids:
        model(mx.array([ids]), cache=caches)
        mx.eval([c.state for c in caches])
    return Lease(caches, [], HitInfo())


def test_rows_at_different_lengths_get_what_each_gets_alone():
    model = make_llama(seed=4)
    starts = [tokens(1, 30), tokens(2, 7), []]  # cached prefixes of 30, 7 and 0 tokens
    chunks = [tokens(10 + i, 5) for i in range(3)]
    together = [lease_at(model, s) for s in starts]
    got = prefill_batch.forward(model, together, chunks, logits=True)
    assert got is not None and got.shape[0] == 3
    for i, (start, chunk) in enumerate(zip(starts, chunks, strict=True)):
        alone = lease_at(model, start)
        want = prefill_batch.forward(model, [alone], [chunk], logits=True)
        assert want is not None
        np.testing.assert_allclose(np.array(got[i]), np.array(want[0]), rtol=1e-4, atol=1e-4)
        for c, w in zip(together[i].caches, alone.caches, strict=True):
            assert c.offset == w.offset == len(start) + len(chunk)  # exactly its own tokens
            k, wk = c.state[0], w.state[0][..., : w.offset, :]
            np.testing.assert_allclose(np.array(k), np.array(wk), rtol=1e-4, atol=1e-5)


def test_which_leases_share_forwards():
    assert prefill_batch.batchable(lease_at(make_llama(seed=4), []))
    checkpointed = Lease(
        make_prompt_cache(make_llama(seed=4)), [], HitInfo(), needs_checkpoints=True
    )
    assert not prefill_batch.batchable(checkpointed)
    assert not prefill_batch.batchable(Lease(make_prompt_cache(gemma()), [], HitInfo()))
    assert not prefill_batch.batchable(Lease(QuantizedLlama().make_cache(), [], HitInfo()))
