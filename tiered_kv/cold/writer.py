"""Write-behind: one background thread draining a FIFO of tasks bounded in bytes.

Ownership: tasks run on the writer thread and must only touch files, the index and evaluated
arrays' bytes (never build MLX graphs).

``max_bytes`` bounds the bytes of droppable tasks *waiting* in the queue (the task being written
is not counted: its bytes are leaving). ``submit`` never blocks and never refuses a task for its
size alone: a task larger than the bound is admitted when no other droppable task waits (so any
entry can reach disk, one at a time); to admit a task the oldest waiting droppable tasks are
dropped (reported through ``on_drop(nbytes, reason)``) until it fits or it waits alone. After :meth:`hold_all`
(shutdown) nothing is dropped. ``run_sync`` waits for its own task; :meth:`wait_idle` /
:attr:`idle` tell when nothing is queued or running.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class _Task:
    fn: Callable[[], Any]
    nbytes: int
    droppable: bool
    done: threading.Event | None = None
    result: Any = None
    error: BaseException | None = None


class Writer:
    def __init__(
        self, max_bytes: int, on_drop: Callable[[int, str], None], name: str = "tiered-kv-writer"
    ) -> None:
        self.max_bytes = max_bytes
        self._on_drop = on_drop
        self._queue: deque[_Task] = deque()
        self._pending = 0  # bytes of droppable tasks waiting
        self._busy = False
        self._closed = False
        self._hold = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running (a snapshot)."""
        with self._cond:
            return not self._queue and not self._busy

    def hold_all(self) -> None:
        """From now on nothing is dropped (shutdown: every entry is written, whatever waits)."""
        with self._cond:
            self._hold = True

    def submit(self, fn: Callable[[], Any], nbytes: int, droppable: bool = True) -> bool:
        """Enqueue ``fn``; False only when the writer is closed (``on_drop`` was told)."""
        with self._cond:
            if self._closed:
                self._on_drop(nbytes, "writer closed")
                return False
            droppable = droppable and not self._hold
            while droppable and self._pending + nbytes > self.max_bytes:
                oldest = next((t for t in self._queue if t.droppable), None)
                if oldest is None:
                    break  # it waits alone: admitted whatever its size
                self._queue.remove(oldest)
                self._pending -= oldest.nbytes
                oldest.fn = _noop  # release what it holds
                self._on_drop(oldest.nbytes, "queue full")
            self._queue.append(_Task(fn, nbytes, droppable))
            if droppable:
                self._pending += nbytes
            self._cond.notify_all()
            return True

    def run_sync(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the writer thread after everything queued before it; return its result.
        TimeoutError when it has not finished within ``timeout`` (it still runs later)."""
        task = _Task(fn, 0, False, threading.Event())
        with self._cond:
            if self._closed:
                raise RuntimeError("writer is closed")
            self._queue.append(task)
            self._cond.notify_all()
        assert task.done is not None
        if not task.done.wait(timeout):
            raise TimeoutError("writer did not finish in time")
        if task.error is not None:
            raise task.error
        return task.result

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty and no task runs; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    flush = wait_idle

    def unwritten(self) -> list[int]:
        """Bytes of the tasks still queued (after a timed-out drain)."""
        with self._cond:
            return [t.nbytes for t in self._queue if t.nbytes]

    def close(self, timeout: float | None = None) -> bool:
        """Drain (up to ``timeout``), then stop the thread. False if the drain timed out: the
        tasks still queued are discarded and the thread is left to finish the running one."""
        drained = self.wait_idle(timeout)
        with self._cond:
            self._closed = True
            if not drained:
                self._queue.clear()
                self._pending = 0
            self._cond.notify_all()
        if drained:
            self._thread.join(timeout)
        return drained

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                task = self._queue.popleft()
                if task.droppable:
                    self._pending -= task.nbytes
                self._busy = True
            try:
                task.result = task.fn()
            except Exception as e:  # a bug in a task must not kill the only writer thread
                task.error = e
                if task.done is None:
                    log.exception("cold-tier writer task failed")
            finally:
                task.fn = _noop  # release the arrays the closure holds
                if task.done is not None:
                    task.done.set()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def _noop() -> None:
    return None
