"""Landing buffers of `both`: evaluated MLX arrays that the restore I/O thread reads bytes into.

`both` reads tokens ``[m, n)`` of every layer tensor while the engine thread computes ``[0, m)``.
To copy the read bytes once (kernel → final array) instead of three times (a numpy buffer,
``mx.array`` of it, ``mx.concatenate``), the engine thread allocates each layer's final array up
front, token-major like the file (``(1, n, heads, ...)``: tokens ``[m, n)`` of it are one
contiguous run, as in the file), and the I/O thread ``preadv``-s the tokens straight into its
memory. What is served is ``mx.swapaxes`` of it, ``(1, heads, n, ...)``: a view.

:func:`allocate` makes those arrays without writing them: MLX has no ``empty``, and ``mx.zeros``
costs a memset of the whole cache on the engine thread before the compute can start (0.1–0.4 s
per GiB on a small CPU; on CUDA a CPU fill of managed memory runs at ~3 GB/s). ``mx.load`` of a
file-like object (:class:`_Blank`) whose data region "reads" nothing gives evaluated arrays whose
pages are first touched by the reader, on the I/O thread, overlapped with the compute. On the CPU
stream: on CUDA that is host-visible (managed) memory, which the GPU then reads in place.

Two landings (:func:`landing`): ``full`` — the arrays hold all ``n`` tokens and the join writes the
computed head (swapped to token-major) into them in place (no copy of the tail at all: right where
CPU and GPU share memory, and on the CPU, whose ``mx.concatenate`` is slow); ``tail`` — the arrays
hold only ``[m, n)`` and the join is one ``mx.concatenate`` of the head and the swapped tail on the
GPU (right on CUDA: the landing memory is managed memory written in host pages; the reader moves each
verified tensor to device memory with a prefetch of its own (:mod:`prefetch`) while the head
computes, and the concatenation copies it within the GPU, instead of the GPU faulting the head into
managed pages and the first attention migrating the tail).

Threads and the one exception to "only the engine thread touches MLX": :func:`allocate` and
:func:`byte_views` run on the engine thread (the views are numpy arrays over the evaluated arrays'
memory, made by ``np.frombuffer``). The I/O thread writes bytes through those views — it never
creates, reads or evaluates an MLX array — and the engine thread queues no MLX operation on these
arrays until the read has returned (``Future.result()``), after which it drops the views. Until
then the arrays hold bytes that are not verified (or not written): they are served only after the
read returned without error, and dropped otherwise.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from tiered_kv.cold import store
from tiered_kv.cold.codec import _MX  # safetensors dtype → MLX dtype

log = logging.getLogger(__name__)

Layout = Mapping[str, tuple[str, tuple[int, ...]]]  # name → (safetensors dtype, shape)


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


#: alignment of each array inside one buffer (:func:`allocate` ``one_buffer``): a page, so a
#: prefetch of one array moves none of its neighbour's pages
_ALIGN = 4096


def allocate(layout: Layout, one_buffer: bool = False) -> dict[str, mx.array]:
    """Evaluated arrays of ``layout`` (name → (safetensors dtype, shape)) with unwritten
    contents (see the module doc). Engine thread. ValueError for a dtype MLX cannot hold.

    ``one_buffer``: the arrays are views of one allocation, each at a page boundary. On CUDA each
    array that ``mx.load`` makes costs ~0.2-0.3 ms, from MLX's buffer cache too: 64 arrays took
    12-20 ms on the H200 where one buffer and its 64 views took 1 ms — a fixed cost of every
    `both`, and at 8B 8k or 1B 8k a tenth of it. Only for arrays never updated in place (the
    ``tail`` landing, which the join concatenates): a view's buffer is shared, so MLX would copy
    the whole array to update it."""
    if not layout:
        return {}
    for dtype, _ in layout.values():
        if dtype not in _MX:
            raise ValueError(f"dtype {dtype}")
    if one_buffer and len(layout) > 1:
        return _views_of_one(layout)
    try:
        got = mx.load(_Blank(layout), format="safetensors", stream=mx.cpu)  # type: ignore[arg-type]
        assert isinstance(got, dict)
        arrays = {name: got[name] for name in layout}
    except (RuntimeError, ValueError, TypeError, KeyError) as e:  # an MLX that loads otherwise
        log.info("landing arrays by mx.zeros (mx.load of a blank file: %s)", e)
        arrays = {n: mx.zeros(s, _MX[d], stream=mx.cpu) for n, (d, s) in layout.items()}
    mx.eval(list(arrays.values()))  # mx.load of a file object evaluates already: a no-op
    return arrays


def _views_of_one(layout: Layout) -> dict[str, mx.array]:
    spans, total = {}, 0
    for name, (dtype, shape) in layout.items():
        nbytes = store.nbytes(dtype, shape)
        spans[name] = (total, nbytes)
        total += -(-nbytes // _ALIGN) * _ALIGN
    whole = allocate({"whole": ("U8", (total,))})["whole"]
    with mx.stream(mx.cpu):  # views of evaluated memory: no kernel, nothing for a GPU to do
        out = {name: whole[o : o + nb].view(_MX[d]).reshape(shape)
               for (name, (d, shape)), (o, nb) in zip(layout.items(), spans.values(), strict=True)}  # fmt: skip
    mx.eval(list(out.values()))
    return out


def landing() -> str:
    """The landing that suits this machine: ``tail`` on CUDA, ``full`` elsewhere (module doc)."""
    cuda = getattr(mx, "cuda", None)
    return "tail" if cuda is not None and cuda.is_available() else "full"


def shapes(layout: Layout, m: int, n: int, way: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``layout`` (token-major shapes of the first ``n`` tokens, ``(1, n, heads, ...)``) as
    landing arrays of ``way``: all ``n`` tokens (``full``) or ``[m, n)`` (``tail``)."""
    if way == "full":
        return dict(layout)
    return {k: (d, (s[0], n - m, *s[2:])) for k, (d, s) in layout.items()}


def byte_views(arrays: Mapping[str, mx.array], m: int, n: int) -> dict[str, np.ndarray]:
    """Writable contiguous uint8 views ``(1, n - m, heads, row bytes)`` of tokens ``[m, n)`` of
    each evaluated token-major array — ``(1, n, heads, ...)`` (landing ``full``) or
    ``(1, n - m, heads, ...)`` (``tail``): the destinations of ``ranged.read_range(..., into=)``.
    Engine thread; the arrays must not be used by MLX while the views are being written."""
    out = {}
    for name, a in arrays.items():
        if a.ndim < 4 or a.shape[0] != 1 or a.shape[1] not in (n, n - m):
            raise ValueError(f"landing array {name} of shape {a.shape} for [{m}, {n})")
        raw = np.frombuffer(a, dtype=np.uint8)  # type: ignore[call-overload]
        if not raw.flags.writeable or raw.nbytes != a.nbytes:
            raise ValueError(f"landing array {name} is not writable memory")
        toks = raw.reshape(1, a.shape[1], a.shape[2], -1)
        out[name] = toks[:, m:n] if a.shape[1] == n else toks
    return out
