"""engine/cli_model.py over a real subprocess: success path and one-line errors on bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, models_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TIERED_KV_MODELS_DIR=str(models_dir))
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", "model", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], text: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("tiered-kv model:")]
    assert len(errors) == 1 and text in errors[0], proc.stderr


def test_tiny_default_dir_under_models_dir(tmp_path: Path) -> None:
    proc = run("tiny", models_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "tiny-test")
    assert (tmp_path / "tiny-test" / "model.safetensors").is_file()


def test_unknown_model_name(tmp_path: Path) -> None:
    assert_one_line_error(
        run("fetch", "llama-70b", models_dir=tmp_path), "unknown model 'llama-70b'"
    )
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run("tiny", str(blocker / "sub" / "out"), models_dir=tmp_path)
    assert_one_line_error(proc, "cannot create")
    proc = run("fetch", "smollm2", str(blocker / "sub" / "out"), models_dir=tmp_path)
    assert_one_line_error(proc, "cannot create")
