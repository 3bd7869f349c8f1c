"""Token ranges of an entry file: block checksums at write time, verified ranged reads at restore.

An entry file is standard safetensors; a layer's KV tensor is ``(1, heads, T, row)``, so tokens
``[s, e)`` of it are ``heads`` contiguous runs. To serve such a range without reading the rest of
the file, the writer adds two keys to ``__metadata__`` (covered by the header checksum):

* ``range_block`` — tokens per checksum block (``RANGE_BLOCK``);
* ``range_xxh``   — JSON ``{tensor: hex}``: per block ``b`` the 16-hex-digit xxh3_64 of the
  block's bytes in every head, in head order (``tokens`` is hashed the same way, as one head).

:func:`read_range` reads whole blocks covering ``[m, n)`` of every covered tensor (plus the tokens
of ``[0, n)``) with positioned reads and checks every block it returns: no unverified byte is
served. Files without these keys (older writers) simply cannot be split (:class:`Unsplittable`).

Threads: :func:`block_checksums` runs on the writer thread over evaluated arrays' bytes;
:func:`read_range` and :func:`resident_share` touch only files, bytes and numpy — they are what
the restore I/O thread runs, and never touch MLX.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiered_kv.cold import store

RANGE_BLOCK = 256
META_BLOCK = "range_block"
META_XXH = "range_xxh"
_HEX = 16


class Unsplittable(ValueError):
    """The entry cannot be read by token ranges (no block checksums, or layers of other shapes)."""


_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8,
             "I64": 8, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # fmt: skip


def _as_u8(x: Any) -> np.ndarray:
    """A flat uint8 view of an evaluated array's bytes (copies only strided slices)."""
    m = memoryview(x)
    return np.frombuffer(m if m.c_contiguous else m.tobytes(), dtype=np.uint8)


def _hash_blocks(runs: np.ndarray, block: int) -> str:
    """``runs``: (heads, T, row_bytes) uint8; one xxh3 per block of T over every head."""
    heads, t = runs.shape[0], runs.shape[1]
    out = []
    for b in range(0, t, block):
        h = xxhash.xxh3_64()
        for i in range(heads):
            h.update(runs[i, b : b + block].data)
        out.append(h.hexdigest())
    return "".join(out)


def _runs(u8: np.ndarray, shape: list[int] | tuple[int, ...]) -> np.ndarray:
    heads, t = int(shape[1]), int(shape[2])
    return u8.reshape(heads, t, -1)


def splittable(name: str, shape: tuple[int, ...] | list[int], n_tokens: int) -> bool:
    """A tensor that holds one row per token on axis 2 of a batch of one."""
    return len(shape) == 4 and int(shape[0]) == 1 and int(shape[2]) == n_tokens and n_tokens > 0


def block_checksums(tokens: np.ndarray, arrays: Mapping[str, Any],
                    block: int = RANGE_BLOCK) -> dict[str, str]:  # fmt: skip
    """The two metadata keys above for an entry about to be written (writer thread)."""
    n = len(tokens)
    sums = {"tokens": _hash_blocks(_as_u8(tokens).reshape(1, n, -1), block)}
    for name, x in arrays.items():
        if splittable(name, tuple(x.shape), n):
            sums[name] = _hash_blocks(_runs(_as_u8(x), tuple(x.shape)), block)
    return {META_BLOCK: str(block), META_XXH: json.dumps(sums, separators=(",", ":"))}


@dataclass
class RangeRead:
    """Verified bytes of ``[start, stop)`` of every layer tensor, and the entry's first tokens."""

    start: int  # block-aligned, ≤ the m asked for
    stop: int  # ≥ the n asked for (block-aligned or the entry's end)
    tokens: np.ndarray  # int32 ids [0, stop)
    #: tensor name → (dtype name as in safetensors, uint8 array (1, heads, stop - start, row))
    tensors: dict[str, tuple[str, np.ndarray]]
    metadata: dict[str, str]
    nbytes: int  # bytes read
    seconds: float


#: the per-tensor byte-chunk checksums of cold entry format 2 (issue 11): ``chunk_bytes`` and
#: ``xxh3`` = {tensor: concatenated xxh3_64 hex digests of its bytes cut into chunk_bytes pieces}
META_CHUNK, META_CHUNK_XXH = "chunk_bytes", "xxh3"


def _checksums(header: store.Header) -> tuple[int, int, dict[str, str]]:
    """(token block, byte chunk, table): block checksums (block > 0, chunk 0) when the writer added
    them, else format 2's byte chunks (block 1, chunk > 0); Unsplittable when neither is there."""
    meta = header.metadata
    try:
        if META_BLOCK in meta and META_XXH in meta:
            block, chunk, sums = int(meta[META_BLOCK]), 0, json.loads(meta[META_XXH])
        elif META_CHUNK in meta and META_CHUNK_XXH in meta:
            block, chunk, sums = 1, int(meta[META_CHUNK]), json.loads(meta[META_CHUNK_XXH])
        else:
            raise Unsplittable("entry written without block or chunk checksums")
        assert isinstance(sums, dict) and block > 0 and chunk >= 0
    except (ValueError, AssertionError) as e:
        if isinstance(e, Unsplittable):
            raise
        raise store.CorruptEntry(f"bad range checksums: {e}") from None
    return block, chunk, sums


def plan_tensors(header: store.Header) -> dict[str, dict[str, Any]]:
    """The tensors a ranged read returns (every one but ``tokens``); Unsplittable when some
    tensor has no per-token rows (checkpoints, wrapped windows, recurrent state)."""
    _, _, sums = _checksums(header)
    n = header.n_tokens
    out = {}
    for name, t in header.tensors.items():
        if name == "tokens":
            continue
        if name not in sums or not splittable(name, t["shape"], n):
            raise Unsplittable(f"tensor {name} cannot be read by token range")
        out[name] = t
    return out


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise store.CorruptEntry("short read")
        got += k


def read_range(path: Path, fingerprint: str, m: int, n: int, workers: int = 4) -> RangeRead:
    """Verified tokens ``[0, n)`` and rows ``[m, n)`` (block-aligned outwards) of every layer.

    Raises store.CorruptEntry (checksum, short file), store.ForeignEntry, Unsplittable,
    FileNotFoundError. Files and numpy only: safe on any thread (``workers`` threads of its own
    read the tensors, and never touch MLX either).
    """
    t0 = time.perf_counter()
    header = store.read_header(path, fingerprint)
    block, chunk, sums = _checksums(header)
    total = header.n_tokens
    if not 0 <= m < n <= total:
        raise ValueError(f"range [{m}, {n}) outside the entry's {total} tokens")
    tensors = plan_tensors(header)
    start, stop = m // block * block, min(total, -(-n // block) * block)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    read = [0]

    def runs(name: str, t: dict[str, Any], dst: np.ndarray, row0: int, every: int) -> None:
        """Rows from ``row0`` of each of ``dst``'s heads (``dst``: heads, rows, row bytes), head
        ``h`` at byte ``row0 * row + h * every`` of tensor ``name``, verified."""
        first = row0 * dst.shape[2]
        base = header.data_start + int(t["data_offsets"][0])
        heads, width = dst.shape[0], dst.shape[1] * dst.shape[2]
        spans = [(first + h * every, first + h * every + width) for h in range(heads)]
        if chunk:
            size = int(t["data_offsets"][1]) - int(t["data_offsets"][0])
            pieces, got = _read_chunked(fd, base, size, spans, sums.get(name, ""), chunk, name)
            for h, piece in enumerate(pieces):
                dst[h] = piece.reshape(dst.shape[1:])
        else:
            for h, (a, _) in enumerate(spans):
                _pread_into(fd, memoryview(dst[h]).cast("B"), base + a)
            _verify(dst, sums[name], row0, block, name)
            got = dst.nbytes
        read[0] += got

    def one(name: str, t: dict[str, Any]) -> tuple[str, tuple[str, np.ndarray]]:
        heads, row = int(t["shape"][1]), _row_bytes(t)
        buf = np.empty((1, heads, stop - start, row), dtype=np.uint8)
        runs(name, t, buf[0], start, total * row)
        return name, (t["dtype"], buf)

    try:
        tok = np.empty((1, stop, 4), dtype=np.uint8)
        runs("tokens", header.tensors["tokens"], tok, 0, 0)
        # positioned reads release the GIL: a few in flight keep a fast disk (or the page cache) busy
        with ThreadPoolExecutor(max(1, min(workers, len(tensors)))) as pool:
            out = dict(pool.map(lambda kv: one(*kv), tensors.items()))
    finally:
        os.close(fd)
    nbytes = read[0]
    tokens = tok.reshape(-1).view("<i4").copy()
    return RangeRead(start, stop, tokens, out, dict(header.metadata), nbytes,
                     time.perf_counter() - t0)  # fmt: skip


def _read_chunked(fd: int, base: int, size: int, spans: list[tuple[int, int]], digests: str,
                  chunk: int, name: str) -> tuple[list[np.ndarray], int]:  # fmt: skip
    """Byte ``spans`` of a tensor of ``size`` bytes at file offset ``base``, read as the whole
    checksum chunks that cover them (adjacent ones merged into one read) and verified chunk by
    chunk. Returns (one uint8 array per span, bytes read)."""
    wanted = sorted({(a // chunk, -(-b // chunk)) for a, b in spans if b > a})
    merged: list[list[int]] = []
    for c0, c1 in wanted:
        if merged and c0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], c1)
        else:
            merged.append([c0, c1])
    bufs: list[tuple[int, int, np.ndarray]] = []
    for c0, c1 in merged:
        lo, hi = c0 * chunk, min(size, c1 * chunk)
        buf = np.empty(hi - lo, dtype=np.uint8)
        _pread_into(fd, buf.data, base + lo)
        for c in range(c0, c1):
            piece = buf[c * chunk - lo : min(size, (c + 1) * chunk) - lo]
            if xxhash.xxh3_64_hexdigest(piece.data) != digests[c * _HEX : (c + 1) * _HEX]:
                raise store.CorruptEntry(f"range checksum mismatch in {name}")
        bufs.append((lo, hi, buf))
    out = []
    for a, b in spans:
        lo, _, buf = next(x for x in bufs if x[0] <= a and b <= x[1])
        out.append(buf[a - lo : b - lo])
    return out, sum(x[2].nbytes for x in bufs)


def _row_bytes(t: dict[str, Any]) -> int:
    shape = t["shape"]
    return int(np.prod(shape[3:], dtype=np.int64)) * _ITEMSIZE[t["dtype"]]


def _verify(runs: np.ndarray, hexes: str, start: int, block: int, name: str) -> None:
    """Check the blocks of ``runs`` (heads, rows from ``start``, row bytes) against ``hexes``."""
    first = start // block
    count = -(-runs.shape[1] // block)
    want = hexes[first * _HEX : (first + count) * _HEX]
    if len(want) != count * _HEX or _hash_blocks(runs, block) != want:
        raise store.CorruptEntry(f"range checksum mismatch in {name}")


def resident_share(path: Path, samples: int = 16) -> float | None:
    """Share of ``path`` in the page cache, probed by ``samples`` 4 KiB non-blocking reads
    (``RWF_NOWAIT``: fails instead of waiting for the disk). None when the OS cannot tell."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        buf = bytearray(4096)
        hits = 0
        for i in range(samples):
            off = (size * (2 * i + 1) // (2 * samples)) // 4096 * 4096
            try:
                hits += os.preadv(fd, [buf], off, flag) > 0
            except BlockingIOError:
                pass
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    return None
                raise
        return hits / samples
    finally:
        os.close(fd)
