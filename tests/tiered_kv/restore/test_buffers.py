"""tiered_kv/restore/buffers.py: landing arrays are evaluated MLX arrays of the entry's layout, and
bytes written through their views (as the restore I/O thread does) are what MLX then reads."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from tiered_kv.cold.landing import allocate
from tiered_kv.restore import buffers


def test_bytes_written_from_another_thread_are_what_mlx_reads():
    full = allocate({"k": ("BF16", (1, 8, 3, 4))})  # token-major: (1, n, heads, row)
    views = buffers.byte_views(full, 5, 8)
    v = views["k"]
    assert v.shape == (1, 3, 3, 8) and v.flags.writeable and v.flags.c_contiguous
    want = mx.random.normal((1, 3, 3, 4)).astype(mx.bfloat16)  # tokens [5, 8), token-major
    raw = np.array(want.view(mx.uint16)).view(np.uint8).reshape(1, 3, 3, 8)

    def io(dst: np.ndarray) -> None:  # bytes only: what the I/O thread does
        dst[...] = raw

    t = threading.Thread(target=io, args=(v,))
    t.start()
    t.join()
    del views, v
    a = full.pop("k")
    a[:, :5] = mx.zeros((1, 5, 3, 4), mx.bfloat16)  # the join's in-place head
    assert mx.array_equal(a[:, 5:], want).item()
    assert mx.array_equal(a[:, :5], mx.zeros((1, 5, 3, 4))).item()


def test_bad_layouts_are_value_errors():
    with pytest.raises(ValueError):
        buffers.byte_views(allocate({"x": ("F32", (1, 1, 4, 2))}), 1, 7)


def test_tail_landing_views_are_the_whole_arrays():
    lay = {"k": ("F32", (1, 9, 2, 4))}  # token-major
    assert buffers.shapes(lay, 3, 9, "full") == lay
    tail = allocate(buffers.shapes(lay, 3, 9, "tail"))
    assert tail["k"].shape == (1, 6, 2, 4)
    v = buffers.byte_views(tail, 3, 9)["k"]
    assert v.shape == (1, 6, 2, 16) and v.flags.c_contiguous
    assert buffers.landing() in ("full", "tail")
