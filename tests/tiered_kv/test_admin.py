"""tiered_kv/admin.py: CacheAdmin reports and repairs a cache dir as data (the CLI only prints it)."""

from __future__ import annotations

import sqlite3

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import flip_byte
from tiered_kv.admin import CacheAdmin, NotAFingerprint
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

FP = "0123456789abcdef0123456789abcdef"


def _one_entry(root) -> Config:
    """A cache dir holding one 8-token entry of fingerprint FP; its config."""
    cfg = Config(cache_dir=root, block_tokens=4)
    tier = ColdTier(root, FP, cfg)
    c = C.KVCache()
    c.update_and_fetch(mx.ones((1, 2, 8, 4)), mx.ones((1, 2, 8, 4)))
    tier.persist(np.arange(8), [c])
    tier.close()
    return cfg


def test_summaries_listings_verify_and_clear_are_values(tmp_path):
    cfg = _one_entry(tmp_path)
    admin = CacheAdmin(cfg)
    admin.check_private()
    [d] = admin.summaries()
    assert (d.name, d.files, d.indexed) == (FP, 1, 1) and d.nbytes > 0
    [listing] = admin.listings()
    assert listing.records is not None and [r.n_tokens for r in listing.records] == [8]
    [checked] = admin.verify()
    assert checked.checked and checked.report.clean and len(checked.report.ok) == 1
    assert admin.quarantine() is None and admin.shared is None
    with pytest.raises(NotAFingerprint):
        admin.clear("../etc")
    assert admin.clear() == [tmp_path / FP] and not (tmp_path / FP).exists()


def test_a_folder_beside_the_fingerprints_is_not_the_caches(tmp_path):
    """``verify --fix`` took a model's folder in the cache dir for a fingerprint, found its weights
    "corrupt" and moved them to quarantine (which the budget later deletes); stats counted it."""
    cfg = _one_entry(tmp_path)
    weights = tmp_path / "my-model" / "model.safetensors"
    weights.parent.mkdir(mode=0o700)
    weights.write_bytes(b"w" * 100_000)
    admin = CacheAdmin(cfg)
    assert [c.name for c in admin.verify(fix=True)] == [FP]
    assert weights.read_bytes() == b"w" * 100_000 and admin.quarantine() is None
    assert [d.name for d in admin.summaries()] == [FP]
    assert admin.total_bytes() < 100_000
    assert admin.clear() == [tmp_path / FP] and weights.exists()


def test_verify_fix_without_a_readable_index_moves_nothing(tmp_path):
    cfg = _one_entry(tmp_path)
    (tmp_path / FP / "index" / "cache.db").write_bytes(b"not sqlite" * 100)
    [entry] = (tmp_path / FP).glob("*.safetensors")
    flip_byte(entry, -1)  # bad, maybe: without the index nothing is known well enough to move it
    [checked] = CacheAdmin(cfg).verify(fix=True)
    assert not checked.checked and checked.report.corrupt == [entry.name] and entry.exists()


def test_verify_of_an_index_with_a_damaged_row_reports_it_unchecked(tmp_path):
    """A row whose token ids are no whole int32s made ``cache verify`` die with numpy's
    ValueError (a traceback); the index is damaged: nothing is moved, the CLI says unchecked."""
    cfg = _one_entry(tmp_path)
    with sqlite3.connect(tmp_path / FP / "index" / "cache.db") as con:
        con.execute("UPDATE entries SET tokens=x'0000000001'")
    con.close()
    [entry] = (tmp_path / FP).glob("*.safetensors")
    for fix in (False, True):
        [checked] = CacheAdmin(cfg).verify(fix=fix)
        assert not checked.checked and entry.exists()
