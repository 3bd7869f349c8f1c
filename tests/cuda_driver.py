"""A CUDA driver for :class:`tiered_kv.cold.gpu.Upload` where there is no GPU: the real ``gpu.py``
(slots, streams, events, ``Batch.wait``) runs over it, so its ordering is tested on the CPU.

A copy is asynchronous, as on a copy engine: ``cuMemcpyHtoDAsync_v2`` queues it on its stream's
thread, which runs it a little later and reads the pinned source *then* (a slot reused before its
copy ran would hand the copy the next chunk's bytes). Events and stream synchronisation keep
CUDA's order on each stream; a population (``cuMemPrefetchAsync_v2``) runs on its stream the same
way, and ``ran`` lists what each stream's thread ran, in order. ``fail`` makes chosen calls return an error (name → the 1-based call
numbers that fail). "Device addresses" are host addresses here: the destinations are numpy
arrays. The real driver and copy engine are tested on the GPU (``tests/tiered_kv/cold/test_gpu.py``
with CUDA).
"""

from __future__ import annotations

import collections
import ctypes
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

CUDA_ERROR = 700  # what a failing call returns (CUDA_ERROR_ILLEGAL_ADDRESS)
_INVALID = 400  # CUDA_ERROR_INVALID_HANDLE: a handle or pointer freed already, or never made


class _Stream:
    """One stream: its operations run in order on a thread of its own."""

    def __init__(self) -> None:
        self.ops: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="fake-cuda-stream").start()

    def _run(self) -> None:
        while (op := self.ops.get()) is not None:  # None: destroyed
            op()


class FakeDriver:
    """The driver calls ``gpu.Upload`` makes, with a copy engine that runs later (module doc)."""

    def __init__(self, delay_s: float = 0.001, fail: dict[str, set[int]] | None = None) -> None:
        self.delay_s, self.fail = delay_s, fail or {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.pending = 0  # copies issued and not yet run
        self.copied = 0  # bytes the copies moved
        self.ran: list[tuple[str, int, int]] = []  # ("populate" | "copy", address, bytes), as run
        self._pinned: dict[int, Any] = {}  # address → buffer, until cuMemFreeHost
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, threading.Event] = {}
        self._next = 0
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory allocated and not freed."""
        return sum(ctypes.sizeof(b) for b in self._pinned.values())

    @property
    def live(self) -> tuple[int, int, int]:
        """(pinned buffers, streams, events) made and not freed / destroyed."""
        return len(self._pinned), len(self._streams), len(self._events)

    def _result(self, name: str) -> int:
        with self._lock:
            self.calls[name] += 1
            return CUDA_ERROR if self.calls[name] in self.fail.get(name, ()) else 0

    def _handle(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def cuCtxSetCurrent(self, ctx: Any) -> int:
        return self._result("cuCtxSetCurrent")

    def cuMemAllocHost_v2(self, out: Any, size: Any) -> int:
        if err := self._result("cuMemAllocHost_v2"):
            return err
        buf = (ctypes.c_uint8 * size.value)()
        self._pinned[ctypes.addressof(buf)] = buf
        out._obj.value = ctypes.addressof(buf)
        return 0

    def cuMemFreeHost(self, ptr: Any) -> int:
        if err := self._result("cuMemFreeHost"):
            return err
        return 0 if self._pinned.pop(int(ptr.value or 0), None) is not None else _INVALID

    def cuStreamDestroy_v2(self, stream: Any) -> int:
        if err := self._result("cuStreamDestroy_v2"):
            return err
        s = self._streams.pop(int(stream.value or 0), None)
        if s is None:
            return _INVALID
        s.ops.put(None)  # its thread ends after what is queued on it
        return 0

    def cuEventDestroy_v2(self, event: Any) -> int:
        if err := self._result("cuEventDestroy_v2"):
            return err
        return 0 if self._events.pop(int(event.value or 0), None) is not None else _INVALID

    def cuStreamCreate(self, out: Any, flags: int) -> int:
        if err := self._result("cuStreamCreate"):
            return err
        handle = self._handle()
        self._streams[handle] = _Stream()
        out._obj.value = handle
        return 0

    def cuEventCreate(self, out: Any, flags: int) -> int:
        if err := self._result("cuEventCreate"):
            return err
        handle, done = self._handle(), threading.Event()
        done.set()  # a fresh event has nothing to wait for
        self._events[handle] = done
        out._obj.value = handle
        return 0

    def cuMemcpyHtoDAsync_v2(self, dst: Any, src: Any, nbytes: Any, stream: Any) -> int:
        if err := self._result("cuMemcpyHtoDAsync_v2"):
            return err
        d, s, n = int(dst.value), int(src.value), int(nbytes.value)

        def run() -> None:
            time.sleep(self.delay_s)
            ctypes.memmove(d, s, n)  # the source is read now, not when the copy was issued
            with self._lock:
                self.pending -= 1
                self.copied += n
                self.ran.append(("copy", d, n))

        with self._lock:
            self.pending += 1
        self._streams[int(stream.value)].ops.put(run)
        return 0

    def cuCtxGetDevice(self, out: Any) -> int:
        if err := self._result("cuCtxGetDevice"):
            return err
        out._obj.value = 0
        return 0

    def cuMemPrefetchAsync_v2(self, addr: Any, nbytes: Any, location: Any, flags: Any,
                              stream: Any) -> int:  # fmt: skip
        if err := self._result("cuMemPrefetchAsync_v2"):
            return err
        a, n = int(addr.value), int(nbytes.value)

        def run() -> None:
            time.sleep(self.delay_s * 5)  # slower than a copy: a copy not made to wait runs first
            with self._lock:
                self.ran.append(("populate", a, n))

        self._streams[int(stream.value)].ops.put(run)
        return 0

    def cuStreamWaitEvent(self, stream: Any, event: Any, flags: Any) -> int:
        if err := self._result("cuStreamWaitEvent"):
            return err
        self._streams[int(stream.value)].ops.put(self._events[int(event.value)].wait)
        return 0

    def cuEventRecord(self, event: Any, stream: Any) -> int:
        if err := self._result("cuEventRecord"):
            return err
        done = threading.Event()
        self._events[int(event.value)] = done
        self._streams[int(stream.value)].ops.put(done.set)
        return 0

    def cuEventSynchronize(self, event: Any) -> int:
        if err := self._result("cuEventSynchronize"):
            return err
        self._events[int(getattr(event, "value", event))].wait()
        return 0

    def cuStreamSynchronize(self, stream: Any) -> int:
        if err := self._result("cuStreamSynchronize"):
            return err
        done = threading.Event()
        self._streams[int(stream.value)].ops.put(done.set)
        done.wait()
        return 0


def upload(monkeypatch: Any, slot_bytes: int, slots: int, **driver: Any) -> tuple[Any, FakeDriver]:
    """A real :class:`tiered_kv.cold.gpu.Upload` of ``slots`` slots of ``slot_bytes`` over a
    :class:`FakeDriver` made with ``driver`` (its arguments)."""
    from tiered_kv.cold import gpu

    monkeypatch.setattr(gpu, "SLOT_BYTES", slot_bytes)
    monkeypatch.setattr(gpu.Batch, "slot_bytes", slot_bytes)
    lib = FakeDriver(**driver)
    return gpu.Upload(lib, 1, slots=slots), lib
