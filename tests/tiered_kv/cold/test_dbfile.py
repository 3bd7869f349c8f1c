"""tiered_kv/cold/dbfile.py: a path others can write is refused, a planted FIFO is no index, each
thread gets its own connection (all closed at once), a failed transaction leaves nothing."""

from __future__ import annotations

import os
import sqlite3
import threading

import pytest

from tiered_kv.cold import dbfile, schema
from tiered_kv.cold.dbfile import Connections, IndexUnreadable, Tx, UnsafeCacheDir


def test_a_path_others_can_write_is_refused(tmp_path):
    d = tmp_path / "index"
    dbfile.check_private(d)  # absent: nothing to refuse yet
    d.mkdir(mode=0o700)
    dbfile.check_private(d)
    os.chmod(d, 0o770)
    with pytest.raises(UnsafeCacheDir, match="writable by other users"):
        dbfile.check_private(d)
    os.symlink(d, tmp_path / "link")
    dbfile.check_private(tmp_path / "link")  # a link is left to fsafe (never followed)
    with pytest.raises(UnsafeCacheDir):
        dbfile.check_private(tmp_path / "link", follow=True)


def test_a_fifo_where_the_index_belongs_is_unreadable(tmp_path):
    db = tmp_path / schema.DB
    dbfile.regular_or_absent(db)
    os.mkfifo(db, 0o600)
    with pytest.raises(IndexUnreadable, match="not a regular file"):
        dbfile.regular_or_absent(db)


def test_each_thread_has_its_own_connection_and_close_closes_them_all(tmp_path):
    dbfile.private(tmp_path)
    conns = Connections(tmp_path / schema.DB, readonly=False)
    mine = conns.get()
    assert conns.get() is mine
    assert mine.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    other: list[sqlite3.Connection] = []
    t = threading.Thread(target=lambda: other.append(conns.get()))
    t.start()
    t.join()
    assert other[0] is not mine
    conns.close()
    for c in (mine, other[0]):
        with pytest.raises(sqlite3.ProgrammingError):
            c.execute("SELECT 1")
    assert conns.get() is not mine  # a later call opens a new one
    conns.close()


def test_a_read_only_connection_cannot_write(tmp_path):
    dbfile.private(tmp_path)
    writer = Connections(tmp_path / schema.DB, readonly=False)
    writer.get().executescript(schema.DDL)
    reader = Connections(tmp_path / schema.DB, readonly=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.get().execute("DELETE FROM meta")
    reader.close()
    writer.close()


def test_a_failed_transaction_leaves_nothing(tmp_path):
    dbfile.private(tmp_path)
    conns = Connections(tmp_path / schema.DB, readonly=False)
    conn = conns.get()
    conn.executescript(schema.DDL)
    with pytest.raises(KeyError):
        with Tx(conn) as c:
            c.execute("INSERT INTO meta VALUES('a', '1')")
            raise KeyError("the writer failed half-way")
    with Tx(conn) as c:
        c.execute("INSERT INTO meta VALUES('b', '2')")
    assert conn.execute("SELECT key FROM meta").fetchall() == [("b",)]
    conns.close()
