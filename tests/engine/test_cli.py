"""engine/cli.py: the command line starts without the bench (`pip install tiered-kv` stays lean)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_ONLY = ("bench", "httpx", "psutil", "tqdm", "matplotlib")


def test_building_the_parser_imports_no_bench_module() -> None:
    code = (
        "import json, sys; from engine.cli import build_parser; build_parser(); "
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({BENCH_ONLY!r}))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
