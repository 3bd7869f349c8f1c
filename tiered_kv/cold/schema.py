"""The cold index's on-disk layout: its tables, its version, and the columns added since (migration).

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
                                                  (NULL: not recorded, an older writer's row:
                                                  filled from its file's header at the next open
                                                  for writing, found by the partial index
                                                  entries_unserved)
    totals(id = 0, entries, nbytes, bad)          one row: the entries' count and byte sum (and
                                                  how many rows' nbytes is malformed), kept by
                                                  triggers, recounted at each open for writing:
                                                  the budget reads it before every write
    blocks(hash INTEGER, entry TEXT, depth INTEGER, last INTEGER)
                                                  one row per full block of an entry: its chained
                                                  key (as signed 64-bit), 1-based depth, 1 on the
                                                  entry's last block; indexed by hash (lookup),
                                                  entry (removal) and hash of last blocks

SQL text and column lists only: no connection is opened here (:mod:`dbfile` does), no row is
decoded (:mod:`rows` does); :class:`index.Index` runs them.
"""

from __future__ import annotations

import sqlite3

SCHEMA = 2
DB = "cache.db"
DDL = """
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
CREATE TABLE IF NOT EXISTS totals(id INTEGER PRIMARY KEY CHECK (id = 0),
    entries INTEGER NOT NULL, nbytes INTEGER NOT NULL, bad INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS totals_insert AFTER INSERT ON entries BEGIN
    UPDATE totals SET entries = entries + 1,
        nbytes = nbytes + (CASE WHEN typeof(NEW.nbytes) = 'integer' AND NEW.nbytes >= 0
                           THEN NEW.nbytes ELSE 0 END),
        bad = bad + (typeof(NEW.nbytes) != 'integer' OR NEW.nbytes < 0) WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS totals_delete AFTER DELETE ON entries BEGIN
    UPDATE totals SET entries = entries - 1,
        nbytes = nbytes - (CASE WHEN typeof(OLD.nbytes) = 'integer' AND OLD.nbytes >= 0
                           THEN OLD.nbytes ELSE 0 END),
        bad = bad - (typeof(OLD.nbytes) != 'integer' OR OLD.nbytes < 0) WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS totals_update AFTER UPDATE OF nbytes ON entries BEGIN
    UPDATE totals SET
        nbytes = nbytes - (CASE WHEN typeof(OLD.nbytes) = 'integer' AND OLD.nbytes >= 0
                           THEN OLD.nbytes ELSE 0 END)
                        + (CASE WHEN typeof(NEW.nbytes) = 'integer' AND NEW.nbytes >= 0
                           THEN NEW.nbytes ELSE 0 END),
        bad = bad - (typeof(OLD.nbytes) != 'integer' OR OLD.nbytes < 0)
                  + (typeof(NEW.nbytes) != 'integer' OR NEW.nbytes < 0) WHERE id = 0; END;
"""
#: (entries, bytes, rows whose nbytes is no count of bytes) of ``entries``, counted row by row
COUNT = ("SELECT count(*), coalesce(sum(CASE WHEN typeof(nbytes) = 'integer' AND nbytes >= 0 "
         "THEN nbytes END), 0), coalesce(sum(typeof(nbytes) != 'integer' OR nbytes < 0), 0) "
         "FROM entries")  # fmt: skip
#: the same, as the ``totals`` row keeps it (None: an index made before it, opened read-only)
TOTALS = "SELECT entries, nbytes, bad FROM totals WHERE id = 0"
COLS = "id, file, n_tokens, nbytes, created, last_used"
#: added after schema 2's first release: an index made before gets them (NULL) when opened for
#: writing; both versions read and write the same file (older ones leave them NULL)
ADDED = (("prompt_tokens", "INTEGER"), ("prompt_key", "INTEGER"), ("trimmable", "INTEGER"),
         ("checkpoints", "TEXT"))  # fmt: skip
PROMPT_INDEX = "CREATE INDEX IF NOT EXISTS entries_prompt ON entries(prompt_key) WHERE prompt_key IS NOT NULL"
#: the rows that do not say what they serve (an older writer's): found without reading the others'
#: ``trimmable``, which sits after the ids blob (reading it walks the blob's overflow pages)
UNSERVED_INDEX = "CREATE INDEX IF NOT EXISTS entries_unserved ON entries(id) WHERE trimmable IS NULL"
#: those rows' ids and files (:data:`UNSERVED_INDEX` only: an error, not a scan, without it)
UNSERVED = "SELECT id, file FROM entries INDEXED BY entries_unserved WHERE trimmable IS NULL"
#: what one of them serves, unless another opener filled it first
SET_SERVING = "UPDATE entries SET trimmable=?, checkpoints=? WHERE id=? AND trimmable IS NULL"
#: one entry row, in the order of :func:`rows.entry_row`
INSERT_ENTRY = (f"INSERT INTO entries({COLS}, tokens, prompt_tokens, prompt_key, trimmable, "
                "checkpoints) VALUES(?,?,?,?,?,?,?,?,?,?,?)")  # fmt: skip
#: one block row, as :func:`rows.block_rows` makes them
INSERT_BLOCK = "INSERT INTO blocks VALUES(?,?,?,?)"


def columns(conn: sqlite3.Connection) -> set[str]:
    """The columns the ``entries`` table has (a read-only index made before :data:`ADDED` lacks
    some)."""
    return {str(r[1]) for r in conn.execute("PRAGMA table_info(entries)")}


def add_columns(c: sqlite3.Connection) -> None:
    """Give an index made before :data:`ADDED` those columns. ``c`` is inside the caller's
    transaction: two processes opening it at once add them once."""
    have = {r[1] for r in c.execute("PRAGMA table_info(entries)")}
    for name, kind in ADDED:
        if name not in have:
            c.execute(f"ALTER TABLE entries ADD COLUMN {name} {kind}")
    c.execute(PROMPT_INDEX)
    c.execute(UNSERVED_INDEX)  # built once (one pass over the rows), empty from then on


def recount(c: sqlite3.Connection) -> None:
    """Set the ``totals`` row from the entries themselves (at each open for writing: an index
    made before it, or one whose row an older build's commits or a crash left unset). ``c`` is
    inside the caller's transaction; the triggers keep it from there on."""
    c.execute(f"INSERT OR REPLACE INTO totals SELECT 0, * FROM ({COUNT})")


def record_columns(have: set[str]) -> str:
    """What a record is read from (:func:`rows.record`): :data:`COLS`, then prompt_tokens (NULL
    where the index was made before it)."""
    return COLS + (", prompt_tokens" if "prompt_tokens" in have else ", NULL")


def serving_columns(have: set[str]) -> str:
    """What an entry serves (:func:`rows.stored`): trimmable, checkpoints (NULL, NULL where the
    index was made before them)."""
    return "trimmable, checkpoints" if {"trimmable", "checkpoints"} <= have else "NULL, NULL"
