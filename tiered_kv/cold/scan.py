"""Byte-only threads that go through a whole entry file beside a loader on the engine thread.

:class:`Scan` reads the data section once, sequentially, into a small ring of reused buffers and
checks every chunk digest (on the hashing pool) as the bytes arrive: the CUDA reload path and
step-wise loads beside running streams trail it (``codec.load_steps``), so the disk is read once
and nothing unverified is used. :class:`Prefetch` only asks the kernel to read ahead
(``posix_fadvise(WILLNEED)``) for a loader that checks what it built itself (host memory).
:func:`check_data` is a whole-file check by a scan (``tiered-kv cache verify``).

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


class _FileThread:
    """A byte-only thread over one entry file: the descriptor (opened in the caller's thread,
    so a symlink raises there; closed by the thread's ``_run`` when it ends), a condition for
    its state, and :meth:`close` to stop it early. A subclass sets its state, then starts
    ``_thread``."""

    def __init__(self, path: Path, name: str) -> None:
        self._fd = open_entry(path)
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class Scan(_FileThread):
    """One sequential pass over an entry's data section on a byte-only thread, every chunk digest
    checked as the bytes arrive.

    Large reads (``step`` bytes, whole chunks of one tensor) go into a small ring of reused
    buffers; each piece is hashed on :func:`pool` while the next one is read, so the pass runs at
    the disk's sequential speed. A loader that reads the same file (``mx.load``) trails it with
    :meth:`wait`: what it reads was just read by the scan (the page cache serves it, the disk is
    read once) and was verified before it is used. Opened in the caller's thread (raises
    FileNotFoundError / CorruptEntry for a symlink); :meth:`close` stops it early.
    """

    def __init__(self, path: Path, header: Header, step: int = READ_BYTES, ring: int = 4) -> None:
        super().__init__(path, "tkv-scan")
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

    def has_read(self, offset: int) -> bool:
        """Whether the scan has read past ``offset`` or ended (then :meth:`wait` raises)."""
        with self._cond:
            return self._read_to >= offset or self._done

    def wait_read(self, offset: int) -> int:
        """Block until the scan has read past ``offset`` (or ended); how far it has read."""
        with self._cond:
            self._cond.wait_for(lambda: self._read_to >= offset or self._done)
            return self._read_to

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


class Prefetch(_FileThread):
    """Asks the kernel to read an entry's data section into the page cache ahead of a loader
    (``posix_fadvise(WILLNEED)``, piece by piece, no copy into this process), never more than
    ``ahead`` bytes past the position the loader last gave to :meth:`advance`. Pages already
    cached cost nothing. Byte-only thread; reads nothing itself, so it verifies nothing: the
    loader checks what it built (:func:`codec.load_steps` over host-memory arrays)."""

    def __init__(self, path: Path, header: Header, ahead: int = 4 * READ_BYTES) -> None:
        super().__init__(path, "tkv-prefetch")
        self._start, self._end, self._ahead = header.data_start, data_end(header), ahead
        self._pos = 0
        self._thread.start()

    def advance(self, offset: int) -> None:
        """The loader is about to read up to ``offset`` (data-section relative)."""
        with self._cond:
            self._pos = max(self._pos, offset)
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            off = 0
            while off < self._end:
                with self._cond:
                    while not (self._stop or off < self._pos + self._ahead):
                        self._cond.wait()
                    if self._stop:
                        return
                n = min(READ_BYTES, self._end - off)
                os.posix_fadvise(self._fd, self._start + off, n, os.POSIX_FADV_WILLNEED)
                off += n
        except OSError:  # a hint only: the loader's own reads report what is wrong
            pass
        finally:
            os.close(self._fd)


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
