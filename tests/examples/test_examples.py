"""examples/: each example runs with no arguments (building the tiny test model) and shows its cache hits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def run(example: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def hits(out: str) -> dict[str, tuple[int, str]]:
    """``call N`` → (cached tokens, tier), from lines like ``call 2: cached 57 of 60 … (tier hot)``."""
    found = re.findall(r"^(call \d+)[^:]*: cached (\d+) of \d+ prompt tokens \(tier (\w+)\)$", out, re.M)
    return {name: (int(n), tier) for name, n, tier in found}


def mlx_lm_generate(out: str) -> None:
    h = hits(out)
    assert h["call 1"] == (0, "none")
    assert h["call 2"][0] > 0 and h["call 2"][1] == "hot"
    assert h["call 3"][0] > 0 and h["call 3"][1] == "cold"  # after the restart: from the disk


#: example → what its output must show (an example without an entry must at least print)
CHECKS = {"mlx_lm_generate": mlx_lm_generate}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_without_arguments(example):
    out = run(example)
    assert out.strip()
    CHECKS.get(example.stem, lambda _: None)(out)


def test_every_example_is_checked():
    assert EXAMPLES and {p.stem for p in EXAMPLES} == set(CHECKS)
