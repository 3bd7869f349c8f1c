"""The shared tier's faults, backoff and counters: one owner for what a Redis call that fails costs.

Every call the tier makes runs through :meth:`Health.call`: a connection error or timeout (a
fetch past its deadline too) marks Redis down for an exponential backoff (1 s doubling to 30 s)
during which calls are skipped at once (counted ``skipped_down``); the outage is logged once and
its end once. Any other Redis error (e.g. OOM under ``maxmemory noeviction``) is counted and
logged once per kind of call, and the call is a miss. :meth:`refused` does the same for a
pipeline's replies Redis refused. Messages go to the logger the owner hands in (the tier's).

Time is the ``clock`` the owner hands in (``time.monotonic``; tests pass one they move).
Threads: any; the counters, the backoff and the set of messages already logged are under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from tiered_kv.shared import reads

T = TypeVar("T")

_BACKOFF_MIN, _BACKOFF_MAX = 1.0, 30.0
_NET = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class Health:
    def __init__(self, url: str, counts: dict[str, Any], log: logging.Logger,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        """``url``: as logged (its password redacted); ``counts``: the counters :meth:`count`,
        :meth:`add` and :meth:`stats` know, with their starting values (``errors``, ``timeouts``,
        ``skipped_down`` and ``outages`` among them); ``log``: where the messages go;
        ``clock``: monotonic seconds, what the backoff is measured in."""
        self.url = url
        self.log = log
        self.clock = clock
        self.lock = threading.Lock()
        self.counts = counts
        self._failures = 0
        self.down_until = 0.0
        self._logged: set[str] = set()

    def call(self, what: str, fn: Callable[[], T], default: T) -> T:
        """``fn()`` unless Redis is in backoff; a network failure starts / extends the backoff."""
        if self.clock() < self.down_until:
            self.count("skipped_down")
            return default
        try:
            out = fn()
        except _NET as e:
            self._down(what, e)
            return default
        except redis.exceptions.RedisError as e:  # e.g. OOM under maxmemory noeviction
            self.count("errors")
            self.once(f"error:{what}", "shared tier %s failed: %s", what, e)
            return default
        if self._failures:
            with self.lock:
                self._failures = 0
                self._logged.discard("down")
            self.log.warning("shared tier %s is reachable again", self.url)
        return out

    def _down(self, what: str, e: BaseException) -> None:
        with self.lock:
            self.counts["errors"] += 1
            if isinstance(e, (redis.exceptions.TimeoutError, TimeoutError)):
                self.counts["timeouts"] += 1
            if self._failures == 0:
                self.counts["outages"] += 1
            self._failures += 1
            wait = min(_BACKOFF_MAX, _BACKOFF_MIN * 2 ** (self._failures - 1))
            self.down_until = self.clock() + wait
        self.once("down", "shared tier %s unreachable (%s: %s); local tiers only, retrying "
                  "with backoff", self.url, what, e)  # fmt: skip

    @property
    def up(self) -> bool:
        return self._failures == 0

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def add(self, **amounts: float) -> None:
        """Several counters at once (one lock: :meth:`stats` never shows half of them)."""
        with self.lock:
            for key, n in amounts.items():
                self.counts[key] += n

    def refused(self, what: str, replies: Sequence[Any]) -> None:
        """Count and log (once) a pipeline's replies Redis refused for another reason than a key
        of another type (:func:`reads.refusal`): e.g. a server or proxy that runs no scripts,
        where every lookup would otherwise be a silent miss."""
        r = reads.refusal(replies)
        if r is not None:
            self.count("errors")
            self.once(f"refused:{what}", "shared tier %s: Redis refused a read: %s", what, r)

    def once(self, kind: str, msg: str, *args: object) -> None:
        with self.lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        self.log.warning(msg, *args)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.counts)


def quietly(fn: Callable[[], Any]) -> None:
    """``fn()``, any Redis or socket error ignored (a clean-up that may find Redis gone)."""
    try:
        fn()
    except (redis.exceptions.RedisError, OSError):
        pass
