"""Removal of cold entries while the tier serves, and the disk budget that feeds it.

:meth:`Remover.remove` (and :meth:`Remover.files_gone`, the file half of a removal committed
inside another transaction) is how a serving tier takes entries out, whatever the reason —
``evicted`` (budget), ``superseded`` (a continuation replaced it), ``vanished`` (its file is
gone), ``quarantined`` (corrupt or foreign): the index change commits first, then the file is
deleted (or moved to quarantine), so a crash in between leaves an orphan file (adopted or
removed at the next open), never a record without its file. A file whose size is not its
row's is checked whole first (:meth:`Remover.settle_size`): a good one keeps its entry, the
row takes its size.

It is not the only code that deletes. The others, each keeping "index first, then files":
:meth:`Remover.make_room` also removes whole paths the index does not hold (other fingerprints'
directories, quarantine: ``usage.remove_path``) and stale temp files (``verify.sweep_temp``);
the write path deletes a file it
published when the index commit fails (``writes``); ``verify`` repairs at open (``reconcile``:
records whose file is gone, stale temp files, corrupt orphans) and on ``verify --fix``.

:meth:`Remover.make_room` runs the pure LRU policy (:mod:`budget`) over the disk's usage and
removes its victims; what it reads per write does not grow with the entry count (its doc says
what it reads, and when it walks the directory). The index itself counts inside the budget:
every entry reserves room for its index rows (token ids, block keys) and the WAL; the WAL is
checkpointed (cut to nothing) before anything is evicted for room it holds
(:meth:`Index.checkpoint`).
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from tiered_kv.cold import budget, store, usage
from tiered_kv.cold.backend import is_key
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Record
from tiered_kv.cold.site import Site
from tiered_kv.cold.verify import check_entry, quarantine, sweep_temp

HEADER_SLACK = 64 << 10  # bytes reserved for an entry file's header
_ROW = 96  # index bytes per block row (key, entry id, depth, two index entries), generous
_WAL = 2  # room for the WAL copy of the pages a commit writes
INDEX = "index"  # the index's directory in the tier's (see site.Site)
#: what lies beside the entries (other processes' temp files, other fingerprints' directories
#: under a shared root) is measured again at least this often while writes go on
RESCAN_SECONDS = 10.0


def index_bytes(n_tokens: int, block_tokens: int) -> int:
    """Room the index needs for an entry of ``n_tokens``: its token ids and block rows, twice
    (the WAL holds a copy of every page a commit writes until the next checkpoint)."""
    return _WAL * (4 * n_tokens + _ROW * (n_tokens // block_tokens) + 4096)


class Remover:
    """Writer thread (and the request thread for vanished / quarantined entries)."""

    def __init__(self, site: Site, disk_bytes: int, free_floor: int) -> None:
        self.site = site
        self.disk_bytes = disk_bytes
        self.free_floor = free_floor
        #: what lies beside the entries, as last measured (:meth:`_rescan`)
        self._beside = usage.Usage(0, [])
        self._stale = True  # measure it again at the next write (set from any thread)
        self._scanned_for: Index | None = None  # the index it was measured beside (a re-open: again)
        self._scanned_at = 0.0

    def remove(self, index: Index, entry_ids: Iterable[str], reason: str) -> list[Record]:
        """Index first (one transaction), then each file; counted under ``reason``."""
        gone = index.remove(list(entry_ids))
        self.files_gone(gone, reason)
        return gone

    def files_gone(self, records: list[Record], reason: str) -> None:
        """The file half of a removal whose index half already committed (e.g. inside the
        transaction that added a continuation)."""
        site = self.site
        for r in records:
            path = site.dir / Path(r.file).name
            if reason == "quarantined":
                quarantine(path, site.quarantine_dir, site.fingerprint)
                self._stale = True  # it lies beside the entries now: measured at the next write
            elif is_key(r.entry_id) and path == site.backend.path(r.entry_id):
                site.backend.delete(r.entry_id)
            else:  # a file adopted under another name (not written by this build)
                path.unlink(missing_ok=True)
        counter = {"evicted": "evictions", "superseded": "superseded", "vanished": "misses_missing",
                   "quarantined": "quarantined"}[reason]  # fmt: skip
        if records:
            site.faults.count(counter, len(records))

    def settle_size(self, index: Index, rec: Record, path: Path) -> None:
        """A file whose size is not its row's (``rec``; a load refused it before allocating):
        checked whole (:func:`verify.check_entry`, no arrays made: a planted header may declare
        GiBs). It checks out: the row was wrong and takes the file's size (an index error; the
        good file was quarantined before). It does not: quarantined, as a load does."""
        site = self.site
        try:
            now = index.get(rec.entry_id)
            if now is None or now.nbytes != rec.nbytes or now.file != rec.file:
                return  # removed, or settled by a check queued before (each failed load asks)
            stored = index.tokens(rec.entry_id)
            if stored is None:
                return  # removed meanwhile
            header = check_entry(path, site.fingerprint, stored)
            size = header.data_start + header.data_len
            if index.resize(rec.entry_id, size, was=rec.nbytes):
                site.faults.count("index_errors")
                site.faults.once("index_size", "cold index row of %s said %d bytes, its file "
                                 "(checked whole) holds %d: row repaired", rec.file, rec.nbytes,
                                 size)  # fmt: skip
        except FileNotFoundError:
            return  # gone meanwhile: the next load finds it so
        except store.CorruptEntry as e:
            site.faults.once(f"corrupt:{type(e).__name__}", "cold entry %s quarantined: %s",
                             rec.file, e)  # fmt: skip
            self.remove(index, [rec.entry_id], "quarantined")
        except (OSError, sqlite3.Error) as e:  # unreadable now: not known to be bad, left as is
            site.faults.once("settle", "cold entry %s not checked: %s", rec.file, e)

    def make_room(self, index: Index, n_tokens: int, data_bytes: int) -> bool:
        """Evict least recently used entries (and stale files) until an entry of ``data_bytes``
        plus its index rows fits the budget and the free-space floor; False if it never can (then
        only until what is there fits: a budget lowered since the last run holds).

        Its cost does not grow with the entry count: the entries' bytes are one row the index
        keeps (:meth:`Index.summary`), only the records that may be evicted are read
        (:meth:`Index.oldest`; before, every record was read and the directory listed), and what
        lies beside the entries is measured by a walk of the cache dir (dead writers' temp files
        swept first) at the first write, after a re-open, a quarantine or a removed path, every
        :data:`RESCAN_SECONDS`, and when the entry does not fit what was measured; the files that
        lay loose in its own directory then are measured again at each write (:meth:`_loose`:
        nothing another process indexed since is counted twice)."""
        site = self.site
        incoming = data_bytes + 4 * n_tokens + HEADER_SLACK + index_bytes(n_tokens, site.block_tokens)
        fresh = self._stale or self._scanned_for is not index or (
            time.monotonic() - self._scanned_at >= RESCAN_SECONDS)  # fmt: skip
        if fresh:
            self._rescan(index)
        use, free = self._measure(index, incoming)
        plan = self._select(use, free, incoming)
        if not plan.fits or (plan.victims and index.wal_bytes() >= self._need(use, free, incoming)):
            # the WAL alone would make the room (or nothing else can): checkpoint before evicting
            # for room it holds, measured after it. Not before every eviction: a full budget
            # evicts at every write, and the checkpoint's fsync cost 1 ms of a 4 ms write of
            # 0.5 MB entries on the CPU VM, where the WAL is kept near 256 KiB anyway
            index.checkpoint()
            if not plan.fits and not fresh:
                self._rescan(index)  # what lies beside may have changed since it was measured
            use, free = self._measure(index, incoming)
            plan = self._select(use, free, incoming)
        if not plan.fits:
            site.faults.once("budget", "cold entry of %d bytes does not fit the disk budget",
                             incoming)  # fmt: skip
            # the budget still holds for what is there (one lowered since the last run)
            self._evict(index, self._select(use, free, 0).victims)
            return False
        self._evict(index, plan.victims)
        return True

    def _rescan(self, index: Index) -> None:
        """Measure what lies beside ``index``'s entries: other fingerprints, quarantine, temp
        files and orphans (the index's own files are measured at each write)."""
        site = self.site
        self._stale = False  # first: a quarantine while it measures has it measured again
        sweep_temp(site.dir)  # a killed writer's temp file was kept, unevictable, until a restart
        self._beside = usage.beside(site.root, site.fingerprint, index.files(), measured=(INDEX,))
        self._scanned_for, self._scanned_at = index, time.monotonic()

    def _measure(self, index: Index, incoming: int) -> tuple[usage.Usage, int]:
        """(usage: every byte and the units that may have to go, free bytes on the disk)."""
        site = self.site
        _, entries = index.summary()
        beside = self._beside.used - sum(self._beside.loose.values()) + self._loose(index)
        used = entries + usage.tree_size(site.dir / INDEX)[0] + beside
        free = shutil.disk_usage(site.root).free
        need = self._need(usage.Usage(used, []), free, incoming)
        items = list(self._beside.items)
        if need > 0:  # the least recently used entries whose bytes cover it, and no more
            items += [budget.Item(("entry", r.entry_id), r.nbytes, r.last_used)
                      for r in index.oldest(need)]  # fmt: skip
        return usage.Usage(used, items), free

    def _loose(self, index: Index) -> int:
        """Bytes of what lay loose beside the entries at the last walk, as it is now: a file
        gone since counts nothing (a temp file renamed into an entry), nor one the index holds
        now (another process's entry published before the walk, indexed after it: counted in
        the index's totals — it was counted twice until the next walk, and entries were evicted
        for room there was). A stat per loose name and one lookup of those named as entries."""
        loose = self._beside.loose
        if not loose:
            return 0
        ids = {n.removesuffix(store.SUFFIX): n for n in loose if n.endswith(store.SUFFIX)}
        named = {k: n for k, n in ids.items() if is_key(k) and n == self.site.backend.path(k).name}
        held = {named[k] for k in index.present(named)}
        return sum(usage.tree_size(self.site.dir / n)[0] for n in loose if n not in held)

    def _need(self, use: usage.Usage, free: int, incoming: int) -> int:
        """Bytes to free before ``incoming`` fits the budget and the free-space floor."""
        return max(use.used + incoming - self.disk_bytes, self.free_floor - free + incoming)

    def _select(self, use: usage.Usage, free: int, incoming: int) -> budget.Plan:
        return budget.select_victims(use.items, used=use.used, incoming=incoming,
                                     budget=self.disk_bytes, free=free,
                                     floor=self.free_floor)  # fmt: skip

    def _evict(self, index: Index, victims: list[budget.Item]) -> None:
        ids = [v.key[1] for v in victims if v.key[0] == "entry"]  # type: ignore[index]
        self.remove(index, ids, "evicted")
        paths = [v.key[1] for v in victims if v.key[0] == "path"]  # type: ignore[index]
        for p in paths:
            usage.remove_path(p, self.site.root)
        if paths:
            self._stale = True  # measured again at the next write
            self.site.faults.count("evictions", len(paths))
