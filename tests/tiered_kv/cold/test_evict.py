"""tiered_kv/cold/evict.py: the disk budget evicts the least recently used entry."""

from __future__ import annotations

import numpy as np

from tests.fixtures import BLOCK, cold_tier, kv_cache


def test_budget_evicts_least_recently_used(tmp_path):
    from tiered_kv.cold import evict, usage

    tier = cold_tier(tmp_path / "kv", disk_free_floor=0)
    for i in range(3):
        tier.persist(np.arange(8) + 100 * i, [kv_cache(8, d=64)])
    assert tier.load(tier.lookup(list(range(8)))) is not None  # touch entry 0
    tier.flush()
    used = usage.scan(tier.root, tier.fingerprint, tier.index.records()).used
    # the tier's estimate: data, tokens, header slack and the entry's index rows
    incoming = 2 * (2 * 8 * 64 * 2) + 4 * 8 + evict.HEADER_SLACK + evict.index_bytes(8, BLOCK)
    tier.remover.disk_bytes = used + incoming - 1
    tier.persist(np.arange(8) + 300, [kv_cache(8, d=64)])
    assert tier.lookup(list(range(8))) is not None  # recently used: kept
    assert tier.lookup(list(range(100, 108))) is None  # least recently used: evicted
    assert tier.lookup(list(range(200, 208))) is not None
    assert tier.stats()["evictions"] == 1 and tier.stats()["entries"] == 3
    tier.close()
