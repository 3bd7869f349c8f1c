"""Deadline-bound reads: the request thread's only way to touch the index or the disk.

One daemon thread runs the cold tier's request-path I/O (index queries, entry headers). The
request thread hands it a function of bytes / sqlite only (never MLX) and waits at most
``deadline`` seconds: past it the call is a miss (:class:`Late`) and the request goes on. While a
late call is still stuck (a frozen or stalled disk), further calls are refused at once instead of
queueing behind it, so a stalled disk costs each request at most one deadline, then nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Late(Exception):
    """The call did not finish within its deadline (or the reader is stuck on an earlier one)."""


class Reader:
    def __init__(self, name: str = "tiered-kv-reader") -> None:
        self._cond = threading.Condition()
        self._job: tuple[Callable[[], Any], list[Any], threading.Event] | None = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T], deadline: float) -> T:
        """``fn()`` on the reader thread; its exception is re-raised here. Raises Late."""
        done = threading.Event()
        box: list[Any] = []
        with self._cond:
            if self._closed:
                raise Late("reader closed")
            if self._busy:
                raise Late("reader still blocked on an earlier call")
            self._busy = True
            self._job = (fn, box, done)
            self._cond.notify_all()
        if not done.wait(deadline):
            raise Late(f"no answer within {deadline:g}s")
        ok, value = box
        if not ok:
            raise value
        return value

    def close(self, wait: float = 0.0) -> bool:
        """Take no further call; True when no call is running (waited for up to ``wait``
        seconds), False while one still is (stuck on a stalled disk, say)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._busy, wait)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                fn, box, done = self._job
                self._job = None
            try:
                box[:] = [True, fn()]
            except BaseException as e:  # handed to the caller (who may have gone: then dropped)
                box[:] = [False, e]
            with self._cond:
                self._busy = False
                self._cond.notify_all()  # a close() waiting for this call
            done.set()
