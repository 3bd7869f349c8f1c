"""tiered_kv/background.py: calls on daemon threads that a stuck call never keeps from exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from tiered_kv import background


def test_a_call_hands_back_its_value_or_its_error():
    assert background.Call(lambda: 7, "t").result() == 7
    failing = background.Call(lambda: 1 // 0, "t")
    with pytest.raises(ZeroDivisionError):
        failing.result()
    assert failing.done()


def test_each_keeps_the_order_of_its_items():
    assert background.each(lambda x: x * x, list(range(20)), 4, "t") == [x * x for x in range(20)]
    assert background.each(lambda x: x, [], 4, "t") == []


def test_each_raises_only_once_every_call_has_ended_and_starts_none_after_an_error():
    ended: list[int] = []
    started: list[int] = []

    def fn(x: int) -> int:
        started.append(x)
        if x == 0:
            raise ValueError("bad")
        time.sleep(0.2)  # still running when the error is raised
        ended.append(x)
        return x

    with pytest.raises(ValueError):
        background.each(fn, list(range(10)), 2, "t")
    assert sorted(ended) == sorted(x for x in started if x != 0)  # nothing left running
    assert len(started) <= 3  # the other thread's item, and at most one it took before


@pytest.mark.parametrize("way", ["call", "each"])
def test_a_call_stuck_forever_never_keeps_the_process_from_exiting(way):
    """``concurrent.futures`` joins its threads at interpreter exit: a load stuck on a frozen disk
    kept a SIGTERM-ed server alive until its read returned (81 s in a reviewer's run)."""
    stuck = "threading.Event().wait()"
    run = {"call": f"background.Call(lambda: {stuck}, 'stuck')",
           "each": f"threading.Thread(target=background.each, args=(lambda _: {stuck}, [1, 2], 2, 'stuck'), daemon=True).start()"}[way]  # fmt: skip
    code = textwrap.dedent(f"""
        import threading, time
        from tiered_kv import background
        {run}
        time.sleep(0.2)
    """)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    assert time.monotonic() - t0 < 20
