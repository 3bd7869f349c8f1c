"""tiered_kv/cold/site.py: a full or read-only cache disk at start never stops the server and
never deletes an index that cannot be rebuilt; a full disk counts as ``disk_full``."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import cold_tier, damage_index, entry_file, kv_cache, rewrite_meta
from tiered_kv.cold import index as index_mod
from tiered_kv.cold import site as site_mod
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

FP = "0123456789abcdef0123456789abcdef"


def kv(n: int) -> C.KVCache:
    c = C.KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return c


def make_tier(root: Path) -> ColdTier:
    return ColdTier(root, FP, Config(cache_dir=root, block_tokens=16, disk_free_floor=0))


def test_damaged_index_on_a_full_disk_is_kept_and_the_tier_starts(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    tier = make_tier(root)
    tier.persist(np.arange(32), [kv(32)])
    tier.close()
    db = tier.dir / "index" / "cache.db"
    damaged = os.urandom(8192)
    db.write_bytes(damaged)
    real = index_mod.Index.__init__

    def full(self, path, readonly=False, create=True):
        if "rebuild" in Path(path).name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(self, path, readonly, create)

    monkeypatch.setattr(index_mod.Index, "__init__", full)
    tier = make_tier(root)  # starts: no traceback, no exit
    st = tier.stats()
    assert st["degraded"] >= 1 and st["disk_full"] >= 1 and st["degraded_now"] == 1, st
    assert db.read_bytes() == damaged  # never deleted what could not be rebuilt
    assert tier.lookup(np.arange(32)) is None  # no index: a miss
    tier.persist(np.arange(48), [kv(48)])  # no crash; skipped
    r = subprocess.run([sys.executable, "-m", "engine.cli", "cache", "verify"],
                       env={**os.environ, "TIERED_KV_DIR": str(root)}, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "could not check" in r.stdout, r  # never "clean"
    monkeypatch.undo()  # space is back: the next write rebuilds the index and goes on
    monkeypatch.setattr(site_mod, "_RETRY_SECONDS", 0.0)
    tier.persist(np.arange(64), [kv(64)])
    assert tier.stats()["degraded_now"] == 0
    assert tier.lookup(np.arange(32)) is not None and tier.lookup(np.arange(64)) is not None
    tier.close()


def test_read_only_index_at_start_still_serves(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    tier = make_tier(root)
    tier.persist(np.arange(32), [kv(32)])
    tier.close()
    real = index_mod.Index.__init__

    def read_only_disk(self, path, readonly=False, create=True):
        if not readonly:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        real(self, path, readonly, create)

    monkeypatch.setattr(index_mod.Index, "__init__", read_only_disk)
    tier = make_tier(root)
    st = tier.stats()
    assert st["degraded"] == 1 and st["read_only"] == 1 and st["entries"] == 1, st
    hit = tier.lookup(list(range(32)) + [1])
    assert hit is not None and tier.load(hit) is not None  # read-only serving
    tier.close()


def test_full_index_disk_counts_as_disk_full(tmp_path):
    root = tmp_path / "kv"
    tier = make_tier(root)
    tier.persist(np.arange(32), [kv(32)])

    def cap() -> None:  # the writer thread's own connection: the database cannot grow
        conn = tier.index._conn()
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={pages}")

    tier.writer.run_sync(cap)
    for i in range(1, 4):
        tier.persist(np.arange(400) + 1000 * i, [kv(400)])
    st = tier.stats()
    assert st["disk_full"] >= 1 and st["index_errors"] == 0, st  # was counted as index_errors
    assert not list(tier.dir.glob(".*.tmp"))
    tier.close()


def test_cache_dir_deleted_during_operation(tmp_path):
    import shutil

    tier = cold_tier(tmp_path / "kv")
    shutil.rmtree(tmp_path / "kv")
    tier.persist(np.arange(8), [kv_cache(8)])  # must not raise
    tier.spill(np.arange(8), [kv_cache(8)])
    tier.flush()
    st = tier.stats()  # re-created with a fresh index: logged once, counted, nothing lost
    assert st["dir_recreated"] == 1 and st["write_errors"] == 0 and st["entries"] == 1
    assert tier.load(tier.lookup(list(range(8)))) is not None
    tier.close()
    tier = cold_tier(tmp_path / "kv")
    assert tier.lookup(list(range(8))) is not None and tier.verify().clean
    tier.close()


@pytest.mark.parametrize("how", ["deleted", "garbage"])
def test_lost_index_is_rebuilt_from_files(tmp_path, how):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    tier.close()
    index = tier.dir / "index"
    if how == "deleted":
        import shutil

        shutil.rmtree(index)
    else:
        for p in index.glob("cache.db*"):
            p.write_bytes(os.urandom(4096))
    tier = cold_tier(tmp_path)
    assert tier.stats()["entries"] == 2
    assert tier.load(tier.lookup(list(range(8)))) is not None
    tier.close()


def test_unknown_format_version_is_refused_at_rebuild(tmp_path):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.close()
    rewrite_meta(entry_file(tier), format_version="999")
    import shutil

    shutil.rmtree(tier.dir / "index")
    tier = cold_tier(tmp_path)
    assert tier.stats()["entries"] == 0 and tier.stats()["quarantined"] == 1
    tier.close()


def test_a_fifo_at_the_index_is_a_damaged_index(tmp_path):
    """sqlite opened a FIFO planted at ``index/cache.db`` and waited on it for ever: the server
    never started (and ``tiered-kv cache stats`` hung). Now it is a damaged index: rebuilt."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.close()
    for p in (tier.dir / "index").glob("cache.db*"):
        p.unlink()
    os.mkfifo(tier.dir / "index" / "cache.db", 0o600)
    tier = cold_tier(tmp_path)
    assert tier.stats()["entries"] == 1
    assert tier.load(tier.lookup(list(range(8)))) is not None
    tier.close()


def _read_only_mount_works(path: Path) -> bool:
    cmd = ["unshare", "-m", "sh", "-c", f"mount --bind -o ro '{path}' '{path}'"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_real_read_only_file_system_still_serves(tmp_path):
    """A cache dir on a read-only file system (a bind mount ``-o ro``: real EROFS, not a patched
    fault): sqlite's ``mode=ro`` cannot open a WAL index there (it needs to make ``-shm``), so
    the tier rebuilt nothing, found 0 entries and served nothing; now the index opens immutable."""
    root = tmp_path / "kv"
    tier = cold_tier(root)
    tier.persist(np.arange(32), [kv_cache(32)])
    tier.close()
    if not _read_only_mount_works(root):
        pytest.skip("needs unshare -m and mount (root, or a user namespace)")
    script = (
        "import sys; from pathlib import Path; from tests.fixtures import cold_tier;"
        f"t = cold_tier(Path({str(root)!r})); s = t.stats(); h = t.lookup(list(range(32)) + [1]);"
        "print(s['entries'], s['read_only'], h is not None and t.load(h) is not None); t.close()"
    )
    cmd = ["unshare", "-m", "sh", "-c",
           f"mount --bind -o ro '{root}' '{root}' && exec '{sys.executable}' -c \"{script}\""]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[3])
    assert out.stdout.split() == ["1", "1", "True"], out.stderr[-2000:]


def test_an_index_damaged_while_serving_is_rebuilt_at_the_next_write(tmp_path):
    """``cache.db`` overwritten while the tier runs: every later spill wrote its file, failed its
    commit and deleted it, every lookup missed, until a restart. Now the write path finds the
    index damaged, rebuilds it from the files and writes on; the earlier entries are served."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.close()
    tier = cold_tier(tmp_path)  # checkpointed at close: all of it is in cache.db
    with open(tier.dir / "index" / "cache.db", "r+b") as f:
        f.write(os.urandom(8192))
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    st = tier.stats()
    assert st["spills"] == 1 and st["entries"] == 2, st
    for ids in (range(8), range(50, 58)):
        hit = tier.lookup(list(ids))
        assert hit is not None and tier.load(hit) is not None
    tier.close()


def test_a_server_with_another_block_size_says_why_it_re_indexes(tmp_path, caplog):
    """Two servers on one directory with two ``TIERED_KV_BLOCK_TOKENS`` re-index each other's
    files at every start (each misses the other's keys): it happened without a word."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(40), [kv_cache(40)])
    tier.close()
    with caplog.at_level("WARNING"):
        other = ColdTier(tmp_path, tier.fingerprint, Config(cache_dir=tmp_path, block_tokens=32))
    assert "TIERED_KV_BLOCK_TOKENS" in caplog.text and other.stats()["entries"] == 1
    other.close()


def test_an_index_row_of_the_wrong_kind_is_a_damaged_index(tmp_path):
    """sqlite's columns take any type: a row whose ``nbytes`` is text made every later spill fail
    with a traceback (not even counted), write-through raise into its caller and `cache ls`
    crash. Now it is a damaged index: rebuilt from the files, and writes go on."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.close()
    damage_index(tier, "UPDATE entries SET nbytes='12 MB'")
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    assert tier.stats()["spills"] == 1 and tier.stats()["entries"] == 2
    assert tier.load(tier.lookup(list(range(8)))) is not None
    tier.close()


@pytest.mark.parametrize("when", ["at-open", "while-serving"])
def test_a_row_damaged_where_only_a_lookup_reads_it_is_rebuilt(tmp_path, when):
    """A row whose ``checkpoints`` / ``trimmable`` / ``tokens`` no writer of ours makes: every
    lookup reaching it missed (counted as an index error) and nothing ever repaired it — the
    open only read the record columns, the write path never reads those. Now a lookup that
    finds one damaged has the writer rebuild the index — one damaged before the open too (the
    open reads no row's ids nor what it serves: ``test_verify::test_the_open_reads_no_ids_blob``);
    the re-open rebuilds it though its own check would pass it."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(16), [kv_cache(16)])
    if when == "at-open":
        tier.close()
    damage_index(tier, "UPDATE entries SET checkpoints='garbage', trimmable=2")
    if when == "at-open":
        tier = cold_tier(tmp_path)
    assert tier.lookup(list(range(14)) + [99]) is None  # this one misses
    assert tier.flush(30)
    hit = tier.lookup(list(range(14)) + [99])
    assert hit is not None and hit.serves == 14 and tier.load(hit) is not None
    tier.close()


def test_a_reopen_never_closes_a_connection_another_thread_is_reading_on(tmp_path):
    """A re-open (an index rebuilt while serving, a directory re-created, a degraded tier's
    retry) closed every thread's connection of the index it replaced — the reader thread's too,
    in the middle of a lookup's query: the lookup failed, or, when the close fell inside the
    query's step, the process died (SIGSEGV; 15 s of lookups beside re-opens did it). The old
    index lets go of the other threads' connections; each closes when its query is done."""
    import threading

    tier, old, q = _three_entries_and_a_query(tmp_path)
    reader = threading.Thread(target=q.run)
    reader.start()
    q.started.wait(30)
    tier.writer.run_sync(tier.site.open, 30)  # as ensure() does
    q.resume.set()
    reader.join(30)
    assert tier.site.index is not old
    assert len(q.got) == 3 and all(isinstance(r, tuple) for r in q.got), q.got
    tier.close()


class _PausedQuery:
    """A query on ``index`` that reads one row, then waits for ``resume`` before it reads the
    rest: ``got`` holds the rows, or the error the rest raised."""

    def __init__(self, index: index_mod.Index) -> None:
        import threading

        self.index, self.started, self.resume = index, threading.Event(), threading.Event()
        self.got: list = []

    def run(self) -> None:
        cur = self.index._conn().execute("SELECT id FROM entries")
        self.got.append(cur.fetchone())
        self.started.set()
        self.resume.wait(30)
        try:
            self.got.extend(cur.fetchall())
        except sqlite3.Error as e:
            self.got.append(e)


def _three_entries_and_a_query(tmp_path: Path) -> tuple[ColdTier, index_mod.Index, _PausedQuery]:
    tier = cold_tier(tmp_path)
    for i in range(3):
        tier.persist(np.arange(8) + 100 * i, [kv_cache(8)])
    index = tier.site.index
    assert index is not None
    return tier, index, _PausedQuery(index)


@pytest.mark.parametrize("where", ["checkpoints", "meta"])
def test_an_index_value_nested_past_the_stack_is_a_damaged_index(tmp_path, where):
    """JSON nested 100 000 deep in a row's checkpoints or in the index meta: RecursionError
    escaped the open (the tier did not start) and the ``cache`` commands (tracebacks)."""
    from tiered_kv.admin import CacheAdmin

    tier = cold_tier(tmp_path)
    tier.persist(np.arange(16), [kv_cache(16)])
    tier.close()
    deep = "[" * 100_000 + "]" * 100_000
    if where == "meta":
        damage_index(tier, "UPDATE meta SET value=? WHERE key='meta'", deep)
    else:
        damage_index(tier, "UPDATE entries SET trimmable=0, checkpoints=?", deep)
    admin = CacheAdmin(tier.config)
    assert [c.checked for c in admin.verify()] == [False] and admin.listings()[0].records is None
    tier = cold_tier(tmp_path)  # the meta is read at open; a row's checkpoints, first by a lookup
    if where == "checkpoints":
        assert tier.lookup(list(range(16)) + [1]) is None and tier.flush(30)
    hit = tier.lookup(list(range(16)) + [1])
    assert hit is not None and hit.serves == 16 and tier.load(hit) is not None
    tier.close()


def test_closing_the_tier_never_closes_a_connection_its_reader_is_querying_on(tmp_path, monkeypatch):
    """The shutdown closed every thread's connection, the reader thread's too while a late
    lookup (a stalled disk past its deadline) was still in its query: the query failed, or the
    process crashed, as a re-open did. A tier closed while its reader is busy lets go of the
    index instead; the query finishes."""
    from tiered_kv.cold import tier as tier_mod
    from tiered_kv.cold.reader import Late

    tier, _, q = _three_entries_and_a_query(tmp_path)
    with pytest.raises(Late):
        tier.reader.call(q.run, 0.01)  # a late lookup
    q.started.wait(30)
    monkeypatch.setattr(tier_mod, "_READER_WAIT", 0.05)  # it is stuck: no use waiting
    tier.close()
    q.resume.set()
    tier.reader._thread.join(30)  # the closed reader ends after its call
    assert len(q.got) == 3 and all(isinstance(r, tuple) for r in q.got), q.got


@pytest.mark.parametrize("finder", ["lookup", "write"])
def test_a_damaged_row_found_while_serving_counts_one_index_error(tmp_path, finder):
    """A lookup that found a damaged row counted ``index_errors`` and then the writer's re-open
    (``Site.ensure``) counted it again: one damaged row, two errors. Whoever finds it counts it
    (the lookup's reader call, the write path); the re-open that rebuilds it does not."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(16), [kv_cache(16)])
    if finder == "lookup":
        damage_index(tier, "UPDATE entries SET checkpoints='garbage', trimmable=2")
        assert tier.lookup(list(range(14)) + [99]) is None  # this one finds it
    else:
        damage_index(tier, "UPDATE entries SET nbytes='12 MB'")
        tier.persist(np.arange(16) + 50, [kv_cache(16)])  # the budget check reads every record
    assert tier.flush(30)
    assert tier.stats()["index_errors"] == 1, tier.stats()
    assert tier.lookup(list(range(16)) + [1]) is not None  # rebuilt from the files
    tier.close()
