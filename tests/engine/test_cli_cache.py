"""engine/cli_cache.py: `tiered-kv cache …` on files only (no model); `verify --fix` and `clear` never
follow a symlink out of the cache dir (issue 12.3, with tests/tiered_kv/cold/test_fsafe.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from engine import cli_cache
from tests.fixtures import flip_byte, intact, kv_cache, precious
from tiered_kv.cold import fsafe, usage
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

FP = "0123456789abcdef0123456789abcdef"
FPA, FPB = "a" * 32, "b" * 32


def _run(capsys, root, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli_cache.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv, "--dir", str(root)])
    args.config = Config(cache_dir=root)
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_stats_ls_verify_fix_clear(tmp_path, capsys):
    tier = ColdTier(tmp_path, FPA, Config(cache_dir=tmp_path, block_tokens=4))
    c = C.KVCache()
    x = mx.ones((1, 2, 8, 4))
    c.update_and_fetch(x, x)
    tier.persist(np.arange(8), [c])
    tier.persist(np.arange(8) + 9, [c])
    tier.close()
    bad = sorted((tmp_path / FPA).glob("*.safetensors"))[0]
    flip_byte(bad, -1, 0x01)

    rc, out = _run(capsys, tmp_path, "stats")
    assert rc == 0 and f"{FPA}: 2 files, 2 indexed entries" in out
    rc, out = _run(capsys, tmp_path, "ls")
    assert rc == 0 and out.count(" tokens") == 2
    rc, out = _run(capsys, tmp_path, "verify")
    assert rc == 1 and f"corrupt: {bad.name}" in out
    rc, out = _run(capsys, tmp_path, "verify", "--fix")
    assert rc == 0 and (tmp_path / "quarantine" / f"{FPA}-{bad.name}").exists()
    rc, out = _run(capsys, tmp_path, "verify")
    assert rc == 0 and f"{FPA}: 1 ok" in out
    rc, out = _run(capsys, tmp_path, "clear")
    assert rc == 0 and not (tmp_path / FPA).exists()


def test_verify_without_index_does_not_call_files_orphans(tmp_path, capsys):
    import shutil

    tier = ColdTier(tmp_path, FPB, Config(cache_dir=tmp_path, block_tokens=4))
    c = C.KVCache()
    c.update_and_fetch(mx.ones((1, 1, 8, 4)), mx.ones((1, 1, 8, 4)))
    tier.persist(np.arange(8), [c])
    tier.close()
    shutil.rmtree(tmp_path / FPB / "index")
    rc, out = _run(capsys, tmp_path, "verify", "--fix")
    assert "1 ok" in out and len(list((tmp_path / FPB).glob("*.safetensors"))) == 1
    assert rc == 2 and "could not check" in out  # what was not checked is never "clean"


def cli(capsys, root: Path, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli_cache.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv, "--dir", str(root)])
    args.config = Config(cache_dir=root)
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out + out.err


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
    tier.persist(np.arange(16), [kv_cache(16)])
    tier.close()
    (root / FP / "planted.safetensors").symlink_to(weights)
    rc, out = cli(capsys, root, "verify", "--fix")
    assert "planted" not in out and intact(weights)


def test_verify_fix_does_not_move_files_into_a_symlinked_quarantine(tmp_path, capsys):
    root, out = tmp_path / "kv", tmp_path / "elsewhere"
    out.mkdir()
    tier = ColdTier(root, FP, Config(cache_dir=root, block_tokens=8))
    tier.persist(np.arange(16), [kv_cache(16)])
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


@pytest.mark.parametrize("where", ["missing", "a-file"])
def test_verify_where_there_is_no_cache_dir_checks_nothing_and_says_so(tmp_path, capsys, where):
    """It printed nothing and exited 0 (all clean) for a path that does not exist or is a file."""
    path = tmp_path / where
    if where == "a-file":
        path.write_text("x")
    rc, out = _run(capsys, path, "verify")
    assert rc == 2 and "nothing checked" in out


def test_a_malformed_index_row_is_an_unreadable_index_not_a_traceback(tmp_path, capsys):
    import sqlite3

    tier = ColdTier(tmp_path, FPA, Config(cache_dir=tmp_path, block_tokens=4))
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.close()
    con = sqlite3.connect(tmp_path / FPA / "index" / "cache.db")
    con.execute("UPDATE entries SET nbytes='12 MB'")
    con.commit()
    con.close()
    rc, out = _run(capsys, tmp_path, "ls")
    assert rc == 0 and "(not indexed)" in out
    rc, out = _run(capsys, tmp_path, "stats")
    assert rc == 0 and "index missing" in out
    rc, out = _run(capsys, tmp_path, "verify")
    assert rc == 2 and "could not check" in out
