"""``dd``, the yardstick of every reload benchmark, and the page-cache drop they all measure "cold" from.

Used by ``micro.reload``, ``sizes``, ``shared_reload`` and ``cold_lookup``, so "cold" means the same in each:
``sync`` (dirty pages cannot be dropped), then ``posix_fadvise(DONTNEED)`` on each file. No library: the drop
is one stdlib call and ``dd`` is itself the reference being compared against. Linux (``posix_fadvise``).
"""

from __future__ import annotations

import mmap
import os
import subprocess
import time
from pathlib import Path

BLOCK = 16 << 20  # dd's block size, reading and writing


def drop_page_cache(*paths: Path) -> None:
    """Evict ``paths`` from the page cache: the next read of each comes from the device."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read(*paths: Path, cold: bool) -> float:
    """Seconds for ``dd`` to read ``paths`` one after the other; with ``cold`` their pages are dropped
    first (not timed), otherwise they are read once before (not timed) so that every page is resident."""
    if cold:
        drop_page_cache(*paths)
    else:
        _dd_read(paths)
    t0 = time.perf_counter()
    _dd_read(paths)
    return time.perf_counter() - t0


def read_fresh(path: Path, cold: bool = True) -> float:
    """Seconds to read ``path`` into memory freshly mapped for it (anonymous, never touched), one
    thread, ``BLOCK`` bytes per read: what ``dd`` does, plus the page faults of the memory a reload
    lands in. Not a second ``dd``: on a VM whose freed memory goes back to its host, faulting in
    fresh memory costs as much as the disk (the 2-core VM: 4 GB in 1.1-6 s), and ``dd`` reads
    into one reused block."""
    if cold:
        drop_page_cache(path)
    size = os.stat(path).st_size
    t0 = time.perf_counter()
    with mmap.mmap(-1, max(1, size)) as mem, memoryview(mem) as view:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < size:
                got = os.preadv(fd, [view[done : done + BLOCK]], done)
                if got <= 0:
                    break
                done += got
        finally:
            os.close(fd)
        return time.perf_counter() - t0


def write(path: Path, nbytes: int) -> float:
    """Seconds for ``dd`` to write ``nbytes`` of zeros to ``path`` and fsync it (whole blocks written,
    the time scaled to ``nbytes``), from a synced page cache."""
    count = max(1, -(-nbytes // BLOCK))
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={BLOCK}", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)  # fmt: skip
    return (time.perf_counter() - t0) * nbytes / (count * BLOCK)


def _dd_read(paths: tuple[Path, ...]) -> None:
    for path in paths:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={BLOCK}"], check=True, capture_output=True)
