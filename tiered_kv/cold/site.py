"""Where a cold tier lives: its directories, its entry backend and its index — opened, rebuilt
and re-opened here, and nowhere else.

Opening never loses data and never stops the server:

* a cache dir or index that another user can write to (or a symlink) is refused with one line
  (:class:`dbfile.UnsafeCacheDir`);
* a damaged index is rebuilt from the entry files *beside* it and swapped in only once the
  rebuild committed — on a full or read-only disk the damaged one is kept and the tier runs
  without an index (every lookup a miss) until a later write can rebuild it;
* an index that cannot be written (read-only disk, full disk) is opened read-only: entries on
  disk are still served, writes fail and are counted;
* a vanished directory is re-created on the next write.

Threads: :meth:`Site.ensure` runs on the writer thread; ``index`` is replaced by a new object,
never mutated, so a reader holding the old one finishes its query on it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from pathlib import Path

from tiered_kv import keys
from tiered_kv.cold import fsafe, store, usage
from tiered_kv.cold.backend import FileBackend
from tiered_kv.cold.dbfile import IndexUnreadable, UnsafeCacheDir, check_private
from tiered_kv.cold.faults import Faults, kind_of
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Damaged, damaged
from tiered_kv.cold.schema import DB, SCHEMA
from tiered_kv.cold.verify import reconcile
from tiered_kv.config import Config

log = logging.getLogger("tiered_kv.cold.tier")
_RETRY_SECONDS = 30.0  # a degraded tier retries opening its index at most this often


class Site:
    def __init__(self, root: Path, fingerprint: str, config: Config, faults: Faults) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.dir = self.root / fingerprint
        self.quarantine_dir = self.root / usage.QUARANTINE
        self.block_tokens = config.block_tokens
        self.seed = f"{fingerprint}:{self.block_tokens}"
        self.backend = FileBackend(self.dir)
        self.faults = faults
        self.index: Index | None = None
        self.writable = False
        self._tried = 0.0
        self.damaged = False  # set by a write or a lookup that found the index damaged
        self.open()

    @property
    def meta(self) -> dict:
        return {"schema": SCHEMA, "seed": self.seed, "block_tokens": self.block_tokens}

    # -- opening -------------------------------------------------------------------------------
    def open(self, rebuild: bool = False) -> None:
        """(Re)open: directories, then the index (rebuilt if damaged; with ``rebuild``, one found
        damaged while serving, rebuilt whatever the open's check finds), then reconcile with the
        files. Raises UnsafeCacheDir, or OSError for a path that can never be a directory."""
        self._tried = time.monotonic()
        check_private(self.root, follow=True)  # the root itself may be a link to another disk
        check_private(self.dir)
        try:
            self.root.mkdir(mode=store.DIR_MODE, parents=True, exist_ok=True)
            fsafe.make_dir(self.dir, store.DIR_MODE)  # a symlink there is refused, not followed
        except OSError as e:
            if kind_of(e) not in ("read_only", "disk_full"):
                raise
            self._degrade("cannot create the cache directory", e)
            old, self.writable = self.index, False
            self.index = self._read_only() if self.dir.is_dir() else None
            if old is not None:
                old.release()  # the reader thread may be querying it now
            return
        old = self.index
        self.index, self.writable = self._open_index(rebuild)
        if old is not None and old is not self.index:
            old.release()  # the reader thread may be querying it now

    def _open_index(self, rebuild: bool = False) -> tuple[Index | None, bool]:
        path = self.dir / "index"
        if rebuild:  # the open's check reads no ids nor what a row serves: it would keep that row
            rebuilt = self._rebuild_aside(path, Damaged("a row found damaged while serving"))
            return rebuilt, rebuilt is not None
        try:
            index = Index(path)
        except UnsafeCacheDir:
            raise
        except (OSError, IndexUnreadable, sqlite3.Error) as e:
            ro = self._read_only()
            if ro is not None:  # readable but not writable: serve what is on disk
                self._degrade("index is not writable, serving read-only", e)
                return ro, False
            rebuilt = self._rebuild_aside(path, e)
            return rebuilt, rebuilt is not None
        try:
            before = index.meta
            rebuild = index.claim_meta(self.meta)  # atomic: of two openers, one clears
            if rebuild and before is not None:  # e.g. two servers with two block sizes on one dir
                log.warning("cold index of %s was made with %s, this server uses %s: re-indexing "
                            "its files (servers sharing a directory must agree on "
                            "TIERED_KV_BLOCK_TOKENS)", self.dir, before, self.meta)  # fmt: skip
            stats = reconcile(self.dir, self.fingerprint, index, self.quarantine_dir, rebuild,
                              self.seed, self.block_tokens)  # fmt: skip
        except (OSError, sqlite3.Error) as e:
            index.close()
            if damaged(e):  # rows no writer of ours made: rebuilt from the files
                rebuilt = self._rebuild_aside(path, e)
                return rebuilt, rebuilt is not None
            self._degrade("cannot update the index, serving read-only", e)
            return self._read_only(), False
        self.faults.count("quarantined", stats.get("quarantined", 0))
        return index, True

    def _read_only(self) -> Index | None:
        try:
            index = Index(self.dir / "index", readonly=True, create=False)
        except UnsafeCacheDir:
            raise
        except (OSError, IndexUnreadable, sqlite3.Error):
            return None
        if index.meta != self.meta:
            index.close()
            return None
        return index

    def _rebuild_aside(self, path: Path, why: BaseException) -> Index | None:
        """Build a fresh index from the files in ``index.rebuild-<pid>/``, then swap it in; the
        damaged one is deleted only after that. On failure the damaged one stays."""
        log.warning("cold index unreadable, rebuilding from files: %s", why)
        tmp = path.with_name(f"index.rebuild-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        fresh: Index | None = None
        try:
            fresh = Index(tmp)
            fresh.claim_meta(self.meta)
            stats = reconcile(self.dir, self.fingerprint, fresh, self.quarantine_dir, True,
                              self.seed, self.block_tokens)  # fmt: skip
            fresh.close()
            aside = path.with_name(f"index.damaged-{os.getpid()}")
            if path.exists():
                os.replace(path, aside)
            os.replace(tmp, path)
            shutil.rmtree(aside, ignore_errors=True)
            index = Index(path)
        except UnsafeCacheDir:
            raise
        except (OSError, IndexUnreadable, sqlite3.Error) as e:
            if fresh is not None:
                fresh.close()
            shutil.rmtree(tmp, ignore_errors=True)
            self._degrade("cannot rebuild the damaged index (kept as is)", e)
            return None
        self.faults.count("quarantined", stats.get("quarantined", 0))
        return index

    def _degrade(self, what: str, e: BaseException) -> None:
        kind = kind_of(e) or "index_errors"
        self.faults.count("degraded")
        self.faults.count(kind)
        self.faults.once(f"degraded:{what}", "cold tier degraded (%s): %s: %s", kind, what, e)

    # -- writer thread -------------------------------------------------------------------------
    def ensure(self) -> Index | None:
        """Before a write: re-create a vanished directory (fresh index rebuilt from what files
        remain), rebuild an index found damaged, or retry a degraded open (at most every 30 s).
        The index to write to, or None."""
        if self.damaged:  # a write or a lookup found the index damaged while serving (whoever
            self.damaged = False  # found it counted it as an index error: once, not here again)
            self.open(rebuild=True)  # its database or a row unreadable: rebuilt from the files
        elif self.index is not None and self.writable:
            if (self.dir / "index" / DB).exists():
                return self.index
            self.faults.once("dir_gone", "cold tier directory %s vanished: re-creating it", self.dir)
            self.faults.count("dir_recreated")
            self.open()
        elif time.monotonic() - self._tried >= _RETRY_SECONDS:
            self.open()
        return self.index if self.writable else None

    def block_hashes(self, tokens: object) -> list[keys.BlockHash]:
        return keys.block_hashes(tokens, self.block_tokens, self.seed)  # type: ignore[arg-type]

    def close(self, others_done: bool = True) -> None:
        """Close the index; where another thread may still be in a query on it (``others_done``
        false: the reader stuck in a late lookup, the writer in its last transaction when the
        shutdown's time ran out) let go of it instead (:meth:`Index.release`, as a re-open
        does): closing their connections under them failed that query or crashed the process."""
        if self.index is not None:
            self.index.close() if others_done else self.index.release()
