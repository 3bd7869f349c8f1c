"""tiered_kv/cold/fsafe.py and its callers (issue 12.3): a symlink planted inside the cache dir is
never followed, and nothing outside the cache dir is deleted, moved, chmod'ed or written.

Each library case of the issue is here with the real parts: the tier's budget eviction (usage.py),
the index open (index.py); the usage scan's own case is in test_usage.py, ``cache verify --fix``
and ``cache clear`` in tests/engine/test_cli_cache.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.fixtures import intact, kv_cache, precious
from tiered_kv.cold import evict, fsafe, usage
from tiered_kv.cold.index import Index
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

FP = "0123456789abcdef0123456789abcdef"


# --- primitives -----------------------------------------------------------------------------------


def test_fingerprint_names_are_hex():
    assert fsafe.is_fingerprint(FP)
    for bad in ("../../x", "..", "", FP.upper(), FP + "0", FP[:-1] + "/", "quarantine"):
        assert not fsafe.is_fingerprint(bad)


def test_remove_refuses_paths_that_resolve_outside(tmp_path):
    root, out = tmp_path / "kv", tmp_path / "out"
    victim = precious(out)
    root.mkdir()
    (root / "link").symlink_to(out, target_is_directory=True)
    assert not fsafe.remove(root, root / "link" / victim.name)  # through a link: refused
    assert not fsafe.remove(root, root / ".." / "out" / victim.name)
    assert intact(victim)
    assert fsafe.remove(root, root / "link")  # the link itself is inside: removed, target kept
    assert not (root / "link").is_symlink() and intact(victim)


def test_walks_skip_symlinks(tmp_path):
    out = tmp_path / "out"
    precious(out)
    (tmp_path / "real").mkdir()
    (tmp_path / "a.safetensors").write_bytes(b"x")
    (tmp_path / "dirlink").symlink_to(out, target_is_directory=True)
    (tmp_path / "b.safetensors").symlink_to(out / "model.safetensors")
    assert fsafe.real_subdirs(tmp_path) == [tmp_path / "out", tmp_path / "real"]
    assert fsafe.regular_files(tmp_path, suffix=".safetensors") == [tmp_path / "a.safetensors"]


def test_make_dir_refuses_a_symlink(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "q").symlink_to(tmp_path / "out", target_is_directory=True)
    with pytest.raises(fsafe.UnsafePath):
        fsafe.make_dir(tmp_path / "q")


# --- the cases ----------------------------------------------------------------------------


def test_budget_eviction_does_not_empty_a_symlinked_quarantine(tmp_path):
    """An eviction under the budget measures and removes; a quarantine that is a planted symlink
    to elsewhere is neither emptied nor followed. The budget is the tier's from its start (set
    on a built tier, the remover never saw it and nothing was evicted: the test proved nothing)."""
    root, out = tmp_path / "kv", tmp_path / "elsewhere"
    victims = [precious(out, f"file{i}") for i in range(3)]
    cfg = Config(cache_dir=root, block_tokens=8, disk_free_floor=0)
    tier = ColdTier(root, FP, cfg)
    tier.persist(np.arange(16), [kv_cache(16)])
    tier.flush()
    tier.index.checkpoint()  # the WAL's bytes as a later write measures them
    first = {r.entry_id for r in tier.index.records()}
    used = usage.scan(tier.root, tier.fingerprint, tier.index.records()).used
    tier.close()
    data = 2 * (2 * 16 * 8 * 2)  # the entry's keys and values
    incoming = data + 4 * 16 + evict.HEADER_SLACK + evict.index_bytes(16, 8)  # the tier's estimate
    (root / usage.QUARANTINE).symlink_to(out, target_is_directory=True)
    tier = ColdTier(root, FP, dataclasses.replace(cfg, disk_bytes=used + incoming - 1))
    tier.persist(np.arange(16) + 100, [kv_cache(16)])  # must evict the first
    tier.flush()
    left = {r.entry_id for r in tier.index.records()}
    tier.close()
    assert len(first) == len(left) == 1 and not first & left  # the first entry was evicted
    assert all(intact(v) for v in victims)


@pytest.mark.parametrize("name", ["cache.db", "cache.db-wal", "cache.db-shm"])
def test_symlinked_index_db_is_not_followed(tmp_path, name):
    index_dir, out = tmp_path / "kv" / FP / "index", tmp_path / "elsewhere"
    victim = precious(out, "victim.db")
    index_dir.mkdir(parents=True)
    (index_dir / name).symlink_to(victim)  # an existing target: chmod'ed or overwritten before
    idx = Index(index_dir)
    idx.claim_meta({"schema": 1})
    idx.close()
    assert intact(victim)  # neither chmod'ed to 0600 nor written by sqlite
    assert (index_dir / "cache.db").is_file() and not (index_dir / "cache.db").is_symlink()


def test_symlinked_index_db_to_a_missing_file_creates_nothing(tmp_path):
    index_dir, out = tmp_path / "kv" / FP / "index", tmp_path / "elsewhere"
    out.mkdir()
    index_dir.mkdir(parents=True)
    (index_dir / "cache.db").symlink_to(out / "created.db")
    Index(index_dir).close()
    assert list(out.iterdir()) == []


def test_symlinked_index_dir_is_replaced_not_followed(tmp_path):
    out = tmp_path / "elsewhere"
    out.mkdir()
    (tmp_path / "index").symlink_to(out, target_is_directory=True)
    Index(tmp_path / "index").close()
    assert list(out.iterdir()) == [] and not (tmp_path / "index").is_symlink()
