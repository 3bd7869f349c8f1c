"""tiered_kv/cold/writer.py: bounded write-behind queue."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.fixtures import cold_tier, kv_cache
from tiered_kv.cold.writer import Writer


def test_queue_full_drops_oldest_and_counts():
    drops: list[int] = []
    gate = threading.Event()
    done: list[str] = []
    w = Writer(max_bytes=100, on_drop=lambda n, why: drops.append(n))
    w.submit(gate.wait, 0, droppable=False)  # hold the thread
    for name in ("a", "b", "c"):
        assert w.submit(lambda n=name: done.append(n), 40)  # type: ignore[misc]
    assert drops == [40]  # "a" dropped to admit "c"
    gate.set()
    assert w.wait_idle(5)
    assert done == ["b", "c"] and drops == [40]
    w.close(5)


def test_task_larger_than_the_bound_is_never_dropped_for_its_size():
    drops: list[int] = []
    gate = threading.Event()
    done: list[str] = []
    w = Writer(max_bytes=100, on_drop=lambda n, why: drops.append(n))
    w.submit(gate.wait, 0, droppable=False)
    assert w.submit(lambda: done.append("huge"), 1000)  # waits alone: admitted
    assert drops == []
    assert w.submit(lambda: done.append("next"), 10)  # queue pressure: the older one goes
    assert drops == [1000]
    assert w.submit(lambda: done.append("huge2"), 1000)  # drops "next", waits alone
    gate.set()
    assert w.wait_idle(5)
    assert done == ["huge2"] and drops == [1000, 10]
    w.close(5)


def test_hold_all_drops_nothing_and_idle_signal():
    drops: list[int] = []
    gate = threading.Event()
    done: list[int] = []
    w = Writer(max_bytes=10, on_drop=lambda n, why: drops.append(n))
    w.submit(gate.wait, 0, droppable=False)
    w.hold_all()  # shutdown
    for i in range(5):
        assert w.submit(lambda i=i: done.append(i), 100)  # type: ignore[misc]
    assert not w.idle and not w.wait_idle(0.05)
    gate.set()
    assert w.wait_idle(5) and w.idle
    assert done == [0, 1, 2, 3, 4] and drops == []
    w.close(5)


def test_close_after_a_timed_out_drain_reports_what_is_left():
    gate = threading.Event()
    w = Writer(max_bytes=10**9, on_drop=lambda n, why: None)
    w.submit(gate.wait, 0, droppable=False)
    w.submit(lambda: None, 123)
    assert w.unwritten() == [123]
    assert not w.close(0.05)
    gate.set()


def test_run_sync_returns_and_raises():
    w = Writer(10, on_drop=lambda n, why: None)
    assert w.run_sync(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        w.run_sync(lambda: 1 / 0)
    w.close(5)


def test_queue_full_drops_oldest_spill(tmp_path):
    tier = cold_tier(tmp_path, spill_queue_bytes=2 * (2 * 2 * 8 * 8 * 2) + 10)  # two entries
    import threading

    gate = threading.Event()
    tier.writer.submit(gate.wait, 0, droppable=False)
    for i in range(4):
        tier.spill(np.arange(8) + 100 * i, [kv_cache(8)])
    gate.set()
    tier.flush()
    st = tier.stats()
    assert st["drops"] == 2 and st["entries"] == 2
    assert tier.lookup(list(range(8))) is None and tier.lookup(list(range(300, 308))) is not None
    tier.close()
