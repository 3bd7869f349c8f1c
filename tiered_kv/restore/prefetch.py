"""Moving `both`'s read tail into GPU memory while the head computes (CUDA only).

On CUDA, MLX arrays live in managed memory (``cudaPointerGetAttributes`` says "managed" for every
array of mlx-cuda 0.32.4, the landing arrays of :mod:`buffers` included). The reader threads write
the tail into the landing arrays from the CPU, so their pages sit in host memory, and the join's
``mx.concatenate`` migrates them page fault by page fault: 0.09-0.29 s for the 1.34 GB tail of an
8B-shaped `both` at 32k tokens on the H200 (5-15 GB/s). The driver's ``cuMemPrefetchAsync`` moves
the same bytes in 0.035-0.05 s, and issued by a reader thread as each tensor is verified it runs
on a stream of its own beside the head's compute (a 0.59 s GPU workload took 0.59 s with the
whole tail prefetched beside it); the join then takes 0.01 s.

It calls the CUDA driver library that MLX itself links (``libcuda.so.1``), through ctypes, in the
context MLX made current on the engine thread. It is a hint: where there is no CUDA, no driver,
or the call fails, nothing is moved and the join migrates the pages as before (a failure is
logged once and turns the prefetch off).

Threads: :func:`open_device` runs on the engine thread (it reads MLX's current context);
:meth:`DevicePrefetch.to_device` on any thread, with bytes only (it never touches an MLX array);
:meth:`DevicePrefetch.wait` on the thread that hands the arrays back to MLX, before it does.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit ordering with MLX's streams


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class DevicePrefetch:
    """Prefetches of host-written managed memory to one GPU, on a stream of their own."""

    def __init__(self, lib: ctypes.CDLL, context: int, device: int) -> None:
        self._lib, self._context, self._device = lib, ctypes.c_void_p(context), device
        self._stream = ctypes.c_void_p()
        self._ok = lib.cuStreamCreate(ctypes.byref(self._stream), _NON_BLOCKING) == 0
        self._lock = threading.Lock()
        self.bytes = 0  # bytes asked to move (a count for tests and metrics)

    def to_device(self, buf: np.ndarray) -> None:
        """Start moving the memory of ``buf`` (a view of a managed array) to the GPU. Any thread;
        returns at once."""
        if not self._ok or buf.nbytes == 0:
            return
        lib = self._lib
        err = lib.cuCtxSetCurrent(self._context) or lib.cuMemPrefetchAsync_v2(
            ctypes.c_uint64(buf.ctypes.data), ctypes.c_size_t(buf.nbytes),
            _Location(_DEVICE, self._device), 0, self._stream)  # fmt: skip
        with self._lock:
            if err:
                self._off(f"cuMemPrefetchAsync error {err}")
            else:
                self.bytes += buf.nbytes

    def wait(self) -> None:
        """Until every prefetch issued has finished (also after a failure turned the prefetch
        off: those issued before it may still run). A failed wait leaves the memory valid."""
        if self._stream.value and (self._lib.cuCtxSetCurrent(self._context) or
                                   self._lib.cuStreamSynchronize(self._stream)):  # fmt: skip
            with self._lock:
                self._off("cuStreamSynchronize failed")

    def close(self) -> None:
        if self._stream.value:
            self.wait()
            self._lib.cuStreamDestroy_v2(self._stream)
            self._stream = ctypes.c_void_p()
        self._ok = False

    def _off(self, why: str) -> None:
        if self._ok:
            log.warning("GPU prefetch of restored KV turned off: %s", why)
        self._ok = False


def open_device() -> DevicePrefetch | None:
    """A prefetcher to the GPU of MLX's current CUDA context, or None where there is none (no
    CUDA, no driver library, no context yet, a driver without ``cuMemPrefetchAsync_v2``). Engine
    thread."""
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemPrefetchAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _Location,
                                              ctypes.c_uint, ctypes.c_void_p]  # fmt: skip
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError) as e:
        log.info("no GPU prefetch of restored KV: %s", e)
        return None
    context, device = ctypes.c_void_p(), ctypes.c_int()
    if lib.cuCtxGetCurrent(ctypes.byref(context)) or not context.value:
        return None
    if lib.cuCtxGetDevice(ctypes.byref(device)):
        return None
    p = DevicePrefetch(lib, context.value, device.value)
    return p if p._ok else None
