"""tiered_kv/cold/rows.py: a record goes in as rows and comes back as the same values; a row no
writer of ours makes is Damaged, never a bare TypeError later."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from tiered_kv.cold import rows, schema
from tiered_kv.cold.rows import Damaged, Record


def _db() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.executescript(schema.DDL)
    schema.add_columns(conn)
    return conn


def test_a_record_goes_in_as_its_rows_and_reads_back():
    conn = _db()
    big = (1 << 64) - 5  # a key past 2**63: stored as a signed INTEGER
    rec = Record("e", "e.safetensors", 8, 64, 1.5, 2.5, (7, big), 6, big, True, (4, 8))
    ids = np.arange(8, dtype="<i4")
    conn.execute(schema.INSERT_ENTRY, rows.entry_row(rec, ids.tobytes()))
    conn.executemany(schema.INSERT_BLOCK, rows.block_rows(rec))
    assert conn.execute("SELECT hash, depth, last FROM blocks ORDER BY depth").fetchall() == [
        (7, 1, 0), (big - (1 << 64), 2, 1)]  # fmt: skip
    have = schema.columns(conn)
    back = rows.record(conn.execute(f"SELECT {schema.record_columns(have)} FROM entries").fetchone())
    assert back == Record("e", "e.safetensors", 8, 64, 1.5, 2.5, prompt_tokens=6)
    got = rows.stored(conn.execute(f"SELECT tokens, {schema.serving_columns(have)} FROM entries")
                      .fetchone(), "e")  # fmt: skip
    assert got.trimmable is True and got.checkpoints == (4, 8)
    assert np.array_equal(got.tokens, ids)


def test_what_an_entry_serves_is_not_known_without_trimmable():
    rec = Record("e", "e.safetensors", 8, 64, 1, 1, checkpoints=(4,))
    assert rows.entry_row(rec, b"")[-2:] == (None, None)  # checkpoints need trimmable recorded
    assert rows.stored((b"\0" * 8, None, "junk"), "e").checkpoints == ()


@pytest.mark.parametrize("row", [
    (1, "f", 8, 1, 1.0, 1.0, None), ("e", "f", "8", 1, 1.0, 1.0, None),
    ("e", "f", 8, 1, "now", 1.0, None), ("e", "f", 8, 1, 1.0, 1.0, 2.5),
    ("e", "f", 8, -1, 1.0, 1.0, None), ("e", "f", -8, 1, 1.0, 1.0, None),
])  # fmt: skip
def test_a_record_row_of_the_wrong_types_is_damaged(row):
    with pytest.raises(Damaged, match="malformed"):
        rows.record(row)


@pytest.mark.parametrize("row", [
    ("ids", 1, "[]"), (b"", 2, "[]"), (b"", 1, "[-1]"), (b"", 0, "[1.5]"), (b"", 1, "{}"),
    (b"", 1, "not json"), (b"", 1, None), (b"\0" * 5, 1, "[]"), (b"\0" * 6, None, None),
])  # fmt: skip
def test_a_stored_row_no_writer_makes_is_damaged(row):
    with pytest.raises(Damaged):
        rows.stored(row, "e")


def test_damaged_means_a_broken_index_not_a_busy_one():
    assert rows.damaged(sqlite3.DatabaseError("file is not a database"))
    assert rows.damaged(Damaged("malformed"))
    assert not rows.damaged(sqlite3.OperationalError("database is locked"))
    assert rows.positions("[0, 8]", "e") == (0, 8)  # 0 too: the header check accepts it


def test_json_nested_past_the_stack_is_not_json():
    """A checkpoints or meta value of JSON nested 100 000 deep raised RecursionError out of
    ``loads``: past every ``sqlite3.Error`` handler, out of a lookup, the tier's open (it failed
    to start) and every ``cache`` command. It is no JSON: the row is Damaged, the meta unknown."""
    deep = "[" * 100_000 + "]" * 100_000
    assert rows.loads(deep) is None
    with pytest.raises(Damaged):
        rows.stored((b"", 0, deep), "e")
