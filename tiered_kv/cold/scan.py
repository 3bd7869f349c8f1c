"""The whole-file check of ``tiered-kv cache verify``: :func:`check_data`.

One sequential pass over an entry's data section in large pieces, each piece's chunk digests
checked on the hashing pool while the next piece is read into the other of two buffers. (A load
checks as it reads too, straight into the arrays: ``ranged.read_tensors``.) Files, bytes and
numpy only: any thread, never MLX.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from tiered_kv.cold.checksums import chunk_digests, n_digest_chars, pool
from tiered_kv.cold.store import READ_BYTES, CorruptEntry, Header, data_end, open_entry


def check_data(path: Path, header: Header, step: int = READ_BYTES) -> None:
    """Read the data section of ``path`` once and check every chunk digest against ``header``
    (pieces of ``step`` bytes, whole chunks of one tensor). Raises CorruptEntry (a checksum, a
    short file, a symlink), FileNotFoundError, OSError."""
    chunk = header.chunk_bytes
    step = max(chunk, step // chunk * chunk)
    # no larger than the data (a small entry), and not zero-filled (np.empty)
    size = min(step, max(1, data_end(header)))
    bufs = [np.empty(size, dtype=np.uint8).data for _ in range(2)]
    checks: list[Future] = []
    fd = open_entry(path)
    try:
        for name, t in sorted(header.tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, stop = t["data_offsets"]
            sums = header.digests(name)
            for off in range(start, stop, step):
                n = min(step, stop - off)
                if len(checks) >= 2:
                    checks[-2].result()  # its buffer is free again; raises CorruptEntry
                view = bufs[len(checks) % 2][:n]
                if read_into(fd, view, header.data_start + off) != n:
                    raise CorruptEntry("short read in data section")
                first = n_digest_chars(off - start, chunk)  # off: chunk-aligned
                want = sums[first : first + n_digest_chars(n, chunk)]
                checks.append(pool().submit(_check_piece, name, view, chunk, want))
        for f in checks:
            f.result()
    finally:
        for f in checks:
            f.cancel()
        os.close(fd)


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """One positioned read (a seam for tests that make the disk slow or short)."""
    return os.preadv(fd, [view], offset)


def _check_piece(name: str, data: memoryview, chunk: int, want: str) -> None:
    if chunk_digests([data], chunk) != want:
        raise CorruptEntry(f"checksum mismatch in tensor {name!r}")
