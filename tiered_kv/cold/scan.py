"""A byte-only thread that goes through a whole entry file: :func:`check_data`, the whole-file
check of ``tiered-kv cache verify``.

:class:`Scan` reads the data section once, sequentially, into a small ring of reused buffers and
checks every chunk digest (on the hashing pool) as the bytes arrive. (A load checks as it reads
too, into the arrays themselves: ``ranged.read_tensors``.)

Threads: each is one thread of its own over one descriptor (opened in the caller's thread, so a
symlink raises there); bytes and numpy only, never MLX.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from tiered_kv.cold.store import (
    READ_BYTES,
    CorruptEntry,
    Header,
    chunk_digests,
    data_end,
    n_digest_chars,
    open_entry,
    pool,
)


class Scan:
    """One sequential pass over an entry's data section on a byte-only thread, every chunk digest
    checked as the bytes arrive.

    Large reads (``step`` bytes, whole chunks of one tensor) go into a small ring of reused
    buffers; each piece is hashed on :func:`pool` while the next one is read, so the pass runs at
    the disk's sequential speed; :meth:`wait` returns once a given offset is read and verified.
    The descriptor is opened in the caller's thread (raises FileNotFoundError / CorruptEntry for
    a symlink) and closed by the thread when it ends; :meth:`close` stops it early.
    """

    def __init__(self, path: Path, header: Header, step: int = READ_BYTES, ring: int = 4) -> None:
        self._fd = open_entry(path)
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tkv-scan", daemon=True)
        self._header = header
        self._step = max(header.chunk_bytes, step // header.chunk_bytes * header.chunk_bytes)
        self._ring = ring
        self._read_to = 0  # data-section offset read so far (pieces handed to hashing)
        self._hashes: list[tuple[int, Future]] = []  # (piece start offset, check), in file order
        self._error: BaseException | None = None
        self._done = False
        self._thread.start()

    def wait(self, offset: int) -> None:
        """Block until every byte of the data section before ``offset`` is read and verified.
        Raises CorruptEntry (a bad chunk, a short file) or the read's OSError."""
        with self._cond:
            self._cond.wait_for(lambda: self._read_to >= offset or self._done)
            if self._read_to < offset and self._error is None:
                raise CorruptEntry("scan ended before the requested offset")
            hashes = [f for start, f in self._hashes if start < offset]
        for f in hashes:
            f.result()  # raises CorruptEntry
        if self._error is not None:
            with self._cond:
                if self._read_to < offset:
                    raise self._error

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        header = self._header
        # no larger than the data (a small entry), and not zero-filled: a bytearray of the
        # ring's 4 x 64 MiB is written whole before the first read (~0.1 s on every reload)
        step = min(self._step, max(1, data_end(header)))
        bufs: list[memoryview] = []
        use = 0
        try:
            for name, t in sorted(header.tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                start, stop = t["data_offsets"]
                sums = header.digests(name)
                for off in range(start, stop, step):
                    n = min(step, stop - off)
                    with self._cond:
                        if self._stop:
                            return
                        if len(self._hashes) >= self._ring:
                            self._hashes[-self._ring][1].result()  # its buffer is free again
                    if len(bufs) < self._ring:
                        bufs.append(np.empty(step, dtype=np.uint8).data)
                    view = bufs[use % self._ring][:n]
                    use += 1
                    if read_into(self._fd, view, header.data_start + off) != n:
                        raise CorruptEntry("short read in data section")
                    first = n_digest_chars(off - start, header.chunk_bytes)  # off: chunk-aligned
                    want = sums[first : first + n_digest_chars(n, header.chunk_bytes)]
                    f = pool().submit(_check_piece, name, view, header.chunk_bytes, want)
                    with self._cond:
                        self._hashes.append((off, f))
                        self._read_to = off + n
                        self._cond.notify_all()
        except BaseException as e:  # handed to wait()
            self._error = e
        finally:
            os.close(self._fd)
            with self._cond:
                self._done = True
                self._cond.notify_all()


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """One positioned read of a scan (a seam for tests that make the disk slow)."""
    return os.preadv(fd, [view], offset)


def _check_piece(name: str, data: memoryview, chunk: int, want: str) -> None:
    if chunk_digests([data], chunk) != want:
        raise CorruptEntry(f"checksum mismatch in tensor {name!r}")


def check_data(path: Path, header: Header) -> None:
    """Stream the data section (one pass, large reads) and check every chunk digest."""
    scan = Scan(path, header)
    try:
        scan.wait(data_end(header))
    finally:
        scan.close()
