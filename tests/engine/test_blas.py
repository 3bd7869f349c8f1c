"""engine/blas.py: preload decision, one-time re-exec, warning, --preload-env."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import blas

ROOT = Path(__file__).resolve().parents[2]


class Execd(Exception):
    pass


@pytest.fixture
def fake_exec(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        calls.append((path, argv, env))
        raise Execd

    monkeypatch.setattr(blas.os, "execve", execve)
    return calls


@pytest.fixture
def linux_with_lib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", (tmp_path / "absent.so", lib))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(blas.REEXEC_MARKER, raising=False)
    monkeypatch.setattr(blas, "_is_cli_process", lambda: True)
    return lib


def test_reexecs_cli_once_with_preload(linux_with_lib: Path, fake_exec: list, monkeypatch) -> None:
    monkeypatch.setattr(blas.sys, "argv", ["/venv/bin/tiered-kv", "model", "tiny"])
    with pytest.raises(Execd):
        blas.ensure_fast_blas()
    (path, argv, env) = fake_exec[0]
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "engine.cli", "model", "tiny"]
    assert env["LD_PRELOAD"] == str(linux_with_lib) and env[blas.REEXEC_MARKER] == "1"


def test_marker_or_existing_preload_stops_reexec(
    linux_with_lib: Path, fake_exec: list, monkeypatch
) -> None:
    monkeypatch.setenv(blas.REEXEC_MARKER, "1")
    blas.ensure_fast_blas()
    monkeypatch.delenv(blas.REEXEC_MARKER)
    monkeypatch.setenv("LD_PRELOAD", f"/other.so:{linux_with_lib}")
    blas.ensure_fast_blas()
    assert fake_exec == []
    assert blas.blas_status().startswith("blas: OpenBLAS preloaded")


def test_in_process_callers_are_not_reexeced(
    linux_with_lib: Path, fake_exec: list, monkeypatch
) -> None:
    monkeypatch.setattr(blas, "_is_cli_process", lambda: False)
    blas.ensure_fast_blas()
    assert fake_exec == []


def test_missing_openblas_warns_one_line(
    monkeypatch, tmp_path: Path, fake_exec: list, capsys
) -> None:
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", (tmp_path / "absent.so",))
    blas.ensure_fast_blas()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OpenBLAS not found" in err and "libopenblas0-pthread" in err
    assert fake_exec == []


def test_macos_does_nothing(monkeypatch, fake_exec: list, capsys) -> None:
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    monkeypatch.setattr(blas, "_is_cli_process", lambda: True)
    blas.ensure_fast_blas()
    assert fake_exec == [] and capsys.readouterr().err == ""
    assert blas.find_openblas() is None and "Accelerate" in blas.blas_status()


def test_preload_env_prints_assignment_or_nothing() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine.blas", "--preload-env"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lib = blas.find_openblas()
    if lib is None:
        assert out == ""
    else:
        assert out.startswith(f"LD_PRELOAD={lib}") and out.count("\n") == 1


@pytest.mark.skipif(blas.find_openblas() is None, reason="Debian OpenBLAS not installed")
def test_cli_runs_with_openblas_preloaded(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("LD_PRELOAD", blas.REEXEC_MARKER)
    }
    env["TIERED_KV_MODELS_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "model", "tiny", str(tmp_path / "m")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "blas: OpenBLAS preloaded" in proc.stderr
