"""Evaluated MLX arrays whose memory a reader fills: the landing of a read that bypasses ``mx.load``.

A ranged read (`both`'s tail) or a staged upload (a whole entry on CUDA, :mod:`gpu`) writes an
entry's bytes straight into the final arrays' memory, so those arrays must exist first, evaluated
and not yet written. MLX has no ``empty``, and ``mx.zeros`` costs a memset of the whole cache
before the read can start (0.1-0.4 s per GiB on a small CPU; on CUDA a CPU fill of managed
memory runs at ~3 GB/s). ``mx.load`` of a file-like object (:class:`_Blank`) whose data region
"reads" nothing gives evaluated arrays whose pages are first touched by the reader. On the CPU
stream: on CUDA that is managed memory, which the GPU reads in place and a DMA copy can target.

Engine thread (it makes MLX arrays).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping

import mlx.core as mx

from tiered_kv.cold import store

log = logging.getLogger(__name__)

Layout = Mapping[str, tuple[str, tuple[int, ...]]]  # name → (safetensors dtype, shape)
#: safetensors dtype code → MLX dtype
MX_DTYPES = {"BOOL": mx.bool_, "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16,
             "U32": mx.uint32, "I32": mx.int32, "U64": mx.uint64, "I64": mx.int64,
             "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32, "F64": mx.float64}  # fmt: skip


class _Blank:
    """A read-only file-like safetensors file of ``layout`` whose data region is never written:
    ``readinto`` copies header bytes and only counts the rest."""

    name = "landing.safetensors"
    closed = False

    def __init__(self, layout: Layout) -> None:
        tensors, off = {}, 0
        for name, (dtype, shape) in layout.items():
            nbytes = store.nbytes(dtype, shape)
            tensors[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [off, off + nbytes],
            }
            off += nbytes
        raw = json.dumps(tensors).encode()
        raw += b" " * (-len(raw) % 8)
        self._head = struct.pack("<Q", len(raw)) + raw
        self._size = len(self._head) + off
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0, self._pos, self._size)[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: memoryview) -> int:
        n = len(buf)
        if self._pos < len(self._head):
            k = min(n, len(self._head) - self._pos)
            buf[:k] = self._head[self._pos : self._pos + k]
        self._pos += n
        return n


#: bytes of one allocation holding several arrays (:func:`allocate` ``one_buffer``)
BUFFER_BYTES = 1 << 30
#: MLX's shapes are 32-bit signed: no dimension reaches this
_MAX_DIM = 1 << 31
#: alignment of each array inside one buffer (:func:`allocate` ``one_buffer``): a page, so each
#: array's memory starts on a page of its own
_ALIGN = 4096


def host_arrays() -> bool:
    """Whether the default device's arrays are host memory that bytes-only threads can read and
    write in place (the CPU; Apple silicon's unified memory), not memory that the CPU's touch would
    migrate (CUDA's managed memory, filled through pinned slots and the GPU's copy: :mod:`gpu`)."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def allocate(layout: Layout, one_buffer: bool = False) -> dict[str, mx.array]:
    """Evaluated arrays of ``layout`` (name → (safetensors dtype, shape)) with unwritten
    contents (see the module doc). Engine thread. ValueError for a dtype MLX cannot hold.

    ``one_buffer``: the arrays are views of one allocation (one per :data:`BUFFER_BYTES`), each at
    a page boundary. On CUDA each array that ``mx.load`` makes costs ~0.2-0.3 ms, from MLX's
    buffer cache too: 64 arrays took 12-20 ms on the H200 where one buffer and its 64 views took
    1 ms — a fixed cost of every `both` and every CUDA load. Only for arrays never updated in
    place (the ``tail`` landing, which the join concatenates; loaded caches, which their first
    growth copies): a view's buffer is shared, so MLX would copy the whole array to update it."""
    if not layout:
        return {}
    for dtype, shape in layout.values():
        if dtype not in MX_DTYPES:
            raise ValueError(f"dtype {dtype}")
        if any(not 0 <= d < _MAX_DIM for d in shape):
            raise ValueError(f"shape {tuple(shape)}: MLX's dimensions are 32-bit")
    if one_buffer and len(layout) > 1:
        return _views_of_few(layout)
    try:
        got = mx.load(_Blank(layout), format="safetensors", stream=mx.cpu)  # type: ignore[arg-type]
        assert isinstance(got, dict)
        arrays = {name: got[name] for name in layout}
    except (RuntimeError, ValueError, TypeError, KeyError) as e:  # an MLX that loads otherwise
        log.info("landing arrays by mx.zeros (mx.load of a blank file: %s)", e)
        arrays = {n: mx.zeros(s, MX_DTYPES[d], stream=mx.cpu) for n, (d, s) in layout.items()}
    mx.eval(list(arrays.values()))  # mx.load of a file object evaluates already: a no-op
    return arrays


def _views_of_few(layout: Layout) -> dict[str, mx.array]:
    """``layout`` as views of as few allocations as :data:`BUFFER_BYTES` allows; an array larger
    than that is allocated alone, in its own shape. MLX's shapes are 32-bit: one buffer of a long
    8B entry (4 GiB at 32k tokens), or one tensor over 2 GiB as a run of bytes, is an array it
    cannot make."""
    out: dict[str, mx.array] = {}
    group: dict[str, tuple[str, tuple[int, ...]]] = {}
    size = 0
    for name, (dtype, shape) in layout.items():
        nbytes = -(-store.nbytes(dtype, shape) // _ALIGN) * _ALIGN
        if nbytes > BUFFER_BYTES:  # its own array, of its own shape (as one U8 run it may not fit)
            out.update(allocate({name: (dtype, shape)}))
            continue
        if group and size + nbytes > BUFFER_BYTES:
            out.update(_views_of_one(group, size))
            group, size = {}, 0
        group[name] = (dtype, shape)
        size += nbytes
    out.update(_views_of_one(group, size))
    return out


def _views_of_one(layout: Layout, total: int) -> dict[str, mx.array]:
    whole = allocate({"whole": ("U8", (total,))})["whole"]
    out, off = {}, 0
    with mx.stream(mx.cpu):  # views of evaluated memory: no kernel, nothing for a GPU to do
        for name, (dtype, shape) in layout.items():
            nbytes = store.nbytes(dtype, shape)
            out[name] = whole[off : off + nbytes].view(MX_DTYPES[dtype]).reshape(shape)
            off += -(-nbytes // _ALIGN) * _ALIGN
    mx.eval(list(out.values()))
    return out
