"""The kernel's pages around a read: how much of an entry file the page cache holds, readahead per
open file, and fresh memory a read lands in faulted in before the read writes it.

* :func:`resident_share` asks ``mincore`` over a read-only mapping of the file (sampled windows
  of a large one): the restore plan prices a read by it, and a whole read into host memory faults
  its destinations in ahead only for a file mostly on disk (:func:`faults_ahead`);
* :func:`no_readahead` and :func:`reopen` set the kernel's readahead per open file description:
  off for a range's spans, one description (one sequential stream) per whole-tensor reader;
* :func:`prefault` (a reader's own piece, one ``madvise(MADV_POPULATE_WRITE)``) and
  :func:`fault_in` (one thread ahead of the readers) fault fresh memory in.

Linux semantics through libc (ctypes); where the OS lacks a call, a probe answers None and a hint
does nothing. Files, memory and ctypes only: any thread, never MLX. The reads themselves are
:mod:`tiered_kv.cold.ranged`'s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import sys
import threading
from pathlib import Path

import numpy as np

from tiered_kv.cold import fsafe


def no_readahead(fd: int) -> None:
    """Turn the kernel's readahead off for this open file (``POSIX_FADV_RANDOM``): the ranged
    read asks for exactly the spans it needs, several threads at once, each span megabytes long.
    With readahead on, those readers share one readahead state that sees no sequential stream,
    and the kernel reads in small pieces: a cold read of the last 16 MiB of 64 tensors (8B, 32k
    tokens, ``both`` at m = 24k) ran at 0.8-1.0 GB/s where ``dd`` reads 1.2-2.2 GB/s; without
    readahead it runs at 1.9-2.1 GB/s. A hint only: where the OS has none, nothing changes."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except (OSError, AttributeError):
        pass


def reopen(fd: int) -> int:
    """A new open file description of ``fd``'s file, for one reader thread: the kernel keeps
    readahead state per open file description, so readers sharing one (or a ``dup``) that each
    read their own tensor front to back look like one stream jumping about, and readahead shrinks
    to nothing. On the 2-core VM, 4 threads each reading a quarter of a cold 1 GiB file in 16 MiB
    ``preadv`` calls: 0.29-0.47 GB/s through one descriptor, 1.92-2.10 through one each (``dd``
    0.81-2.05; ``scratch``-style probe, 4 rounds). Linux: ``/proc/self/fd`` opens the same inode
    (renamed or unlinked since, still the same file; no path lookup, no symlink followed); where
    there is no ``/proc``, a ``dup`` (shared readahead, as before)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return os.dup(fd)


#: the residency probe of a large file asks about this many evenly spaced windows of
#: :data:`PROBE_PAGES` pages (a smaller file: every page). ``mincore`` over every page cost
#: ~16 ms a GB on this project's 2-core VM (70 ms of a 4 GiB entry's plan, on the request path);
#: each call costs ~10 µs, so few wide windows: 64 × 256 KiB is 0.7 ms whatever the size, and a
#: share estimated from 4096 pages decides as well as one counted over all of them.
PROBE_WINDOWS = 64
PROBE_PAGES = 64


def resident_share(path: Path) -> float | None:
    """Share of ``path``'s pages in the page cache: ``mincore`` over a read-only mapping of the
    file (every page of a small file, :data:`PROBE_WINDOWS` evenly spaced windows of a large
    one), which touches no page and starts no read. None when the OS cannot tell.

    (A non-blocking read, ``RWF_NOWAIT``, is no probe: on a miss the kernel starts readahead
    before it answers EAGAIN, so the next probe of a cold file found it warm — on the H200 every
    plan after the first priced a cold read at the warm rate.)"""
    libc = _libc()
    if libc is None:
        return None
    try:
        fd = fsafe.open_file(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            return None
        try:
            return _sampled_share(libc, addr, -(-size // mmap.PAGESIZE))
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def _sampled_share(libc: ctypes.CDLL, addr: int, pages: int) -> float | None:
    if pages <= PROBE_WINDOWS * PROBE_PAGES:
        windows = [(0, pages)]
    else:
        last = pages - PROBE_PAGES
        windows = [(i * last // (PROBE_WINDOWS - 1), PROBE_PAGES) for i in range(PROBE_WINDOWS)]
    vec = np.zeros(sum(n for _, n in windows), dtype=np.uint8)  # not a ctypes array (a type per size)
    at = 0
    for first, n in windows:
        where = ctypes.c_void_p(addr + first * mmap.PAGESIZE)
        if libc.mincore(where, n * mmap.PAGESIZE, ctypes.c_void_p(vec.ctypes.data + at)) != 0:
            return None
        at += n
    return int(np.count_nonzero(vec & 1)) / len(vec)


_MAP_FAILED = ctypes.c_void_p(-1).value
#: Linux ≥ 5.14: fault a range's pages in, writable, in one call
_MADV_POPULATE_WRITE = 23
#: smaller destinations are left to fault as they are written
PREFAULT_MIN = 1 << 20
#: share of a file's pages in the page cache below which a whole read into host memory faults
#: its destinations in ahead (:func:`fault_in`). From the page cache the readers are copying as
#: fast as the cores go, and the extra thread only competes: a warm 1 GB reload ran at 2.59 GB/s
#: with it, 3.45 without (0.25 GB: 3.39 / 4.24)
FAULT_AHEAD_BELOW = 0.5
#: bytes :func:`fault_in` faults in per call (as much as a reader reads per call:
#: ``ranged._GROUP_BYTES``)
FAULT_PIECE = 16 << 20
_prefault = {"on": sys.platform == "linux"}


def prefault(view: memoryview) -> None:
    """Fault in the whole pages of ``view`` (writable memory about to be read into) in one
    ``madvise(MADV_POPULATE_WRITE)``: a read into fresh memory otherwise takes a page fault per
    4 KiB inside the copy (a reload into memory freshly allocated for it, as every reload after
    a restart is). On the 2-core VM a warm 1 GB reload went from 0.281 s to 0.246 s
    (``bench.sizes --shape bench --gb 1``); the pages are the ones the read writes anyway.
    Linux only; a kernel that does not know it (older than 5.14: EINVAL) is not asked again;
    any other failure (ENOMEM, EFAULT) leaves this piece to fault as it is written."""
    if not _prefault["on"] or len(view) < PREFAULT_MIN:
        return
    libc = _libc()
    if libc is None:
        return
    addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
    page = mmap.PAGESIZE
    lo, hi = -(-addr // page) * page, (addr + len(view)) // page * page
    if hi > lo and libc.madvise(ctypes.c_void_p(lo), hi - lo, _MADV_POPULATE_WRITE) != 0:
        if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):
            _prefault["on"] = False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's mmap / mincore / munmap / madvise, typed (None where there is none)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]  # fmt: skip
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def faults_ahead(path: Path) -> bool:
    """Whether a whole read of ``path`` into fresh host memory should have :func:`fault_in` run
    ahead of its readers: only where the kernel can populate (:func:`prefault`) and under
    :data:`FAULT_AHEAD_BELOW` of the file is in the page cache (an unknown share counts as none)."""
    return _prefault["on"] and (resident_share(path) or 0.0) < FAULT_AHEAD_BELOW


def fault_in(arrays: list[np.ndarray], done: threading.Event,
             stop: threading.Event | None = None) -> None:  # fmt: skip
    """Fault in ``arrays`` (fresh host memory a whole read is about to fill), one
    :data:`FAULT_PIECE` at a time in the given order, until ``done`` or ``stop`` is set: one
    thread ahead of the readers, which then copy into pages already there (each reader's own
    :func:`prefault` finds them resident). On the 2-core VM, a cold 4 GB read into fresh MLX
    arrays ran at 2.26-2.60 GB/s with it and 1.90-2.07 without (6 alternating rounds;
    1 GB: 1.70-2.48 against 1.29-2.12): the readers faulting their own pages, four at once, spent
    up to twice the CPU on it. Only for a file mostly on disk (:data:`FAULT_AHEAD_BELOW`)."""
    for a in arrays:
        view = a.reshape(-1).data.cast("B")
        for i in range(0, len(view), FAULT_PIECE):
            if done.is_set() or (stop is not None and stop.is_set()):
                return
            prefault(view[i : i + FAULT_PIECE])
