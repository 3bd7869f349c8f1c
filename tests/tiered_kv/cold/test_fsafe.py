"""tiered_kv/cold/fsafe.py and its callers (issue 12.3): a symlink planted inside the cache dir is
never followed, and nothing outside the cache dir is deleted, moved, chmod'ed or written.

Each case of the issue is here with the real parts: the tier's budget eviction (usage.py),
``cache verify --fix`` and ``cache clear`` (engine/cli_cache.py), the index open (index.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from engine import cli_cache
from tiered_kv.cold import fsafe, usage
from tiered_kv.cold.index import Index
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

FP = "0123456789abcdef0123456789abcdef"


def kv(n: int, d: int = 8) -> C.KVCache:
    c = C.KVCache()
    x = mx.random.normal((1, 2, n, d)).astype(mx.bfloat16)
    c.update_and_fetch(x, x * 2)
    return c


def precious(outside: Path, name: str = "model.safetensors", size: int = 4096) -> Path:
    """A file outside the cache dir that nothing may touch (old mtime: first in any LRU)."""
    outside.mkdir(parents=True, exist_ok=True)
    p = outside / name
    p.write_bytes(b"w" * size)
    os.chmod(p, 0o644)
    os.utime(p, (1e9, 1e9))
    return p


def intact(p: Path, size: int = 4096) -> bool:
    return p.is_file() and p.read_bytes() == b"w" * size and stat.S_IMODE(p.stat().st_mode) == 0o644


def cli(capsys, root: Path, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli_cache.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv, "--dir", str(root)])
    args.config = Config(cache_dir=root)
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out + out.err


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
    root, out = tmp_path / "kv", tmp_path / "elsewhere"
    victims = [precious(out, f"file{i}") for i in range(3)]
    tier = ColdTier(root, FP, Config(cache_dir=root, block_tokens=8, disk_free_floor=0))
    tier.persist(np.arange(16), [kv(16)])
    (root / usage.QUARANTINE).symlink_to(out, target_is_directory=True)
    tier.flush()
    used = usage.scan(tier.root, tier.fingerprint, tier.index.records()).used
    incoming = 2 * (2 * 16 * 8 * 2) + 4 * 16 + (64 << 10)  # the tier's estimate
    tier.config = dataclasses.replace(tier.config, disk_bytes=used + incoming - 1)
    tier.persist(np.arange(16) + 100, [kv(16)])  # must evict something
    tier.flush()
    tier.close()
    assert all(intact(v) for v in victims)


def test_usage_never_deletes_through_a_symlinked_quarantine(tmp_path):
    root, out = tmp_path / "kv", tmp_path / "elsewhere"
    victim = precious(out)
    root.mkdir()
    (root / usage.QUARANTINE).symlink_to(out, target_is_directory=True)
    items = usage.scan(root, FP, []).items
    assert [i.key for i in items] == [("path", root / usage.QUARANTINE)]  # the link, as a link
    assert not usage.remove_path(root / usage.QUARANTINE / victim.name)
    for item in items:
        usage.remove_path(item.key[1])  # type: ignore[index]
    assert intact(victim) and not os.path.lexists(root / usage.QUARANTINE)


def test_verify_fix_does_not_follow_a_symlinked_fingerprint_dir(tmp_path, capsys):
    root, model = tmp_path / "kv", tmp_path / "my-model"
    weights = precious(model)
    root.mkdir()
    (root / FP).symlink_to(model, target_is_directory=True)
    rc, _ = cli(capsys, root, "verify", "--fix")
    assert rc == 0 and intact(weights)
    assert not (root / usage.QUARANTINE).exists()


def test_verify_fix_does_not_read_or_move_a_symlinked_entry(tmp_path, capsys):
    root, model = tmp_path / "kv", tmp_path / "my-model"
    weights = precious(model)
    tier = ColdTier(root, FP, Config(cache_dir=root, block_tokens=8))
    tier.persist(np.arange(16), [kv(16)])
    tier.close()
    (root / FP / "planted.safetensors").symlink_to(weights)
    rc, out = cli(capsys, root, "verify", "--fix")
    assert "planted" not in out and intact(weights)


def test_verify_fix_does_not_move_files_into_a_symlinked_quarantine(tmp_path, capsys):
    root, out = tmp_path / "kv", tmp_path / "elsewhere"
    out.mkdir()
    tier = ColdTier(root, FP, Config(cache_dir=root, block_tokens=8))
    tier.persist(np.arange(16), [kv(16)])
    tier.close()
    (bad,) = fsafe.regular_files(root / FP, suffix=".safetensors")
    bad.write_bytes(b"garbage")
    (root / usage.QUARANTINE).symlink_to(out, target_is_directory=True)
    cli(capsys, root, "verify", "--fix")
    assert list(out.iterdir()) == []  # nothing moved out of the cache dir


@pytest.mark.parametrize("name", ["../../x", "..", "../kv2", "/abs/path", "quarantine"])
def test_clear_fingerprint_must_be_hex(tmp_path, capsys, name):
    root = tmp_path / "a" / "b" / "kv"
    root.mkdir(parents=True)
    keep = [precious(tmp_path / "a" / "x"), precious(tmp_path / "a" / "b" / "kv2"),
            precious(root / "quarantine")]  # fmt: skip
    rc, out = cli(capsys, root, "clear", "--fingerprint", name)
    assert rc == 2 and "not a fingerprint" in out
    assert all(intact(p) for p in keep)


def test_clear_removes_links_not_their_targets(tmp_path, capsys):
    root, out = tmp_path / "kv", tmp_path / "elsewhere"
    victims = [precious(out / "q"), precious(out / "fp")]
    root.mkdir()
    (root / usage.QUARANTINE).symlink_to(out / "q", target_is_directory=True)
    (root / FP).symlink_to(out / "fp", target_is_directory=True)
    rc, _ = cli(capsys, root, "clear")
    assert rc == 0 and all(intact(v) for v in victims)
    assert not os.path.lexists(root / usage.QUARANTINE)
    rc, _ = cli(capsys, root, "clear", "--fingerprint", FP)
    assert rc == 0 and all(intact(v) for v in victims) and not os.path.lexists(root / FP)


@pytest.mark.parametrize("name", ["cache.db", "cache.db-wal", "cache.db-shm"])
def test_symlinked_index_db_is_not_followed(tmp_path, name):
    index_dir, out = tmp_path / "kv" / FP / "index", tmp_path / "elsewhere"
    victim = precious(out, "victim.db")
    index_dir.mkdir(parents=True)
    (index_dir / name).symlink_to(victim)  # an existing target: chmod'ed or overwritten before
    idx = Index(index_dir)
    idx.set_meta({"schema": 1})
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
