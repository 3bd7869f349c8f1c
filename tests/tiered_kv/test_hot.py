"""tiered_kv/hot.py: stored entries never change; the byte budget and the memory threshold evict
the least recently used entry (through TieredCache, hot tier alone)."""

from __future__ import annotations

import numpy as np

from tests.fixtures import FakeProbe, entry_arrays, feed, hot_only, store_turn, tokens
from tiered_kv.hot import Entry


def test_stored_entry_unchanged_after_many_cycles(small_model):
    tc = hot_only(small_model)  # default threshold: short hits share the entry read-only
    p = tokens(12, 48)
    store_turn(tc, small_model, p)
    (entry,) = tc.hot.entries.values()
    before = entry_arrays(entry)
    for i in range(6):
        branch = p[: 10 + 5 * i] + tokens(100 + i, 7)
        lease = tc.fetch(branch)
        feed(small_model, lease.caches, lease.remaining)
        feed(small_model, lease.caches, tokens(200 + i, 3))  # "generation" on the handed-out cache
        tc.store(lease, branch + tokens(200 + i, 3))
    assert entry.id in tc.hot.entries
    after = entry_arrays(entry)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])


def test_byte_budget_evicts_lru(small_model):
    spilled: list[Entry] = []
    tc = hot_only(small_model)
    tc.hot.on_evict = spilled.append
    a, b, c = tokens(20, 30), tokens(21, 30), tokens(22, 30)
    store_turn(tc, small_model, a)
    store_turn(tc, small_model, b)
    store_turn(tc, small_model, a + [1])  # a's continuation supersedes a → b is least recently used
    assert len(tc.hot) == 2
    tc.hot.budget_bytes = tc.hot.nbytes  # room for exactly what is stored now
    store_turn(tc, small_model, c)
    assert [e.tokens.tolist() for e in spilled] == [b]
    assert tc.hot.nbytes <= tc.hot.budget_bytes


def test_memory_threshold_evicts(small_model):
    probe = FakeProbe(active=0, capacity=1000)
    spilled: list[Entry] = []
    tc = hot_only(small_model, probe=probe, memory_threshold=0.5)
    tc.hot.on_evict = spilled.append
    store_turn(tc, small_model, tokens(30, 20))
    store_turn(tc, small_model, tokens(31, 20))
    assert not spilled
    probe.value = 900  # over 0.5 × 1000: evict LRU until 400 bytes are freed
    store_turn(tc, small_model, tokens(32, 20))
    assert spilled and spilled[0].tokens.tolist() == tokens(30, 20)
