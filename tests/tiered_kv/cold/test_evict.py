"""tiered_kv/cold/evict.py: the disk budget evicts the least recently used entry."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures import BLOCK, cold_tier, damage_index, kv_cache


def test_budget_evicts_least_recently_used(tmp_path):
    from tiered_kv.cold import evict, usage

    tier = cold_tier(tmp_path / "kv", disk_free_floor=0)
    for i in range(3):
        tier.persist(np.arange(8) + 100 * i, [kv_cache(8, d=64)])
    assert tier.load(tier.lookup(list(range(8)))) is not None  # touch entry 0
    tier.flush()
    tier.index.checkpoint()  # as the tier does before it evicts: the WAL is not what is measured
    used = usage.scan(tier.root, tier.fingerprint, tier.index.records()).used
    # the tier's estimate: data, tokens, header slack and the entry's index rows
    incoming = 2 * (2 * 8 * 64 * 2) + 4 * 8 + evict.HEADER_SLACK + evict.index_bytes(8, BLOCK)
    tier.remover.disk_bytes = used + incoming - 1
    tier.persist(np.arange(8) + 300, [kv_cache(8, d=64)])
    assert tier.lookup(list(range(8))) is not None  # recently used: kept
    assert tier.lookup(list(range(100, 108))) is None  # least recently used: evicted
    assert tier.lookup(list(range(200, 208))) is not None
    assert tier.stats()["evictions"] == 1 and tier.stats()["entries"] == 3
    tier.close()


def test_a_write_over_budget_leaves_what_is_not_the_caches(tmp_path):
    """The same through the write path: a tier whose directory also holds a models folder and a
    file, with a budget the entries overrun, evicts its own entries only."""
    weights = tmp_path / "models" / "m" / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"w" * 300_000)
    os.utime(weights.parent.parent, (1, 1))  # older than anything the cache holds
    # (400 kB was overrun only by the index's WAL, now kept small: five 21 kB entries fit it)
    tier = cold_tier(tmp_path, disk_bytes=200_000, disk_free_floor=0)
    for k in range(5):
        tier.persist(np.arange(40) + 100 * k, [kv_cache(40, d=64)])
    assert weights.read_bytes() == b"w" * 300_000
    assert tier.stats()["spills"] == 5 and tier.stats()["evictions"] >= 1
    tier.close()


def test_a_lowered_budget_holds_even_when_the_new_entry_cannot_fit(tmp_path):
    """Restarted with a budget below what is on disk: a write too large for the new budget was
    skipped before anything was evicted, so the old entries stayed over the budget for good."""
    from tiered_kv.cold import usage

    tier = cold_tier(tmp_path, disk_free_floor=0)
    for k in range(5):
        tier.persist(np.arange(40) + 100 * k, [kv_cache(40, d=64)])
    tier.close()
    tier = cold_tier(tmp_path, disk_bytes=150_000, disk_free_floor=0)
    # measured as the write measures it when the entry does not fit: after a checkpoint (the
    # open's WAL pages counted here made the check below hold by 96 bytes, and fail once the
    # index file grew by a page: the tier's own measure was right in both)
    tier.index.checkpoint()
    used = usage.scan(tier.root, tier.fingerprint, tier.index.records()).used
    each = tier.index.records()[0].nbytes  # five entries of one size
    assert used > 150_000
    tier.persist(np.arange(400) + 1000, [kv_cache(400, d=64)])  # larger than the whole budget
    st = tier.stats()
    assert st["spills"] == 0 and 1 <= st["entries"] < 5 and st["evictions"] == 5 - st["entries"]
    # what is left fits, but for the index's own growth (its WAL holds the evictions' pages)
    entries = sum(r.nbytes for r in tier.index.records())
    assert used - each * st["evictions"] <= 150_000 and entries <= 150_000
    tier.close()


def test_a_row_of_negative_bytes_does_not_lift_the_budget(tmp_path):
    """A damaged row whose ``nbytes`` is negative was summed into the budget's usage as it is:
    with it the tier held 10 MB under a 3 MB budget, never evicting, and ``stats`` reported
    negative bytes. It is a damaged index now: rebuilt from the files at the open."""
    tier = cold_tier(tmp_path, disk_bytes=3_000_000, disk_free_floor=0)
    tier.persist(np.arange(16), [kv_cache(16)])
    tier.close()
    damage_index(tier, "UPDATE entries SET nbytes=-1000000000000")
    tier = cold_tier(tmp_path, disk_bytes=3_000_000, disk_free_floor=0)
    for i in range(1, 40):
        tier.persist(np.arange(64) + 1000 * i, [kv_cache(64, 512)])
    st = tier.stats()
    assert st["evictions"] > 0 and 0 < st["bytes"] <= 3_000_000, st
    tier.close()


def test_a_small_budget_still_holds_entries_beside_the_index_wal(tmp_path):
    """sqlite's WAL (grown to ~2.4-4 MB by its default 1000-page checkpoint, never shrunk) counts
    against the budget: under a 2.5 MB budget, after 150 writes of 33 KB entries, one entry was
    held and every other write skipped. The WAL is kept small and checkpointed before evicting."""
    tier = cold_tier(tmp_path, disk_bytes=2_500_000, disk_free_floor=0)
    for i in range(150):
        tier.persist(np.arange(64) + 1000 * i, [kv_cache(64, 64)])
    st = tier.stats()
    assert st["skipped"] == 0 and st["spills"] == 150, st
    assert st["entries"] >= 40 and st["bytes"] >= 1_300_000, st  # most of the budget is entries
    wal = tier.dir / "index" / "cache.db-wal"
    assert wal.stat().st_size <= 512 << 10
    assert tier.lookup(list(range(149_000, 149_064))) is not None  # the newest is kept
    tier.close()


def test_a_write_reads_no_more_rows_or_listings_however_many_entries_there_are(tmp_path, monkeypatch):
    """Every write read every index record and listed the tier's directory (twice): ~8 ms per
    write at 1,000 entries, 23 ms at 3,000. Now a write reads one totals row, the records it may
    evict, and walks the directory only at the first write (and every ``RESCAN_SECONDS``)."""
    from tiered_kv.cold import evict, rows

    monkeypatch.setattr(evict, "RESCAN_SECONDS", 1e9)  # no walk for time's sake in this test
    decoded, listed = [0], [0]
    real_record, real_scandir = rows.record, os.scandir

    def record(row):
        decoded[0] += 1
        return real_record(row)

    def scandir(path="."):
        listed[0] += Path(path) == tier.dir
        return real_scandir(path)

    tier = cold_tier(tmp_path, disk_free_floor=0)
    monkeypatch.setattr(rows, "record", record)
    monkeypatch.setattr(os, "scandir", scandir)

    def writes(first: int, n: int) -> tuple[int, int]:
        decoded[0] = listed[0] = 0
        for i in range(first, first + n):
            tier.persist(np.arange(16) + 1000 * i, [kv_cache(16, d=1024)])  # 131 kB each
        return decoded[0], listed[0]

    writes(0, 1)  # the first write after the open walks the directory once
    assert writes(1, 5) == (0, 0)  # 6 entries: no record read, no listing
    writes(6, 30)
    assert writes(36, 5) == (0, 0)  # 41 entries: the same
    assert tier.stats()["entries"] == 41
    # at the budget (what is there now, less a byte): each write evicts the least recently used
    # entries it needs room of (one or two), reading only those (chosen before and after the
    # WAL's checkpoint, then removed) and the row after them (a tie with the last would count):
    # a few per write and per victim, where all 41 were read per write before
    use, _ = tier.remover._measure(tier.index, 0)
    tier.remover.disk_bytes = use.used - 1
    got = writes(41, 5)
    st = tier.stats()
    assert st["evictions"] >= 3 and st["spills"] == 46, st
    assert got[1] == 0 and got[0] <= 4 * (st["evictions"] + 5), (got, st["evictions"])
    assert tier.lookup(list(range(16))) is None  # the oldest went first
    assert tier.lookup(list(range(45_000, 45_016))) is not None
    tier.close()


@pytest.mark.parametrize("over", [1, 150_000, 10**9])
def test_the_victims_are_those_of_the_whole_scan(tmp_path, over):
    """The budget reads only the oldest records now; its victims are the ones the LRU policy
    picks over a scan of every record and the whole dir (ties in ``last_used`` included, a
    stale fingerprint directory and a quarantined file beside them), as before."""
    from tiered_kv.cold import budget, usage

    tier = cold_tier(tmp_path, disk_free_floor=0)
    for i in range(12):
        tier.persist(np.arange(16) + 1000 * i, [kv_cache(16, d=256)])
    for n, r in enumerate(tier.index.records()):
        tier.index.touch(r.entry_id, 1e9 + n // 3)  # ties of three
    other = tmp_path / ("f" * 32)
    other.mkdir(mode=0o700)
    (other / "x.safetensors").write_bytes(b"x" * 50_000)
    os.utime(other, (1e9 + 1.5, 1e9 + 1.5))
    (tmp_path / usage.QUARANTINE).mkdir(mode=0o700)
    (tmp_path / usage.QUARANTINE / "q.safetensors").write_bytes(b"q" * 30_000)
    tier.remover._stale = True  # measured now (as at a write after them)
    tier.remover._rescan(tier.index)
    whole = usage.scan(tier.root, tier.fingerprint, tier.index.records())
    tier.remover.disk_bytes = whole.used - over
    incoming = 70_000
    use, free = tier.remover._measure(tier.index, incoming)
    assert use.used == whole.used
    want = budget.select_victims(whole.items, used=whole.used, incoming=incoming,
                                 budget=tier.remover.disk_bytes, free=free, floor=0)  # fmt: skip
    got = tier.remover._select(use, free, incoming)
    assert got == want and (over < 10**9 or not got.fits)
    assert len(got.victims) > 1
    tier.close()


def test_a_wrong_size_is_settled_once_however_many_loads_asked(tmp_path, monkeypatch):
    """Each load that finds a row of the wrong size queues a whole-file check on the writer
    (non-droppable). Every queued check read the whole file again, though the first had repaired
    the row: 100 requests for a 16 GB entry before the writer came to them were 1.6 TB of reads
    holding up every spill. A check whose row is no longer the one the load found reads nothing."""
    from tests.fixtures import entry_file
    from tiered_kv.cold import evict

    tier = cold_tier(tmp_path, disk_free_floor=0)
    tier.persist(np.arange(16), [kv_cache(16)])
    tier.flush()
    path = entry_file(tier)
    size = path.stat().st_size
    damage_index(tier, "UPDATE entries SET nbytes = nbytes + 100")
    (stale,) = tier.index.records()  # what each failed load hands the writer
    checked = []
    real = evict.check_entry

    def check_entry(*a, **k):
        checked.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(evict, "check_entry", check_entry)
    for _ in range(3):
        tier.remover.settle_size(tier.index, stale, path)
    assert [r.nbytes for r in tier.index.records()] == [size]
    assert checked == [path] and tier.stats()["index_errors"] == 1
    tier.close()


def test_a_full_budget_checkpoints_only_where_the_wal_would_make_the_room(tmp_path, monkeypatch):
    """At a full budget every write evicts. The checkpoint before evicting (for room the WAL holds)
    ran at every one of them: an fsync, 1 ms of a 4 ms write of 0.5 MB entries on the CPU VM,
    and up to 0.1 s where another process reads. It runs only where the WAL (kept near 256 KiB)
    holds the room the write needs; small entries under a small budget still get it (the test
    above)."""
    from tiered_kv.cold.evict import Remover
    from tiered_kv.cold.index import Index

    needs: list[int] = []
    seen: list[tuple[int, int]] = []  # (WAL bytes, bytes the write needed) at each checkpoint
    real_need, real_checkpoint = Remover._need, Index.checkpoint

    def need(self, *a):
        needs.append(real_need(self, *a))
        return needs[-1]

    def checkpoint(self):
        wal = self.path / "cache.db-wal"
        seen.append((wal.stat().st_size if wal.exists() else 0, needs[-1]))
        return real_checkpoint(self)

    monkeypatch.setattr(Remover, "_need", need)
    monkeypatch.setattr(Index, "checkpoint", checkpoint)
    tier = cold_tier(tmp_path, disk_bytes=40_000_000, disk_free_floor=0)
    caches = [kv_cache(1024, 256)]
    evicting = 0  # writes that evicted something
    for i in range(40):  # 2 MB entries (real ones are MBs to GBs): full from about the 19th
        before = tier.stats()["evictions"]
        tier.persist(np.arange(1024) + 10_000 * i, caches)
        evicting += tier.stats()["evictions"] > before
    st = tier.stats()
    tier.close()
    assert evicting >= 10 and st["skipped"] == 0, (evicting, st)
    assert all(wal >= n for wal, n in seen), seen
    assert len(seen) < evicting, (len(seen), evicting)  # was one at every evicting write


def test_an_entry_another_process_indexed_since_the_walk_is_counted_once(tmp_path, monkeypatch):
    """Two processes on one dir: A walked the directory while B's entry file was published but
    not yet indexed (so it lay beside A's entries, counted), then B indexed it. Until A's next
    walk (up to ``RESCAN_SECONDS``) A counted that file twice — in the index's totals and beside
    them — and evicted entries to make room it had."""
    from tiered_kv.cold import evict, usage
    from tiered_kv.cold.index import Index

    monkeypatch.setattr(evict, "RESCAN_SECONDS", 1e9)  # only A's first write walks the dir
    a, b = cold_tier(tmp_path, disk_free_floor=0), cold_tier(tmp_path, disk_free_floor=0)
    real_add, walked = Index.add, list[bool]()

    def add(self, *args, **kw):  # B's file is in place, its index row not yet committed
        if self is b.index and not walked:
            walked.append(True)
            a.persist(np.arange(8), [kv_cache(8, d=64)])  # A's first write: it walks the dir now
            assert a.flush(60)
        return real_add(self, *args, **kw)

    monkeypatch.setattr(Index, "add", add)
    big = np.arange(64) + 500
    b.persist(big, [kv_cache(64, d=2048)])  # 1 MiB
    assert b.flush(60) and walked
    a.index.checkpoint()  # as the tier does before it evicts: the WAL is not what is measured
    used = usage.scan(a.root, a.fingerprint, a.index.records()).used
    incoming = 2 * (2 * 8 * 64 * 2) + 4 * 8 + evict.HEADER_SLACK + evict.index_bytes(8, BLOCK)
    a.remover.disk_bytes = used + incoming + (256 << 10)  # room for it, far less than B's 1 MiB
    a.persist(np.arange(8) + 100, [kv_cache(8, d=64)])
    assert a.flush(60)
    assert a.stats()["evictions"] == 0
    assert a.lookup(list(range(8))) is not None and a.lookup(big.tolist()) is not None
    a.close()
    b.close()
