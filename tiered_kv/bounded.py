"""BoundedWorker: one daemon thread draining a FIFO of tasks bounded in bytes, never blocking.

The one such queue of the project: behind the cold tier's write-behind
(:mod:`tiered_kv.cold.writer`) and the shared tier's publisher (:mod:`tiered_kv.shared.publisher`).

``max_bytes`` bounds the bytes of droppable tasks *waiting* in the queue (the task running is not
counted: its bytes are leaving). ``submit`` never blocks and never refuses a task for its size
alone: a task larger than the bound is admitted when no other droppable task waits (so any
entry gets through, one at a time); to admit a task the oldest waiting droppable tasks are
dropped (reported through ``on_drop(nbytes, reason)``) until it fits or it waits alone. After
:meth:`hold_all` (shutdown) nothing is dropped. :meth:`run_sync` waits for its own task;
:meth:`wait_idle` / :attr:`idle` tell when nothing is queued or running; :meth:`discard` takes
back what still waits (a timed-out drain).

Ownership: the tasks run on the worker's thread; what they may touch is the owner's rule (the
cold writer: files, the index and evaluated arrays' bytes; the publisher: bytes and the network —
never MLX). A task's closure is released as soon as it has run or been dropped.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: ``on_drop(nbytes, reason)``: a task was dropped ("queue full") or refused ("closed")
OnDrop = Callable[[int, str], None]


@dataclass
class _Task:
    fn: Callable[[], Any]
    nbytes: int
    droppable: bool
    done: threading.Event | None = None
    result: Any = None
    error: BaseException | None = None


class BoundedWorker:
    def __init__(self, max_bytes: int, on_drop: OnDrop, name: str = "tiered-kv-worker") -> None:
        self.max_bytes = max_bytes
        self.name = name
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
        """From now on nothing is dropped (shutdown: every task runs, whatever waits)."""
        with self._cond:
            self._hold = True

    def submit(self, fn: Callable[[], Any], nbytes: int, droppable: bool = True) -> bool:
        """Enqueue ``fn``; False only when the worker is closed (``on_drop`` was told, for a
        droppable task: what may not be dropped is no drop, e.g. a cold tier's touch)."""
        with self._cond:
            if self._closed:
                if droppable:
                    self._on_drop(nbytes, "closed")
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
        """Run ``fn`` on the worker thread after everything queued before it; return its result.
        TimeoutError when it has not finished within ``timeout`` (it still runs later);
        RuntimeError when the worker is closed."""
        task = _Task(fn, 0, False, threading.Event())
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._queue.append(task)
            self._cond.notify_all()
        assert task.done is not None
        if not task.done.wait(timeout):
            raise TimeoutError(f"{self.name} did not finish in time")
        if task.error is not None:
            raise task.error
        return task.result

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty and no task runs; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def waiting(self) -> list[int]:
        """Bytes of the tasks still queued (a snapshot)."""
        with self._cond:
            return [t.nbytes for t in self._queue if t.nbytes]

    def discard(self) -> list[int]:
        """Take every waiting task out of the queue (they never run); their bytes."""
        with self._cond:
            gone = [t.nbytes for t in self._queue]
            for t in self._queue:
                t.fn = _noop
            self._queue.clear()
            self._pending = 0
            self._cond.notify_all()
            return gone

    def close(self, timeout: float | None = None) -> bool:
        """Drain (up to ``timeout``), then stop the thread. False if the drain timed out: the
        tasks still queued are discarded and the thread is left to finish the running one."""
        drained = self.wait_idle(timeout)
        if not drained:
            self.discard()
        with self._cond:
            self._closed = True
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
            except Exception as e:  # a bug in a task must not kill the only worker thread
                task.error = e
                if task.done is None:
                    log.exception("%s: task failed", self.name)
            finally:
                task.fn = _noop  # release what the closure holds
                if task.done is not None:
                    task.done.set()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def _noop() -> None:
    return None
