"""Removal of cold entries while the tier serves, and the disk budget that feeds it.

:meth:`Remover.remove` (and :meth:`Remover.files_gone`, the file half of a removal committed
inside another transaction) is how a serving tier takes entries out, whatever the reason —
``evicted`` (budget), ``superseded`` (a continuation replaced it), ``vanished`` (its file is
gone), ``quarantined`` (corrupt or foreign): the index change commits first, then the file is
deleted (or moved to quarantine), so a crash in between leaves an orphan file (adopted or
removed at the next open), never a record without its file.

It is not the only code that deletes. The others, each keeping "index first, then files":
:meth:`Remover.make_room` also removes whole paths the index does not hold (other fingerprints'
directories, quarantine: ``usage.remove_path``) and stale temp files (``verify.sweep_temp``);
the write path deletes a file it
published when the index commit fails (``writes``); ``verify`` repairs at open (``reconcile``:
records whose file is gone, stale temp files, corrupt orphans) and on ``verify --fix``.

:meth:`Remover.make_room` runs the pure LRU policy (:mod:`budget`) over the usage scan and
removes its victims. The index itself counts inside the budget: every entry reserves room for
its index rows (token ids, block keys) and the WAL; the WAL is checkpointed (cut to nothing)
before anything is evicted for room it holds (:meth:`Index.checkpoint`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from tiered_kv.cold import budget, usage
from tiered_kv.cold.backend import is_key
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Record
from tiered_kv.cold.site import Site
from tiered_kv.cold.verify import quarantine, sweep_temp

HEADER_SLACK = 64 << 10  # bytes reserved for an entry file's header
_ROW = 96  # index bytes per block row (key, entry id, depth, two index entries), generous
_WAL = 2  # room for the WAL copy of the pages a commit writes


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
            elif is_key(r.entry_id) and path == site.backend.path(r.entry_id):
                site.backend.delete(r.entry_id)
            else:  # a file adopted under another name (not written by this build)
                path.unlink(missing_ok=True)
        counter = {"evicted": "evictions", "superseded": "superseded", "vanished": "misses_missing",
                   "quarantined": "quarantined"}[reason]  # fmt: skip
        if records:
            site.faults.count(counter, len(records))

    def make_room(self, index: Index, n_tokens: int, data_bytes: int) -> bool:
        """Evict least recently used entries (and stale files) until an entry of ``data_bytes``
        plus its index rows fits the budget and the free-space floor; False if it never can (then
        only until what is there fits: a budget lowered since the last run holds)."""
        site = self.site
        sweep_temp(site.dir)  # a killed writer's temp file was kept, unevictable, until a restart
        incoming = data_bytes + 4 * n_tokens + HEADER_SLACK + index_bytes(n_tokens, site.block_tokens)
        for attempt in (0, 1):
            use = usage.scan(site.root, site.fingerprint, index.records())
            free = shutil.disk_usage(site.root).free
            plan = budget.select_victims(use.items, used=use.used, incoming=incoming,
                                         budget=self.disk_bytes, free=free,
                                         floor=self.free_floor)  # fmt: skip
            if attempt or plan.fits and not plan.victims:
                break
            index.checkpoint()  # before evicting for room the WAL holds: measured after it
        if not plan.fits:
            site.faults.once("budget", "cold entry of %d bytes does not fit the disk budget",
                             incoming)  # fmt: skip
            # the budget still holds for what is there (one lowered since the last run)
            plan = budget.select_victims(use.items, used=use.used, incoming=0,
                                         budget=self.disk_bytes, free=free,
                                         floor=self.free_floor)  # fmt: skip
            self._evict(index, plan.victims)
            return False
        self._evict(index, plan.victims)
        return True

    def _evict(self, index: Index, victims: list[budget.Item]) -> None:
        ids = [v.key[1] for v in victims if v.key[0] == "entry"]  # type: ignore[index]
        self.remove(index, ids, "evicted")
        paths = [v.key[1] for v in victims if v.key[0] == "path"]  # type: ignore[index]
        for p in paths:
            usage.remove_path(p, self.site.root)
        if paths:
            self.site.faults.count("evictions", len(paths))
