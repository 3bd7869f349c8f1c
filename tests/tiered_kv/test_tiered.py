"""tiered_kv/tiered.py: TieredCache hits equal a cold prefill (hot tier alone, then with a real cold
tier on disk: spill on eviction, reload on a hot miss, restart). The hot tier's own rules are in
test_hot.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from tests.fixtures import cold_logits, feed, flip_byte, hot_only, prefill_turn, store_turn, tokens
from tiered_kv.config import Config
from tiered_kv.opening import open_cache
from tiered_kv.prefix import as_tokens, common_prefix
from tiered_kv.steps import drain
from tiered_kv.tiered import TieredCache

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


IDENTITY = {"model": "test-fingerprint"}


def open_tc(model, root, **kw) -> TieredCache:
    """Through the door: open_cache decides which tiers are on (``tiers=()``: none)."""
    kw.setdefault("cold_deadline", 30.0)  # a loaded machine must not turn a lookup into a miss
    cfg = Config(cache_dir=root, block_tokens=16, **kw)
    return open_cache(cfg, IDENTITY, lambda: make_prompt_cache(model))


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


def test_a_hot_entry_taken_while_a_disk_read_failed_is_never_served_twice(small_model, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """A request found its hot candidate, then read a longer disk hit beside the batch's steps;
    meanwhile another request took that entry over (and wrote into its arrays). The read failed
    (a corrupt file) and the first request fell back to the entry it had found: both wrote into
    one entry's arrays, and the second's answer came from the first's tokens."""
    from tiered_kv.cold import codec

    real = codec.load_steps

    def not_read_yet(*a: Any, **k: Any) -> Any:
        yield  # the reader thread has not read the file yet: the batch goes on
        return (yield from real(*a, **k))

    monkeypatch.setattr(codec, "load_steps", not_read_yet)
    x, g = tokens(60, 48), tokens(62, 8)
    tc = open_tc(small_model, tmp_path, min_continuation_tokens=0)
    store_turn(tc, small_model, x, extra=g)  # the hot entry E = x + g (the disk is empty)
    c = x + g[:4] + tokens(61, 40)
    other = open_tc(small_model, tmp_path)  # a second server on the directory writes C
    prefill_turn(other, small_model, c)
    other.close()
    (path,) = [p for p in tmp_path.rglob("*.safetensors") if not p.name.startswith(".")]
    flip_byte(path, -100)
    a = c[: len(x) + 12]  # E serves len(x) + 4 of it, the corrupt C more
    steps = tc.fetch_steps(a, background=True)
    next(steps)  # A: reading C
    b = x + g + tokens(63, 3)
    lease_b = tc.fetch(b)  # B continues E: takes it over
    assert lease_b.hit.tier == "hot" and lease_b.hit.tokens == len(x) + len(g)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        lease_a = done.value
    assert tc.stats()["cold_quarantined"] == 1
    shared = [x is y for ca, cb in zip(lease_a.caches, lease_b.caches, strict=True)
              for x, y in ((ca.keys, cb.keys), (ca.values, cb.values)) if x is not None]  # fmt: skip
    assert not any(shared)
    feed(small_model, lease_a.caches, lease_a.remaining)  # A writes its tokens
    got = feed(small_model, lease_b.caches, lease_b.remaining)
    np.testing.assert_allclose(got, cold_logits(small_model, b), rtol=1e-4, atol=1e-4)
    tc.close()


@pytest.mark.parametrize("beside", [False, True], ids=["whole", "beside"])
@pytest.mark.parametrize("damage", ["corrupt", "vanished"])
def test_a_disk_hit_that_fails_to_load_gives_way_to_the_next_entry(small_model, tmp_path, damage,
                                                                   beside):  # fmt: skip
    """A disk lookup named only the longest entry: when its file turned out corrupt or gone at
    load time the request got no disk hit at all, though a shorter entry on the disk shared a
    prefix with the prompt too. The bad entry leaves the index (quarantined / dropped, counted as
    before), and the next lookup names the next best."""
    p = tokens(64, 40)
    short, long = p + tokens(65, 8), p + tokens(66, 30)
    a = open_tc(small_model, tmp_path)
    prefill_turn(a, small_model, short)
    prefill_turn(a, small_model, long)
    a.close()  # both spilled: neither serves all the other served
    files = [f for f in tmp_path.rglob("*.safetensors") if not f.name.startswith(".")]
    assert len(files) == 2
    bad = max(files, key=lambda f: f.stat().st_size)
    b = open_tc(small_model, tmp_path)
    if damage == "corrupt":
        flip_byte(bad, -100)
    else:  # after the open (which drops the records of missing files)
        bad.unlink()
    ids = long + tokens(67, 5)
    lease = drain(b.fetch_steps(ids, background=beside))
    assert lease.hit.tier == "cold" and lease.hit.tokens == common_prefix(as_tokens(short), as_tokens(ids)) >= len(p)
    logits = feed(small_model, lease.caches, lease.remaining)
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), **TOL)
    want = {"corrupt": "cold_quarantined", "vanished": "cold_misses_missing"}[damage]
    assert b.stats()[want] == 1
    b.close()


def test_a_disk_entry_that_cannot_be_cut_back_never_displaces_a_hot_hit(tmp_path):
    """A sliding-window entry on the disk (gemma-3: past its window it cannot be cut back) shared a
    longer prefix with the prompt than the hot entry, but diverged before its end with no
    checkpoint there: it serves nothing. The lookup reported its common prefix, so the disk hit
    was taken over the hot one (which serves its whole length), loaded for nothing, and the
    request got no hit at all."""
    from tests.fixtures import gemma

    m = gemma()
    tc = open_tc(m, tmp_path)
    base, a = tokens(90, 40), tokens(91, 20)
    prefill_turn(tc, m, base + a)  # D: 60 tokens, past the window of 16, no checkpoints
    tc.hot.budget_bytes, budget = 0, tc.hot.budget_bytes
    tc.hot.enforce()  # D goes to the disk
    tc.cold.flush()
    tc.hot.budget_bytes = budget
    prefill_turn(tc, m, base + a[:10])  # H: 50 tokens, in memory
    ids = base + a[:15] + tokens(92, 10)  # 55 in common with D (serves 0), 50 with H (serves 50)
    logits, hit = prefill_turn(tc, m, ids)
    assert hit.tier == "hot" and hit.tokens == 50
    np.testing.assert_allclose(logits, cold_logits(m, ids), **TOL)
    assert tc.stats()["cold_loads"] == 0  # the disk entry was never read
    tc.close()


@pytest.mark.parametrize("beside", [False, True], ids=["whole", "beside"])
def test_a_disk_hit_that_cannot_be_read_gives_way_to_the_next_entry(small_model, tmp_path,
                                                                    monkeypatch, beside):  # fmt: skip
    """An entry that fails to load but stays indexed (EACCES / EIO: the file may be fine) was
    named again by the next lookup, and the fetch stopped there: the shorter entry sharing the
    prompt's prefix was never tried. The lookup now skips the entries already tried."""
    from tiered_kv.cold import fsafe

    p = tokens(64, 40)
    short, long = p + tokens(65, 8), p + tokens(66, 30)
    a = open_tc(small_model, tmp_path)
    prefill_turn(a, small_model, short)
    prefill_turn(a, small_model, long)
    a.close()  # both spilled: the longer one is the newest holder of the blocks they share
    files = [f for f in tmp_path.rglob("*.safetensors") if not f.name.startswith(".")]
    bad = max(files, key=lambda f: f.stat().st_size)
    real = fsafe.open_nofollow

    def refusing(path, flags, mode=0o600):
        if Path(path) == bad:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, flags, mode)

    b = open_tc(small_model, tmp_path)
    monkeypatch.setattr(fsafe, "open_nofollow", refusing)
    ids = long + tokens(67, 5)
    lease = drain(b.fetch_steps(ids, background=beside))
    assert lease.hit.tier == "cold"
    assert lease.hit.tokens == common_prefix(as_tokens(short), as_tokens(ids)) >= len(p)
    logits = feed(small_model, lease.caches, lease.remaining)
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), **TOL)
    s = b.stats()
    assert s["cold_load_errors"] == 1 and s["cold_quarantined"] == 0 and bad.exists()
    b.close()
