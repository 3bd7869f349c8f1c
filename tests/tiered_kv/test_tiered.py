"""tiered_kv/tiered.py: TieredCache hits equal a cold prefill (hot tier alone, then with a real cold
tier on disk: spill on eviction, reload on a hot miss, restart). The hot tier's own rules are in
test_hot.py, how a fetch picks its candidate across the tiers in test_finding.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures import cold_logits, feed, hot_only, open_tc, prefill_turn, store_turn, tokens

TOL: dict[str, Any] = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cont", [10**9, 8], ids=["shared-view", "continuation-take"])
def test_exact_hit_recomputes_last_token(small_model, cont):
    tc = hot_only(small_model, min_continuation_tokens=cont)
    p = tokens(1, 40)
    store_turn(tc, small_model, p)
    logits, hit = store_turn(tc, small_model, p)
    assert hit == len(p) - 1  # full hit still recomputes the last prompt token
    np.testing.assert_allclose(logits, cold_logits(small_model, p), **TOL)


@pytest.mark.parametrize("cont", [10**9, 8])
def test_prefix_hit(small_model, cont):
    tc = hot_only(small_model, min_continuation_tokens=cont)
    p, q = tokens(2, 30), tokens(3, 25)
    store_turn(tc, small_model, p)
    logits, hit = store_turn(tc, small_model, p + q)
    assert hit == len(p)
    np.testing.assert_allclose(logits, cold_logits(small_model, p + q), **TOL)


@pytest.mark.parametrize("cont", [10**9, 8])
def test_divergence_in_the_middle(small_model, cont):
    tc = hot_only(small_model, min_continuation_tokens=cont)
    p = tokens(4, 50)
    store_turn(tc, small_model, p)
    other = p[:20] + tokens(5, 17)
    logits, hit = store_turn(tc, small_model, other)
    assert hit == 20 + (1 if other[20] == p[20] else 0) or hit >= 20
    np.testing.assert_allclose(logits, cold_logits(small_model, other), **TOL)


@pytest.mark.parametrize("cont", [10**9, 8])
def test_longer_entry_trimmed(small_model, cont):
    tc = hot_only(small_model, min_continuation_tokens=cont)
    p, q = tokens(6, 30), tokens(7, 30)
    store_turn(tc, small_model, p + q)
    logits, hit = store_turn(tc, small_model, p)
    assert hit == len(p) - 1
    np.testing.assert_allclose(logits, cold_logits(small_model, p), **TOL)


def test_continuation_updates_in_place(small_model):
    tc = hot_only(small_model, min_continuation_tokens=8)
    p = tokens(8, 40)
    gen = tokens(9, 6)
    store_turn(tc, small_model, p, gen)
    assert len(tc.hot) == 1
    turn2 = p + gen + tokens(10, 12)
    logits, hit = store_turn(tc, small_model, turn2)
    assert hit == len(p) + len(gen)
    assert len(tc.hot) == 1  # the longer entry replaced the old one
    np.testing.assert_allclose(logits, cold_logits(small_model, turn2), **TOL)
    turn3 = turn2 + tokens(11, 9)
    logits, hit = store_turn(tc, small_model, turn3)
    assert hit == len(turn2)
    np.testing.assert_allclose(logits, cold_logits(small_model, turn3), **TOL)


def test_a_turn_resending_the_whole_prompt_takes_the_entry_over(small_model):
    """Agent clients send the model's answer back re-rendered (reasoning dropped, tool calls as
    their JSON), so the next turn resends the previous prompt whole and diverges inside what the
    model generated. That turn continues the entry all the same: taken over, cut back to the
    common prefix and written in place, and the result replaces it (before: shared read-only,
    a copy of the whole KV, and both entries kept: the session's KV twice, then three times...)."""
    tc = hot_only(small_model, min_continuation_tokens=8)
    p, gen = tokens(8, 40), tokens(9, 6)
    store_turn(tc, small_model, p, gen)
    for turn, answer in enumerate(([7, 7, 3], [5, 4]), start=2):
        (old,) = tc.hot.entries.values()
        assert old.prompt_tokens is not None and old.prompt_tokens < len(old.tokens)
        nxt = old.tokens[: old.prompt_tokens].tolist() + answer + tokens(10 + turn, 12)
        lease = tc.fetch(nxt)
        assert lease.taken is old and len(tc.hot) == 0, turn
        assert lease.hit.tokens >= old.prompt_tokens
        logits = feed(small_model, lease.caches, lease.remaining)
        np.testing.assert_allclose(logits, cold_logits(small_model, nxt), **TOL)
        answered = tokens(20 + turn, 4)  # what the model generates: the next turn drops it
        feed(small_model, lease.caches, answered)
        tc.store(lease, nxt + answered)
        (entry,) = tc.hot.entries.values()
        assert list(entry.tokens) == nxt + answered and entry.prompt_tokens == len(nxt)


def test_an_entry_whose_prompt_another_resent_is_superseded(small_model):
    """A request that shared an entry read-only (the prompt resent exactly: a regenerate; or a
    prompt more than twice the entry) and resent its whole prompt stores an entry that serves
    everything the old one served but the old answer: the old one goes (no spill)."""
    tc = hot_only(small_model, min_continuation_tokens=8)
    p = tokens(8, 40)
    store_turn(tc, small_model, p, tokens(9, 6))
    _, hit = store_turn(tc, small_model, p, tokens(10, 6))  # regenerate: the same prompt
    assert hit == len(p) - 1
    (entry,) = tc.hot.entries.values()
    assert list(entry.tokens) == p + tokens(10, 6) and tc.hot.stats.replaced == 1
    other = p[:30] + tokens(11, 20)  # a branch inside the prompt: both stay
    store_turn(tc, small_model, other)
    assert len(tc.hot) == 2


def test_interleaved_other_prefix_keeps_main_entry(small_model):
    tc = hot_only(small_model, min_continuation_tokens=16)
    main = tokens(13, 60)
    store_turn(tc, small_model, main)
    title = tokens(14, 20)  # a title request with another system prompt
    store_turn(tc, small_model, title)
    assert len(tc.hot) == 2
    logits, hit = store_turn(tc, small_model, main + tokens(15, 5))
    assert hit == len(main)
    np.testing.assert_allclose(logits, cold_logits(small_model, main + tokens(15, 5)), **TOL)


def test_inconsistent_cache_is_cut_back(small_model):
    tc = hot_only(small_model)
    p = tokens(40, 30)
    lease = tc.fetch(p)
    feed(small_model, lease.caches, p)
    lease.caches[0].trim(0)
    lease.caches[1].trim(5)  # layers disagree, as after a failure mid-forward
    tc.store(lease, p[:20])
    (entry,) = tc.hot.entries.values()
    assert len(entry.tokens) == 20
    assert all(c.offset == 20 for c in entry.caches)
    logits, hit = store_turn(tc, small_model, p[:20] + [3, 4])
    np.testing.assert_allclose(logits, cold_logits(small_model, p[:20] + [3, 4]), **TOL)


class _Unknown:
    """A cache class the registry does not know."""

    nbytes = 0


def test_unknown_cache_class_is_not_cached(small_model, caplog):
    tc = hot_only(small_model)
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
    tc = hot_only(small_model, min_continuation_tokens=cont)
    bases = [tokens(70 + i, 60) for i in range(3)]
    for base, cut, extra in ops:
        ids = bases[base][:cut] + tokens(80 + cut + extra, extra)
        logits, hit = store_turn(tc, small_model, ids)
        assert hit < len(ids)
        np.testing.assert_allclose(logits, cold_logits(small_model, ids), **TOL)


def test_evicted_entry_reloads_from_disk(small_model, tmp_path):
    tc = open_tc(small_model, tmp_path)
    p = tokens(50, 70)
    prefill_turn(tc, small_model, p)
    tc.hot.budget_bytes = 0
    tc.hot.enforce()  # evict everything → spilled write-behind
    tc.cold.flush()
    assert len(tc.hot) == 0 and tc.stats()["cold_spills"] == 1
    ids = p + tokens(51, 9)
    logits, hit = prefill_turn(tc, small_model, ids)
    assert hit.tier == "cold" and hit.tokens == len(p) and hit.load_bytes > 0
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), rtol=1e-4, atol=1e-4)
    tc.close()


def test_restart_hits_disk_and_prefetch_fills_memory(small_model, tmp_path):
    a = open_tc(small_model, tmp_path)
    p = tokens(52, 60)
    prefill_turn(a, small_model, p)
    a.close()  # graceful: spills what memory holds, flushes
    b = open_tc(small_model, tmp_path)
    ids = p + tokens(53, 5)
    logits, hit = prefill_turn(b, small_model, ids)
    assert hit.tier == "cold" and hit.tokens == len(p)
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), rtol=1e-4, atol=1e-4)
    b.close()
    c = open_tc(small_model, tmp_path, prefetch_entries=2)
    assert c.prefetch() >= 1 and len(c.hot) >= 1
    _, hit = prefill_turn(c, small_model, ids + [4])
    assert hit.tier == "hot" and hit.tokens == len(ids)
    c.close()


def test_an_entry_reloaded_after_a_restart_knows_its_prompt(small_model, tmp_path):
    """An entry file keeps how many of its ids were the prompt (metadata ``prompt_tokens``), so
    the first turn after a restart, which re-renders the last answer, continues the reloaded
    entry — taken over, one entry in memory — instead of sharing it and keeping both (before:
    a reloaded entry's prompt was all of its ids)."""
    a = open_tc(small_model, tmp_path, min_continuation_tokens=8)
    p = tokens(56, 60)
    store_turn(a, small_model, p, tokens(57, 6))
    a.close()  # graceful: spilled
    b = open_tc(small_model, tmp_path, min_continuation_tokens=8)
    nxt = p + [7, 7, 3] + tokens(58, 12)
    lease = b.fetch(nxt)
    assert lease.hit.tier == "cold" and lease.hit.tokens >= len(p)
    assert lease.taken is not None and lease.taken.prompt_tokens == len(p)
    logits = feed(small_model, lease.caches, lease.remaining)
    np.testing.assert_allclose(logits, cold_logits(small_model, nxt), **TOL)
    b.store(lease, nxt)
    assert len(b.hot) == 1
    b.close()


def test_cold_only_mode_persists_every_turn(small_model, tmp_path):
    tc = open_tc(small_model, tmp_path, tiers=("cold",))
    p = tokens(54, 40)
    prefill_turn(tc, small_model, p)
    _, hit = prefill_turn(tc, small_model, p + [9, 9])
    assert hit.tier == "cold" and hit.tokens == len(p)
    tc.close()


def test_disabled_cache_never_hits(small_model, tmp_path):
    tc = open_tc(small_model, tmp_path, tiers=())
    p = tokens(55, 30)
    prefill_turn(tc, small_model, p)
    assert prefill_turn(tc, small_model, p)[1].tokens == 0
