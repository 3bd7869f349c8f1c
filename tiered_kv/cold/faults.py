"""Fault counting and logging of the cold tier: one owner for its counters and warnings.

Every counter the tier exports (``stats()`` → ``/metrics`` as ``tiered_kv_cache_cold_<name>``)
lives here, behind one lock, so the writer thread, the reader thread and the request thread may
all count. :meth:`Faults.io_error` turns an ``OSError`` / ``sqlite3.Error`` into its kind:
``disk_full`` (ENOSPC, EDQUOT, SQLITE_FULL), ``read_only`` (EROFS, EACCES, EPERM,
SQLITE_READONLY), ``dir_missing`` (ENOENT) or ``index_errors`` (any other sqlite error).
Warnings are logged once per kind; repeated events (drops) at most once per ``interval`` with
the number and bytes suppressed since.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time
from typing import Any

log = logging.getLogger("tiered_kv.cold.tier")

COUNTERS = (
    "spills", "spill_bytes", "drops", "drop_bytes", "quarantined", "write_errors", "skipped",
    "evictions", "superseded", "loads", "load_bytes", "misses_missing", "disk_full", "read_only",
    "dir_missing", "index_errors", "dir_recreated", "lookup_timeouts", "degraded",
    "shutdown_unwritten", "shutdown_unwritten_bytes", "late_write_through", "load_errors",
)  # fmt: skip
_ERRNO = {errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EROFS: "read_only",
          errno.EACCES: "read_only", errno.EPERM: "read_only", errno.ENOENT: "dir_missing"}  # fmt: skip
_SQLITE = {13: "disk_full", 8: "read_only"}  # SQLITE_FULL, SQLITE_READONLY (primary codes)


def kind_of(e: BaseException) -> str:
    """The counter an I/O error belongs to ('' for an OSError of no special kind)."""
    if isinstance(e, sqlite3.Error):
        code = getattr(e, "sqlite_errorcode", None)
        if code is not None and code & 0xFF in _SQLITE:
            return _SQLITE[code & 0xFF]
        text = str(e).lower()
        if "disk is full" in text:
            return "disk_full"
        if "readonly" in text or "read-only" in text:
            return "read_only"
        return "index_errors"
    if isinstance(e, OSError):
        return _ERRNO.get(e.errno or 0, "")
    return "index_errors"


class Faults:
    def __init__(self, interval: float = 30.0) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(COUNTERS, 0)
        self.load_seconds = 0.0
        self._logged: set[str] = set()
        self._interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, list[int]] = {}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def add_load(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._n["loads"] += 1
            self._n["load_bytes"] += nbytes
            self.load_seconds += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._n)
            out["load_seconds"] = self.load_seconds
        return out

    def once(self, kind: str, msg: str, *args: Any) -> None:
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.warning(msg, *args)

    def io_error(self, what: str, e: BaseException) -> str:
        """Count a failed write / index operation by kind and log it once per kind."""
        kind = kind_of(e)
        self.count("write_errors")
        if kind:
            self.count(kind)
        code = errno.errorcode.get(getattr(e, "errno", None) or 0, type(e).__name__)
        self.once(f"{what}:{code}", "cold %s failed (%s): %s", what, code, e)
        return kind

    def drop(self, nbytes: int, reason: str) -> None:
        """Count a dropped spill; log at most once per interval with what was held back."""
        now = time.monotonic()
        with self._lock:
            self._n["drops"] += 1
            self._n["drop_bytes"] += nbytes
            held = self._held.setdefault(reason, [0, 0])
            held[0] += 1
            held[1] += nbytes
            if now - self._last.get(reason, -1e9) < self._interval:
                return
            self._last[reason] = now
            n, b = held
            self._held[reason] = [0, 0]
        log.warning("cold spill dropped (%s): %d entr%s, %d bytes since the last report",
                    reason, n, "y" if n == 1 else "ies", b)  # fmt: skip
