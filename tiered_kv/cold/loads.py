"""The cold tier's read path (request thread, its I/O on the reader thread): lookup, load, describe,
recent, and what a failed load means.

A load locates its entry on the reader thread within ``cold_deadline`` (index record, indexed
token ids, the file's header checked against both), then reads the file into allocated arrays
(``codec.load_steps``) and compares its token ids with the index's. A failure is judged here, once:

* the record gone since the lookup (superseded / evicted, maybe by another process): a miss,
  counted as ``misses_missing``; the file gone, or replaced while it was read: a miss, its
  record removed as ``vanished``;
* a file whose size is not its row's (:class:`SizeDiffers`): a miss now; the writer thread
  decides whether the row or the file is wrong (``evict.Remover.settle_size``);
* unreadable (EACCES, EIO), or arrays MLX cannot allocate: a miss, counted as ``load_errors``;
  the file may be fine;
* corrupt or foreign: quarantined (``evict.Remover.remove``), counted, a miss.

A loaded entry's touch is queued to the writer, never waited for; :meth:`ReadPath.recent` sees
it before it commits. Index queries and header reads go through :class:`reader.Reader`
(:meth:`ReadPath.ask`): late or failing, they are a miss, counted; a damaged index is rebuilt
from the files on the writer thread. No writes here but removals, repairs and touches, each
handed to :mod:`evict` or :mod:`writes`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tiered_kv import keys, layers
from tiered_kv.cold import codec, store
from tiered_kv.cold.evict import Remover
from tiered_kv.cold.faults import Faults
from tiered_kv.cold.lookup import ColdHit, Finder
from tiered_kv.cold.reader import Late, Reader
from tiered_kv.cold.rows import Record, damaged
from tiered_kv.cold.site import Site
from tiered_kv.cold.writer import Writer
from tiered_kv.cold.writes import WritePath
from tiered_kv.steps import Steps


class SizeDiffers(store.CorruptEntry):
    """An entry file whose size is not its index row's: the row or the file is wrong."""


class Loaded(NamedTuple):
    caches: list
    tokens: np.ndarray
    #: position → snapshot of the non-positional layers (recurrent / sliding window) there
    checkpoints: dict[int, list]
    #: how many of ``tokens`` were the request's prompt (None: all, or not known)
    prompt_tokens: int | None = None


class ReadPath:
    """The read side of one :class:`tier.ColdTier` (its public entry points document each call).
    ``changed`` is called (reader or writer thread) after entries were removed or a row repaired,
    so the tier's sizes follow."""

    def __init__(
        self,
        site: Site,
        deadline: float,
        faults: Faults,
        parts: tuple[Remover, WritePath, Writer, Reader],
        changed: Callable[[], None],
    ) -> None:
        self.site = site
        self.deadline = deadline
        self.faults = faults
        self.remover, self.writes, self.writer, self.reader = parts
        self.changed = changed
        self.finder = Finder(site.dir, site.fingerprint, site.block_tokens)
        self._touched: dict[str, float] = {}

    # -- lookup ----------------------------------------------------------------------------------
    def lookup(
        self, prompt_ids: Sequence[int] | np.ndarray, exclude: Collection[str] = ()
    ) -> ColdHit | None:
        tokens = keys.as_int32(prompt_ids)
        hashes = keys.block_hashes(tokens, self.site.block_tokens, self.site.seed)
        if not hashes:
            return None
        # a copy: a lookup past its deadline goes on on the reader thread as the caller adds more
        skip = frozenset(exclude)
        return self.ask(lambda: self._lookup(tokens, hashes, skip), None)

    def _lookup(self, tokens: np.ndarray, hashes: list, exclude: Collection[str]) -> ColdHit | None:
        index = self.site.index
        return None if index is None else self.finder.best(index, tokens, hashes, exclude)

    def ask(self, fn: Any, default: Any, deadline: float | None = None) -> Any:
        """``fn()`` on the reader thread within the deadline; ``default`` when late or when the
        index fails (counted, logged once)."""
        try:
            return self.reader.call(fn, self.deadline if deadline is None else deadline)
        except Late as e:
            self.faults.count("lookup_timeouts")
            self.faults.once("late", "cold index / disk too slow, treating as a miss: %s", e)
        except sqlite3.Error as e:
            self.faults.count("index_errors")
            self.faults.once("index_read", "cold index unreadable, treating as a miss: %s", e)
            if damaged(e):  # rows no writer of ours made: rebuilt from the files (writer thread)
                self._rebuild_soon()
        return default

    def _rebuild_soon(self) -> None:
        """Have the writer re-open the index, rebuilt from the files (once, however many
        lookups found it damaged meanwhile). Not on a read-only or full disk: nothing can be
        rebuilt there, and each re-open would find the same row again."""
        if self.site.damaged or not self.site.writable:
            return
        self.site.damaged = True
        self.writer.submit(self.site.ensure, 0, droppable=False)

    # -- load ------------------------------------------------------------------------------------
    def load_steps(self, hit: ColdHit, beside: bool = False) -> Steps[Loaded | None]:
        found = self.ask(lambda: self._locate(hit.entry_id), None)
        if found is None:
            return None
        if found == "gone":  # removed since the lookup (superseded / evicted, maybe elsewhere)
            self.faults.count("misses_missing")
            return None
        rec, path, header, stored = found
        if isinstance(header, Exception):
            self._bad(rec, path, header)
            return None
        t0 = time.perf_counter()
        try:
            arrays = yield from codec.load_steps(path, header, beside)
            tokens = codec.tokens_of(arrays)
            if not np.array_equal(stored, tokens):
                raise store.CorruptEntry("file tokens differ from the index")
            caches, checkpoints = codec.decode(arrays, header.metadata)
        except FileNotFoundError:
            self._vanished(rec)
            return None
        except (store.CorruptEntry, layers.CorruptState, layers.UnsupportedCache) as e:
            self._bad(rec, path, e)
            return None
        except OSError as e:  # the read failed
            self._bad(rec, path, e)
            return None
        except RuntimeError as e:  # MLX refused the arrays' memory (CUDA: out of memory): a miss
            self.faults.count("load_errors")
            self.faults.once("load:memory", "cold entry %s not loaded: %s", rec.file, e)
            return None
        self.faults.add_load(rec.nbytes, time.perf_counter() - t0)
        now = time.time()
        self._touched[rec.entry_id] = now  # seen by recent() before the queued touch commits
        self.writer.submit(lambda: self._touch(rec.entry_id, now), 0, droppable=False)
        return Loaded(caches, tokens, checkpoints, store.prompt_of(header.metadata, len(tokens)))

    # -- restore plans ----------------------------------------------------------------------------
    def describe(self, hit: ColdHit) -> tuple[Path, int] | None:
        return self.ask(lambda: self._describe(hit.entry_id), None)

    def _describe(self, entry_id: str) -> tuple[Path, int] | None:
        index = self.site.index
        rec = index.get(entry_id) if index is not None else None
        return None if rec is None else (self.site.dir / Path(rec.file).name, rec.nbytes)

    def _touch(self, entry_id: str, when: float) -> None:
        self.writes.touch(entry_id, when)
        if self._touched.get(entry_id) == when:
            del self._touched[entry_id]

    def _locate(self, entry_id: str) -> tuple[Record, Path, Any, np.ndarray] | str | None:
        """Reader thread: the record, its path, its checked header (or the error reading it)
        and the indexed token ids."""
        index = self.site.index
        if index is None:
            return None
        rec = index.get(entry_id)
        stored = index.tokens(entry_id) if rec is not None else None
        if rec is None or stored is None:
            return "gone"
        path = self.site.dir / Path(rec.file).name
        try:
            header: Any = store.read_header(path, self.site.fingerprint)
            if header.n_tokens != len(stored):
                raise store.CorruptEntry("file token count differs from the index")
            if header.data_start + header.data_len != rec.nbytes:  # before anything is allocated
                raise SizeDiffers("file size differs from the index")
        except (OSError, store.CorruptEntry) as e:
            header = e
        return rec, path, header, stored

    # -- what a failed load means ----------------------------------------------------------------
    def _bad(self, rec: Record, path: Path, err: Exception) -> None:
        if isinstance(err, FileNotFoundError) or self._was_replaced(rec, path):
            self._vanished(rec)  # deleted between our reads: a miss, not corruption
        elif isinstance(err, SizeDiffers):  # a miss now; the row or the file is wrong: which,
            self.writer.submit(lambda: self._judge(rec, path), 0, droppable=False)  # the writer says
        elif isinstance(err, OSError):  # unreadable (EACCES, EIO): a miss; the file may be fine
            self.faults.count("load_errors")
            self.faults.once(f"load:{err.errno}", "cold entry %s unreadable: %s", rec.file, err)
        else:
            self.faults.once(f"corrupt:{type(err).__name__}", "cold entry %s quarantined: %s",
                             rec.file, err)  # fmt: skip
            self._remove([rec.entry_id], "quarantined")

    def _judge(self, rec: Record, path: Path) -> None:
        """Writer thread: the row or the file is wrong (:meth:`Remover.settle_size`)."""
        index = self.site.index
        if index is not None and self.site.writable:
            self.remover.settle_size(index, rec, path)
            self.changed()

    def _vanished(self, rec: Record) -> None:
        self._remove([rec.entry_id], "vanished")

    def _remove(self, ids: list[str], reason: str) -> None:
        index = self.site.index
        if index is None:
            return

        def remove() -> None:
            self.remover.remove(index, ids, reason)
            self.changed()

        try:
            self.ask(remove, None)
        except OSError as e:  # quarantine cannot move / delete (read-only disk)
            self.faults.once("remove", "cold entry removal failed: %s", e)

    def _was_replaced(self, rec: Record, path: Path) -> bool:
        """The file is gone or its record was removed (another process superseded / evicted
        it while we read): what we read may be half of a vanished file, not a corrupt one."""
        index = self.site.index
        if index is None:
            return True
        return bool(self.ask(lambda: not path.exists() or index.tokens(rec.entry_id) is None, True))

    # -- warm start -------------------------------------------------------------------------------
    def recent(self, limit_entries: int, limit_bytes: int) -> list[ColdHit]:
        if limit_entries <= 0 and limit_bytes <= 0 or self.site.index is None:
            return []
        index = self.site.index
        # the touches not yet committed, copied before the records are read: one that commits
        # in between is in the records (copied after, it was in neither)
        touched = dict(self._touched)
        recs = self.ask(index.records, [], deadline=max(5.0, self.deadline))
        out: list[ColdHit] = []
        total = 0
        for r in sorted(recs, key=lambda r: -max(r.last_used, touched.get(r.entry_id, 0.0))):
            if limit_entries > 0 and len(out) >= limit_entries:
                break
            if limit_bytes > 0 and total + r.nbytes > limit_bytes:
                break
            out.append(ColdHit(r.entry_id, r.n_tokens, r.n_tokens, r.n_tokens))
            total += r.nbytes
        return out


__all__ = ["ColdHit", "Loaded", "ReadPath", "SizeDiffers"]
