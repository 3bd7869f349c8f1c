"""The shared tier's backoff, counters and messages logged once (``tiered_kv/shared/health.py``),
through a SharedTier against a real redis-server that dies, restarts, stalls or refuses. The
backoff runs on a clock the test moves (``StepClock``): attempts are counted, never timed. Toy
entries: ``tests/fixtures.py``."""

from __future__ import annotations

import signal

from tests.fixtures import StepClock
from tests.fixtures import toy_entry as entry
from tests.fixtures import toy_ids as ids
from tests.fixtures import toy_tier as tier


def test_dead_redis_costs_one_attempt_then_backoff(redis_server):
    t = tier(redis_server.url, clock=StepClock())  # a clock that stands still: still in backoff
    toks = ids(11, 64)
    t.publish(entry(toks), toks)
    redis_server.kill()
    assert t.lookup(toks) is None
    assert t.lookup(toks) is None  # in backoff: not even a connect
    s = t.stats()
    assert s["errors"] == 1 and s["skipped_down"] == 1 and s["outages"] == 1 and s["up"] == 0
    assert not t.publish(entry(toks), toks)
    assert t.stats()["errors"] == 1 and t.stats()["skipped_down"] == 2


def test_the_backoff_doubles_from_one_second_to_thirty(redis_server):
    """After each failed attempt Redis is not asked again until the backoff has passed: 1 s,
    doubling, at most 30 s; the whole outage is one."""
    clock = StepClock()
    t = tier(redis_server.url, clock=clock)
    toks = ids(14, 64)
    redis_server.kill()
    assert t.lookup(toks) is None and t.stats()["errors"] == 1
    for attempt, wait in enumerate([1, 2, 4, 8, 16, 30, 30], start=2):
        clock.advance(wait - 0.25)
        assert t.lookup(toks) is None and t.stats()["errors"] == attempt - 1  # skipped
        clock.advance(0.25)
        assert t.lookup(toks) is None and t.stats()["errors"] == attempt  # asked again
    assert t.stats()["outages"] == 1


def test_restarted_empty_redis_is_used_again_after_backoff(redis_server, caplog):
    clock = StepClock()
    t = tier(redis_server.url, clock=clock)
    toks = ids(12, 64)
    t.publish(entry(toks), toks)
    redis_server.kill()
    assert t.lookup(toks) is None and t.stats()["up"] == 0  # down: the backoff starts
    redis_server.start()  # the same port, an empty dataset
    assert not t.publish(entry(toks), toks) and t.stats()["skipped_down"] == 1  # backoff
    clock.advance(1.0)  # the backoff has passed
    with caplog.at_level("WARNING", logger="tiered_kv.shared.redis_tier"):
        assert t.lookup(toks) is None  # empty dataset: a miss, no error
    assert t.stats()["errors"] == 1 and t.stats()["up"] == 1
    assert sum("reachable again" in r.getMessage() for r in caplog.records) == 1
    assert t.publish(entry(toks), toks)
    assert t.lookup(toks) is not None and t.stats()["up"] == 1


def test_stalled_redis_times_out(redis_server):
    t = tier(redis_server.url, timeout=0.3)
    toks = ids(13, 64)
    t.publish(entry(toks), toks)
    redis_server.stop_signal(signal.SIGSTOP)  # alive but answering nothing
    try:
        assert t.lookup(toks) is None
        assert t.stats()["timeouts"] == 1
    finally:
        redis_server.stop_signal(signal.SIGCONT)


def test_a_redis_that_refuses_scripts_is_counted_and_logged_not_a_silent_miss(redis_server, caplog):
    """A server (or proxy) that runs no scripts refuses every lookup's bounded read: each lookup
    is a miss, but the refusal is counted and logged once, not taken for an evicted entry."""
    t = tier(redis_server.url)
    toks = ids(60, 64)
    assert t.publish(entry(toks), toks)
    redis_server.client().acl_setuser("default", enabled=True, nopass=True, keys=["*"],
                                      channels=["*"], commands=["+@all", "-@scripting"])  # fmt: skip
    with caplog.at_level("WARNING", logger="tiered_kv.shared.redis_tier"):
        assert t.lookup(toks) is None
        assert t.lookup(toks) is None
    assert t.stats()["errors"] >= 1
    assert sum("refused" in r.getMessage() for r in caplog.records) == 1
