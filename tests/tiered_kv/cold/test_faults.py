"""tiered_kv/cold/faults.py: counters by kind, drops logged rate-limited with their bytes."""

from __future__ import annotations

import errno
import logging
import sqlite3

from tiered_kv.cold import faults as faults_mod
from tiered_kv.cold.faults import Faults, kind_of


def test_kinds():
    assert kind_of(OSError(errno.ENOSPC, "full")) == "disk_full"
    assert kind_of(OSError(errno.EDQUOT, "quota")) == "disk_full"
    assert kind_of(OSError(errno.EROFS, "ro")) == "read_only"
    assert kind_of(sqlite3.OperationalError("database or disk is full")) == "disk_full"
    assert kind_of(sqlite3.OperationalError("attempt to write a readonly database")) == "read_only"
    assert kind_of(sqlite3.DatabaseError("file is not a database")) == "index_errors"


def test_drops_are_counted_and_logged_rate_limited_with_bytes(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(faults_mod.time, "monotonic", lambda: now[0])
    f = Faults(interval=30.0)
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        f.drop(1000, "queue full")
        f.drop(2000, "queue full")
        f.drop(3000, "queue full")
        now[0] += 31
        f.drop(4000, "queue full")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "1 entry, 1000 bytes" in msgs[0] and "3 entries, 9000 bytes" in msgs[1]
    st = f.snapshot()
    assert st["drops"] == 4 and st["drop_bytes"] == 10_000
