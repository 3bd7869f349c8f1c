"""TieredCache (hot tier only here): hits equal a cold prefill; stored entries never change."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from tests.tiered_kv.conftest import cold_logits, feed, tokens
from tiered_kv import layers
from tiered_kv.config import Config
from tiered_kv.memory import MemoryProbe
from tiered_kv.tiered import TieredCache

TOL = dict(rtol=1e-4, atol=1e-4)


class FakeProbe(MemoryProbe):
    """A memory reading the test controls (only faults are faked)."""

    def __init__(self, active: int = 0, capacity: int = 1 << 40) -> None:
        super().__init__(capacity)
        self.value = active

    def active(self) -> int:
        return self.value


def make_tc(model, probe=None, **kw) -> TieredCache:
    cfg = Config(tiers=("hot",), **kw)
    return TieredCache(cfg, lambda: make_prompt_cache(model), None, probe or FakeProbe())


def run(tc: TieredCache, model, prompt: list[int], extra: list[int] = ()) -> tuple[np.ndarray, int]:
    """Fetch, prefill the suffix, optionally feed ``extra`` (generated ids), store."""
    lease = tc.fetch(prompt)
    assert lease.remaining == prompt[lease.hit.tokens :]
    logits = feed(model, lease.caches, lease.remaining)
    fed = list(prompt)
    if extra:
        feed(model, lease.caches, extra)
        fed += list(extra)
    tc.store(lease, fed)
    return logits, lease.hit.tokens


def snapshot(entry) -> dict[str, np.ndarray]:
    arrays, _ = layers.encode(entry.caches)
    return {k: np.array(v) for k, v in arrays.items()}


@pytest.mark.parametrize("cont", [10**9, 8], ids=["shared-view", "continuation-take"])
def test_exact_hit_recomputes_last_token(small_model, cont):
    tc = make_tc(small_model, min_continuation_tokens=cont)
    p = tokens(1, 40)
    run(tc, small_model, p)
    logits, hit = run(tc, small_model, p)
    assert hit == len(p) - 1  # full hit still recomputes the last prompt token
    np.testing.assert_allclose(logits, cold_logits(small_model, p), **TOL)


@pytest.mark.parametrize("cont", [10**9, 8])
def test_prefix_hit(small_model, cont):
    tc = make_tc(small_model, min_continuation_tokens=cont)
    p, q = tokens(2, 30), tokens(3, 25)
    run(tc, small_model, p)
    logits, hit = run(tc, small_model, p + q)
    assert hit == len(p)
    np.testing.assert_allclose(logits, cold_logits(small_model, p + q), **TOL)


@pytest.mark.parametrize("cont", [10**9, 8])
def test_divergence_in_the_middle(small_model, cont):
    tc = make_tc(small_model, min_continuation_tokens=cont)
    p = tokens(4, 50)
    run(tc, small_model, p)
    other = p[:20] + tokens(5, 17)
    logits, hit = run(tc, small_model, other)
    assert hit == 20 + (1 if other[20] == p[20] else 0) or hit >= 20
    np.testing.assert_allclose(logits, cold_logits(small_model, other), **TOL)


@pytest.mark.parametrize("cont", [10**9, 8])
def test_longer_entry_trimmed(small_model, cont):
    tc = make_tc(small_model, min_continuation_tokens=cont)
    p, q = tokens(6, 30), tokens(7, 30)
    run(tc, small_model, p + q)
    logits, hit = run(tc, small_model, p)
    assert hit == len(p) - 1
    np.testing.assert_allclose(logits, cold_logits(small_model, p), **TOL)


def test_continuation_updates_in_place(small_model):
    tc = make_tc(small_model, min_continuation_tokens=8)
    p = tokens(8, 40)
    gen = tokens(9, 6)
    run(tc, small_model, p, gen)
    assert len(tc.hot) == 1
    turn2 = p + gen + tokens(10, 12)
    logits, hit = run(tc, small_model, turn2)
    assert hit == len(p) + len(gen)
    assert len(tc.hot) == 1  # the longer entry replaced the old one
    np.testing.assert_allclose(logits, cold_logits(small_model, turn2), **TOL)
    turn3 = turn2 + tokens(11, 9)
    logits, hit = run(tc, small_model, turn3)
    assert hit == len(turn2)
    np.testing.assert_allclose(logits, cold_logits(small_model, turn3), **TOL)


def test_stored_entry_unchanged_after_many_cycles(small_model):
    tc = make_tc(small_model)  # default threshold: short hits share the entry read-only
    p = tokens(12, 48)
    run(tc, small_model, p)
    (entry,) = tc.hot.entries.values()
    before = snapshot(entry)
    for i in range(6):
        branch = p[: 10 + 5 * i] + tokens(100 + i, 7)
        lease = tc.fetch(branch)
        feed(small_model, lease.caches, lease.remaining)
        feed(small_model, lease.caches, tokens(200 + i, 3))  # "generation" on the handed-out cache
        tc.store(lease, branch + tokens(200 + i, 3))
    assert entry.id in tc.hot.entries
    after = snapshot(entry)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])


def test_interleaved_other_prefix_keeps_main_entry(small_model):
    tc = make_tc(small_model, min_continuation_tokens=16)
    main = tokens(13, 60)
    run(tc, small_model, main)
    title = tokens(14, 20)  # a title request with another system prompt
    run(tc, small_model, title)
    assert len(tc.hot) == 2
    logits, hit = run(tc, small_model, main + tokens(15, 5))
    assert hit == len(main)
    np.testing.assert_allclose(logits, cold_logits(small_model, main + tokens(15, 5)), **TOL)


def test_byte_budget_evicts_lru(small_model):
    spilled = []
    tc = make_tc(small_model)
    tc.hot.on_evict = spilled.append
    a, b, c = tokens(20, 30), tokens(21, 30), tokens(22, 30)
    run(tc, small_model, a)
    run(tc, small_model, b)
    run(tc, small_model, a + [1])  # a's continuation supersedes a → b is least recently used
    assert len(tc.hot) == 2
    tc.hot.budget_bytes = tc.hot.nbytes  # room for exactly what is stored now
    run(tc, small_model, c)
    assert [e.tokens.tolist() for e in spilled] == [b]
    assert tc.hot.nbytes <= tc.hot.budget_bytes


def test_memory_threshold_evicts(small_model):
    probe = FakeProbe(active=0, capacity=1000)
    spilled = []
    tc = make_tc(small_model, probe=probe, memory_threshold=0.5)
    tc.hot.on_evict = spilled.append
    run(tc, small_model, tokens(30, 20))
    run(tc, small_model, tokens(31, 20))
    assert not spilled
    probe.value = 900  # over 0.5 × 1000: evict LRU until 400 bytes are freed
    run(tc, small_model, tokens(32, 20))
    assert spilled and spilled[0].tokens.tolist() == tokens(30, 20)


def test_inconsistent_cache_is_cut_back(small_model):
    tc = make_tc(small_model)
    p = tokens(40, 30)
    lease = tc.fetch(p)
    feed(small_model, lease.caches, p)
    lease.caches[0].trim(0)
    lease.caches[1].trim(5)  # layers disagree, as after a failure mid-forward
    tc.store(lease, p[:20])
    (entry,) = tc.hot.entries.values()
    assert len(entry.tokens) == 20
    assert all(c.offset == 20 for c in entry.caches)
    logits, hit = run(tc, small_model, p[:20] + [3, 4])
    np.testing.assert_allclose(logits, cold_logits(small_model, p[:20] + [3, 4]), **TOL)


class _Unknown:
    """A cache class the registry does not know."""

    nbytes = 0


def test_unknown_cache_class_is_not_cached(small_model, caplog):
    tc = make_tc(small_model)
    p = tokens(60, 20)
    lease = tc.fetch(p)
    lease.caches = [_Unknown()]
    tc.store(lease, p)
    tc.store(lease, p)
    assert len(tc.hot) == 0
    assert sum("not caching" in r.message for r in caplog.records) == 1  # logged once


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(1, 12)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([10**9, 8]),
)
def test_any_request_sequence_equals_cold(small_model, ops, cont):
    """Property: whatever was stored before, the logits after a hit equal a cold prefill."""
    tc = make_tc(small_model, min_continuation_tokens=cont)
    bases = [tokens(70 + i, 60) for i in range(3)]
    for base, cut, extra in ops:
        ids = bases[base][:cut] + tokens(80 + cut + extra, extra)
        logits, hit = run(tc, small_model, ids)
        assert hit < len(ids)
        np.testing.assert_allclose(logits, cold_logits(small_model, ids), **TOL)
