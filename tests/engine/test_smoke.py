"""`tiered-kv smoke` (engine/smoke.py) end to end on the CPU, as CI runs it: real subprocess servers (ours and
mlx_lm.server) on the Llama-3-RoPE test model, whose lazy load-time array fails on any thread but the engine's."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_smoke_passes_on_the_default_device(tiny_llama3_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "smoke", str(tiny_llama3_dir), "--prefix-words", "600"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    steps = [ln for ln in out.splitlines() if ln.startswith(("ok  ", "FAIL"))]
    assert len(steps) == 8 and all(ln.startswith("ok  ") for ln in steps), out
    assert "tier hot" in steps[2] and "tier cold" in steps[6]
    assert "| completion 3 (after restart) |" in out


def test_smoke_fails_loudly_without_a_model(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "smoke", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "no model at" in proc.stderr
