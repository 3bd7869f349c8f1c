"""engine/leasing.py: requests on one new prompt wait for the first one's prefill and start from its
published prompt; a disk hit is read beside the running streams.

Real tiny mlx-lm llama, real TieredCache and cold tier (helpers: tests/engine/batching.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine.batch import BatchLoop
from engine.events import Chunk, Hit, SamplingParams
from engine.inflight import SHORT_PREFILL
from engine.leasing import shared
from tests.engine.batching import ModelEngine, Sink, alone, hit_of, run_until
from tests.fixtures import make_llama, tokens
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache


def test_shared_counts_leading_tokens():
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert shared(a, np.array([1, 2, 9], dtype=np.int32)) == 2
    assert shared(a, a[:3]) == 3 and shared(a, np.array([], dtype=np.int32)) == 0


def test_requests_sharing_a_new_prompt_wait_for_the_first_ones_prefill():
    """Two requests on one uncached system prompt, sent together: the second waits for the first's
    prefill and starts from its published prompt instead of prefilling the shared part again."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",), min_continuation_tokens=16))
    system = tokens(80, 100)
    loop, a, b = BatchLoop(engine), Sink(), Sink()
    loop.add(a, system + tokens(81, 5), SamplingParams(max_tokens=3))
    loop.add(b, system + tokens(82, 4), SamplingParams(max_tokens=3))
    run_until(loop, lambda: a.done and b.done)
    first, second = sorted([hit_of(a).tokens, hit_of(b).tokens])
    assert first == 0 and second >= len(system)


def test_a_disk_hit_is_read_beside_the_running_streams(tmp_path, monkeypatch):
    """A request whose prefix comes from the cold tier does not stop another stream: the file is
    read into its arrays by the load's thread (here a disk made slow) while the running request
    keeps decoding, and gives what the load of a request alone gives."""
    from tiered_kv.cold import ranged
    from tiered_kv.cold.tier import ColdTier

    model = make_llama(seed=4)
    cfg = Config(cache_dir=tmp_path, block_tokens=16, restore="load")

    def restarted() -> ModelEngine:
        e = ModelEngine(model, cfg)
        e.cache = TieredCache(
            e.config, lambda: make_prompt_cache(model), ColdTier(tmp_path, "fp", cfg)
        )
        return e

    on_disk = tokens(90, 64)
    first = restarted()
    alone(first, on_disk + [5], 1)
    first.cache.close()  # spilled: the entry is on disk only
    asked = on_disk + tokens(91, 5)
    ref = alone(restarted(), asked, 6)
    assert hit_of(ref).tier == "cold"

    def slow(fn: Callable) -> Callable:
        def wrapped(*a: Any) -> Any:
            time.sleep(0.2)
            return fn(*a)

        return wrapped

    monkeypatch.setattr(ranged, "_preadv_all", slow(ranged._preadv_all))  # every read of a load
    engine = restarted()
    loop, running, restored = BatchLoop(engine), Sink(), Sink()
    loop.add(running, tokens(92, 8), SamplingParams(max_tokens=100_000))
    run_until(loop, lambda: len(running.ids) >= 2)
    loop.add(restored, asked, SamplingParams(max_tokens=6))
    before = len(running.ids)
    run_until(loop, lambda: any(isinstance(e, Hit) for e in restored.events), limit=10**6)
    assert len(running.ids) - before >= 5  # it kept decoding while the entry was read
    run_until(loop, lambda: restored.done, limit=10**6)
    got, want = hit_of(restored), hit_of(ref)
    assert (got.tokens, got.tier) == (want.tokens, "cold") and restored.ids == ref.ids
    loop.close()


def test_without_shared_forwards_a_request_is_looked_up_when_it_prefills_next():
    """Prompts that do not share forwards gain nothing from being leased together: the request
    with the least prompt left is looked up, prefilled and gets its first token before another
    request's lookup (which may be a disk read or a `both` restore) runs."""
    from tests.engine.batching import PROMPTS, warmed

    engine = warmed(make_llama(seed=4), {})
    engine.share_prefill = False
    order: list[str] = []
    fetch = engine.cache.fetch_steps

    def recorded(ids: list[int], background: bool = True) -> Any:
        order.append(f"fetch {len(ids)}")
        return fetch(ids, background)

    engine.cache.fetch_steps = recorded  # type: ignore[method-assign,assignment]

    class Ordered(Sink):
        def emit(self, event: Any) -> None:
            if isinstance(event, Chunk) and not self.chunks:
                order.append("first token")
            super().emit(event)

    loop, fresh, cached = BatchLoop(engine), Ordered(), Ordered()
    fresh_ids = tokens(90, SHORT_PREFILL + 40)  # nothing cached, not short: all to prefill
    loop.add(fresh, fresh_ids, SamplingParams(max_tokens=2))
    loop.add(cached, PROMPTS[0], SamplingParams(max_tokens=2))  # shared prompt cached: 9 left
    run_until(loop, lambda: fresh.done and cached.done)
    assert order[:3] == [f"fetch {len(PROMPTS[0])}", "first token", f"fetch {len(fresh_ids)}"]


def test_a_waiting_request_whose_client_left_gives_its_place_back_at_once():
    """With prompts not sharing forwards, a request behind a long prefill waits unleased; its
    client went away, yet it held its batch place until the prefill ahead of it ended (20 s on
    the CPU for a 6.5k-token prompt: a third request waited that long for a place)."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",)))
    engine.share_prefill = False
    loop, long, gone = BatchLoop(engine, max_batch=2), Sink(), Sink()
    loop.add(long, tokens(60, 200), SamplingParams(max_tokens=2))
    loop.add(gone, tokens(61, 300), SamplingParams(max_tokens=2))
    loop.step()
    assert gone in [s.sink for s in loop.leasing.waiting]  # behind the long prefill
    gone.cancel = True
    loop.step()
    assert gone.done and not gone.chunks and loop.active == 1 and not long.done
