"""tiered_kv/finding.py: a fetch's candidate across the tiers, with a real cold tier on disk: a disk
hit that fails to load (corrupt, vanished, unreadable) gives way to the next best entry, a disk
entry that serves nothing never displaces a hot hit, and a hot candidate taken while a disk read
ran is never served twice. The shared tier's part is in shared/test_link.py, the restore plans
(load / compute / both) in restore/test_restorer.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures import cold_logits, feed, flip_byte, open_tc, prefill_turn, store_turn, tokens
from tiered_kv.prefix import as_tokens, common_prefix
from tiered_kv.steps import drain

TOL: dict[str, Any] = dict(rtol=1e-4, atol=1e-4)


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
