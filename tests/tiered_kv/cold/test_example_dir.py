"""cache_dir.example/ is a real cold tier that today's code reads and verifies clean."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from tests.fixtures import rewrite_meta
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

EXAMPLE = Path(__file__).resolve().parents[3] / "cache_dir.example"


def open_copy(tmp_path: Path) -> tuple[ColdTier, Path]:
    root = tmp_path / "kv"
    shutil.copytree(EXAMPLE, root)
    for p in [root, *root.rglob("*")]:  # git keeps no modes; a umask 002 checkout is 0775
        p.chmod(0o700 if p.is_dir() else 0o600)
    (fp,) = [p for p in root.iterdir() if p.is_dir()]
    return ColdTier(root, fp.name, Config(cache_dir=root, block_tokens=16)), fp


def test_example_verifies_clean_and_loads(tmp_path):
    tier, fp = open_copy(tmp_path)
    report = tier.verify()
    assert report.clean, report
    files = sorted(fp.glob("*.safetensors"))
    assert len(files) == 2 and tier.stats()["entries"] == 2
    for rec in tier.index.records():
        ids = tier.index.tokens(rec.entry_id)
        hit = tier.lookup(ids)
        assert hit is not None and hit.tokens == len(ids)
        got = tier.load(hit)
        assert got is not None
        caches, tokens, checkpoints = got.caches, got.tokens, got.checkpoints
        assert np.array_equal(tokens, ids) and checkpoints == {}
        assert [c.offset for c in caches] == [len(ids)] * 2
    tier.close()


def test_unknown_format_version_is_refused_cleanly(tmp_path):
    tier, fp = open_copy(tmp_path)
    victim = sorted(fp.glob("*.safetensors"))[0]
    rec = next(r for r in tier.index.records() if r.file == victim.name)
    ids = tier.index.tokens(rec.entry_id)
    rewrite_meta(victim, format_version="999")
    hit = tier.lookup(ids)
    assert tier.load(hit) is None  # refused: quarantined, counted, a miss
    assert tier.stats()["quarantined"] == 1
    assert not victim.exists() and any((tmp_path / "kv" / "quarantine").iterdir())
    tier.close()
