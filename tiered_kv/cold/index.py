"""The cold index: plain sqlite (no pickles), the source of truth for what the disk tier holds.

``<cache_dir>/<fingerprint>/index/cache.db`` (WAL, ``synchronous=FULL``)::

    meta(key TEXT PRIMARY KEY, value TEXT)        JSON values: "meta" → {"schema", "seed",
                                                  "block_tokens"}; a mismatch clears the index
    entries(id TEXT PRIMARY KEY, file, n_tokens, nbytes, created, last_used, tokens BLOB,
            prompt_tokens, prompt_key,            tokens: the ids as int32 LE (exact comparison);
            trimmable, checkpoints)               prompt_tokens: how many were the prompt (NULL:
                                                  all, or not known); prompt_key: the chained key
                                                  of the prompt's last full block (signed, NULL:
                                                  none or not known), indexed; trimmable (0 / 1)
                                                  and checkpoints (JSON list of positions): what a
                                                  lookup needs to say what the entry serves
                                                  (NULL: not recorded, an older writer's row)
    blocks(hash INTEGER, entry TEXT, depth INTEGER, last INTEGER)
                                                  one row per full block of an entry: its chained
                                                  key (as signed 64-bit), 1-based depth, 1 on the
                                                  entry's last block; indexed by hash (lookup),
                                                  entry (removal) and hash of last blocks

Nothing is kept in memory: every read is a query, so several processes sharing the directory see
each other's commits at once. Each thread gets its own connection (all closed by :meth:`close`);
writes are ``BEGIN IMMEDIATE`` transactions. Whoever calls a method owns the wait: the tier calls
the request-path queries through its deadline-bound reader thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
import urllib.parse
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered_kv.cold import fsafe

SCHEMA = 2
DB = "cache.db"
_MAX_CANDIDATES = 4
_PARAMS = 500  # host parameters per IN (...) query
_DDL = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries(
    id TEXT PRIMARY KEY, file TEXT NOT NULL, n_tokens INTEGER NOT NULL, nbytes INTEGER NOT NULL,
    created REAL NOT NULL, last_used REAL NOT NULL, tokens BLOB NOT NULL,
    prompt_tokens INTEGER, prompt_key INTEGER);
CREATE TABLE IF NOT EXISTS blocks(hash INTEGER NOT NULL, entry TEXT NOT NULL,
    depth INTEGER NOT NULL, last INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS blocks_hash ON blocks(hash);
CREATE INDEX IF NOT EXISTS blocks_last ON blocks(hash) WHERE last=1;
CREATE INDEX IF NOT EXISTS blocks_entry ON blocks(entry);
"""
_COLS = "id, file, n_tokens, nbytes, created, last_used"
#: added after schema 2's first release: an index made before gets them (NULL) when opened for
#: writing; both versions read and write the same file (older ones leave them NULL)
_ADDED = (("prompt_tokens", "INTEGER"), ("prompt_key", "INTEGER"), ("trimmable", "INTEGER"),
          ("checkpoints", "TEXT"))
_PROMPT_INDEX = "CREATE INDEX IF NOT EXISTS entries_prompt ON entries(prompt_key) WHERE prompt_key IS NOT NULL"


class IndexUnreadable(RuntimeError):
    """The sqlite index is missing its schema, damaged or not an index at all."""


class UnsafeCacheDir(OSError):
    """A cache dir or index file that another user could write to (or a symlink)."""


@dataclass(frozen=True)
class Record:
    entry_id: str
    file: str
    n_tokens: int
    nbytes: int
    created: float
    last_used: float
    #: the entry's chained block keys — carried by records being *added* only; records read
    #: back from the index leave it empty (the keys live in the ``blocks`` table)
    blocks: tuple[int, ...] = ()
    #: how many of its ids were the prompt (None: all, or not known)
    prompt_tokens: int | None = None
    #: the key of the prompt's last full block (:func:`keys.prompt_key`) — carried by records
    #: being added only, like ``blocks``
    prompt_key: int | None = None
    #: what the entry serves (``declared.Serving``: its layers can be cut back, its checkpoint
    #: positions) — carried by records being added only; read back by :meth:`Index.stored`
    trimmable: bool | None = None
    checkpoints: tuple[int, ...] = ()


@dataclass(frozen=True)
class Stored:
    """What a lookup reads of one entry: its ids and what it can serve."""

    tokens: np.ndarray
    #: None: not recorded (a row written by a version before the column; the file's header says)
    trimmable: bool | None
    checkpoints: tuple[int, ...]


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


def _regular_or_absent(db: Path) -> None:
    try:
        mode = os.lstat(db).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):  # links: refused below, or removed
        raise IndexUnreadable(f"{db}: not a regular file")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


class Index:
    def __init__(self, path: Path, readonly: bool = False, create: bool = True) -> None:
        """Open (``create``: or create) the index in directory ``path``. ``readonly`` opens an
        existing database without writing (a read-only disk). Raises IndexUnreadable on a
        damaged or foreign one, UnsafeCacheDir on one that others can write."""
        self.path = Path(path)
        self.db = self.path / DB
        self.readonly = readonly
        self._ro_mode = "mode=ro"  # "immutable=1" on a read-only file system (see _open)
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        for p in (self.path, self.db, self.path / f"{DB}-wal", self.path / f"{DB}-shm"):
            check_private(p)  # before anything is created, chmod-ed or opened there
        _regular_or_absent(self.db)  # sqlite would wait for ever on a FIFO planted there
        if create and not readonly:
            _private(self.path)
        elif self.path.is_symlink() or self.db.is_symlink():
            raise IndexUnreadable(f"{self.db}: a symlink (never followed)")
        if not self.db.exists():
            raise IndexUnreadable(f"{self.db}: missing")
        try:
            self._open()
        except sqlite3.Error as e:
            self.close()
            if not (readonly and isinstance(e, sqlite3.OperationalError)
                    and _read_only_fs(self.path)):  # fmt: skip
                raise IndexUnreadable(f"{self.db}: {e!r}") from None
            # a WAL database on a read-only file system: sqlite cannot make its -shm there, so
            # "mode=ro" fails to open it; nothing can change it there: it is immutable
            self._ro_mode = "immutable=1"
            try:
                self._open()
            except sqlite3.Error as e2:
                self.close()
                raise IndexUnreadable(f"{self.db}: {e2!r}") from None

    def _open(self) -> None:
        conn = self._conn()
        if not self.readonly:
            conn.executescript(_DDL)
            self._add_columns(conn)
        have = self._columns(conn)  # a read-only index made before some lacks them
        self._prompts = "prompt_tokens" in have
        self._read = _COLS + (", prompt_tokens" if self._prompts else ", NULL")
        self._serving = ("trimmable, checkpoints" if {"trimmable", "checkpoints"} <= have
                         else "NULL, NULL")  # fmt: skip
        self._meta = self._read_meta()

    # -- connections -------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.readonly:
                uri = f"file:{urllib.parse.quote(str(self.db))}?{self._ro_mode}"  # path: # ? %
                conn = sqlite3.connect(uri, uri=True, check_same_thread=False,
                                       isolation_level=None, timeout=5)  # fmt: skip
            else:
                conn = sqlite3.connect(str(self.db), check_same_thread=False,
                                       isolation_level=None, timeout=10)  # fmt: skip
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")  # a committed record survives power loss
            conn.execute("PRAGMA trusted_schema=OFF")
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    @staticmethod
    def _columns(conn: sqlite3.Connection) -> set[str]:
        return {str(r[1]) for r in conn.execute("PRAGMA table_info(entries)")}

    def _add_columns(self, conn: sqlite3.Connection) -> None:
        """Give an index made before :data:`_ADDED` those columns (one transaction: two
        processes opening it at once add them once)."""
        with self._tx() as c:
            have = {r[1] for r in c.execute("PRAGMA table_info(entries)")}
            for name, kind in _ADDED:
                if name not in have:
                    c.execute(f"ALTER TABLE entries ADD COLUMN {name} {kind}")
            c.execute(_PROMPT_INDEX)

    def _read_meta(self) -> dict | None:
        try:
            row = self._conn().execute("SELECT value FROM meta WHERE key='meta'").fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                raise IndexUnreadable(f"{self.db}: not a tiered-kv index ({e})") from None
            raise
        if row is None:
            return None
        try:
            meta = json.loads(row[0])
        except ValueError:
            return None
        return meta if isinstance(meta, dict) else None

    @property
    def meta(self) -> dict | None:
        return self._meta

    # -- reads (any thread) ------------------------------------------------------------------
    def records(self) -> list[Record]:
        rows = self._conn().execute(f"SELECT {self._read} FROM entries").fetchall()
        return [_record(r) for r in rows]

    def summary(self) -> tuple[int, int]:
        """(entries, bytes) — one query."""
        n, b = self._conn().execute("SELECT count(*), coalesce(sum(nbytes), 0) FROM entries").fetchone()
        return int(n), int(b)

    def get(self, entry_id: str) -> Record | None:
        row = self._conn().execute(f"SELECT {self._read} FROM entries WHERE id=?", (entry_id,)).fetchone()
        return None if row is None else _record(row)

    def tokens(self, entry_id: str) -> np.ndarray | None:
        row = self._conn().execute("SELECT tokens FROM entries WHERE id=?", (entry_id,)).fetchone()
        return None if row is None else np.frombuffer(row[0], dtype="<i4")

    def stored(self, entry_id: str) -> Stored | None:
        """The entry's ids and what it serves (one query), None when it is not indexed. Raises
        Damaged on a value no writer of ours makes."""
        q = f"SELECT tokens, {self._serving} FROM entries WHERE id=?"
        row = self._conn().execute(q, (entry_id,)).fetchone()
        if row is None:
            return None
        raw, trimmable, points = row
        if not isinstance(raw, bytes) or trimmable not in (None, 0, 1):
            raise Damaged(f"index row of entry {entry_id[:40]!r} is malformed")
        ckpts = _positions(points, entry_id) if trimmable is not None else ()
        return Stored(np.frombuffer(raw, dtype="<i4"), None if trimmable is None else bool(trimmable), ckpts)

    def _newest_holder(self, key: int, exclude: Sequence[str] = ()) -> str | None:
        marks = ",".join("?" * len(exclude))
        skip = f" AND entry NOT IN ({marks})" if exclude else ""
        q = f"SELECT entry FROM blocks WHERE hash=?{skip} ORDER BY rowid DESC LIMIT 1"
        row = self._conn().execute(q, (_signed(key), *exclude)).fetchone()
        return None if row is None else str(row[0])

    def _present(self, key: int) -> bool:
        q = "SELECT 1 FROM blocks WHERE hash=? LIMIT 1"
        return self._conn().execute(q, (_signed(key),)).fetchone() is not None

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
            part = [_signed(k) for k in keys[i : i + _PARAMS]]
            marks = ",".join("?" * len(part))
            q = f"SELECT entry, depth, hash FROM blocks WHERE last=1 AND hash IN ({marks})"
            for eid, depth, h in conn.execute(q, part).fetchall():
                if depth <= len(keys) and _signed(keys[depth - 1]) == h:
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
            same = row is not None and _loads(row[0]) == meta
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

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except sqlite3.Error:
                pass
        self._local = threading.local()

    # -- helpers -----------------------------------------------------------------------------
    def _tx(self) -> _Tx:
        return _Tx(self._conn())

    @staticmethod
    def _insert(c: sqlite3.Connection, rec: Record, tokens: bytes) -> None:
        pkey = None if rec.prompt_key is None else _signed(rec.prompt_key)
        trim = None if rec.trimmable is None else int(rec.trimmable)
        points = None if rec.trimmable is None else json.dumps(list(rec.checkpoints))
        c.execute(f"INSERT INTO entries({_COLS}, tokens, prompt_tokens, prompt_key, trimmable, "
                  "checkpoints) VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                  (rec.entry_id, rec.file, rec.n_tokens, rec.nbytes, rec.created, rec.last_used,
                   tokens, rec.prompt_tokens, pkey, trim, points))  # fmt: skip
        n = len(rec.blocks)
        c.executemany("INSERT INTO blocks VALUES(?,?,?,?)",
                      [(_signed(h), rec.entry_id, d, int(d == n))
                       for d, h in enumerate(rec.blocks, 1)])  # fmt: skip

    def _delete(self, c: sqlite3.Connection, ids: list[str]) -> list[Record]:
        gone: list[Record] = []
        for eid in ids:
            row = c.execute(f"SELECT {self._read} FROM entries WHERE id=?", (eid,)).fetchone()
            if row is None:
                continue
            gone.append(_record(row))
            c.execute("DELETE FROM entries WHERE id=?", (eid,))
            c.execute("DELETE FROM blocks WHERE entry=?", (eid,))
        return gone


class _Tx:
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


class Damaged(sqlite3.DatabaseError):
    """A row no writer of ours makes (sqlite's columns take any type): the index is damaged."""


def damaged(e: BaseException) -> bool:
    """Whether ``e`` says the index is damaged (no database, or rows of the wrong kind), as
    opposed to a busy, full or read-only one: rebuilt from the files."""
    return type(e) is sqlite3.DatabaseError or isinstance(e, Damaged)


def _record(row: Sequence) -> Record:
    """A record read back: the six :data:`_COLS`, then prompt_tokens. Raises Damaged."""
    eid, file, n_tokens, nbytes, created, last_used, prompt_tokens = row
    if not (isinstance(eid, str) and isinstance(file, str) and type(n_tokens) is int
            and type(nbytes) is int and isinstance(created, (int, float))
            and isinstance(last_used, (int, float))
            and (prompt_tokens is None or type(prompt_tokens) is int)):  # fmt: skip
        raise Damaged(f"index row of entry {str(eid)[:40]!r} is malformed")
    return Record(eid, file, n_tokens, nbytes, created, last_used, prompt_tokens=prompt_tokens)


def _positions(text: object, entry_id: str) -> tuple[int, ...]:
    """The checkpoints column: a JSON list of positions (0 too: a file may hold one there, the
    header check accepts it and it serves nothing). Raises Damaged."""
    points = _loads(text) if isinstance(text, str) else None
    if not (isinstance(points, list) and all(type(p) is int and p >= 0 for p in points)):
        raise Damaged(f"index row of entry {entry_id[:40]!r} has malformed checkpoints")
    return tuple(points)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _private(path: Path) -> None:
    """The index dir 0700 and ``cache.db`` created 0600 before sqlite opens it (sqlite gives its
    -wal / -shm files the database's mode): the index holds prompt token ids. No symlink there
    is followed (:func:`fsafe.private_db` removes planted links)."""
    fsafe.private_db(path, DB)
