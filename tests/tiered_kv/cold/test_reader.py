"""tiered_kv/cold/reader.py + the tier's use of it: a stalled disk never stalls a request."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tiered_kv.cold.index import Index
from tiered_kv.cold.reader import Late, Reader
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config


def test_late_call_is_a_miss_and_later_calls_do_not_queue_behind_it():
    r = Reader()
    gate = threading.Event()
    with pytest.raises(Late):
        r.call(gate.wait, 0.05)
    with pytest.raises(Late, match="still blocked"):
        r.call(lambda: 1, 5.0)  # refused at once, not after another deadline
    gate.set()
    for _ in range(100):  # the stuck call finishes; the reader serves again
        try:
            assert r.call(lambda: 7, 5.0) == 7
            break
        except Late:
            threading.Event().wait(0.01)
    with pytest.raises(ZeroDivisionError):
        r.call(lambda: 1 / 0, 5.0)
    r.close()


def kv(n: int) -> C.KVCache:
    c = C.KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return c


def test_frozen_index_makes_lookups_misses_not_waits(tmp_path: Path, monkeypatch):
    tier = ColdTier(tmp_path, "fp", Config(cache_dir=tmp_path, block_tokens=16, cold_deadline=0.1))
    tier.persist(np.arange(32), [kv(32)])
    frozen = threading.Event()
    real = Index.candidates

    def stalled(self, keys, exclude=()):
        frozen.wait()  # like a sqlite read on a frozen disk
        return real(self, keys, exclude)

    monkeypatch.setattr(Index, "candidates", stalled)
    done = []
    t = threading.Thread(target=lambda: done.append([tier.lookup(np.arange(32)) for _ in range(5)]))
    t.start()
    t.join(30)  # a bound far above the deadline: the request path did not block on the disk
    assert not t.is_alive() and done == [[None] * 5]
    assert tier.stats()["lookup_timeouts"] == 5
    frozen.set()
    monkeypatch.undo()
    for _ in range(200):
        hit = tier.lookup(np.arange(32))
        if hit is not None:
            break
        threading.Event().wait(0.01)
    assert hit is not None and tier.load(hit) is not None
    tier.close()


def test_a_stalled_writer_does_not_block_lookups_or_loads(tmp_path: Path):
    tier = ColdTier(tmp_path, "fp", Config(cache_dir=tmp_path, block_tokens=16))
    tier.persist(np.arange(32), [kv(32)])
    gate = threading.Event()
    tier.writer.submit(gate.wait, 0, droppable=False)  # e.g. an fsync on a frozen disk
    tier.spill(np.arange(48) + 100, [kv(48)])
    hit = tier.lookup(np.arange(32))
    assert hit is not None and tier.load(hit) is not None  # touch queued, never waited for
    gate.set()
    tier.close()


def test_close_returns_once_the_running_call_ends_not_at_its_wait():
    """``close(wait)`` waits for a running call (the shutdown lets go of the index rather than
    close it under a query still running); the reader never told it the call had ended, so the
    close slept its whole ``wait`` (2 s of every shutdown that found a lookup running)."""
    release = threading.Event()
    r = Reader()
    with pytest.raises(Late):
        r.call(lambda: release.wait(30), 0.01)
    got: list[bool] = []
    closer = threading.Thread(target=lambda: got.append(r.close(600)), daemon=True)
    closer.start()
    release.set()
    closer.join(60)
    assert not closer.is_alive() and got == [True]
