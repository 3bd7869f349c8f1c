"""Entry bytes from evaluated arrays, in one pass: the write side of the entry format
(:mod:`tiered_kv.cold.store`), writer thread only.

One pass (:func:`encode`) works because the header's length does not depend on the digests' values
(16 hex digits per chunk, a fixed-length ``header_xxh``), so its bytes are reserved first (zeros),
the data is made, hashed and written block by block, and the real header is written last over the
reserved bytes (:attr:`Encoded.head`), before the file is published. Splittable layer tensors are
stored token-major (:func:`tiered_kv.cold.store.splittable`; the format's doc says why).

Threads: :func:`encode` runs on the writer thread and reads only buffers (numpy views of
evaluated arrays; token-major tensors are transposed by numpy, block by block, and every block
hashed, on the hashing pool (:func:`tiered_kv.cold.checksums.pool`) one block ahead of the writer).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiered_kv.cold.checksums import CHUNK_BYTES, Digests, n_digest_chars, pool
from tiered_kv.cold.store import FORMAT, header_bytes, nbytes, splittable, swapped

#: bytes of one block of tokens transposed at a time on the write path (token-major tensors)
BLOCK_BYTES = 32 << 20


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its safetensors dtype code, logical shape and bytes (any strides;
    a numpy array whose dtype has the same item size, e.g. uint16 for bfloat16)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class Encoded:
    """An entry's bytes as pieces to write in order; ``nbytes`` in all.

    ``pieces`` is consumed once, in order, and a piece may be reused for a later one as soon as
    the next is asked for (token-major tensors are transposed into two alternating buffers): a
    consumer that keeps a piece copies it. ``head``, when set, is called once after the last
    piece was consumed and returns the entry's real first bytes, which replace the reserved
    bytes (zeros) the first piece held — the header, whose checksums are known only once every
    data byte went by (:func:`encode`). ``head`` is None for bytes that are whole already."""

    pieces: Iterable[memoryview]
    nbytes: int
    head: Callable[[], bytes] | None = None

    @staticmethod
    def whole(data: bytes | bytearray | memoryview) -> Encoded:
        """Bytes that are already a complete entry (e.g. fetched from the shared tier)."""
        view = memoryview(data).cast("B")
        return Encoded([view], len(view))

    def join(self) -> bytearray:
        """All the bytes in one buffer (consumes ``pieces``; tests, and a backend that needs it)."""
        out = bytearray()
        for p in self.pieces:
            out += p
        if self.head is not None:
            first = self.head()
            out[: len(first)] = first
        return out


# -- bytes of (possibly strided) arrays --------------------------------------------------------
def flat_bytes(a: Any) -> memoryview:
    """A C-contiguous buffer's bytes as a flat ``B`` view (no copy)."""
    return memoryview(a).cast("B")


def byte_blocks(a: np.ndarray) -> list[memoryview]:
    """``a``'s bytes in C order as a few contiguous byte views (no copy for the strided slices
    a KV cache holds: one block per leading index)."""
    if a.size == 0:
        return []
    if a.flags.c_contiguous:
        return [flat_bytes(a.reshape(-1))]
    k = a.ndim  # the longest contiguous tail of dimensions
    expect = a.itemsize
    while k > 0 and (a.shape[k - 1] == 1 or a.strides[k - 1] == expect):
        expect *= a.shape[k - 1]
        k -= 1
    if k == a.ndim:  # not even the last axis is contiguous: copy (not a layout we produce)
        return [flat_bytes(np.ascontiguousarray(a).reshape(-1))]
    return [flat_bytes(np.ascontiguousarray(a[idx]).reshape(-1))
            for idx in np.ndindex(*a.shape[:k])]  # fmt: skip


# -- encode (writer thread) --------------------------------------------------------------------
def encode(tokens: np.ndarray, tensors: Sequence[Tensor], metadata: Mapping[str, str],
           chunk: int = CHUNK_BYTES, block: int = BLOCK_BYTES) -> Encoded:  # fmt: skip
    """The entry's bytes in one pass: each tensor's bytes are made once, as the writer consumes
    them, and its chunk checksums are computed over those same bytes as they go by. The header
    (which holds the checksums) has a length that does not depend on their values (16 hex digits
    per chunk, a fixed-length ``header_xxh``), so the first piece is ``8 + len(header)`` reserved
    zero bytes and :attr:`Encoded.head` gives the real first bytes once every piece was consumed.

    Splittable tensors are stored token-major (module doc): numpy transposes ``block`` bytes of
    tokens at a time into two reused buffers, each block made and hashed on the pool while the
    writer writes the one before, so an entry never needs a second copy of itself in memory.
    Every other tensor is written from the array's own buffer, no copy, hashed on the pool in
    blocks of the same size, one ahead of the writer too. ``chunk``: the checksum granularity (tests use small ones to exercise ranged
    reads). Writer thread: numpy and bytes only."""
    assert tokens.dtype == np.dtype("<i4") and all(t.name != "tokens" for t in tensors)
    n_tokens = len(tokens)
    items = [Tensor("tokens", "I32", (n_tokens,), tokens), *tensors]
    major = [t.name != "tokens" and splittable(t.shape, n_tokens) for t in items]
    table: dict[str, Any] = {}
    off = 0
    for t, tm in zip(items, major, strict=True):
        n = nbytes(t.dtype, t.shape)
        assert n == t.data.nbytes, t.name
        shape = list(swapped(t.shape)) if tm else list(t.shape)
        table[t.name] = {"dtype": t.dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n

    def meta(sums: Sequence[str]) -> dict[str, str]:
        return {**metadata, "format_version": str(FORMAT), "n_tokens": str(n_tokens),
                "chunk_bytes": str(chunk),
                "token_major": json.dumps([t.name for t, tm in zip(items, major, strict=True)
                                           if tm], separators=(",", ":")),
                "xxh3": json.dumps({t.name: s for t, s in zip(items, sums, strict=True)},
                                   separators=(",", ":"))}  # fmt: skip

    # digests are hex: the same length whatever their values, so the header's length is known now
    blank = [
        "0" * n_digest_chars(t["data_offsets"][1] - t["data_offsets"][0], chunk)
        for t in table.values()
    ]
    size = len(header_bytes(table, meta(blank)))
    stream = _Stream(items, major, chunk, block)

    def head() -> bytes:
        raw = header_bytes(table, meta(stream.digests()))
        if len(raw) != size:
            raise RuntimeError(f"header is {len(raw)} bytes, {size} were reserved")
        return struct.pack("<Q", size) + raw

    return Encoded(stream.pieces(memoryview(bytes(8 + size))), 8 + size + off, head)


class _Stream:
    """The data pieces of one entry as one stream of blocks, each made once (token-major ones
    transposed into a shared :class:`_Ring`), hashed as it is made, and made on the pool one
    block ahead of the writer — across tensor boundaries, so the writer never waits for a
    tensor's first block."""

    def __init__(self, items: list[Tensor], major: list[bool], chunk: int, block: int) -> None:
        self._items, self._major, self._chunk, self._block = items, major, chunk, block
        self._sums: list[Digests] = []
        self._done = False

    def pieces(self, first: memoryview) -> Iterator[memoryview]:
        yield first
        yield from _one_ahead(self._blocks())

    def _blocks(self) -> Iterator[memoryview]:
        ring = _Ring()
        for t, tm in zip(self._items, self._major, strict=True):
            d = Digests(self._chunk)
            self._sums.append(d)
            if tm:
                blocks = _token_major_blocks(t.data, self._block, ring)
            else:  # views of the array itself (valid throughout), cut to blocks to overlap
                blocks = (v[i : i + self._block] for v in byte_blocks(t.data)
                          for i in range(0, len(v), self._block))  # fmt: skip
            for b in blocks:
                d.update(b)
                yield b
        self._done = True

    def digests(self) -> list[str]:
        """Every tensor's digests; only after the last piece was consumed."""
        if not self._done:
            raise RuntimeError("entry header asked for before all its bytes were written")
        return [d.hexdigests() for d in self._sums]


class _Ring:
    """``count`` reused byte buffers taken in turn: a block is valid until ``count - 1`` more
    were taken. Grown (never shrunk) to the largest block asked for; not zero-filled."""

    def __init__(self, count: int = 2) -> None:
        self._bufs: list[np.ndarray] = []
        self._count = count
        self._taken = 0

    def take(self, nbytes: int) -> np.ndarray:
        slot = self._taken % self._count
        self._taken += 1
        if slot == len(self._bufs):
            self._bufs.append(np.empty(nbytes, dtype=np.uint8))
        elif self._bufs[slot].nbytes < nbytes:
            self._bufs[slot] = np.empty(nbytes, dtype=np.uint8)
        return self._bufs[slot][:nbytes]


def _token_major_blocks(a: np.ndarray, block: int = BLOCK_BYTES,
                        ring: _Ring | None = None) -> Iterator[memoryview]:  # fmt: skip
    """The bytes of ``a.swapaxes(1, 2)`` (``a``: ``(1, heads, T, ...)``, any strides) in C order,
    ``block`` bytes of whole tokens at a time, each copied by numpy into a buffer of ``ring``
    (a block is valid until the ring's next buffer after it is taken)."""
    ring = ring or _Ring()
    v = a.swapaxes(1, 2)[0]  # (T, heads, ...): a view
    t_all = v.shape[0]
    per = a.nbytes // max(1, t_all)
    step = max(1, min(t_all, block // max(1, per)))
    for t0 in range(0, t_all, step):
        k = min(step, t_all - t0)
        buf = ring.take(k * per).view(a.dtype).reshape(k, *v.shape[1:])
        np.copyto(buf, v[t0 : t0 + k])
        yield flat_bytes(buf.reshape(-1))


def _one_ahead(blocks: Iterator[memoryview]) -> Iterator[memoryview]:
    """``blocks``, each made on the pool while the consumer writes the one before (numpy's copy,
    xxhash and ``write`` all release the GIL). Two buffers alternate: see :class:`_Ring`."""
    nxt = pool().submit(next, blocks, None)
    try:
        while (cur := nxt.result()) is not None:
            nxt = pool().submit(next, blocks, None)
            yield cur
    finally:
        if not nxt.cancel():
            nxt.exception()  # wait: never leave the generator running on the pool
