"""Write-behind to the shared tier: one daemon thread draining a FIFO bounded in bytes.

The local cold tier hands over, for each entry it has written, a ``read`` function (the entry's
bytes from the local store, or None when it is gone meanwhile) and the entry's token ids; the
queue holds no entry bytes, only those promises, and ``max_bytes`` bounds the bytes they stand
for (the backlog of publishing). Past it the oldest waiting entry is dropped (counted,
``on_drop``); one larger than the bound is admitted when nothing else waits.

Ownership: tasks run on the publisher thread and touch only bytes (a file read, the network) —
never MLX. ``submit`` never blocks the request thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Read = Callable[[], Any]  # → a buffer of the entry's bytes, or None (gone)


def map_file(path: Path) -> memoryview | None:
    """A read-only map of a local entry file (pages come from the page cache as they are sent:
    publishing a 4 GB entry does not hold 4 GB of process memory), or None once it is gone or
    unreadable. Never follows a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, or a symlink planted in the cache dir (ELOOP): nothing to publish
        return None
    try:
        if os.fstat(fd).st_size == 0:
            return None
        return memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)  # the map keeps the file's pages


@dataclass
class _Job:
    read: Read
    tokens: np.ndarray
    nbytes: int


class Publisher:
    def __init__(
        self,
        publish: Callable[[Any, np.ndarray], bool],
        max_bytes: int,
        on_drop: Callable[[int], None],
        name: str = "tiered-kv-publisher",
    ) -> None:
        self._publish = publish
        self.max_bytes = max_bytes
        self._on_drop = on_drop
        self._queue: deque[_Job] = deque()
        self._pending = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def submit(self, read: Read, tokens: np.ndarray, nbytes: int) -> None:
        with self._cond:
            if self._closed:
                self._on_drop(nbytes)
                return
            while self._queue and self._pending + nbytes > self.max_bytes:
                old = self._queue.popleft()
                self._pending -= old.nbytes
                self._on_drop(old.nbytes)
            self._queue.append(_Job(read, tokens, nbytes))
            self._pending += nbytes
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued entry is published (or skipped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Publish what is queued within ``timeout`` seconds, drop the rest, stop the thread."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            for job in self._queue:
                self._on_drop(job.nbytes)
            self._queue.clear()
            self._pending = 0
            self._cond.notify_all()
        self._thread.join(timeout)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._pending -= job.nbytes
                self._busy = True
            try:
                data = job.read()
                if data is not None:
                    self._publish(data, job.tokens)
                del data
            except Exception:  # a bug must not kill the only publisher thread
                log.exception("shared-tier publish failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
