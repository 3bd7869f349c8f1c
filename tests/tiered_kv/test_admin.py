"""tiered_kv/admin.py: CacheAdmin reports and repairs a cache dir as data (the CLI only prints it)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tiered_kv.admin import CacheAdmin, NotAFingerprint
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config


def test_summaries_listings_verify_and_clear_are_values(tmp_path):
    cfg = Config(cache_dir=tmp_path, block_tokens=4)
    tier = ColdTier(tmp_path, "fpA", cfg)
    c = C.KVCache()
    c.update_and_fetch(mx.ones((1, 2, 8, 4)), mx.ones((1, 2, 8, 4)))
    tier.persist(np.arange(8), [c])
    tier.close()
    admin = CacheAdmin(cfg)
    admin.check_private()
    [d] = admin.summaries()
    assert (d.name, d.files, d.indexed) == ("fpA", 1, 1) and d.nbytes > 0
    [listing] = admin.listings()
    assert listing.records is not None and [r.n_tokens for r in listing.records] == [8]
    [checked] = admin.verify()
    assert checked.checked and checked.report.clean and len(checked.report.ok) == 1
    assert admin.quarantine() is None and admin.shared is None
    with pytest.raises(NotAFingerprint):
        admin.clear("../etc")
    assert admin.clear() == [tmp_path / "fpA"] and not (tmp_path / "fpA").exists()
