"""Write-behind to the shared tier: a :class:`tiered_kv.bounded.BoundedWorker` publishing entries.

One daemon thread draining a FIFO bounded in bytes (:mod:`tiered_kv.bounded` has the rules).

The local cold tier hands over, for each entry it has written, a ``read`` function (the entry's
bytes from the local store, or None when it is gone meanwhile) and the entry's token ids; the
queue holds no entry bytes, only those promises, and ``max_bytes`` bounds the bytes they stand
for (the backlog of publishing). Past it the oldest waiting entry is dropped (counted,
``on_drop``); one larger than the bound is admitted when nothing else waits.

Ownership: tasks run on the publisher thread and touch only bytes (a file read, the network) —
never MLX. ``submit`` never blocks the request thread.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiered_kv.bounded import BoundedWorker

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


class Publisher:
    def __init__(
        self,
        publish: Callable[[Any, np.ndarray], bool],
        max_bytes: int,
        on_drop: Callable[[int], None],
        name: str = "tiered-kv-publisher",
    ) -> None:
        self._publish = publish
        self._on_drop = on_drop
        self._worker = BoundedWorker(max_bytes, lambda nbytes, why: on_drop(nbytes), name)

    @property
    def pending_bytes(self) -> int:
        return self._worker.pending_bytes

    def submit(self, read: Read, tokens: np.ndarray, nbytes: int) -> None:
        self._worker.submit(lambda: self._send(read, tokens), nbytes)

    def _send(self, read: Read, tokens: np.ndarray) -> None:
        """Publisher thread: the entry's bytes (None: gone meanwhile), then the network."""
        data = read()
        if data is not None:
            self._publish(data, tokens)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued entry is published (or skipped); False on timeout."""
        return self._worker.wait_idle(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Publish what is queued within ``timeout`` seconds, drop the rest, stop the thread."""
        done = self._worker.wait_idle(timeout)
        if not done:
            for nbytes in self._worker.discard():
                self._on_drop(nbytes)
        self._worker.close(timeout if done else 0)
        return done
