"""tiered_kv/restore/prefetch.py: a landing array written from the CPU is moved to the GPU by a
prefetch issued on another thread, and keeps its bytes. Needs CUDA (the CI machine has none:
skipped there; run on the H200 with ``pytest tests/tiered_kv/restore``)."""

from __future__ import annotations

import ctypes
import threading

import mlx.core as mx
import numpy as np
import pytest

from tiered_kv.restore import buffers, prefetch

_cuda = getattr(mx, "cuda", None)
pytestmark = pytest.mark.skipif(_cuda is None or not _cuda.is_available(), reason="needs CUDA")

_LAST_PREFETCH_LOCATION = 4  # CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION


def last_prefetch_device(lib: ctypes.CDLL, buf: np.ndarray) -> int:
    out = ctypes.c_int(-2)
    err = lib.cuMemRangeGetAttribute(ctypes.byref(out), ctypes.c_size_t(4), _LAST_PREFETCH_LOCATION,
                                     ctypes.c_uint64(buf.ctypes.data), ctypes.c_size_t(buf.nbytes))  # fmt: skip
    assert err == 0
    return out.value


def test_a_landing_array_moves_to_the_gpu_from_another_thread_and_keeps_its_bytes():
    mx.eval(mx.ones((4,)) + 1)  # MLX's context is current on this (the engine) thread
    p = prefetch.open_device()
    assert p is not None
    arr = buffers.allocate({"k": ("BF16", (1, 4096, 8, 128))})["k"]
    view = np.frombuffer(arr, dtype=np.uint8)  # type: ignore[call-overload]
    view[:] = np.arange(view.size, dtype=np.int64) % 251
    want = view.copy()
    assert last_prefetch_device(p._lib, view) != p._device  # written by the CPU, never moved
    t = threading.Thread(target=p.to_device, args=(view,))
    t.start()
    t.join()
    p.wait()
    assert p.bytes == view.nbytes
    assert last_prefetch_device(p._lib, view) == p._device
    doubled = mx.concatenate([arr, arr], axis=1).view(mx.uint8)  # read on the GPU
    got = np.array(doubled).reshape(-1)
    assert np.array_equal(got[: view.size], want) and np.array_equal(got[view.size :], want)
    p.close()
    p.to_device(view)  # closed: a no-op, not an error
    assert p.bytes == view.nbytes
