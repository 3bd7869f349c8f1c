"""tiered_kv/cold/landing.py: unwritten evaluated arrays of a layout, separate or views of one
allocation, whose memory a reader fills and MLX then reads."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tiered_kv.cold.landing import allocate


def test_allocate_gives_evaluated_arrays_of_the_layout():
    lay = {"0.keys": ("BF16", (1, 2, 10, 4)), "0.values": ("F32", (1, 2, 10, 4)),
           "1.keys.1": ("U32", (1, 2, 10, 1))}  # fmt: skip
    got = allocate(lay)
    assert set(got) == set(lay)
    assert got["0.keys"].dtype == mx.bfloat16 and got["0.values"].dtype == mx.float32
    assert got["1.keys.1"].dtype == mx.uint32 and got["0.keys"].shape == (1, 2, 10, 4)


def test_bad_layouts_are_value_errors():
    with pytest.raises(ValueError):
        allocate({"x": ("Q4", (1, 1, 2, 2))})
    for shape in ((1, 1 << 31), (1, -2)):  # a header MLX cannot shape: refused, not OverflowError
        for one in (False, True):
            with pytest.raises(ValueError, match="shape"):
                allocate({"x": ("U8", shape), "y": ("U8", (1,))}, one_buffer=one)
    assert allocate({}) == {}


def test_one_buffer_holds_every_array_apart_and_mlx_reads_what_was_written():
    """``one_buffer`` (the tail landing): views of one allocation, each on its own pages; bytes
    written into one array through its byte view are what MLX reads there, and nothing else."""
    lay = {f"{i}.{kv}": ("BF16", (1, 5, 3, 4)) for i in range(3) for kv in ("keys", "values")}
    got = allocate(lay, one_buffer=True)
    assert set(got) == set(lay) and all(a.shape == (1, 5, 3, 4) for a in got.values())
    views = {k: np.frombuffer(a, dtype=np.uint8).reshape(a.shape[:3] + (-1,)) for k, a in got.items()}  # type: ignore[call-overload]
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


def test_a_layout_larger_than_one_allocation_is_cut_into_several(monkeypatch):
    """An 8B entry of 32k tokens is 4 GiB: as one U8 array MLX cannot make it (its shapes are
    32-bit; on the H200 the first load of such an entry raised OverflowError). The arrays are
    then views of several allocations of at most BUFFER_BYTES, every array whole in one."""
    from tiered_kv.cold import landing

    monkeypatch.setattr(landing, "BUFFER_BYTES", 3 * 4096)
    lay = {f"{i}": ("F32", (1, 1000 + i, 1, 1)) for i in range(7)}  # ~1 page each
    got = allocate(lay, one_buffer=True)
    views = {k: np.frombuffer(a, dtype=np.uint8) for k, a in got.items()}  # type: ignore[call-overload]
    for k, v in views.items():
        v[...] = int(k) + 1
    del views
    for k, a in got.items():
        assert a.shape == lay[k][1] and mx.all(a.view(mx.uint8) == int(k) + 1).item(), k


def test_a_real_layout_over_4_gib_allocates():
    """Unwritten memory (nothing touched): 4.5 GiB of virtual memory, not of RAM."""
    lay = {f"{i}.keys": ("BF16", (1, 32768, 8, 128)) for i in range(72)}  # 8B-shaped, 32k tokens
    got = allocate(lay, one_buffer=True)
    assert len(got) == 72 and got["71.keys"].shape == (1, 32768, 8, 128)


def test_one_array_over_2_gib_gets_an_allocation_of_its_own():
    """A single tensor over 2^31 bytes (32 KV heads x 128 x bf16 at 256k tokens, say) cannot be a
    U8 run of one buffer; it was an OverflowError, and now is an array of its own shape."""
    lay = {"0.keys": ("BF16", (1, 1, 3, 1 << 29)), "0.values": ("BF16", (1, 2, 3, 4))}
    got = allocate(lay, one_buffer=True)
    assert got["0.keys"].shape == (1, 1, 3, 1 << 29) and got["0.keys"].dtype == mx.bfloat16
    assert got["0.values"].shape == (1, 2, 3, 4)
