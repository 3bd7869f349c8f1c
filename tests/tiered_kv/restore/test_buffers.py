"""tiered_kv/restore/buffers.py: landing arrays are evaluated MLX arrays of the entry's layout, and
bytes written through their views (as the restore I/O thread does) are what MLX then reads."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from tiered_kv.restore import buffers


def test_allocate_gives_evaluated_arrays_of_the_layout():
    lay = {"0.keys": ("BF16", (1, 2, 10, 4)), "0.values": ("F32", (1, 2, 10, 4)),
           "1.keys.1": ("U32", (1, 2, 10, 1))}  # fmt: skip
    got = buffers.allocate(lay)
    assert set(got) == set(lay)
    assert got["0.keys"].dtype == mx.bfloat16 and got["0.values"].dtype == mx.float32
    assert got["1.keys.1"].dtype == mx.uint32 and got["0.keys"].shape == (1, 2, 10, 4)


def test_bytes_written_from_another_thread_are_what_mlx_reads():
    full = buffers.allocate({"k": ("BF16", (1, 8, 3, 4))})  # token-major: (1, n, heads, row)
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
        buffers.allocate({"x": ("Q4", (1, 1, 2, 2))})
    with pytest.raises(ValueError):
        buffers.byte_views(buffers.allocate({"x": ("F32", (1, 1, 4, 2))}), 1, 7)
    assert buffers.allocate({}) == {}


def test_tail_landing_views_are_the_whole_arrays():
    lay = {"k": ("F32", (1, 9, 2, 4))}  # token-major
    assert buffers.shapes(lay, 3, 9, "full") == lay
    tail = buffers.allocate(buffers.shapes(lay, 3, 9, "tail"))
    assert tail["k"].shape == (1, 6, 2, 4)
    v = buffers.byte_views(tail, 3, 9)["k"]
    assert v.shape == (1, 6, 2, 16) and v.flags.c_contiguous
    assert buffers.landing() in ("full", "tail")


def test_one_buffer_holds_every_array_apart_and_mlx_reads_what_was_written():
    """``one_buffer`` (the tail landing): views of one allocation, each on its own pages; bytes
    written into one array through its byte view are what MLX reads there, and nothing else."""
    lay = {f"{i}.{kv}": ("BF16", (1, 5, 3, 4)) for i in range(3) for kv in ("keys", "values")}
    got = buffers.allocate(lay, one_buffer=True)
    assert set(got) == set(lay) and all(a.shape == (1, 5, 3, 4) for a in got.values())
    views = buffers.byte_views(got, 0, 5)
    starts = sorted(v.ctypes.data for v in views.values())
    assert all(b - a >= 4096 for a, b in zip(starts, starts[1:], strict=False))  # apart
    assert all(s % 4096 == starts[0] % 4096 for s in starts)
    want = {k: mx.random.normal((1, 5, 3, 4)).astype(mx.bfloat16) for k in lay}
    for k, v in views.items():
        v[...] = np.array(want[k].view(mx.uint16)).view(np.uint8).reshape(v.shape)
    del views
    for k, a in got.items():
        assert mx.array_equal(a, want[k]).item(), k
    # the join's concatenation reads them as any array
    both = mx.concatenate([got["0.keys"], got["2.values"]], axis=1)
    assert mx.array_equal(both[:, 5:], want["2.values"]).item()
