"""checkpoints.py: one test per rule, named after it (real mlx-lm cache classes, tiny shapes)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from tiered_kv import checkpoints, layers
from tiered_kv.hot import HotTier, new_entry
from tiered_kv.memory import MemoryProbe


def kv(seed: int, n: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    k, v = (mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32)) for _ in "kv")
    return k, v


def model_cache(n: int, seed: int = 0) -> list:
    """A hybrid model's cache holding ``n`` tokens: attention, recurrent state, a sliding window
    and a CacheList pairing attention with recurrent state."""
    attn, window, inner = KVCache(), RotatingKVCache(max_size=8), KVCache()
    for c in (attn, window, inner):
        c.update_and_fetch(*kv(seed, n))
    rec, rec2 = ArraysCache(1), ArraysCache(1)
    rec[0], rec2[0] = mx.full((1, 4), float(n)), mx.full((1, 2), float(n))
    return [attn, rec, window, CacheList(inner, rec2)]


# -- where --------------------------------------------------------------------------------------
def test_checkpoint_after_each_end_of_message_token():
    assert checkpoints.positions(0, [5, 2, 5, 5, 2, 5], {2}, 1000) == [2, 5, 6]


def test_checkpoint_every_checkpoint_tokens():
    assert checkpoints.positions(0, [5] * 40, set(), 16) == [16, 32, 40]
    assert checkpoints.positions(20, [5] * 20, set(), 16) == [32, 40]  # counted from 0, not start


def test_checkpoint_at_the_end_of_the_prompt():
    assert checkpoints.positions(7, [5, 5, 5], set(), 1024) == [10]


def test_checkpoints_only_inside_the_prefilled_span():
    assert checkpoints.positions(16, [2, 5], {2}, 16) == [17, 18]  # 16 itself was the start


# -- snapshot / restore ---------------------------------------------------------------------
def test_snapshot_holds_only_the_non_positional_layers_sharing_their_buffers():
    caches = model_cache(5)
    snap = checkpoints.snapshot(caches)
    assert [type(s).__name__ if s is not None else None for s in snap] == [
        None, "ArraysCache", "RotatingKVCache", None, "ArraysCache"
    ]  # fmt: skip
    # a slice (no copy) in an array object of its own: a write into the layer's never reaches it
    assert snap[1].cache[0] is not caches[1].cache[0]
    assert mx.array_equal(snap[1].cache[0], caches[1].cache[0])


def test_snapshot_taken_only_at_a_checkpoint_position():
    ckpts: checkpoints.Checkpoints = {}
    caches = model_cache(5)
    checkpoints.take(ckpts, 4, [5, 10], caches)
    assert ckpts == {}
    checkpoints.take(ckpts, 5, [5, 10], caches)
    assert list(ckpts) == [5]


def test_restore_slices_positional_layers_and_takes_the_others_from_the_checkpoint():
    at5 = checkpoints.snapshot(model_cache(5))
    entry = model_cache(6)  # the window is not wrapped at 6 (max 8) but recurrent state is at 6
    got = checkpoints.restore(entry, 5, 6, at5)
    assert got is not None
    assert got[0].offset == 5 and got[3].caches[0].offset == 5
    assert mx.array_equal(got[1].cache[0], mx.full((1, 4), 5.0))  # from the checkpoint
    assert mx.array_equal(got[3].caches[1].cache[0], mx.full((1, 2), 5.0))
    assert got[2].offset == 5


def test_restore_without_a_checkpoint_only_at_the_entry_length():
    entry = model_cache(6)
    assert checkpoints.restore(entry, 5, 6, None) is None  # recurrent state exists only at 6
    assert checkpoints.restore(entry, 6, 6, None) is not None


# -- which serve what -----------------------------------------------------------------------
def test_served_from_the_nearest_checkpoint_at_or_before_the_common_prefix():
    assert checkpoints.nearest([10, 16, 20, 30], 27) == 20
    assert checkpoints.nearest([10, 16], 16) == 16
    assert checkpoints.nearest([10, 16], 9) == 0


def test_entry_serves_exactly_any_length_when_trimmable_else_its_checkpoints_and_itself():
    assert checkpoints.exact_lengths(40, [10, 20], trimmable=True) is None
    assert checkpoints.exact_lengths(40, [10, 20], trimmable=False) == {10, 20, 40}


def test_entry_supersedes_a_prefix_only_when_it_serves_all_that_prefix_served():
    assert checkpoints.serves_all(40, [], True, 25, [])
    assert checkpoints.serves_all(40, [10, 20], False, 20, [10])
    assert not checkpoints.serves_all(40, [10, 20], False, 25, [])  # no checkpoint at 25
    assert not checkpoints.serves_all(40, [20], False, 20, [10])  # would lose the one at 10


def test_an_entry_keeps_only_the_checkpoints_inside_it():
    ckpts = {0: ["a"], 10: ["b"], 20: ["c"], 30: ["d"]}
    assert list(checkpoints.upto(ckpts, 20)) == [10, 20]


def test_a_lease_carries_the_state_it_starts_from_as_a_checkpoint():
    caches = model_cache(7)
    got = checkpoints.inherit({5: ["s5"], 9: ["s9"]}, 7, caches, needed=True)
    assert list(got) == [5, 7] and got[5] == ["s5"]
    assert checkpoints.inherit({5: ["s5"]}, 7, caches, needed=False) == {5: ["s5"]}


# -- budget ---------------------------------------------------------------------------------
def test_budget_keeps_the_latest_checkpoints():
    sizes = {16: 10, 32: 10, 48: 10, 64: 10}
    assert checkpoints.within(sizes, 25) == [48, 64]
    assert checkpoints.within(sizes, 100) == [16, 32, 48, 64]


def test_checkpoints_on_disk_keep_to_their_share_of_the_entry():
    snap = checkpoints.snapshot(model_cache(4))
    size = checkpoints.snapshot_bytes(snap)
    ckpts = {p: snap for p in (4, 8, 12, 16)}
    kept = checkpoints.for_disk(ckpts, 0.5, 5 * size)  # room for two of them
    assert list(kept) == [12, 16]


def test_thinning_drops_the_least_recently_used_entries_earliest_checkpoints_first():
    entries = [(1, 9, {10: 5, 20: 5}), (2, 3, {10: 5, 20: 5, 30: 5})]  # entry 2 is older
    assert checkpoints.thin(entries, 100) == {}
    assert checkpoints.thin(entries, 20) == {2: frozenset({10})}
    assert checkpoints.thin(entries, 5) == {2: frozenset({10, 20, 30}), 1: frozenset({10})}


def test_thinning_never_mutates_a_stored_entry():
    """Thinning replaces the entry by a copy with fewer checkpoints: a holder of the entry (a
    spill in flight, a lease's candidate) sees it unchanged."""
    snap = checkpoints.snapshot(model_cache(4))
    entry = new_entry(np.arange(16), model_cache(16), {p: snap for p in (4, 8, 12, 16)})
    before = dict(entry.checkpoints), entry.checkpoint_bytes, entry.nbytes
    budget = 10 * entry.nbytes
    share = 2.5 * checkpoints.snapshot_bytes(snap) / budget  # room for two of the four
    hot = HotTier(budget, 1.0, lambda e: None, MemoryProbe(1 << 40), share)
    hot.insert(entry)
    (stored,) = hot.entries.values()
    assert sorted(stored.checkpoints) == [12, 16] and stored.id == entry.id
    assert (dict(entry.checkpoints), entry.checkpoint_bytes, entry.nbytes) == before
    assert stored.nbytes == entry.nbytes - 2 * checkpoints.snapshot_bytes(snap)


# -- on disk --------------------------------------------------------------------------------
def test_checkpoints_round_trip_through_their_on_disk_form():
    ckpts = {5: checkpoints.snapshot(model_cache(5)), 9: checkpoints.snapshot(model_cache(9))}
    arrays, tree = checkpoints.encode(ckpts)
    assert tree is not None and all(checkpoints.is_checkpoint_array(k) for k in arrays)
    back = checkpoints.decode(arrays, tree)
    assert sorted(back) == [5, 9]
    for pos in back:
        a, _ = layers.encode(back[pos])
        b, _ = layers.encode(ckpts[pos])
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    assert checkpoints.encode({}) == ({}, None) and checkpoints.decode({}, None) == {}


def test_bad_checkpoint_metadata_is_corrupt_state():
    with pytest.raises(layers.CorruptState):
        checkpoints.decode({}, "not json")
