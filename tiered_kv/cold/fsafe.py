"""File-system primitives for the cache dir that follow no symlink and delete nothing outside it.

Anyone who can write into ``TIERED_KV_DIR`` can plant a symlink there. Everything under the dir is
data: a link inside it is never followed — walks use ``follow_symlinks=False``, opens
``O_NOFOLLOW``, a directory we make or enter must be a real directory — and a deletion happens
only when the path's parent resolves inside the cache dir (a link itself is removed, never its
target). Pure ``os`` calls, no MLX, safe from any thread.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)

#: a fingerprint directory's name: ``keys.fingerprint`` is a 128-bit hex digest
FINGERPRINT_RE = re.compile(r"[0-9a-f]{32}")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafePath(OSError):
    """A path inside the cache dir is a symlink (or not the kind of file expected there)."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(errno.ELOOP, f"{what}: refusing it", str(path))


def is_fingerprint(name: str) -> bool:
    """Whether ``name`` can be a fingerprint directory (32 lowercase hex digits, nothing else)."""
    return FINGERPRINT_RE.fullmatch(name) is not None


def resolves_inside(root: Path, path: Path) -> bool:
    """Whether ``path`` (its last component not followed) lies strictly inside ``root``: every
    directory between them resolves under ``realpath(root)`` — no symlink leads out."""
    base = os.path.realpath(root)
    parent = os.path.realpath(Path(path).parent)
    return (parent == base or parent.startswith(base + os.sep)) and Path(path).name not in (
        "",
        ".",
        "..",
    )


def make_dir(path: Path, mode: int = 0o700) -> None:
    """``mkdir -p`` that refuses a symlink (or a file) where the directory should be."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(path, "not a directory (a symlink?)")


def remove(root: Path, path: Path) -> bool:
    """Delete ``path`` — a file, a symlink (the link, not its target) or a directory tree
    (``shutil.rmtree`` does not follow links inside it) — when it resolves inside ``root``.
    False (logged) when it does not; a vanished path is fine."""
    if not resolves_inside(root, path):
        log.warning("not deleting %s: it does not resolve inside the cache dir %s", path, root)
        return False
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return True


def real_subdirs(path: Path) -> list[Path]:
    """The directories directly in ``path`` (symlinks to directories excluded), sorted."""
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))


def regular_files(path: Path, prefix: str = "", suffix: str = "") -> list[Path]:
    """The regular files directly in ``path`` named ``prefix*suffix`` (symlinks excluded), sorted."""
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        Path(e.path)
        for e in entries
        if e.name.startswith(prefix)
        and e.name.endswith(suffix)
        and e.is_file(follow_symlinks=False)
    )


def open_nofollow(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that fails (ELOOP) on a symlink instead of opening its target."""
    return os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)


def open_file(path: Path, flags: int, mode: int = 0o600) -> int:
    """:func:`open_nofollow` of a regular file: a symlink, FIFO, socket or device planted at
    ``path`` raises :class:`UnsafePath` — never blocks (a FIFO's open waits for a writer, and
    its read for ever) and never reads a device."""
    try:
        fd = open_nofollow(path, flags | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(path, "a symlink") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePath(path, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_file`), at most ``limit`` of them
    (ValueError past it: a small file of ours grown huge is not ours)."""
    fd = open_file(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size > limit:
            raise ValueError(f"{path.name} is over {limit} bytes")
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def private_db(dir_path: Path, name: str = "cache.db") -> None:
    """Before sqlite opens ``dir_path/name``: the dir a real 0700 directory, the database a real
    0600 file, and no symlink at the database or its ``-wal`` / ``-shm`` / ``-journal`` names
    (sqlite would write through it into another file). Planted links are removed, not followed;
    sqlite gives its side files the database's mode."""
    if dir_path.is_symlink():
        log.warning("removing a symlink planted at %s (never followed)", dir_path)
        dir_path.unlink()
    make_dir(dir_path)
    for suffix in ("", "-wal", "-shm", "-journal"):
        p = dir_path / f"{name}{suffix}"
        if p.is_symlink():
            log.warning("removing a symlink planted at %s (never followed)", p)
            p.unlink(missing_ok=True)
    fd = open_file(dir_path / name, os.O_RDWR | os.O_CREAT)
    try:
        _chmod_own(fd, 0o600)
    finally:
        os.close(fd)
    for p in [dir_path, *dir_path.glob(f"{name}-*")]:
        try:
            fd = open_nofollow(p, os.O_RDONLY)
        except OSError:  # vanished, a link, or not ours
            continue
        try:
            _chmod_own(fd, 0o700 if p == dir_path else 0o600)
        finally:
            os.close(fd)


def _chmod_own(fd: int, mode: int) -> None:
    try:
        os.fchmod(fd, mode)
    except PermissionError:  # not ours (another user's old index): leave it to them
        pass
