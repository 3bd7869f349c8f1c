"""The cold index: diskcache (sqlite) on disk, with an in-memory mirror for fast lookups.

On disk (source of truth, survives restarts) under ``<cache_dir>/<fingerprint>/index/``::

    ("meta",)        → {"schema": 1, "seed": str, "block_tokens": int}
    ("rec", id)      → Record fields (file, n_tokens, nbytes, created, last_used, blocks)
    ("tok", id)      → the entry's token ids, int32 LE bytes (exact comparison)

The mirror maps every block key to the entries holding it (oldest first) and keeps the records
without token bytes; it is rebuilt from the records at open. Thread-safety: every method takes
the index lock, so the request thread (lookup, quarantine) and the writer thread (add, evict)
may both call it; each mutation commits on disk before the mirror changes.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import diskcache
import numpy as np

SCHEMA = 1
_MAX_CANDIDATES = 4


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
            self._db = diskcache.Cache(
                str(path),
                eviction_policy="none",
                size_limit=2**62,
                sqlite_synchronous=2,  # FULL: a committed record survives power loss
                cull_limit=0,
            )
            raw = list(self._db.iterkeys())
            meta = self._db.get(("meta",))
            recs = [self._db.get(k) for k in raw if isinstance(k, tuple) and k[:1] == ("rec",)]
        except (sqlite3.Error, OSError, ValueError, EOFError) as e:
            raise IndexUnreadable(f"{path}: {e!r}") from None
        self.meta: dict | None = meta if isinstance(meta, dict) else None
        self._records: dict[str, Record] = {}
        self._blocks: dict[int, list[str]] = {}
        try:
            for r in sorted((Record(**d) for d in recs if d), key=lambda r: r.created):
                self._mirror_add(r)
        except TypeError as e:
            raise IndexUnreadable(f"{path}: bad record {e!r}") from None

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
                self._db.set(("rec", entry_id), asdict(r))

    def clear(self) -> None:
        with self._lock:
            self._db.clear()
            self._records.clear()
            self._blocks.clear()
            self.meta = None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- mirror ------------------------------------------------------------------------------
    def _mirror_add(self, r: Record) -> None:
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
