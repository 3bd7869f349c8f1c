"""tiered_kv/cold/pages.py: the kernel's pages around a read. The page-cache probe reads nothing
(a cold file stays cold however often it is probed), samples a large file's windows, answers None
for a symlink and leaves no garbage; a reopened descriptor is the same file with a description of
its own; fresh memory is faulted in by one call, ahead of the readers until they are done, and a
kernel without ``MADV_POPULATE_WRITE`` skips those tests, saying why."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.fixtures import needs_populate_write, needs_proc_fd
from tiered_kv.cold import pages


def test_a_planted_symlink_is_not_probed(tmp_path):
    path = tmp_path / "entry.bin"
    path.write_bytes(b"x" * 100_000)
    link = tmp_path / "link.bin"
    link.symlink_to(path)
    assert pages.resident_share(link) is None
    assert pages.resident_share(path) is not None


def test_resident_share_is_a_share_or_unknown(tmp_path):
    path = tmp_path / "entry.bin"
    path.write_bytes(b"x" * 100_000)
    share = pages.resident_share(path)
    assert share is None or 0.0 <= share <= 1.0


def test_probing_a_cold_file_does_not_warm_it(tmp_path):
    """Issue 15 on the H200: a non-blocking read that misses starts readahead, so the plan's
    probe after the benchmark's found every sampled page resident ("warm=1.0" in every cold
    plan) and priced cold reads at warm rates. The probe reads nothing: a dropped file stays
    cold however often it is probed, and a file that was read is warm."""
    path = tmp_path / "entry.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8))
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        first = pages.resident_share(path)
        if first is None or first > 0.05:
            pytest.skip(f"the page cache of {tmp_path} cannot be dropped here ({first})")
        again = [pages.resident_share(path) for _ in range(3)]
        time.sleep(0.2)  # readahead a probe started would have landed by now
        again.append(pages.resident_share(path))
        assert again == [0.0] * 4
        while os.read(fd, 8 << 20):
            pass
    finally:
        os.close(fd)
    assert pages.resident_share(path) == 1.0


def test_a_large_file_is_probed_by_samples_that_estimate_its_share(tmp_path):
    """The probe of a file over PROBE_WINDOWS × PROBE_PAGES pages samples evenly spaced windows
    (every page cost ~16 ms a GB on the request path): half of it resident reads as about half,
    the first and last windows see the file's two ends."""
    size = 4 * pages.PROBE_WINDOWS * pages.PROBE_PAGES * mmap.PAGESIZE  # 4 pages a sampled one
    path = tmp_path / "entry.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8))
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if (pages.resident_share(path) or 0.0) > 0.02:
            pytest.skip(f"the page cache of {tmp_path} cannot be dropped here")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # readahead off
        os.pread(fd, mmap.PAGESIZE, 0)  # the first page
        share = pages.resident_share(path)
        assert share is not None and 0.0 < share < 0.05
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
        while os.read(fd, 8 << 20):
            pass
        os.posix_fadvise(fd, 0, size // 2, os.POSIX_FADV_DONTNEED)
        share = pages.resident_share(path)
        assert share is not None and 0.45 <= share <= 0.55
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, mmap.PAGESIZE, size - mmap.PAGESIZE)  # the last page
        share = pages.resident_share(path)
        assert share is not None and share > 0.0
    finally:
        os.close(fd)



def test_the_page_cache_probe_leaves_no_garbage(tmp_path):
    """One probe per restore plan: it makes no ctypes array type per file size (a type is a
    reference cycle, left for the cyclic collector)."""
    import ctypes
    import gc

    from tiered_kv.cold.pages import resident_share

    p = tmp_path / "f"
    p.write_bytes(b"x" * 40_000)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        assert resident_share(p) is not None
        gc.collect()
        ours = [o for o in gc.garbage if isinstance(o, ctypes._SimpleCData | ctypes.Array)
                or (isinstance(o, type) and issubclass(o, ctypes.Array))]  # fmt: skip
        assert ours == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()



def test_a_reopened_file_is_the_same_file(tmp_path):
    """Where there is a /proc or not (a dup there): the file the descriptor names, renamed since."""
    p = tmp_path / "f"
    p.write_bytes(b"abcdef")
    fd = os.open(p, os.O_RDONLY)
    p.rename(tmp_path / "g")  # renamed since: still the file the descriptor names
    own = pages.reopen(fd)
    try:
        assert own != fd and os.fstat(own).st_ino == os.fstat(fd).st_ino
        assert os.pread(own, 2, 1) == b"bc"
    finally:
        os.close(own)
        os.close(fd)


@needs_proc_fd
def test_a_reopened_file_has_a_description_of_its_own(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abcdef")
    fd = os.open(p, os.O_RDONLY)
    os.lseek(fd, 3, os.SEEK_SET)
    p.rename(tmp_path / "g")  # renamed since: still the file the descriptor names
    own = pages.reopen(fd)
    try:
        assert os.fstat(own).st_ino == os.fstat(fd).st_ino
        assert os.lseek(own, 0, os.SEEK_CUR) == 0 and os.read(own, 2) == b"ab"
        assert os.lseek(fd, 0, os.SEEK_CUR) == 3
    finally:
        os.close(own)
        os.close(fd)



@needs_populate_write
def test_prefault_makes_fresh_memory_resident_before_the_read():
    """The pages a read will write are faulted in by one call (not one fault per page inside the
    copy); a destination under PREFAULT_MIN is left alone."""
    libc = pages._libc()
    assert libc is not None
    page = mmap.PAGESIZE

    def resident(m: mmap.mmap) -> int:
        vec = np.zeros(len(m) // page, dtype=np.uint8)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert libc.mincore(ctypes.c_void_p(addr), len(m), ctypes.c_void_p(vec.ctypes.data)) == 0
        return int(np.count_nonzero(vec & 1))

    big, small = mmap.mmap(-1, 8 << 20), mmap.mmap(-1, pages.PREFAULT_MIN // 2)
    assert resident(big) == resident(small) == 0
    pages.prefault(memoryview(big))
    pages.prefault(memoryview(small))
    assert resident(big) == len(big) // page and resident(small) == 0
    assert pages._prefault["on"]


@needs_populate_write
def test_prefault_that_fails_for_its_memory_stays_on_for_the_next():
    """Only a kernel without MADV_POPULATE_WRITE turns it off for good: a range it fails on
    (ENOMEM: here, memory no longer mapped) costs that piece its prefault, no more."""
    libc = pages._libc()
    assert libc is not None
    n = 4 << 20
    addr = libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # fmt: skip
    assert libc.munmap(ctypes.c_void_p(addr), n) == 0
    gone = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
    pages.prefault(gone)
    assert ctypes.get_errno() == errno.ENOMEM
    assert pages._prefault["on"]


#: (AUDIT_ARCH, madvise's syscall number) of the architectures the filter below knows
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 28), "aarch64": (0xC00000B7, 233)}
#: installs a seccomp filter that answers madvise(..., MADV_POPULATE_WRITE) with EINVAL, as a
#: kernel older than 5.14 does, then runs the rest of argv as ``python -m ...`` (exec keeps it)
_OLD_KERNEL = """
import ctypes, os, struct, sys
arch, nr, advice = (int(a) for a in sys.argv[1:4])
ins = [(0x20, 0, 0, 4), (0x15, 0, 5, arch), (0x20, 0, 0, 0), (0x15, 0, 3, nr),
       (0x20, 0, 0, 32), (0x15, 0, 1, advice), (0x06, 0, 0, 0x00050000 | 22),
       (0x06, 0, 0, 0x7FFF0000)]
prog = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in ins))
fprog = struct.pack("HP", len(ins), ctypes.addressof(prog))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS"
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, ctypes.get_errno()
os.execv(sys.executable, [sys.executable, *sys.argv[4:]])
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in _SECCOMP_ARCH,
                    reason="the old-kernel filter knows Linux x86_64 and aarch64")  # fmt: skip
def test_the_prefault_tests_skip_on_a_kernel_without_populate_write():
    """On a kernel older than 5.14 the prefault tests failed (the prefault turned itself off, so
    nothing was resident; the unmapped range answered EINVAL, not ENOMEM). Here such a kernel is
    a seccomp filter answering that madvise with EINVAL: they skip, saying why."""
    arch, nr = _SECCOMP_ARCH[platform.machine()]
    argv = [sys.executable, "-c", _OLD_KERNEL, str(arch), str(nr), str(pages._MADV_POPULATE_WRITE),
            "-m", "pytest", __file__, "-q", "-rs", "-p", "no:cacheprovider",
            "-k", "prefault and not without_populate_write"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "2 skipped" in out, out
    assert out.count("lacks MADV_POPULATE_WRITE (Linux >= 5.14): madvise failed with EINVAL") == 2



def _resident_pages(m: mmap.mmap) -> int:
    libc = pages._libc()
    assert libc is not None
    vec = np.zeros(len(m) // mmap.PAGESIZE, dtype=np.uint8)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mincore(ctypes.c_void_p(addr), len(m), ctypes.c_void_p(vec.ctypes.data)) == 0
    return int(np.count_nonzero(vec & 1))


@needs_populate_write
def test_fault_in_faults_in_every_array_until_the_readers_are_done():
    """The fault-ahead thread's work: every page of fresh memory resident; nothing once the
    readers are through (``done``) or the read was called off (``stop``)."""
    maps = [mmap.mmap(-1, 3 * pages.FAULT_PIECE // 2) for _ in range(3)]
    arrays = [np.frombuffer(m, dtype=np.uint8) for m in maps]
    pages.fault_in(arrays[:1], threading.Event())
    assert _resident_pages(maps[0]) == len(maps[0]) // mmap.PAGESIZE
    done, stop = threading.Event(), threading.Event()
    done.set()
    pages.fault_in(arrays[1:2], done)
    stop.set()
    pages.fault_in(arrays[2:], threading.Event(), stop)
    assert _resident_pages(maps[1]) == _resident_pages(maps[2]) == 0
    del arrays
