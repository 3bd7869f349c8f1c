"""ColdTier: the disk tier facade (files via store.py, index via index.py, writes via writer.py).

Threads and ownership:

* the **request thread** owns MLX: it calls ``lookup``, ``load`` (builds arrays with ``mx.load``),
  ``spill`` / ``persist`` (encodes the caches and ``mx.eval``-s the sliced arrays *before* they
  cross to the writer), ``recent``, ``stats``, ``verify``;
* the **writer thread** only reads those evaluated arrays' bytes, writes files and commits the
  index; it never builds an MLX graph. Spilled arrays belong to the queue until written or dropped.

Misses are ``None``; corrupt / foreign files raise ``store.CorruptEntry`` inside the tier and are
quarantined, counted and turned into misses; I/O errors while writing are counted and logged
once per kind, never raised into the request path.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from tiered_kv import keys, layers
from tiered_kv.cold import budget, ranged, store, usage
from tiered_kv.cold.index import Index, IndexUnreadable, Record
from tiered_kv.cold.verify import VerifyReport, quarantine, reconcile, verify_dir
from tiered_kv.cold.writer import Writer
from tiered_kv.config import Config
from tiered_kv.prefix import common_prefix

log = logging.getLogger(__name__)
_HEADER_SLACK = 64 << 10  # bytes reserved for a header when checking the budget


@dataclass(frozen=True)
class ColdHit:
    entry_id: str
    tokens: int  # exact common prefix length at token level (ids compared, not hashes)
    entry_tokens: int  # length of the stored entry


class Loaded(NamedTuple):
    caches: list
    tokens: np.ndarray
    #: position → snapshot of the non-positional layers (recurrent / sliding window) there
    checkpoints: dict[int, list]


@dataclass
class _Spill:
    tokens: np.ndarray
    arrays: dict[str, mx.array]
    metadata: dict[str, str]
    nbytes: int
    #: lengths of older entries this one may replace: any length when every layer can be cut
    #: back, else only its checkpoint positions
    serves: frozenset[int] | None = None


_CKPT = "ckpt."
#: write-error kinds counted apart (stats ``disk_full`` ...; exported as metrics by the server)
_FAULTS = ("disk_full", "read_only", "dir_missing")
_FAULT_OF = {errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EROFS: "read_only",
             errno.EACCES: "read_only", errno.EPERM: "read_only", errno.ENOENT: "dir_missing"}  # fmt: skip


class ColdTier:
    def __init__(self, root: Path, fingerprint: str, config: Config) -> None:
        """Open ``root/<fingerprint>/`` (created 0700), open or rebuild the index, reconcile it
        with the files and start the writer thread. ``fingerprint`` comes from the engine;
        a cache salt or stored-KV quantisation is mixed in here (``keys.tier_fingerprint``)."""
        self.config = config
        self.root = Path(root)
        self.fingerprint = keys.tier_fingerprint(
            fingerprint, config.cache_salt, config.kv_bits, config.kv_group_size
        )
        self.dir = self.root / self.fingerprint
        self.quarantine_dir = self.root / usage.QUARANTINE
        self.block_tokens = config.block_tokens
        self.seed = f"{self.fingerprint}:{self.block_tokens}"
        self._stats = dict.fromkeys(
            ("spills", "spill_bytes", "drops", "drop_bytes", "quarantined", "write_errors",
             "skipped", "evictions", "superseded", "loads", "load_bytes", "misses_missing",
             *_FAULTS, "index_errors", "dir_recreated"), 0
        )  # fmt: skip
        self._stats_lock = threading.Lock()
        self._load_seconds = 0.0
        self._logged: set[str] = set()
        self._ensure_dirs()
        self.index = self._open_index()
        self.writer = Writer(config.spill_queue_bytes, self._on_drop)

    # -- opening -------------------------------------------------------------------------------
    def _ensure_dirs(self) -> None:
        for d in (self.root, self.dir):
            d.mkdir(mode=store.DIR_MODE, parents=True, exist_ok=True)

    def _open_index(self) -> Index:
        path = self.dir / "index"
        try:
            index = Index(path)
        except IndexUnreadable as e:
            log.warning("cold index unreadable, rebuilding from files: %s", e)
            shutil.rmtree(path, ignore_errors=True)
            index = Index(path)
        want = {"schema": 1, "seed": self.seed, "block_tokens": self.block_tokens}
        rebuild = index.claim_meta(want)  # atomic: of two processes opening at once, one clears
        stats = reconcile(self.dir, self.fingerprint, index, self.quarantine_dir, rebuild, self.seed,
                          self.block_tokens)  # fmt: skip
        self._count("quarantined", stats.get("quarantined", 0))
        return index

    def _check_index(self) -> None:
        """Writer thread: when the directory (and so the index file) was deleted under us,
        re-create it and open a fresh index (rebuilt from whatever files are there)."""
        if (self.dir / "index" / "cache.db").exists():
            return
        self._log_once("dir_gone", "cold tier directory %s vanished: re-creating it", self.dir)
        self._count("dir_recreated")
        self._ensure_dirs()
        self.index = self._open_index()  # the old one is dropped, not closed: readers may hold it

    # -- request thread: lookup / load -----------------------------------------------------------
    def lookup(self, prompt_ids: Sequence[int] | np.ndarray) -> ColdHit | None:
        """Longest exact prefix of ``prompt_ids`` held by one entry, or None. No file I/O."""
        tokens = keys.as_int32(prompt_ids)
        hashes = keys.block_hashes(tokens, self.block_tokens, self.seed)
        try:
            return self._lookup(tokens, hashes)
        except sqlite3.Error as e:
            self._count("index_errors")
            self._log_once("index_read", "cold index unreadable, treating as a miss: %s", e)
            return None

    def _lookup(self, tokens: np.ndarray, hashes: list) -> ColdHit | None:
        index = self.index
        index.refresh()  # another process may have committed (or removed) entries
        best: ColdHit | None = None
        for eid, depth in index.candidates(hashes):
            stored = index.tokens(eid)
            if stored is None:  # removed meanwhile (by us or another process)
                continue
            n = common_prefix(stored, tokens)
            if n > 0 and (best is None or n > best.tokens):
                best = ColdHit(eid, n, len(stored))
            if n >= depth * self.block_tokens:
                break  # the hashes were right: nothing shallower can match further
        return best

    def load(self, hit: ColdHit) -> Loaded | None:
        """(caches holding the whole entry, entry token ids, checkpoints) or None (missing /
        corrupt).

        The caller trims to ``hit.tokens``. Request thread only (creates MLX arrays)."""
        try:
            return self._load(hit)
        except sqlite3.Error as e:
            self._count("index_errors")
            self._log_once("index_read", "cold index unreadable, treating as a miss: %s", e)
            return None

    def _load(self, hit: ColdHit) -> Loaded | None:
        rec = self.index.get(hit.entry_id)
        if rec is None:
            return None
        path = self.dir / rec.file
        t0 = time.perf_counter()
        try:
            arrays, header, tokens = store.load_entry(path, self.fingerprint)
            stored = self.index.tokens(rec.entry_id)
            if stored is None:  # superseded / evicted (maybe by another process) while loading
                raise FileNotFoundError(path)
            if not np.array_equal(stored, tokens):
                raise store.CorruptEntry("file tokens differ from the index")
            caches, checkpoints = _decode(arrays, header.metadata)
        except FileNotFoundError:
            self._vanished(rec)
            return None
        except (store.CorruptEntry, layers.CorruptState, layers.UnsupportedCache) as e:
            if self._was_replaced(rec, path):
                self._vanished(rec)  # deleted between our reads: a miss, not corruption
            else:
                self._quarantine(rec, e)
            return None
        dt = time.perf_counter() - t0
        with self._stats_lock:
            self._stats["loads"] += 1
            self._stats["load_bytes"] += rec.nbytes
            self._load_seconds += dt
        now = time.time()
        self.index.touch(rec.entry_id, now, persist=False)
        self.writer.submit(lambda: self._persist_touch(rec.entry_id, now), 0, droppable=False)
        return Loaded(caches, tokens, checkpoints)

    def describe(self, hit: ColdHit) -> tuple[Path, int] | None:
        """(entry file path, file bytes) of a hit, or None when its record is gone (issue 15:
        the restore plan sizes the read and probes the page cache with it)."""
        try:
            rec = self.index.get(hit.entry_id)
        except sqlite3.Error:
            return None
        return None if rec is None else (self.dir / rec.file, rec.nbytes)

    def _vanished(self, rec: Record) -> None:
        self.index.remove([rec.entry_id])
        self._count("misses_missing")

    def _was_replaced(self, rec: Record, path: Path) -> bool:
        """The file is gone or its record was removed (another process superseded / evicted
        it while we read): what we read may be half of a vanished file, not a corrupt one."""
        if not path.exists():
            return True
        self.index.refresh()
        return self.index.get(rec.entry_id) is None or self.index.tokens(rec.entry_id) is None

    def recent(self, limit_entries: int, limit_bytes: int) -> list[ColdHit]:
        """Most recently used entries first, within both limits (0 = no limit on that axis;
        both 0 = nothing), for warm-start prefetch."""
        if limit_entries <= 0 and limit_bytes <= 0:
            return []
        out: list[ColdHit] = []
        total = 0
        self.index.refresh()
        for r in sorted(self.index.records(), key=lambda r: -r.last_used):
            if limit_entries > 0 and len(out) >= limit_entries:
                break
            if limit_bytes > 0 and total + r.nbytes > limit_bytes:
                break
            out.append(ColdHit(r.entry_id, r.n_tokens, r.n_tokens))
            total += r.nbytes
        return out

    # -- request thread: hand over to the writer ----------------------------------------------
    def spill(
        self, token_ids: np.ndarray, caches: list, checkpoints: dict[int, list] | None = None
    ) -> None:
        """Queue the entry for writing and return at once (oldest queued spill dropped when the
        queue passes ``spill_queue_bytes``). Entries shorter than one block are not stored."""
        job = self._prepare(token_ids, caches, checkpoints)
        if job is not None:
            self.writer.submit(lambda: self._write(job), job.nbytes)

    def persist(
        self, token_ids: np.ndarray, caches: list, checkpoints: dict[int, list] | None = None
    ) -> None:
        """Write-through: returns once the file and its index record are durable (or the write
        failed, counted and logged)."""
        job = self._prepare(token_ids, caches, checkpoints)
        if job is not None:
            self.writer.run_sync(lambda: self._write(job))

    def _prepare(
        self, token_ids: np.ndarray, caches: list, checkpoints: dict[int, list] | None
    ) -> _Spill | None:
        tokens = keys.as_int32(token_ids)
        if len(tokens) < self.block_tokens:
            self._count("skipped")
            return None
        try:
            arrays, meta = layers.encode(caches)
            layout = layers.layout(caches)
            ckpts = checkpoints or {}
            tree = {}
            for pos, snap in ckpts.items():
                a, m = layers.encode(snap)
                arrays.update({f"{_CKPT}{pos}.{k}": x for k, x in a.items()})
                tree[str(pos)] = m["layers"]
            if tree:
                meta["checkpoints"] = json.dumps(tree, separators=(",", ":"))
            serves = None if layers.can_trim(caches) else frozenset(ckpts) | {len(tokens)}
        except layers.UnsupportedCache as e:
            self._log_once("unsupported", "cold tier does not store this cache: %s", e)
            self._count("skipped")
            return None
        mx.eval(list(arrays.values()))  # slices evaluated here: the writer only reads bytes
        metadata = {**meta, "fingerprint": self.fingerprint, "layout": layout,
                    "created": repr(time.time())}  # fmt: skip
        return _Spill(tokens, arrays, metadata, sum(a.nbytes for a in arrays.values()), serves)

    # -- writer thread ---------------------------------------------------------------------------
    def _write(self, job: _Spill) -> None:
        path: Path | None = None
        try:
            self._check_index()
            self._ensure_dirs()
            self.index.refresh()  # budget and supersede see the other processes' entries
            size = job.nbytes + 4 * len(job.tokens) + _HEADER_SLACK
            if not self._make_room(size):
                self._count("skipped")
                return
            eid = uuid.uuid4().hex
            path = self.dir / f"{eid}{store.SUFFIX}"
            # issue 15: block checksums let a restore read (and verify) token ranges only
            meta = {**job.metadata, **ranged.block_checksums(job.tokens, job.arrays)}
            nbytes = store.write_entry(path, job.tokens, job.arrays, meta)
            now = time.time()
            blocks = tuple(keys.block_hashes(job.tokens, self.block_tokens, self.seed))
            rec = Record(eid, path.name, len(job.tokens), nbytes, now, now, blocks)
            older = [r for r in self.index.prefixes_of(list(blocks)) if self._is_prefix(r, job)]
            self.index.add(rec, job.tokens.tobytes(), remove=[r.entry_id for r in older])
            path = None  # committed
            for r in older:  # continuation: superseded entries, deleted after the commit
                (self.dir / r.file).unlink(missing_ok=True)
            with self._stats_lock:
                self._stats["spills"] += 1
                self._stats["spill_bytes"] += nbytes
                self._stats["superseded"] += len(older)
        except (OSError, sqlite3.Error, IndexUnreadable) as e:
            self._count("write_errors")
            code = getattr(e, "errno", None) or 0
            fault = _FAULT_OF.get(code, "index_errors" if not isinstance(e, OSError) else "")
            if fault:
                self._count(fault)
            kind = errno.errorcode.get(code, type(e).__name__)
            self._log_once(f"write:{kind}", "cold spill failed (%s): %s", kind, e)
            if path is not None:
                path.unlink(missing_ok=True)

    def _is_prefix(self, r: Record, job: _Spill) -> bool:
        stored = self.index.tokens(r.entry_id)
        if stored is None or not 0 < len(stored) <= len(job.tokens):
            return False
        if job.serves is not None and len(stored) not in job.serves:
            return False  # the new entry could not serve the old one's length
        return bool(np.array_equal(stored, job.tokens[: len(stored)]))

    def _make_room(self, incoming: int) -> bool:
        use = usage.scan(self.root, self.fingerprint, self.index.records())
        free = shutil.disk_usage(self.root).free
        plan = budget.select_victims(use.items, used=use.used, incoming=incoming,
                                     budget=self.config.disk_bytes, free=free,
                                     floor=self.config.disk_free_floor)  # fmt: skip
        if not plan.fits:
            self._log_once(
                "budget", "cold entry of %d bytes does not fit the disk budget", incoming
            )
            return False
        self._evict(plan.victims)
        return True

    def _evict(self, victims: list[budget.Item]) -> None:
        """The one deletion path: index commit first, then the files."""
        ids = [k[1] for k in (v.key for v in victims) if k[0] == "entry"]  # type: ignore[index]
        gone = self.index.remove(ids)
        for r in gone:
            (self.dir / r.file).unlink(missing_ok=True)
        for v in victims:
            if v.key[0] == "path":  # type: ignore[index]
                usage.remove_path(v.key[1])  # type: ignore[index]
        self._count("evictions", len(victims))

    def _persist_touch(self, entry_id: str, when: float) -> None:
        try:
            self.index.touch(entry_id, when)
        except sqlite3.Error as e:
            self._log_once("touch", "cold index touch failed: %s", e)

    # -- faults / bookkeeping ------------------------------------------------------------------
    def _quarantine(self, rec: Record, err: Exception) -> None:
        self._log_once(f"corrupt:{type(err).__name__}", "cold entry %s quarantined: %s",
                       rec.file, err)  # fmt: skip
        self.index.remove([rec.entry_id])
        quarantine(self.dir / rec.file, self.quarantine_dir, self.fingerprint)
        self._count("quarantined")

    def _on_drop(self, nbytes: int) -> None:
        with self._stats_lock:
            self._stats["drops"] += 1
            self._stats["drop_bytes"] += nbytes

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[name] += n

    def _log_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args)

    # -- maintenance -----------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued spill is written (or ``timeout`` passes)."""
        self.writer.flush(timeout)

    def stats(self) -> dict:
        recs = self.index.records()
        with self._stats_lock:
            out: dict[str, Any] = dict(self._stats)
            out["load_seconds"] = self._load_seconds
        out["errors"] = out["write_errors"]
        out["entries"] = len(recs)
        out["bytes"] = sum(r.nbytes for r in recs)
        out["queue_bytes"] = self.writer.pending_bytes
        return out

    def verify(self, fix: bool = False) -> VerifyReport:
        """Check every file (checksums included) against the index; ``fix`` quarantines bad
        files, removes orphans and drops records whose file is missing."""
        self.flush()
        return self.writer.run_sync(
            lambda: verify_dir(self.dir, self.fingerprint, self.index, self.quarantine_dir, fix)
        )

    def close(self) -> None:
        """Drain the spill queue, stop the writer, close the index (the writer thread's sqlite
        connection too: diskcache keeps one per thread, and a leaked one keeps the -shm file
        mapped, so a later open of a damaged index in this process died of SIGBUS)."""
        self.writer.flush()
        try:
            self.writer.run_sync(self.index.close)
        except RuntimeError:  # already closed
            pass
        self.writer.close()
        self.index.close()


__all__ = ["ColdHit", "ColdTier", "VerifyReport"]


def _decode(arrays: dict[str, mx.array], metadata: dict[str, str]) -> tuple[list, dict[int, list]]:
    """The entry's caches and its checkpoints (arrays named ``ckpt.<pos>.<path>``)."""
    main = {k: v for k, v in arrays.items() if not k.startswith(_CKPT)}
    caches = layers.decode(main, metadata)
    try:
        tree = json.loads(metadata.get("checkpoints", "{}"))
        positions = {int(p): t for p, t in tree.items()}
    except (ValueError, AttributeError) as e:
        raise layers.CorruptState(f"bad checkpoint metadata: {e}") from None
    checkpoints: dict[int, list] = {}
    for pos, layer_tree in positions.items():
        prefix = f"{_CKPT}{pos}."
        sub = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
        checkpoints[pos] = layers.decode(sub, {"layers": layer_tree})
    return caches, checkpoints
