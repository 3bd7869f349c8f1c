"""tiered_kv/cold/writer.py: bounded write-behind queue."""

from __future__ import annotations

import threading

import pytest

from tiered_kv.cold.writer import Writer


def test_queue_full_drops_oldest_and_counts():
    drops: list[int] = []
    gate = threading.Event()
    done: list[str] = []
    w = Writer(max_bytes=100, on_drop=drops.append)
    w.submit(gate.wait, 0, droppable=False)  # hold the thread
    for name in ("a", "b", "c"):
        assert w.submit(lambda n=name: done.append(n), 40)
    assert drops == [40]  # "a" dropped to admit "c"
    assert not w.submit(lambda: done.append("huge"), 101)
    gate.set()
    assert w.flush(5)
    assert done == ["b", "c"] and drops == [40, 101]
    w.close(5)


def test_run_sync_returns_and_raises():
    w = Writer(10, on_drop=lambda n: None)
    assert w.run_sync(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        w.run_sync(lambda: 1 / 0)
    w.close(5)
