"""tiered_kv/cold/schema.py: an index made before the added columns reads as not known, and gains
them (once) when opened for writing."""

from __future__ import annotations

import sqlite3

from tests.fixtures import INDEX_BEFORE_ADDED_COLUMNS as _FIRST
from tiered_kv.cold import schema


def test_an_index_before_the_added_columns_reads_them_as_null_then_gains_them_once():
    conn = sqlite3.connect(":memory:")
    conn.executescript(_FIRST)
    have = schema.columns(conn)
    assert not {name for name, _ in schema.ADDED} & have
    q = f"SELECT {schema.record_columns(have)}, {schema.serving_columns(have)} FROM entries"
    assert conn.execute(q).fetchone()[-3:] == (None, None, None)
    for _ in range(2):  # a second open adds nothing twice
        conn.executescript(schema.DDL)
        schema.add_columns(conn)
    have = schema.columns(conn)
    assert {name for name, _ in schema.ADDED} <= have
    assert schema.record_columns(have).endswith("prompt_tokens")
    assert schema.serving_columns(have) == "trimmable, checkpoints"
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "entries_prompt" in names
    assert conn.execute("SELECT prompt_key, trimmable FROM entries").fetchall() == [(None, None)]
