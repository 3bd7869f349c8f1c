"""engine/prefill.py: suffix-only prefill in evaluated chunks, checkpoints at the cuts, a stop
between chunks. The library's tests use a copy (``tests.fixtures.prefill``): it must stay the same."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.prefill import PrefillStopped, fill, prefill
from tests import fixtures
from tests.fixtures import tokens
from tiered_kv import drain
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache


def lease_of(model, ids: list[int]):
    tc = TieredCache(Config(tiers=()), lambda: make_prompt_cache(model), None)
    return tc.fetch(ids)


def test_the_library_tests_copy_equals_the_engine(small_model):
    ids, cuts = tokens(90, 45), [7, 20, 33, 45]
    got = {}
    for name, run in (("engine", prefill), ("fixtures", fixtures.prefill)):
        lease, fed = lease_of(small_model, ids), list[int]()
        logits = run(small_model, lease, fed, 8, cuts)
        got[name] = (np.array(logits), fed, sorted(lease.checkpoints), lease.caches[0].offset)
    (le, fe, ce, oe), (lf, ff, cf, of) = got["engine"], got["fixtures"]
    np.testing.assert_array_equal(le, lf)
    assert fe == ff == ids and ce == cf == cuts and oe == of == len(ids)


def test_stop_between_chunks_keeps_what_was_evaluated(small_model):
    ids, seen = tokens(91, 40), []
    lease, fed = lease_of(small_model, ids), list[int]()
    with pytest.raises(PrefillStopped):
        prefill(small_model, lease, fed, 8, on_progress=lambda d, t: seen.append((d, t)),
                should_stop=lambda: len(seen) >= 2)  # fmt: skip
    assert seen == [(8, 40), (16, 40)] and fed == ids[:16]
    mx.eval([c.state for c in lease.caches])
    assert lease.caches[0].offset == 16


def assert_same_kv_as_a_prefill(model, ids: list[int], caches, step: int) -> np.ndarray:
    """``caches`` hold the KV of a plain prefill of ``ids`` in ``step``-token chunks (the library
    tests' copy: mlx-lm's growth, no room given). Returns that prefill's last logits."""
    ref = lease_of(model, ids)
    logits = fixtures.prefill(model, ref, [], step)
    tol = fixtures.f32_tol(1e-5)
    for a, b in zip(caches, ref.caches, strict=True):
        for x, y in zip(a.state, b.state, strict=True):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=tol, atol=tol)
    return np.array(logits)


class _Room(fixtures.Steps):
    """Records the room each step finds in the first layer's KV buffer (None: no buffer yet)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.room = list[int | None]()

    def __call__(self, x, cache=None):
        self.room.append(None if cache[0].keys is None else cache[0].keys.shape[2])
        return super().__call__(x, cache=cache)


def test_fill_gives_the_caches_room_for_all_its_steps_once(small_model):
    """After its first step a fill's caches hold one buffer with room for every later step: no step
    grows them by a concatenation (a larger copy of the whole cache, allocated anew each step:
    on CUDA those allocations slowed a `both`'s read beside the head ~1.5x, H100 8B 128k). The KV
    is the plain prefill's all the same."""
    ids = tokens(93, 640)
    model = _Room(small_model)
    lease = lease_of(model, ids)
    drain(fill(model, lease, 128))
    assert model.lengths == [128] * 5
    assert model.room == [None, 768, 768, 768, 768]  # mlx-lm's growth: None, 256, 256, 512, 512
    assert lease.caches[0].offset == 640 and lease.caches[0].keys.shape[2] == 768
    assert_same_kv_as_a_prefill(small_model, ids, lease.caches, 128)


def test_a_prefill_gives_the_caches_room_for_the_whole_prompt_after_its_first_step(small_model):
    """A long prompt's prefill reserves room as a fill does: no body step and not the last token
    copies the cache into a larger one (before: 256, 256, 512, 512, 768 slots, one copy per
    growth). Logits and KV are a plain step-by-step prefill's all the same."""
    ids = tokens(94, 640)
    model = _Room(small_model)
    lease, fed = lease_of(model, ids), list[int]()
    logits = prefill(model, lease, fed, 128)
    assert model.lengths == [128, 128, 128, 128, 127, 1]
    assert model.room == [None, 768, 768, 768, 768, 768]
    assert fed == ids and lease.caches[0].offset == 640 and lease.caches[0].keys.shape[2] == 768
    want = assert_same_kv_as_a_prefill(small_model, ids, lease.caches, 128)
    tol = fixtures.f32_tol(1e-5)
    np.testing.assert_allclose(np.array(logits), want, rtol=tol, atol=tol)


def test_fill_feeds_whole_steps_and_holds_the_same_kv(small_model):
    """A restore's head (Engine.compute_prefix) is fed in whole steps from the start, no last-token
    step: 2 x 16, not 16 + 15 + 1 (on CUDA each new (length, offset) compiles on first use)."""
    ids = tokens(92, 32)
    model = fixtures.Steps(small_model)
    lease = lease_of(model, ids)
    drain(fill(model, lease, 16))
    assert model.lengths == [16, 16] and lease.caches[0].offset == 32
    assert_same_kv_as_a_prefill(small_model, ids, lease.caches, 16)
