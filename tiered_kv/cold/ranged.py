"""Token ranges of an entry file: ranged reads verified by the entry's own chunk checksums.

An entry file is standard safetensors (cold format 2, :mod:`store`); a layer's KV tensor is
``(1, heads, T, row)``, so tokens ``[s, e)`` of it are ``heads`` contiguous runs of bytes. Format 2
already holds, in ``__metadata__`` (covered by the header checksum), ``chunk_bytes`` and ``xxh3``:
per tensor the xxh3_64 of each ``chunk_bytes`` piece of its bytes. :func:`read_range` reads the
whole chunks that cover rows ``[m, n)`` of every head of every layer tensor (adjacent chunks in one
positioned read) plus the chunks of ``tokens[0, n)``, and checks every chunk before anything is
served: no unverified byte leaves this module. There is no second integrity scheme: what the load
path checks, the ranged path checks. The cost is read granularity: a range is read in whole chunks
(4 MiB), so a short range of a long head run reads up to two chunks more than it serves.

Files are opened with :func:`fsafe.open_nofollow` (a symlink planted in the cache dir is never
followed) and the header is read from that same descriptor.

Threads: :func:`read_range` and :func:`resident_share` touch only files, bytes and numpy — they
are what the restore I/O thread runs, and never touch MLX.
"""

from __future__ import annotations

import errno
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiered_kv.cold import fsafe, store

_HEX = 16


class Unsplittable(ValueError):
    """The entry cannot be read by token ranges (layers without one row per token)."""


def splittable(name: str, shape: tuple[int, ...] | list[int], n_tokens: int) -> bool:
    """A tensor that holds one row per token on axis 2 of a batch of one."""
    return len(shape) == 4 and int(shape[0]) == 1 and int(shape[2]) == n_tokens and n_tokens > 0


@dataclass
class RangeRead:
    """Verified bytes of ``[start, stop)`` of every layer tensor, and the entry's first tokens."""

    start: int  # the m asked for
    stop: int  # the n asked for
    tokens: np.ndarray  # int32 ids [0, stop)
    #: tensor name → (dtype name as in safetensors, uint8 array (1, heads, stop - start, row))
    tensors: dict[str, tuple[str, np.ndarray]]
    metadata: dict[str, str]
    nbytes: int  # bytes read (whole chunks: ≥ the bytes served)
    seconds: float


def plan_tensors(header: store.Header) -> dict[str, dict[str, Any]]:
    """The tensors a ranged read returns (every one but ``tokens``); Unsplittable when some
    tensor has no per-token rows (checkpoints, wrapped windows, recurrent state)."""
    n = header.n_tokens
    out = {}
    for name, t in header.tensors.items():
        if name == "tokens":
            continue
        if not splittable(name, t["shape"], n):
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
    """Verified tokens ``[0, n)`` and rows ``[m, n)`` of every layer tensor.

    Raises store.CorruptEntry (checksum, short file, a symlink), store.ForeignEntry,
    Unsplittable, FileNotFoundError. Files and numpy only: safe on any thread (``workers``
    threads of its own read the tensors, and never touch MLX either).
    """
    t0 = time.perf_counter()
    try:
        fd = fsafe.open_nofollow(path, os.O_RDONLY)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise store.CorruptEntry(f"{path.name} is a symlink") from None
        raise
    try:
        header = store.read_header_fd(fd, fingerprint)
        chunk, total = header.chunk_bytes, header.n_tokens
        if not 0 <= m < n <= total:
            raise ValueError(f"range [{m}, {n}) outside the entry's {total} tokens")
        tensors = plan_tensors(header)
        read = [0]

        def runs(name: str, t: dict[str, Any], dst: np.ndarray, row0: int, every: int) -> None:
            """Rows from ``row0`` of each of ``dst``'s heads (``dst``: heads, rows, row bytes),
            head ``h`` at byte ``row0 * row + h * every`` of tensor ``name``, verified."""
            first = row0 * dst.shape[2]
            base = header.data_start + int(t["data_offsets"][0])
            size = int(t["data_offsets"][1]) - int(t["data_offsets"][0])
            heads, width = dst.shape[0], dst.shape[1] * dst.shape[2]
            spans = [(first + h * every, first + h * every + width) for h in range(heads)]
            pieces, got = _read_chunked(fd, base, size, spans, header.digests(name), chunk, name)
            for h, piece in enumerate(pieces):
                dst[h] = piece.reshape(dst.shape[1:])
            read[0] += got

        def one(name: str, t: dict[str, Any]) -> tuple[str, tuple[str, np.ndarray]]:
            heads, row = int(t["shape"][1]), _row_bytes(t)
            buf = np.empty((1, heads, n - m, row), dtype=np.uint8)
            runs(name, t, buf[0], m, total * row)
            return name, (t["dtype"], buf)

        tok = np.empty((1, n, 4), dtype=np.uint8)
        runs("tokens", header.tensors["tokens"], tok, 0, 0)
        # positioned reads release the GIL: a few in flight keep a fast disk (or the page cache) busy
        with ThreadPoolExecutor(max(1, min(workers, len(tensors)))) as pool:
            out = dict(pool.map(lambda kv: one(*kv), tensors.items()))
    finally:
        os.close(fd)
    tokens = tok.reshape(-1).view("<i4").copy()
    return RangeRead(m, n, tokens, out, dict(header.metadata), read[0],
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
    return int(np.prod(shape[3:], dtype=np.int64)) * store.ITEMSIZE[t["dtype"]]


def resident_share(path: Path, samples: int = 16) -> float | None:
    """Share of ``path`` in the page cache, probed by ``samples`` 4 KiB non-blocking reads
    (``RWF_NOWAIT``: fails instead of waiting for the disk). None when the OS cannot tell."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return None
    try:
        fd = fsafe.open_nofollow(path, os.O_RDONLY)
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
