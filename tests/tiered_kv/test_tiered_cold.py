"""TieredCache with a real cold tier on disk: spill on eviction, reload on a hot miss, restart."""

from __future__ import annotations

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine.prefill import prefill
from tests.tiered_kv.conftest import cold_logits, tokens
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache

FP = "test-fingerprint"


def open_tc(model, root, **kw) -> TieredCache:
    cfg = Config(cache_dir=root, block_tokens=16, **kw)
    return TieredCache(cfg, lambda: make_prompt_cache(model), ColdTier(root, FP, cfg))


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
