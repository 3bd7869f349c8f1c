"""ColdTier: the disk tier's facade and one door; it hands writes to the writer, owns the lifecycle.

Here: the request thread's hand-over to the writer (``spill`` / ``persist`` / ``adopt``) and the
lifecycle (``flush``, ``stats``, ``verify``, ``close``). Each other concern has one owner module:

* :mod:`site`   — directories, backend, index opening / rebuild / degraded mode;
* :mod:`loads`  — the read path: lookup, load, describe, recent, and what a failed load means
  (vanished, a wrong row repaired, unreadable, quarantined);
* :mod:`lookup` — which entry serves the most of a prompt (what it serves: ``policy.servable``);
* :mod:`codec`  — caches ⇄ tensors (MLX, request thread), verified loads;
* :mod:`store`  — the entry file format and its checksums (bytes only);
* :mod:`backend`— where entry bytes live (put / get / contains / delete by key);
* :mod:`writes` — the write path (writer thread);
* :mod:`evict`  — removing entries while serving (index first, then file) and the disk budget;
* :mod:`verify` — reconcile at open, full verify, quarantine;
* :mod:`faults` — counters and rate-limited logging;
* :mod:`writer` / :mod:`reader` — the write-behind thread and the deadline-bound reader thread.

Threads and ownership:

* the **request thread** owns MLX: it calls ``lookup``, ``load`` (verified reads into allocated arrays, ``codec.load_steps``),
  ``spill`` / ``persist`` (encodes the caches and ``mx.eval``-s them *before* they cross to the
  writer), ``recent``, ``stats``. It never waits on the disk without a bound: index queries and
  entry headers go through the reader thread with ``cold_deadline`` seconds (past it: a miss,
  counted as ``lookup_timeouts``); touches are queued to the writer and never waited for;
* the **writer thread** only reads evaluated arrays' bytes, writes files and commits the index.

Misses are ``None``; corrupt / foreign files raise ``store.CorruptEntry`` inside the tier and are
quarantined, counted and turned into misses; I/O errors are counted by kind and logged once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiered_kv import keys, layers
from tiered_kv.cold import codec, gpu, store
from tiered_kv.cold.codec import Prepared
from tiered_kv.cold.evict import Remover
from tiered_kv.cold.faults import Faults
from tiered_kv.cold.index import Index
from tiered_kv.cold.loads import Loaded, ReadPath
from tiered_kv.cold.lookup import ColdHit
from tiered_kv.cold.reader import Reader
from tiered_kv.cold.site import Site
from tiered_kv.cold.verify import VerifyReport, verify_dir
from tiered_kv.cold.writer import Writer
from tiered_kv.cold.writes import Published, Raw, WritePath
from tiered_kv.config import Config
from tiered_kv.steps import Steps, drain

_MIN_RATE = 50e6  # bytes/s below which a write-through wait gives up (the write goes on)
#: at shutdown, how long a running lookup (an index query, a header read) is waited for before
#: the index is let go of rather than closed under it
_READER_WAIT = 2.0


class ColdTier:
    def __init__(self, root: Path, fingerprint: str, config: Config) -> None:
        """Open ``root/<fingerprint>/`` (created 0700; refused when others can write it), open or
        rebuild the index, reconcile it with the files and start the writer and reader threads.
        A full or read-only disk starts the tier degraded (logged once), never fails the start.
        ``fingerprint`` comes from the engine; a cache salt or stored-KV quantisation is mixed
        in here (``keys.tier_fingerprint``)."""
        self.config = config
        self.fingerprint = keys.tier_fingerprint(
            fingerprint, config.cache_salt, config.kv_bits, config.kv_group_size
        )
        self.block_tokens = config.block_tokens
        self.faults = Faults()
        self.site = Site(Path(root), self.fingerprint, config, self.faults)
        self.root, self.dir = self.site.root, self.site.dir
        self.quarantine_dir, self.seed = self.site.quarantine_dir, self.site.seed
        self.remover = Remover(self.site, config.disk_bytes, config.disk_free_floor)
        self.writes = WritePath(self.site, self.remover)
        self.writer = Writer(config.spill_queue_bytes, self.faults.drop)
        self.reader = Reader()
        parts = (self.remover, self.writes, self.writer, self.reader)
        self.loads = ReadPath(
            self.site, config.cold_deadline, self.faults, parts, self._refresh_summary
        )
        self._summary = (0, 0)
        self._refresh_summary()

    @property
    def index(self) -> Index:
        """The current index (tests, CLI); None-safe callers use ``site.index``."""
        assert self.site.index is not None, "cold tier has no index (degraded)"
        return self.site.index

    # -- request thread: lookup / load (:mod:`loads`) --------------------------------------------
    def lookup(
        self, prompt_ids: Sequence[int] | np.ndarray, exclude: Collection[str] = ()
    ) -> ColdHit | None:
        """The entry that serves the most of ``prompt_ids`` (``ColdHit.serves``), none of
        ``exclude`` (entries the caller failed to load), or None (also when the index does not
        answer within ``cold_deadline``)."""
        return self.loads.lookup(prompt_ids, exclude)

    def load(self, hit: ColdHit) -> Loaded | None:
        """(caches holding the whole entry, entry token ids, checkpoints) or None (missing /
        corrupt / too slow). The caller trims to ``hit.tokens``. Request thread only."""
        return drain(self.loads.load_steps(hit))

    def load_steps(self, hit: ColdHit, beside: bool = False) -> Steps[Loaded | None]:
        """:meth:`load`; ``beside``, for a request thread with other work to keep going (the
        batch loop's decode steps): each ``next()`` returns at once while a thread of the load
        reads the file (``codec.load_steps``). Request thread."""
        return self.loads.load_steps(hit, beside)

    def describe(self, hit: ColdHit) -> tuple[Path, int] | None:
        """(entry file path, file bytes) of a hit, or None when its record is gone or the index
        does not answer within the deadline (issue 15: the restore plan sizes the read and probes
        the page cache with it). Request thread; the index query runs on the reader thread."""
        return self.loads.describe(hit)

    def recent(self, limit_entries: int, limit_bytes: int) -> list[ColdHit]:
        """Most recently used entries first, within both limits (0 = no limit on that axis;
        both 0 = nothing), for warm-start prefetch."""
        return self.loads.recent(limit_entries, limit_bytes)

    # -- request thread: hand over to the writer ----------------------------------------------
    def spill(
        self,
        token_ids: np.ndarray,
        caches: list,
        checkpoints: dict[int, list] | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """Queue the entry for writing and return at once. Never dropped for its size; the oldest
        waiting spill is dropped when the queue passes ``spill_queue_bytes`` (logged, counted).
        Entries shorter than one block are not stored. ``prompt_tokens``: how many of the ids
        were the request's prompt (kept with the entry; None: all)."""
        job = self._prepare(token_ids, caches, checkpoints, prompt_tokens)
        if job is not None:
            self.writer.submit(lambda: self._write(job), job.nbytes)

    def persist(
        self,
        token_ids: np.ndarray,
        caches: list,
        checkpoints: dict[int, list] | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """Write-through: returns once the file and its index record are durable, the write
        failed (counted, logged), or a stalled disk made it late (it completes later)."""
        job = self._prepare(token_ids, caches, checkpoints, prompt_tokens)
        if job is None:
            return
        try:
            self.writer.run_sync(lambda: self._write(job), 30.0 + job.nbytes / _MIN_RATE)
        except TimeoutError:
            self.faults.count("late_write_through")
            self.faults.once("late_write", "cold write-through is late (stalled disk?)")
        except RuntimeError:  # closed
            self.faults.drop(job.nbytes, "closed")

    def _prepare(
        self,
        token_ids: np.ndarray,
        caches: list,
        checkpoints: dict[int, list] | None,
        prompt_tokens: int | None = None,
    ) -> Prepared | None:
        tokens = keys.as_int32(token_ids)
        if len(tokens) < self.block_tokens:
            self.faults.count("skipped")
            return None
        try:
            return codec.prepare(tokens, caches, checkpoints, self.fingerprint, prompt_tokens)
        except layers.UnsupportedCache as e:
            self.faults.once("unsupported", "cold tier does not store this cache: %s", e)
            self.faults.count("skipped")
            return None

    # -- [shared tier, issue 17] -----------------------------------------------------------------
    def publish_to(self, hook: Published) -> None:
        """``hook(read, tokens, nbytes)`` hears of each entry this tier writes (writer thread);
        ``read()`` gives the entry's bytes, or None once it is gone."""
        self.writes.published = hook

    def adopt(self, data: bytearray, tokens: np.ndarray) -> Loaded | None:
        """An entry fetched (and verified) from the shared tier: decoded through the cold tier's
        own in-memory load path (chunk digests checked again over the bytes the arrays are made
        from) and queued to be written here as it is, so the next restart finds it locally; not
        published again. Request thread (builds MLX arrays); None when refused."""
        view = memoryview(data)
        try:
            header = store.parse_buffer(view, self.fingerprint)
            arrays = codec.load_buffer(view, header)
            ids = codec.tokens_of(arrays)
            if not np.array_equal(ids, keys.as_int32(tokens)):
                raise store.CorruptEntry("entry tokens differ from the shared index")
            caches, checkpoints = codec.decode(arrays, header.metadata)
        except (store.CorruptEntry, layers.CorruptState, layers.UnsupportedCache) as e:
            self.faults.once("adopt", "shared entry refused by the cold tier: %s", e)
            return None
        except RuntimeError as e:  # MLX refused the arrays' memory (CUDA: out of memory): a miss
            self.faults.count("load_errors")
            self.faults.once("load:memory", "shared entry not loaded: %s", e)
            return None
        if len(ids) >= self.block_tokens:
            job = Raw(ids, data, header.metadata)
            self.writer.submit(lambda: self._write(job), job.nbytes)
        return Loaded(caches, ids, checkpoints, store.prompt_of(header.metadata, len(ids)))

    def _write(self, job: Prepared | Raw) -> None:
        self.writes.write(job)
        self._refresh_summary()

    def _refresh_summary(self) -> None:
        index = self.site.index
        try:
            self._summary = index.summary() if index is not None else (0, 0)
        except sqlite3.Error:
            pass

    # -- maintenance -----------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Block until every queued spill is written (or ``timeout`` passes); False if late."""
        done = self.writer.wait_idle(timeout)
        if done:
            self.loads.ask(self._refresh_summary, None)
        return done

    def begin_close(self) -> None:
        """Shutdown starts: from now on no spill is dropped (close writes them all)."""
        self.writer.hold_all()

    def stats(self) -> dict[str, Any]:
        """Counters and sizes; never touches the disk (sizes as of the last write or flush)."""
        out = self.faults.snapshot()
        out["errors"] = out["write_errors"]
        out["entries"], out["bytes"] = self._summary
        out["queue_bytes"] = self.writer.pending_bytes
        out["writer_idle"] = int(self.writer.idle)
        out["degraded_now"] = int(self.site.index is None or not self.site.writable)
        out["gpu_upload_bytes"] = gpu.uploaded_bytes()  # loads and `both` reads (CUDA)
        return out

    def verify(self, fix: bool = False) -> VerifyReport:
        """Check every file (checksums included) against the index; ``fix`` quarantines bad
        files, removes orphans and drops records whose file is missing."""
        self.flush()
        report = self.writer.run_sync(
            lambda: verify_dir(self.dir, self.fingerprint, self.site.index, self.quarantine_dir, fix)
        )
        self.writer.run_sync(self._refresh_summary)
        return report

    def close(self, timeout: float | None = None) -> bool:
        """Write every queued spill (nothing is dropped from here on) within ``timeout`` seconds
        (default ``shutdown_seconds``), then stop the threads and close the index. What could
        not be written in time is logged with its bytes and counted. False if that happened."""
        self.begin_close()
        limit = self.config.shutdown_seconds if timeout is None else timeout
        done = self.writer.wait_idle(limit)
        if not done:
            left = self.writer.unwritten()
            self.faults.count("shutdown_unwritten", len(left))
            self.faults.count("shutdown_unwritten_bytes", sum(left))
            self.faults.once("shutdown", "cold tier: %d entries (%d bytes) not written within "
                             "%gs at shutdown", len(left), sum(left), limit)  # fmt: skip
        if done:
            try:  # the writer thread's sqlite connection is closed with the others below
                self.writer.run_sync(lambda: None, 10)
            except (RuntimeError, TimeoutError):
                pass
        self.writer.close(0 if not done else None)
        idle = self.reader.close(_READER_WAIT)
        self.site.close(others_done=done and idle)
        return done


__all__ = ["ColdHit", "ColdTier", "Loaded", "VerifyReport"]
