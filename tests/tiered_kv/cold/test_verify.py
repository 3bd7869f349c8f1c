"""tiered_kv/cold/verify.py: reconcile at open, full verify and its fix (through the tier)."""

from __future__ import annotations

import numpy as np

from tests.fixtures import cold_tier, flip_byte, kv_cache


def test_reopen_reconciles_orphans_and_missing_files(tmp_path):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    tier.close()
    files = sorted(tier.dir.glob("*.safetensors"))
    files[0].unlink()
    (tier.dir / "stray.safetensors").write_bytes(b"x")
    (tier.dir / ".partial.123.tmp").write_bytes(b"x")
    tier = cold_tier(tmp_path)
    assert tier.stats()["entries"] == 1
    assert {p.name for p in tier.dir.iterdir()} == {"index", files[1].name}
    assert tier.verify().clean
    tier.close()


def test_verify_reports_and_fixes(tmp_path):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    a, b = sorted(tier.dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    flip_byte(b, b.stat().st_size - 1)
    report = tier.verify()
    assert report.corrupt == [b.name] and report.ok == [a.name] and not report.clean
    report = tier.verify(fix=True)
    assert tier.verify().clean and tier.stats()["entries"] == 1
    tier.close()
