"""tiered_kv/bounded.py: one worker thread, a FIFO bounded in bytes, never blocking the submitter."""

from __future__ import annotations

import threading

import pytest

from tiered_kv.bounded import BoundedWorker


def _held(drops: list) -> tuple[BoundedWorker, threading.Event]:
    """A worker of 100 bytes whose thread is held by a non-droppable task until the gate opens."""
    gate, started = threading.Event(), threading.Event()
    w = BoundedWorker(100, lambda n, why: drops.append((n, why)))
    w.submit(lambda: started.set() or gate.wait(30), 0, droppable=False)  # type: ignore[func-returns-value]
    assert started.wait(30)  # running: out of the queue
    return w, gate


def test_the_oldest_waiting_task_is_dropped_to_admit_a_new_one():
    drops: list = []
    done: list[str] = []
    w, gate = _held(drops)
    for name in ("a", "b", "c"):
        assert w.submit(lambda n=name: done.append(n), 40)  # type: ignore[misc]
    assert drops == [(40, "queue full")] and w.pending_bytes == 80
    gate.set()
    assert w.wait_idle(10) and w.idle
    assert done == ["b", "c"] and w.pending_bytes == 0
    w.close(5)


def test_a_task_larger_than_the_bound_waits_alone_and_non_droppable_tasks_stay():
    drops: list = []
    done: list[str] = []
    w, gate = _held(drops)
    assert w.submit(lambda: done.append("kept"), 500, droppable=False)
    assert w.submit(lambda: done.append("huge"), 1000)  # no droppable task waits: admitted
    assert drops == []
    assert w.submit(lambda: done.append("small"), 10)  # over the bound: the huge one goes
    assert drops == [(1000, "queue full")]
    gate.set()
    assert w.wait_idle(10)
    assert done == ["kept", "small"]
    w.close(5)


def test_hold_all_drops_nothing():
    drops: list = []
    done: list[int] = []
    w, gate = _held(drops)
    w.hold_all()
    for i in range(4):
        assert w.submit(lambda i=i: done.append(i), 100)  # type: ignore[misc]
    assert not w.wait_idle(0.05)
    gate.set()
    assert w.wait_idle(10) and done == [0, 1, 2, 3] and drops == []
    w.close(5)


def test_discard_takes_back_what_waits_and_it_never_runs():
    drops: list = []
    done: list[str] = []
    w, gate = _held(drops)
    w.submit(lambda: done.append("x"), 7)
    w.submit(lambda: done.append("y"), 8)
    assert w.waiting() == [7, 8]
    assert w.discard() == [7, 8] and w.pending_bytes == 0 and w.waiting() == []
    gate.set()
    assert w.wait_idle(10) and done == [] and drops == []
    w.close(5)


def test_a_failing_task_does_not_stop_the_thread_and_run_sync_hands_back_its_result():
    w = BoundedWorker(100, lambda n, why: None)
    done: list[str] = []
    w.submit(lambda: 1 / 0, 1)  # logged
    w.submit(lambda: done.append("after"), 1)
    assert w.run_sync(lambda: 42, 10) == 42 and done == ["after"]
    with pytest.raises(ZeroDivisionError):
        w.run_sync(lambda: 1 / 0, 10)
    assert w.close(5)


def test_close_after_a_timed_out_drain_discards_and_refuses_later_tasks():
    drops: list = []
    w, gate = _held(drops)
    w.submit(lambda: None, 30)
    assert not w.close(0.05)  # the held task is still running
    assert w.waiting() == [] and w.pending_bytes == 0
    assert not w.submit(lambda: None, 5)
    assert drops == [(5, "closed")]
    with pytest.raises(RuntimeError):
        w.run_sync(lambda: None)
    gate.set()


def test_a_task_that_may_not_be_dropped_is_no_drop_when_refused_closed():
    """A closed worker refuses every task, but only a droppable one (a spill) is a drop: the cold
    tier's maintenance tasks (a touch, a size check, an index rebuild; non-droppable, 0 bytes)
    refused after close were counted and logged as dropped spills."""
    drops: list = []
    w = BoundedWorker(100, lambda n, why: drops.append((n, why)))
    assert w.close(5)
    assert not w.submit(lambda: None, 0, droppable=False)
    assert drops == []
    assert not w.submit(lambda: None, 7)
    assert drops == [(7, "closed")]
