"""CacheAdmin: inspect, verify and clear a cache directory (and the shared tier) without a model.

Owner of what ``tiered-kv cache stats|ls|verify|clear`` reads and repairs; it prints nothing (the
CLI formats). One thread, files and sqlite only (no MLX); nothing read is unpickled. Every
sub-directory of the root named as a fingerprint (32 hex digits) is one; anything else there is
not the cache's (``TIERED_KV_DIR`` may also hold models) and is never read, moved or counted.
Symlinks inside the root are never followed (a linked "fingerprint" is skipped, a linked
``quarantine/`` is removed as a link).
Run ``verify(fix=True)`` and ``clear`` while no server uses the directory. A root or index that
other users can write to raises :class:`UnsafeCacheDir`.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.cold import fsafe, usage
from tiered_kv.cold.dbfile import IndexUnreadable, UnsafeCacheDir, check_private
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Record
from tiered_kv.cold.verify import VerifyReport, entry_files, verify_dir
from tiered_kv.config import Config

__all__ = ["CacheAdmin", "NotAFingerprint", "SharedUnreachable", "UnsafeCacheDir"]


class NotAFingerprint(ValueError):
    """``clear(fingerprint=...)`` got a name that is not 32 hex digits."""


class SharedUnreachable(OSError):
    """The shared tier's Redis did not answer (or refused)."""


@dataclass(frozen=True)
class DirSummary:
    name: str  # the fingerprint
    files: int
    indexed: int | None  # None: no readable index
    nbytes: int


@dataclass(frozen=True)
class Listing:
    name: str
    records: list[Record] | None  # most recently used first; None: no readable index
    files: list[tuple[str, int]]  # (name, bytes) of the entry files (listed when not indexed)


@dataclass(frozen=True)
class Checked:
    name: str
    report: VerifyReport
    checked: bool  # False: no readable index, so the files could not be checked


class CacheAdmin:
    """The cache directory ``root`` (default ``config.cache_dir``) and, when
    ``config.shared_url`` is set, the shared tier (:attr:`shared`)."""

    def __init__(self, config: Config, root: Path | None = None) -> None:
        self.config = config
        self.root = Path(root or config.cache_dir).expanduser()
        self.shared = SharedAdmin(config) if config.shared_url else None

    def check_private(self) -> None:
        """Raise :class:`UnsafeCacheDir` when other users can write to the root."""
        check_private(self.root)

    def fingerprints(self) -> list[Path]:
        """Fingerprint dirs: real directories named as fingerprints only (a symlink may point at a
        model's folder; a model's folder may sit beside them)."""
        return [p for p in fsafe.real_subdirs(self.root) if fsafe.is_fingerprint(p.name)]

    @property
    def quarantine_dir(self) -> Path:
        return self.root / usage.QUARANTINE

    def summaries(self) -> list[DirSummary]:
        out = []
        for fp_dir in self.fingerprints():
            with _index(fp_dir) as index:
                records = _records(index)
                n = len(records) if records is not None else None
            size = usage.tree_size(fp_dir)[0]
            out.append(DirSummary(fp_dir.name, len(entry_files(fp_dir)), n, size))
        return out

    def quarantine(self) -> tuple[int, int] | None:
        """(files, bytes) in ``quarantine/``, or None when there is none (or it is a link)."""
        q = self.quarantine_dir
        if not q.is_dir() or q.is_symlink():
            return None
        return len(list(q.iterdir())), usage.tree_size(q)[0]

    def total_bytes(self) -> int:
        """The cache's bytes under the root, as the disk budget counts them."""
        return usage.scan(self.root, "", []).used

    def listings(self) -> list[Listing]:
        out = []
        for fp_dir in self.fingerprints():
            with _index(fp_dir) as index:
                records = _records(index)
                if records is None:
                    files = [(p.name, p.stat().st_size) for p in entry_files(fp_dir)]
                    out.append(Listing(fp_dir.name, None, files))
                    continue
            out.append(Listing(fp_dir.name, sorted(records, key=lambda r: -r.last_used), []))
        return out

    def verify(self, fix: bool = False) -> list[Checked]:
        """Every file's header and checksums against its fingerprint's index; ``fix``
        quarantines bad files, removes orphans and drops records whose file is gone — only where
        the index could be read (without it nothing is known well enough to move)."""
        out = []
        for fp_dir in self.fingerprints():
            with _index(fp_dir, write=fix) as opened:
                index = opened if _records(opened) is not None else None  # damaged: unchecked
                fixing = fix and index is not None
                report = verify_dir(fp_dir, fp_dir.name, index, self.quarantine_dir, fixing)
            out.append(Checked(fp_dir.name, report, index is not None))
        return out

    def clear(self, fingerprint: str | None = None) -> list[Path]:
        """Delete one fingerprint's entries, or every fingerprint and the quarantine; returns
        what was removed. Raises :class:`NotAFingerprint` for a name that is not one."""
        if fingerprint is not None and not fsafe.is_fingerprint(fingerprint):
            raise NotAFingerprint(fingerprint)
        targets = [self.root / fingerprint] if fingerprint else [*self.fingerprints()]
        if not fingerprint:
            targets.append(self.quarantine_dir)
        return [p for p in targets if os.path.lexists(p) and fsafe.remove(self.root, p)]


def _records(index: Index | None) -> list[Record] | None:
    """Its records, or None where there is no index or it is damaged (a malformed row)."""
    if index is None:
        return None
    try:
        index.check()  # a row a lookup or a load would find damaged
        return index.records()
    except sqlite3.Error:
        return None


@contextmanager
def _index(fp_dir: Path, write: bool = False) -> Iterator[Index | None]:
    """The fingerprint's index, or None when it is absent / unreadable (rebuilt at next open).
    Never creates one: an empty new index would make every file look like an orphan. Opened
    read-only unless ``write`` (verify --fix). Plain sqlite: nothing in it is unpickled."""
    path = fp_dir / "index"
    if not (path / "cache.db").exists():
        yield None
        return
    for p in (fp_dir, path):
        check_private(p)
    try:
        index = Index(path, readonly=not write, create=False)
    except (IndexUnreadable, sqlite3.Error):
        yield None
        return
    try:
        yield index if index.meta is not None else None
    finally:
        index.close()


class SharedAdmin:
    """The shared tier's entries (``TIERED_KV_SHARED``). Imports redis on first use; a Redis
    that does not answer raises :class:`SharedUnreachable`."""

    TIMEOUT = 10.0  # the CLI may wait longer than a request would

    def __init__(self, config: Config) -> None:
        self.url = config.shared_url

    @property
    def where(self) -> str:
        """The URL without its password."""
        from tiered_kv.shared.redis_tier import redact

        return redact(self.url)

    def entries(self) -> list[Any]:
        """Every entry of every fingerprint (``survey.EntryInfo``), newest first."""
        from tiered_kv.shared import survey

        return self._ask(lambda c: survey.entries(c))

    def stats(self) -> tuple[list[Any], dict[str, Any]]:
        """(entries, Redis's own memory facts: used / max memory, policy, evicted keys)."""
        from tiered_kv.shared import survey

        return self._ask(lambda c: (survey.entries(c), survey.server(c)))

    def verify(self, fix: bool = False) -> dict[str, Any]:
        """Per fingerprint a ``survey.SharedReport``; ``fix`` unlinks bad entries and orphans."""
        from tiered_kv.shared import entry, survey

        return self._ask(lambda c: survey.verify(c, self.url, entry.checker, fix))

    def _ask(self, fn: Any) -> Any:
        import redis

        from tiered_kv.shared.redis_tier import connect

        try:
            return fn(connect(self.url, self.TIMEOUT))
        except (redis.RedisError, OSError) as e:
            raise SharedUnreachable(str(e)) from e
