"""TieredCache with a real cold tier on disk: spill on eviction, reload on a hot miss, restart."""

from __future__ import annotations

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine.prefill import prefill
from tests.tiered_kv.conftest import cold_logits, tokens
from tiered_kv.config import Config
from tiered_kv.opening import open_cache
from tiered_kv.tiered import TieredCache

IDENTITY = {"model": "test-fingerprint"}


def open_tc(model, root, **kw) -> TieredCache:
    """Through the door: open_cache decides which tiers are on (``tiers=()``: none)."""
    kw.setdefault("cold_deadline", 30.0)  # a loaded machine must not turn a lookup into a miss
    cfg = Config(cache_dir=root, block_tokens=16, **kw)
    return open_cache(cfg, IDENTITY, lambda: make_prompt_cache(model))


def run(tc, model, ids):
    lease = tc.fetch(ids)
    fed = ids[: lease.hit.tokens]
    logits = np.array(prefill(model, lease, fed, 16))
    tc.store(lease, fed)
    return logits, lease.hit


def test_evicted_entry_reloads_from_disk(small_model, tmp_path):
    tc = open_tc(small_model, tmp_path)
    p = tokens(50, 70)
    run(tc, small_model, p)
    tc.hot.budget_bytes = 0
    tc.hot.enforce()  # evict everything → spilled write-behind
    tc.cold.flush()
    assert len(tc.hot) == 0 and tc.stats()["cold_spills"] == 1
    ids = p + tokens(51, 9)
    logits, hit = run(tc, small_model, ids)
    assert hit.tier == "cold" and hit.tokens == len(p) and hit.load_bytes > 0
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), rtol=1e-4, atol=1e-4)
    tc.close()


def test_restart_hits_disk_and_prefetch_fills_memory(small_model, tmp_path):
    a = open_tc(small_model, tmp_path)
    p = tokens(52, 60)
    run(a, small_model, p)
    a.close()  # graceful: spills what memory holds, flushes
    b = open_tc(small_model, tmp_path)
    ids = p + tokens(53, 5)
    logits, hit = run(b, small_model, ids)
    assert hit.tier == "cold" and hit.tokens == len(p)
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), rtol=1e-4, atol=1e-4)
    b.close()
    c = open_tc(small_model, tmp_path, prefetch_entries=2)
    assert c.prefetch() >= 1 and len(c.hot) >= 1
    _, hit = run(c, small_model, ids + [4])
    assert hit.tier == "hot" and hit.tokens == len(ids)
    c.close()


def test_cold_only_mode_persists_every_turn(small_model, tmp_path):
    tc = open_tc(small_model, tmp_path, tiers=("cold",))
    p = tokens(54, 40)
    run(tc, small_model, p)
    _, hit = run(tc, small_model, p + [9, 9])
    assert hit.tier == "cold" and hit.tokens == len(p)
    tc.close()


def test_disabled_cache_never_hits(small_model, tmp_path):
    tc = open_tc(small_model, tmp_path, tiers=())
    p = tokens(55, 30)
    run(tc, small_model, p)
    assert run(tc, small_model, p)[1].tokens == 0


def _engine(model_dir, root, **kw):
    from engine.generate import Engine

    kw.setdefault("cold_deadline", 30.0)  # (the deadline itself: tests/tiered_kv/cold/test_reader.py)
    # these tests ask whether entries reach the disk and serve: a disk hit is loaded (the planner,
    # free to recompute a short hit, has its own tests in tests/tiered_kv/restore/)
    kw.setdefault("restore", "load")
    return Engine(model_dir, Config(cache_dir=root, block_tokens=16, disk_free_floor=0, **kw))


def _answer(engine, ids: list[int]):
    from engine.generate import SamplingParams

    chunks = list(engine.generate(ids, SamplingParams(max_tokens=2)))
    return chunks[-1].usage


def test_spill_bigger_than_the_queue_bound_reaches_disk_and_serves_after_restart(
    tiny_bench_dir, tmp_path
):
    """Issue 11: an entry larger than TIERED_KV_SPILL_QUEUE_BYTES was dropped at once (no file)."""
    root = tmp_path / "kv"
    eng = _engine(tiny_bench_dir, root, spill_queue_bytes=1000, hot_bytes=1)
    ids = tokens(60, 80)
    _answer(eng, ids)
    _answer(eng, tokens(62, 40))  # evicts the first entry from memory: it spills
    eng.cache.cold.flush()
    st = eng.cache.stats()
    assert st["cold_spills"] == 1 and st["cold_drops"] == 0, st
    eng.close()
    eng = _engine(tiny_bench_dir, root, spill_queue_bytes=1000)
    usage = _answer(eng, ids + tokens(61, 3))
    assert usage.cache_tier == "cold" and usage.cached_tokens >= 64, usage
    eng.close()


def test_shutdown_writes_every_memory_only_entry_whatever_its_size(tiny_bench_dir, tmp_path):
    """Issue 11: close() dropped memory-only entries larger than the queue bound."""
    root = tmp_path / "kv"
    eng = _engine(tiny_bench_dir, root, spill_queue_bytes=1000)  # all stay in memory
    prompts = [tokens(70 + i, 48 + 16 * i) for i in range(3)]
    for p in prompts:
        _answer(eng, p)
    assert eng.cache.stats()["cold_spills"] == 0 and len(eng.cache.hot) == 3
    eng.close()
    assert len(list(root.glob("*/*.safetensors"))) == 3
    eng = _engine(tiny_bench_dir, root)
    st0 = eng.cache.stats()
    assert st0["cold_entries"] == 3 and st0["cold_drops"] == 0, st0
    for p in prompts:
        usage = _answer(eng, p + [5])
        assert usage.cache_tier == "cold" and usage.cached_tokens >= len(p) - 16, usage
    eng.close()
