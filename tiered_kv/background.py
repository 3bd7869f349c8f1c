"""Byte-only calls on daemon threads of their own, never joined at interpreter exit.

``concurrent.futures`` joins its worker threads when the interpreter exits, daemon or not: a load
whose read a stalled disk held kept a SIGTERM-ed server alive until the read returned (forever on
a frozen disk). The cold tier's readers run here instead: :class:`Call` runs one function on a
thread of its own (a load beside running streams, `both`'s read); :func:`each` maps one function
over items on a few threads and returns once every one of them is done (a file's tensors read in
parallel). What the functions touch is their owner's rule (here: files, bytes and numpy, never MLX).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741


class Call(Generic[T]):
    """``fn()`` running on a daemon thread named ``name``; :meth:`done` never blocks, :meth:`result`
    waits and returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to result()
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> T:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def each(fn: Callable[[I], T], items: Sequence[I], workers: int, name: str) -> list[T]:
    """``[fn(x) for x in items]`` on up to ``workers`` daemon threads. After an error no further
    item starts; returns (or raises the first error) only once every thread has finished, so no
    call is still running into memory the caller may free."""
    out: list[T | None] = [None] * len(items)
    errors: list[BaseException] = []
    lock = threading.Lock()
    order = iter(range(len(items)))

    def work() -> None:
        while True:
            with lock:
                i = None if errors else next(order, None)
            if i is None:
                return
            try:
                out[i] = fn(items[i])
            except BaseException as e:
                with lock:
                    errors.append(e)
                return

    threads = [threading.Thread(target=work, name=f"{name}-{k}", daemon=True)
               for k in range(max(1, min(workers, len(items))))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out  # type: ignore[return-value]
