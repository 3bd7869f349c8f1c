"""The cold index: diskcache (sqlite) on disk, with an in-memory mirror for fast lookups.

On disk (source of truth, survives restarts) under ``<cache_dir>/<fingerprint>/index/``::

    ("meta",)        → {"schema": 1, "seed": str, "block_tokens": int}
    ("rec", id)      → Record fields (file, n_tokens, nbytes, created, last_used, blocks)
    ("tok", id)      → the entry's token ids, int32 LE bytes (exact comparison)
    ("seq",)         → (epoch, n): n counts committed adds/removes; a new epoch after a clear
    ("log", n)       → (added ids, removed ids) of commit n (the last ``LOG_KEEP`` are kept)

The mirror maps every block key to the entries holding it (oldest first) and keeps the records
without token bytes; it is rebuilt from the records at open. Several processes may share one
index: :meth:`refresh` (one small read) notices other processes' commits through ``("seq",)``
and replays their ``("log", n)`` rows into the mirror (a full reload when the log is gone or the
epoch changed). Thread-safety: every method takes the index lock, so the request thread
(lookup, quarantine) and the writer thread (add, evict) may both call it; each mutation commits
on disk before the mirror changes.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import diskcache
import numpy as np

from tiered_kv.cold import fsafe

SCHEMA = 1
_MAX_CANDIDATES = 4
LOG_KEEP = 4096  # change-log rows kept for other processes' incremental refresh
_SEQ = ("seq",)


class IndexUnreadable(RuntimeError):
    """The sqlite index is missing its schema, damaged or not an index at all."""


@dataclass(frozen=True)
class Record:
    entry_id: str
    file: str
    n_tokens: int
    nbytes: int
    created: float
    last_used: float
    blocks: tuple[int, ...]


class Index:
    def __init__(self, path: Path) -> None:
        """Open (or create) the diskcache at ``path``. Raises IndexUnreadable on a damaged one."""
        self.path = path
        self._lock = threading.RLock()
        try:
            _private(path)
            self._db = diskcache.Cache(
                str(path),
                eviction_policy="none",
                size_limit=2**62,
                sqlite_synchronous=2,  # FULL: a committed record survives power loss
                cull_limit=0,
                disk_min_file_size=2**30,  # token ids inside sqlite: no extra (0644) value files
            )
            meta = self._db.get(("meta",))
        except (sqlite3.Error, OSError, ValueError, EOFError) as e:
            raise IndexUnreadable(f"{path}: {e!r}") from None
        self.meta: dict | None = meta if isinstance(meta, dict) else None
        self._records: dict[str, Record] = {}
        self._blocks: dict[int, list[str]] = {}
        self._seq: tuple[str, int] = ("", 0)
        self.reloads = 0  # full mirror reloads after open (another process cleared / log gone)
        self._reload()

    def _reload(self) -> None:
        """Rebuild the mirror from every record on disk. Raises IndexUnreadable."""
        try:
            # seq first: a commit racing with this read is replayed again later (idempotent)
            seq = self._db.get(_SEQ)
            raw = list(self._db.iterkeys())
            recs = [self._db.get(k) for k in raw if isinstance(k, tuple) and k[:1] == ("rec",)]
        except (sqlite3.Error, OSError, ValueError, EOFError) as e:
            raise IndexUnreadable(f"{self.path}: {e!r}") from None
        self._records.clear()
        self._blocks.clear()
        try:
            for r in sorted((Record(**d) for d in recs if d), key=lambda r: r.created):
                self._mirror_add(r)
        except TypeError as e:
            raise IndexUnreadable(f"{self.path}: bad record {e!r}") from None
        self._seq = _as_seq(seq)

    def refresh(self) -> None:
        """Bring the mirror up to date with commits of other processes (and this one's writer).

        Costs one key read when nothing changed; replays the change log otherwise, or reloads
        everything when the log no longer reaches back (or the index was cleared meanwhile)."""
        with self._lock:
            seq = _as_seq(self._db.get(_SEQ))
            if seq == self._seq:
                return
            epoch, n = self._seq
            if seq[0] != epoch or not n < seq[1] <= n + LOG_KEEP:
                self.reloads += 1
                self._reload()
                return
            for i in range(n + 1, seq[1] + 1):
                change = self._db.get(("log", i))
                if change is None:  # trimmed meanwhile
                    self.reloads += 1
                    self._reload()
                    return
                added, removed = change
                for eid in removed:
                    if eid in self._records:
                        self._mirror_remove(eid)
                for eid in added:
                    d = self._db.get(("rec", eid))
                    if d is not None:
                        self._mirror_add(Record(**d))
            self._seq = seq

    # -- reads (any thread) ------------------------------------------------------------------
    def records(self) -> list[Record]:
        with self._lock:
            return list(self._records.values())

    def get(self, entry_id: str) -> Record | None:
        with self._lock:
            return self._records.get(entry_id)

    def tokens(self, entry_id: str) -> np.ndarray | None:
        raw = self._db.get(("tok", entry_id))
        return None if raw is None else np.frombuffer(raw, dtype="<i4")

    def candidates(self, keys: Sequence[int]) -> list[tuple[str, int]]:
        """(entry id, matched full blocks), deepest first: the newest entry at the deepest
        present block, then shallower ones (a collision fallback), at most 4, distinct."""
        with self._lock:
            depth = 0
            for k in keys:
                if k not in self._blocks:
                    break
                depth += 1
            out: list[tuple[str, int]] = []
            for d in range(depth, 0, -1):
                eid = self._blocks[keys[d - 1]][-1]
                if all(eid != e for e, _ in out):
                    out.append((eid, d))
                    if len(out) == _MAX_CANDIDATES:
                        break
            return out

    def prefixes_of(self, keys: Sequence[int]) -> list[Record]:
        """Records whose full blocks are a prefix of ``keys`` (exact token check is the caller's)."""
        with self._lock:
            found: dict[str, Record] = {}
            for k in keys:
                for eid in self._blocks.get(k, ()):
                    r = self._records[eid]
                    if len(r.blocks) <= len(keys) and r.blocks[-1] == keys[len(r.blocks) - 1]:
                        found[eid] = r
            return list(found.values())

    # -- mutations (commit first, then mirror) -------------------------------------------------
    def set_meta(self, meta: dict) -> None:
        with self._lock:
            self._db.set(("meta",), meta)
            self.meta = meta

    def claim_meta(self, meta: dict) -> bool:
        """Make ``meta`` the index's meta; when it differs, clear the index in the same
        transaction (so two processes opening at once clear it once). True: it was cleared
        (the caller rebuilds from the files)."""
        with self._lock:
            with self._db.transact():
                if self._db.get(("meta",)) == meta:
                    cleared = False
                else:
                    for k in list(self._db.iterkeys()):
                        self._db.delete(k)
                    self._db.set(("meta",), meta)
                    self._db.set(_SEQ, (uuid.uuid4().hex, 0))
                    cleared = True
            self.meta = meta
            self._reload()
            return cleared

    def _log(self, added: Sequence[str], removed: Sequence[str]) -> None:
        """Inside a transaction: count this commit and record what it changed."""
        prev = _as_seq(self._db.get(_SEQ))
        new = (prev[0] or uuid.uuid4().hex, prev[1] + 1)
        self._db.set(_SEQ, new)
        self._db.set(("log", new[1]), (tuple(added), tuple(removed)))
        self._db.delete(("log", new[1] - LOG_KEEP))
        if self._seq == prev:  # nobody else committed since our last look
            self._seq = new

    def add(self, rec: Record, tokens: bytes, remove: Iterable[str] = ()) -> None:
        """Insert ``rec`` and delete ``remove`` in one transaction."""
        with self._lock:
            gone = [e for e in remove if e in self._records]
            with self._db.transact():
                self._db.set(("rec", rec.entry_id), asdict(rec))
                self._db.set(("tok", rec.entry_id), tokens)
                for eid in gone:
                    self._db.delete(("rec", eid))
                    self._db.delete(("tok", eid))
                self._log([rec.entry_id], gone)
            for eid in gone:
                self._mirror_remove(eid)
            self._mirror_add(rec)

    def add_many(self, items: Iterable[tuple[Record, bytes]]) -> None:
        with self._lock:
            items = list(items)
            with self._db.transact():
                for rec, tokens in items:
                    self._db.set(("rec", rec.entry_id), asdict(rec))
                    self._db.set(("tok", rec.entry_id), tokens)
                self._log([rec.entry_id for rec, _ in items], [])
            for rec, _ in sorted(items, key=lambda i: i[0].created):
                self._mirror_add(rec)

    def remove(self, entry_ids: Iterable[str]) -> list[Record]:
        """Delete records (one transaction); returns those that existed."""
        with self._lock:
            gone = [self._records[e] for e in entry_ids if e in self._records]
            with self._db.transact():
                for r in gone:
                    self._db.delete(("rec", r.entry_id))
                    self._db.delete(("tok", r.entry_id))
                if gone:
                    self._log([], [r.entry_id for r in gone])
            for r in gone:
                self._mirror_remove(r.entry_id)
            return gone

    def touch(self, entry_id: str, when: float, persist: bool = True) -> None:
        """Update last_used in the mirror; ``persist`` also writes it (writer thread)."""
        with self._lock:
            r = self._records.get(entry_id)
            if r is None:
                return
            r = Record(**{**asdict(r), "last_used": max(when, r.last_used)})
            self._records[entry_id] = r
            if persist:
                with self._db.transact():  # never resurrect a record another process removed
                    if ("rec", entry_id) in self._db:
                        self._db.set(("rec", entry_id), asdict(r))

    def clear(self) -> None:
        with self._lock:
            self._db.clear()
            self._db.set(_SEQ, (uuid.uuid4().hex, 0))
            self._records.clear()
            self._blocks.clear()
            self._seq = ("", -1)  # differs from anything on disk: the next refresh reloads
            self.meta = None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- mirror ------------------------------------------------------------------------------
    def _mirror_add(self, r: Record) -> None:
        if r.entry_id in self._records:  # replayed from the log or adopted twice
            self._mirror_remove(r.entry_id)
        self._records[r.entry_id] = r
        for k in r.blocks:
            self._blocks.setdefault(k, []).append(r.entry_id)

    def _mirror_remove(self, entry_id: str) -> None:
        r = self._records.pop(entry_id)
        for k in r.blocks:
            lst = self._blocks.get(k)
            if lst is not None:
                lst[:] = [e for e in lst if e != entry_id]
                if not lst:
                    del self._blocks[k]


def _as_seq(value: object) -> tuple[str, int]:
    if isinstance(value, tuple) and len(value) == 2:
        return (str(value[0]), int(value[1]))
    return ("", 0)


def _private(path: Path) -> None:
    """The index dir 0700 and ``cache.db`` created 0600 before sqlite opens it (sqlite gives its
    -wal / -shm files the database's mode): the index holds prompt token ids. No symlink there
    is followed (:func:`fsafe.private_db`)."""
    fsafe.private_db(path, "cache.db")
