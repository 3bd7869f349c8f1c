"""The cold index's sqlite file: refused when others can write it, made private, one connection
per thread, ``BEGIN IMMEDIATE`` transactions.

A cache dir or index that another user owns or can write to is refused (:func:`check_private`):
whoever can write there could plant entries or an index. The index dir is made 0700 and
``cache.db`` 0600 before sqlite opens it, no symlink there is followed. Writers connect with WAL
and ``synchronous=FULL``; readers by a ``mode=ro`` URI, or ``immutable=1`` on a read-only file
system; the WAL is kept small (:data:`WAL_PAGES`, :data:`WAL_BYTES`: it counts against the disk
budget). :class:`Connections` is safe from any thread: each gets its own connection; an index replaced
while others may still read it is released (:meth:`Connections.release`), never closed under them.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
import urllib.parse
from pathlib import Path

from tiered_kv.cold import fsafe
from tiered_kv.cold.schema import DB

#: a writer's WAL is checkpointed once it holds this many pages, and cut back to
#: :data:`WAL_BYTES` when it restarts: the WAL stays near 256 KiB, not sqlite's 4 MB
WAL_PAGES = 64
WAL_BYTES = 256 << 10


class IndexUnreadable(RuntimeError):
    """The sqlite index is missing its schema, damaged or not an index at all."""


class UnsafeCacheDir(OSError):
    """A cache dir or index file that another user could write to (or a symlink)."""


def check_private(path: Path, follow: bool = False) -> None:
    """Refuse ``path`` (one clear line) when it is owned by another user or writable by group /
    others: whoever can write there could plant entries or an index. ``follow``: check a
    symlink's target (the cache root may be a link); other links are left to :mod:`fsafe`."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        return  # a link inside the cache dir is never followed: fsafe removes or refuses it
    if st.st_uid != os.geteuid():
        raise UnsafeCacheDir(f"{path} is owned by uid {st.st_uid}, not this user; refusing it")
    if st.st_mode & 0o022:
        raise UnsafeCacheDir(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"refusing it (chmod go-w {path})"
        )


def regular_or_absent(db: Path) -> None:
    """Refuse a ``db`` that is there but no regular file: sqlite would wait for ever on a FIFO
    planted there. Links pass: the caller refuses or removes them."""
    try:
        mode = os.lstat(db).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):  # links: refused below, or removed
        raise IndexUnreadable(f"{db}: not a regular file")


def read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def private(path: Path) -> None:
    """The index dir 0700 and ``cache.db`` created 0600 before sqlite opens it (sqlite gives its
    -wal / -shm files the database's mode): the index holds prompt token ids. No symlink there
    is followed (:func:`fsafe.private_db` removes planted links)."""
    fsafe.private_db(path, DB)


class Connections:
    """One connection to ``db`` per thread that asks (:meth:`get`), all closed by :meth:`close`."""

    def __init__(self, db: Path, readonly: bool) -> None:
        self.db = db
        self.readonly = readonly
        self.ro_mode = "mode=ro"  # "immutable=1" on a read-only file system (see Index.__init__)
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def get(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.readonly:
                uri = f"file:{urllib.parse.quote(str(self.db))}?{self.ro_mode}"  # path: # ? %
                conn = sqlite3.connect(uri, uri=True, check_same_thread=False,
                                       isolation_level=None, timeout=5)  # fmt: skip
            else:
                conn = sqlite3.connect(str(self.db), check_same_thread=False,
                                       isolation_level=None, timeout=10)  # fmt: skip
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")  # a committed record survives power loss
                # the WAL counts against the disk budget: left alone it grew to ~4 MB (sqlite's
                # 1000-page checkpoint) and never shrank, so a budget of a few MB held nothing
                conn.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")
                conn.execute(f"PRAGMA journal_size_limit={WAL_BYTES}")
            conn.execute("PRAGMA trusted_schema=OFF")
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def release(self) -> None:
        """Let go of every thread's connection, closing only this thread's: another thread's may
        be in the middle of a query (closed under its step, sqlite crashed the process), and
        is closed once that query lets go of it (its last reference). A later :meth:`get`
        connects anew."""
        mine = getattr(self._local, "conn", None)
        with self._lock:
            self._conns = []
        self._local = threading.local()
        if mine is not None:
            try:
                mine.close()
            except sqlite3.Error:
                pass

    def close(self) -> None:
        """Close every thread's connection: only once no other thread reads (shutdown)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except sqlite3.Error:
                pass
        self._local = threading.local()


class Tx:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on error)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if kind is None:
            self.conn.execute("COMMIT")
        else:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
