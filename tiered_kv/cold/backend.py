"""Where entry bytes live: the cold tier's narrow storage interface and its local-file backend.

A backend stores one opaque byte string per key (an entry id) and knows nothing of KV caches,
the index or budgets. The cold tier needs exactly four operations of it::

    put(key, entry)   -> int          write ``entry`` (a ``encode.Encoded``) under ``key``,
                                      atomically (a reader sees the old value, nothing, or the
                                      whole new one) and durably before returning; the size.
                                      The value is the concatenation of ``entry.pieces``, then,
                                      when ``entry.head`` is set, its first ``len(head())``
                                      bytes replaced by ``entry.head()`` (see below)
    get(key)          -> buffer|None  the whole value (one read), or None when absent
    contains(key)     -> bool
    delete(key)       -> None         absent is fine

``put``'s value is written in one pass. ``entry.pieces`` is iterated once, in order, and a piece
is valid only until the next one is asked for. ``entry.head`` (when not None) may be called only
after the last piece was consumed: it returns the entry's real first bytes (the header, whose
checksums cover the data that just went by), which take the place of the reserved bytes the
first piece held. So a backend writes the pieces as they come and then patches the start (the
file backend: one ``pwrite`` at offset 0 before its fsync), or gathers and patches in memory. A
``head`` that raises (or any failure before the value is whole) publishes nothing: the key keeps
its old value or stays absent. ``encode.Encoded.whole(data)`` wraps bytes that are complete
already (no ``head``).

Errors are ``OSError`` (ENOSPC, EROFS, ENOENT of the directory ... counted by the tier).
A shared backend (e.g. a key-value server) implements these four; :class:`FileBackend` adds
``path(key)`` so the tier can hand a local file to its readers (``ranged.read_tensors``: reads
straight into the arrays' memory). Keys are ``[0-9A-Za-z_-]{1,64}`` (entry ids), never paths.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import xxhash

from tiered_kv.cold import encode, store

_KEY = re.compile(r"^[0-9A-Za-z_-]{1,64}$")
_WRITE = 1 << 30  # at most this many bytes per write(): Linux caps one write at ~2 GiB
_COALESCE = 8 << 20  # small pieces are gathered into one write up to this size


@runtime_checkable
class Backend(Protocol):
    """Bytes of entries by key (see the module docstring for the contract)."""

    def put(self, key: str, entry: encode.Encoded) -> int: ...
    def get(self, key: str) -> bytearray | None: ...
    def contains(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...


#: the end of a temp file's name (:func:`temp_path`)
TMP_SUFFIX = ".tmp"


def temp_path(path: Path, pid: int) -> Path:
    """Where process ``pid`` (of this host and PID namespace) writes ``path`` before publishing
    it: ``.<name>.<pid>-<where>.tmp`` beside it (hidden: never an entry file; the pid tells
    :mod:`verify` whether its writer lives, ``<where>`` whether that pid means anything here)."""
    return path.with_name(f".{path.name}.{pid}-{pid_space()}{TMP_SUFFIX}")


@functools.cache
def pid_space() -> str:
    """12 hex digits naming where this process's pids mean something: this boot of this host
    and its PID namespace. Two containers sharing a cache directory each have their own pid 1,
    and neither sees the other's pids: a pid from elsewhere tells nothing of its writer."""
    parts = [os.uname().nodename]
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text(),
                 lambda: os.readlink("/proc/self/ns/pid")):  # fmt: skip
        try:
            parts.append(read().strip())
        except OSError:
            parts.append("")
    return xxhash.xxh3_64_hexdigest("\0".join(parts).encode())[:12]


#: temp files this process is writing now (paths): another tier of this process sharing the
#: directory must not take them for a dead writer's (:func:`verify.stale_temp`)
_writing: set[str] = set()  # names: unique (each holds its entry's key), however the dir is spelt
_writing_lock = threading.Lock()


def writing(path: Path) -> bool:
    """Whether this process is writing the temp file ``path`` now (any of its tiers)."""
    with _writing_lock:
        return Path(path).name in _writing


def is_temp(name: str) -> bool:
    """A file name of :func:`temp_path`'s shape (its writer's pid may not parse)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def temp_writer(name: str) -> int | None:
    """The pid of the process that writes the temp file ``name`` (:func:`temp_path`); None
    when ``name`` is not a temp file's, names no pid, or a pid of another host or PID namespace
    (:func:`pid_space`). A name without ``-<where>`` (written before it was added) is taken
    for this one's."""
    if not is_temp(name):
        return None
    pid, _, where = name.removesuffix(TMP_SUFFIX).rsplit(".", 1)[-1].partition("-")
    if where and where != pid_space():
        return None
    return int(pid) if pid.isascii() and pid.isdigit() else None


def is_key(key: str) -> bool:
    return bool(_KEY.match(key))


def check_key(key: str) -> str:
    if not _KEY.match(key):
        raise ValueError(f"bad entry key {key!r}")
    return key


class FileBackend:
    """One file per key, ``<dir>/<key>.safetensors`` (0600, the dir 0700).

    ``put`` writes a temp file in the same directory with large sequential writes, then the
    header over its reserved first bytes (one ``pwrite``), one fsync, ``os.replace`` into
    place, then fsyncs the directory; on any failure the temp file is removed. Nothing follows a symlink: files are
    opened with ``O_NOFOLLOW`` and temp files created with ``O_EXCL``. Thread-safe (its one state:
    the process's temp files in flight, :func:`writing`).
    """

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)

    def path(self, key: str) -> Path:
        return self.dir / f"{check_key(key)}{store.SUFFIX}"

    def put(self, key: str, entry: encode.Encoded) -> int:
        path = self.path(key)
        tmp = temp_path(path, os.getpid())
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with _writing_lock:
            _writing.add(tmp.name)
        try:
            return self._put(tmp, path, flags, entry)
        finally:
            with _writing_lock:
                _writing.discard(tmp.name)

    def _put(self, tmp: Path, path: Path, flags: int, entry: encode.Encoded) -> int:
        try:
            fd = os.open(tmp, flags, store.FILE_MODE)
        except FileExistsError:  # a leftover of ours (same pid, earlier failure): replace it
            os.unlink(tmp)
            fd = os.open(tmp, flags, store.FILE_MODE)
        try:
            try:
                total = _write_all(fd, entry.pieces)
                if entry.head is not None:
                    first = entry.head()
                    if len(first) > total:
                        raise RuntimeError(f"head of {len(first)} bytes over {total} written")
                    _pwrite(fd, memoryview(first), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        fsync_dir(self.dir)
        return total

    def get(self, key: str) -> bytearray | None:
        try:
            fd = store.open_entry(self.path(key))
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            view = memoryview(buf)
            off = 0
            while off < size:
                got = os.preadv(fd, [view[off : off + _WRITE]], off)
                if got == 0:
                    return None  # shrank while reading: replaced under us
                off += got
            return buf
        finally:
            os.close(fd)

    def contains(self, key: str) -> bool:
        try:
            st = os.lstat(self.path(key))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode)

    def delete(self, key: str) -> None:
        _unlink(self.path(key))


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_all(fd: int, pieces: Iterable[memoryview]) -> int:
    """Write ``pieces`` in order: large ones directly, runs of small ones gathered first (copied
    as they come: a piece may be reused once the next one is asked for)."""
    total = 0
    small = bytearray()
    for p in pieces:
        if len(p) >= _COALESCE:
            if small:
                total += _write(fd, memoryview(small))
                small = bytearray()
            total += _write(fd, p)
        else:
            small += p
            if len(small) >= _COALESCE:
                total += _write(fd, memoryview(small))
                small = bytearray()
    if small:
        total += _write(fd, memoryview(small))
    return total


def _write(fd: int, view: memoryview) -> int:
    off, n = 0, len(view)
    while off < n:
        wrote = os.write(fd, view[off : off + _WRITE])
        if wrote <= 0:
            raise OSError(errno.EIO, "write returned 0")
        off += wrote
    return n


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    """Write ``view`` at ``offset`` (the header over its reserved bytes)."""
    done = 0
    while done < len(view):
        wrote = os.pwrite(fd, view[done:], offset + done)
        if wrote <= 0:
            raise OSError(errno.EIO, "pwrite returned 0")
        done += wrote


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
