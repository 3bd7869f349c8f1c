"""The cold index: plain sqlite (no pickles), the source of truth for what the disk tier holds.

:class:`Index` answers the lookup's queries (records, an entry's ids, the block-candidate search)
and commits the writer's changes; the file's layout and migration are :mod:`schema`'s, the rows'
encoding and checks :mod:`rows`', the file's safety and connections :mod:`dbfile`'s.

Nothing is kept in memory: every read is a query, so several processes sharing the directory see
each other's commits at once. Each thread gets its own connection (all closed by :meth:`close`);
writes are ``BEGIN IMMEDIATE`` transactions. Whoever calls a method owns the wait: the tier calls
the request-path queries through its deadline-bound reader thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from tiered_kv.cold import rows, schema
from tiered_kv.cold.dbfile import (
    Connections,
    IndexUnreadable,
    Tx,
    check_private,
    private,
    read_only_fs,
    regular_or_absent,
)
from tiered_kv.cold.rows import Record, Stored

_MAX_CANDIDATES = 4
_PARAMS = 500  # host parameters per IN (...) query


class Index:
    def __init__(self, path: Path, readonly: bool = False, create: bool = True) -> None:
        """Open (``create``: or create) the index in directory ``path``. ``readonly`` opens an
        existing database without writing (a read-only disk). Raises IndexUnreadable on a
        damaged or foreign one, UnsafeCacheDir on one that others can write."""
        self.path = Path(path)
        self.db = self.path / schema.DB
        self.readonly = readonly
        self._conns = Connections(self.db, readonly)
        for p in (self.path, self.db, self.path / f"{schema.DB}-wal", self.path / f"{schema.DB}-shm"):
            check_private(p)  # before anything is created, chmod-ed or opened there
        regular_or_absent(self.db)  # sqlite would wait for ever on a FIFO planted there
        if create and not readonly:
            private(self.path)
        elif self.path.is_symlink() or self.db.is_symlink():
            raise IndexUnreadable(f"{self.db}: a symlink (never followed)")
        if not self.db.exists():
            raise IndexUnreadable(f"{self.db}: missing")
        try:
            self._open()
        except sqlite3.Error as e:
            self.close()
            if not (readonly and isinstance(e, sqlite3.OperationalError)
                    and read_only_fs(self.path)):  # fmt: skip
                raise IndexUnreadable(f"{self.db}: {e!r}") from None
            # a WAL database on a read-only file system: sqlite cannot make its -shm there, so
            # "mode=ro" fails to open it; nothing can change it there: it is immutable
            self._conns.ro_mode = "immutable=1"
            try:
                self._open()
            except sqlite3.Error as e2:
                self.close()
                raise IndexUnreadable(f"{self.db}: {e2!r}") from None

    def _open(self) -> None:
        conn = self._conn()
        if not self.readonly:
            conn.executescript(schema.DDL)
            with self._tx() as c:  # one transaction: two processes opening at once add them once
                schema.add_columns(c)
                schema.recount(c)
        have = schema.columns(conn)  # a read-only index made before some lacks them
        self._totals = bool(conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='totals'").fetchone())  # fmt: skip
        self._prompts = "prompt_tokens" in have
        self._read = schema.record_columns(have)
        self._serving = schema.serving_columns(have)
        self._meta = self._read_meta()

    def _conn(self) -> sqlite3.Connection:
        """This thread's connection (made on its first call)."""
        return self._conns.get()

    def _read_meta(self) -> dict | None:
        try:
            row = self._conn().execute("SELECT value FROM meta WHERE key='meta'").fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                raise IndexUnreadable(f"{self.db}: not a tiered-kv index ({e})") from None
            raise
        meta = None if row is None else rows.loads(row[0])
        return meta if isinstance(meta, dict) else None

    @property
    def meta(self) -> dict | None:
        return self._meta

    # -- reads (any thread) ------------------------------------------------------------------
    def records(self) -> list[Record]:
        found = self._conn().execute(f"SELECT {self._read} FROM entries").fetchall()
        return [rows.record(r) for r in found]

    def summary(self) -> tuple[int, int]:
        """(entries, bytes): one row read (the ``totals`` the triggers keep; the budget asks
        before every write), or one sum over the entries where an index made before it is read
        only. Raises Damaged when a row's ``nbytes`` is no count of bytes."""
        conn = self._conn()
        row = conn.execute(schema.TOTALS).fetchone() if self._totals else None
        n, b, bad = row if row is not None else conn.execute(schema.COUNT).fetchone()
        if bad:
            raise rows.Damaged(f"{bad} index rows have malformed sizes")
        return int(n), int(b)

    def files(self) -> set[str]:
        """Every record's file name (one query)."""
        return {f for (f,) in self._conn().execute("SELECT file FROM entries")}

    def present(self, entry_ids: Collection[str]) -> set[str]:
        """Those of ``entry_ids`` the index holds (primary-key lookups: no row decoded)."""
        ids, out = list(entry_ids), set[str]()
        for lo in range(0, len(ids), 500):  # under SQLite's bound on a statement's parameters
            part = ids[lo : lo + 500]
            sql = f"SELECT id FROM entries WHERE id IN ({','.join('?' * len(part))})"
            out.update(i for (i,) in self._conn().execute(sql, part))
        return out

    def oldest(self, nbytes: int) -> list[Record]:
        """Records least recently used first, as many as it takes for their bytes to reach
        ``nbytes``, and every one tied with the last (all, when they never reach it): the budget's
        LRU victims are among them, whatever else it weighs. Reads no further rows."""
        out: list[Record] = []
        total = 0
        cur = self._conn().execute(f"SELECT {self._read} FROM entries ORDER BY last_used, id")
        try:
            for row in cur:
                rec = rows.record(row)
                if total >= nbytes and (not out or rec.last_used != out[-1].last_used):
                    break
                out.append(rec)
                total += rec.nbytes
        finally:
            cur.close()  # the statement ends here: the evictions' transaction follows
        return out

    def get(self, entry_id: str) -> Record | None:
        row = self._conn().execute(f"SELECT {self._read} FROM entries WHERE id=?", (entry_id,)).fetchone()
        return None if row is None else rows.record(row)

    def tokens(self, entry_id: str) -> np.ndarray | None:
        row = self._conn().execute("SELECT tokens FROM entries WHERE id=?", (entry_id,)).fetchone()
        return None if row is None else rows.ids(row[0], entry_id)

    def files_by_id(self) -> dict[str, str]:
        """{entry id: file name} of every record, the record columns ahead of the ids checked as
        :func:`rows.record` checks them: the open's check. Those columns sit before the ids blob in
        each row, so no blob page is read (the columns after it would walk the blob's overflow
        pages: the open of 10k entries read all 92 MB of the index); the rest of a row — its ids,
        ``prompt_tokens``, what it serves — is checked where a lookup or a load reads it, and a
        damaged one found there has the index rebuilt as the open would. Raises Damaged."""
        out = {}
        for row in self._conn().execute(f"SELECT {schema.COLS} FROM entries"):
            rec = rows.record((*row, None))
            out[rec.entry_id] = rec.file
        return out

    def check(self) -> None:
        """Read every row, its ids too, as a lookup and a load would (``cache ls`` / ``verify``:
        not the open, which reads every blob no more: :meth:`files_by_id`); raises Damaged on a
        value no writer of ours makes (the index is then rebuilt from the files)."""
        q = f"SELECT {self._read}, tokens, {self._serving} FROM entries"
        for row in self._conn().execute(q):
            rec = rows.record(row[:7])
            rows.stored(row[7:], rec.entry_id)

    def unserved(self) -> dict[str, str]:
        """{entry id: file name} of the rows that do not say what they serve (an older version
        wrote them), through their partial index: no other row is read. Writable index only."""
        return {str(eid): str(file) for eid, file in self._conn().execute(schema.UNSERVED)}

    def set_serving(self, items: Iterable[tuple[str, bool, tuple[int, ...]]]) -> None:
        """Record what entries serve — (id, trimmable, checkpoints) — where their rows do not say
        (one transaction)."""
        values = [(*rows.serving(trim, points), eid) for eid, trim, points in items]
        with self._tx() as c:
            c.executemany(schema.SET_SERVING, values)

    def stored(self, entry_id: str) -> Stored | None:
        """The entry's ids and what it serves (one query), None when it is not indexed. Raises
        Damaged on a value no writer of ours makes."""
        q = f"SELECT tokens, {self._serving} FROM entries WHERE id=?"
        row = self._conn().execute(q, (entry_id,)).fetchone()
        return None if row is None else rows.stored(row, entry_id)

    def _newest_holder(self, key: int, exclude: Sequence[str] = ()) -> str | None:
        marks = ",".join("?" * len(exclude))
        skip = f" AND entry NOT IN ({marks})" if exclude else ""
        q = f"SELECT entry FROM blocks WHERE hash=?{skip} ORDER BY rowid DESC LIMIT 1"
        row = self._conn().execute(q, (rows.signed(key), *exclude)).fetchone()
        return None if row is None else str(row[0])

    def _present(self, key: int) -> bool:
        q = "SELECT 1 FROM blocks WHERE hash=? LIMIT 1"
        return self._conn().execute(q, (rows.signed(key),)).fetchone() is not None

    def candidates(
        self, keys: Sequence[int], exclude: Collection[str] = ()
    ) -> Iterator[tuple[str, int]]:
        """(entry id, matched full blocks), deepest first: the newest entry at the deepest
        present block, then shallower ones (a collision fallback, or an entry serving more than
        a deeper one), at most 4, distinct, none of ``exclude`` (entries the caller could not
        load: the newest holder of a block other than them).

        Keys are chained, so the present ones form a prefix of ``keys``: the deepest is found by
        binary search (log2(len(keys)) point queries), and so is each depth where the newest
        holder changes (:meth:`_next_holder`); a generator, so a caller that is satisfied by the
        first candidate stops the queries there."""
        lo, hi = 0, len(keys)  # keys[:lo] present, keys[hi:] absent
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._present(keys[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        skip = sorted(exclude)
        seen: set[str] = set()
        d = lo
        eid = self._newest_holder(keys[d - 1], skip) if d else None
        while d > 0:
            if eid is not None and eid not in seen:
                seen.add(eid)
                yield eid, d
                if len(seen) == _MAX_CANDIDATES:
                    return
            d, eid = self._next_holder(keys, d, eid, skip)

    def _next_holder(
        self, keys: Sequence[int], d: int, holder: str | None, skip: Sequence[str]
    ) -> tuple[int, str | None]:
        """(depth, newest holder) of the deepest block above ``d`` — ``holder``'s, the newest of
        ``keys[d - 1]`` — whose newest holder is another; (0, None) when none is. Whoever holds a
        block holds every shallower one (chained keys): going shallower, the newest holder only
        changes to a newer entry and never back, so a binary search finds where (a walk of one
        query per block took milliseconds past an entry that cannot be cut back)."""
        found: tuple[int, str | None] = (0, None)
        lo, hi = 1, d - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            eid = self._newest_holder(keys[mid - 1], skip)
            if eid != holder:
                lo, found = mid + 1, (mid, eid)
            else:
                hi = mid - 1
        return found

    def covered_by(self, keys: Sequence[int]) -> list[Record]:
        """Records a new entry with block keys ``keys`` may supersede: those whose full blocks
        are a prefix of ``keys`` (their last block is ``keys[depth - 1]`` at their own block
        count), and those whose prompt's full blocks are (their ``prompt_key`` is in ``keys``).
        The exact token check is the caller's."""
        found: set[str] = set()
        conn = self._conn()
        for i in range(0, len(keys), _PARAMS):
            part = [rows.signed(k) for k in keys[i : i + _PARAMS]]
            marks = ",".join("?" * len(part))
            q = f"SELECT entry, depth, hash FROM blocks WHERE last=1 AND hash IN ({marks})"
            for eid, depth, h in conn.execute(q, part).fetchall():
                if depth <= len(keys) and rows.signed(keys[depth - 1]) == h:
                    found.add(eid)
            if self._prompts:
                q = f"SELECT id FROM entries WHERE prompt_key IN ({marks})"
                found.update(eid for (eid,) in conn.execute(q, part).fetchall())
        out = [self.get(eid) for eid in sorted(found)]
        return [r for r in out if r is not None]

    # -- mutations ---------------------------------------------------------------------------
    def claim_meta(self, meta: dict) -> bool:
        """Make ``meta`` the index's meta; when it differs, clear the index in the same
        transaction (so two processes opening at once clear it once). True: it was cleared
        (the caller rebuilds from the files)."""
        with self._tx() as c:
            row = c.execute("SELECT value FROM meta WHERE key='meta'").fetchone()
            same = row is not None and rows.loads(row[0]) == meta
            if not same:
                c.execute("DELETE FROM blocks")
                c.execute("DELETE FROM entries")
                c.execute("INSERT OR REPLACE INTO meta VALUES('meta', ?)", (json.dumps(meta),))
        self._meta = meta
        return not same

    def add(self, rec: Record, tokens: bytes, remove: Iterable[str] = ()) -> list[Record]:
        """Insert ``rec`` (with ``rec.blocks``) and delete ``remove`` in one transaction;
        returns the removed records that existed. A record of ``rec``'s own id (another process
        opened the directory between the file's publish and this commit, and adopted the file) is
        replaced, never removed with its file."""
        with self._tx() as c:
            self._delete(c, [rec.entry_id])
            gone = self._delete(c, [e for e in remove if e != rec.entry_id])
            self._insert(c, rec, tokens)
        return gone

    def add_many(self, items: Iterable[tuple[Record, bytes]]) -> None:
        with self._tx() as c:
            for rec, tokens in sorted(items, key=lambda i: i[0].created):
                self._delete(c, [rec.entry_id])  # adopted twice (two processes): keep one
                self._insert(c, rec, tokens)

    def remove(self, entry_ids: Iterable[str]) -> list[Record]:
        """Delete records (one transaction); returns those that existed."""
        ids = list(entry_ids)
        if not ids:
            return []
        with self._tx() as c:
            return self._delete(c, ids)

    def resize(self, entry_id: str, nbytes: int, was: int) -> bool:
        """Set a record's ``nbytes`` to its file's (found to differ) where it still is ``was``
        (the totals follow). True: it was changed."""
        with self._tx() as c:
            q = "UPDATE entries SET nbytes=? WHERE id=? AND nbytes=?"
            return c.execute(q, (nbytes, entry_id, was)).rowcount > 0

    def touch(self, entry_id: str, when: float) -> None:
        """Raise last_used (never resurrects a record another process removed)."""
        with self._tx() as c:
            c.execute("UPDATE entries SET last_used=max(last_used, ?) WHERE id=?", (when, entry_id))

    def clear(self) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM blocks")
            c.execute("DELETE FROM entries")
            c.execute("DELETE FROM meta")
        self._meta = None

    def wal_bytes(self) -> int:
        """Bytes of the WAL file now (0 when there is none)."""
        try:
            return os.lstat(self.path / f"{schema.DB}-wal").st_size
        except OSError:
            return 0

    def checkpoint(self) -> None:
        """Copy the WAL into the database and cut it to nothing (the budget counts it), as far
        as readers allow: one still reading an older snapshot keeps what it reads (not an
        error). Waits for readers (another process's too) 0.1 s at most, not the connection's
        10 s: it runs before a write."""
        conn = self._conn()
        (wait,) = conn.execute("PRAGMA busy_timeout").fetchone()
        conn.execute("PRAGMA busy_timeout=100")
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            conn.execute(f"PRAGMA busy_timeout={int(wait)}")

    def close(self) -> None:
        """Close every thread's connection (a later call opens a new one). Only where no other
        thread may be querying it: :meth:`release` where one may."""
        self._conns.close()

    def release(self) -> None:
        """Let go of an index that is being replaced: this thread's connection is closed, the
        others' once their queries end (:meth:`Connections.release`)."""
        self._conns.release()

    # -- helpers -----------------------------------------------------------------------------
    def _tx(self) -> Tx:
        return Tx(self._conn())

    @staticmethod
    def _insert(c: sqlite3.Connection, rec: Record, tokens: bytes) -> None:
        c.execute(schema.INSERT_ENTRY, rows.entry_row(rec, tokens))
        c.executemany(schema.INSERT_BLOCK, rows.block_rows(rec))

    def _delete(self, c: sqlite3.Connection, ids: list[str]) -> list[Record]:
        gone: list[Record] = []
        for eid in ids:
            row = c.execute(f"SELECT {self._read} FROM entries WHERE id=?", (eid,)).fetchone()
            if row is None:
                continue
            gone.append(rows.record(row))
            c.execute("DELETE FROM entries WHERE id=?", (eid,))
            c.execute("DELETE FROM blocks WHERE entry=?", (eid,))
        return gone
