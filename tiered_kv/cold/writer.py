"""Write-behind: one background thread draining a FIFO of tasks bounded in bytes.

Ownership: tasks run on the writer thread and must only touch files, the index and evaluated
arrays' bytes (never build MLX graphs). ``submit`` never blocks: past ``max_bytes`` the oldest
droppable task is dropped (reported through ``on_drop``). ``run_sync`` waits for its own task.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
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
    meta: dict[str, Any] = field(default_factory=dict)


class Writer:
    def __init__(
        self, max_bytes: int, on_drop: Callable[[int], None], name: str = "tiered-kv-writer"
    ) -> None:
        self.max_bytes = max_bytes
        self._on_drop = on_drop
        self._queue: deque[_Task] = deque()
        self._pending = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def submit(self, fn: Callable[[], Any], nbytes: int, droppable: bool = True) -> bool:
        """Enqueue ``fn``; False when it was dropped at once (bigger than the whole bound)."""
        with self._cond:
            if self._closed:
                self._on_drop(nbytes)
                return False
            if droppable and nbytes > self.max_bytes:
                self._on_drop(nbytes)
                return False
            while droppable and self._pending + nbytes > self.max_bytes:
                oldest = next((t for t in self._queue if t.droppable), None)
                if oldest is None:
                    break
                self._queue.remove(oldest)
                self._pending -= oldest.nbytes
                self._on_drop(oldest.nbytes)
            self._queue.append(_Task(fn, nbytes, droppable))
            self._pending += nbytes
            self._cond.notify_all()
            return True

    def run_sync(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the writer thread after everything queued before it; return its result."""
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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty and idle; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Drain, then stop the thread. Returns False if the drain timed out."""
        drained = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return drained

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                task = self._queue.popleft()
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
