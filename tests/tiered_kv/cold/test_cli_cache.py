"""engine/cli_cache.py: `tiered-kv cache …` on files only (no model)."""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from engine import cli_cache
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config


def _run(capsys, root, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli_cache.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv, "--dir", str(root)])
    args.config = Config(cache_dir=root)
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_stats_ls_verify_fix_clear(tmp_path, capsys):
    tier = ColdTier(tmp_path, "fpA", Config(cache_dir=tmp_path, block_tokens=4))
    c = C.KVCache()
    x = mx.ones((1, 2, 8, 4))
    c.update_and_fetch(x, x)
    tier.persist(np.arange(8), [c])
    tier.persist(np.arange(8) + 9, [c])
    tier.close()
    bad = sorted((tmp_path / "fpA").glob("*.safetensors"))[0]
    data = bytearray(bad.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))

    rc, out = _run(capsys, tmp_path, "stats")
    assert rc == 0 and "fpA: 2 files, 2 indexed entries" in out
    rc, out = _run(capsys, tmp_path, "ls")
    assert rc == 0 and out.count(" tokens") == 2
    rc, out = _run(capsys, tmp_path, "verify")
    assert rc == 1 and f"corrupt: {bad.name}" in out
    rc, out = _run(capsys, tmp_path, "verify", "--fix")
    assert rc == 0 and (tmp_path / "quarantine" / f"fpA-{bad.name}").exists()
    rc, out = _run(capsys, tmp_path, "verify")
    assert rc == 0 and "fpA: 1 ok" in out
    rc, out = _run(capsys, tmp_path, "clear")
    assert rc == 0 and not (tmp_path / "fpA").exists()


def test_verify_without_index_does_not_call_files_orphans(tmp_path, capsys):
    import shutil

    tier = ColdTier(tmp_path, "fpB", Config(cache_dir=tmp_path, block_tokens=4))
    c = C.KVCache()
    c.update_and_fetch(mx.ones((1, 1, 8, 4)), mx.ones((1, 1, 8, 4)))
    tier.persist(np.arange(8), [c])
    tier.close()
    shutil.rmtree(tmp_path / "fpB" / "index")
    rc, out = _run(capsys, tmp_path, "verify", "--fix")
    assert "1 ok" in out and len(list((tmp_path / "fpB").glob("*.safetensors"))) == 1
    assert rc == 2 and "could not check" in out  # what was not checked is never "clean"
