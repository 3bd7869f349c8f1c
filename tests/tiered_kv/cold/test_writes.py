"""tiered_kv/cold/writes.py: the write path counts a full disk and recovers."""

from __future__ import annotations

import errno

import numpy as np

from tests.fixtures import cold_tier, kv_cache
from tiered_kv.cold import store


def test_enospc_during_spill_is_counted_not_raised(tmp_path, monkeypatch):
    tier = cold_tier(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "replace", full)
    tier.spill(np.arange(8), [kv_cache(8)])
    tier.persist(np.arange(9), [kv_cache(9)])
    tier.flush()
    st = tier.stats()
    assert st["write_errors"] == 2 and st["entries"] == 0
    assert not list(tier.dir.glob("*.safetensors")) and not list(tier.dir.glob(".*.tmp"))
    monkeypatch.undo()
    tier.persist(np.arange(8), [kv_cache(8)])
    assert tier.stats()["entries"] == 1
    tier.close()
