"""pyproject.toml: every third-party import is declared, and where (the library and the server need only
the core dependencies; the bench its extra; the tests theirs)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"tiered_kv", "engine", "bench", "tests"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(*groups: str) -> set[str]:
    """Distribution names declared in ``groups`` ("core" or an extra), self-references resolved."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names: set[str] = set()
    todo = list(groups)
    while todo:
        group = todo.pop()
        for req in project["dependencies"] if group == "core" else extras[group]:
            name = _norm(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])
            if name == _norm(project["name"]):
                todo += re.findall(r"\[([^\]]+)\]", req)[0].split(",")
            else:
                names.add(name)
    return names


def _local_modules() -> set[str]:
    """Test helpers imported by their bare name (pytest puts their folders on sys.path)."""
    return {p.stem for p in (ROOT / "tests").rglob("*.py")} | {
        p.name for p in (ROOT / "tests").rglob("*") if p.is_dir()
    }


def _undeclared(folder: Path, *groups: str) -> dict[str, list[str]]:
    """Imported top-level module → files, for every import no distribution in ``groups`` provides."""
    declared = _requirements(*groups)
    provides = packages_distributions()
    local = _local_modules() if folder.name == "tests" else set()
    missing: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top in sys.stdlib_module_names or top in FIRST_PARTY or top in local:
                    continue
                if not {_norm(d) for d in provides.get(top, [top])} & declared:
                    missing.setdefault(top, []).append(path.name)
    return missing


def test_library_imports_only_core_dependencies() -> None:
    assert _undeclared(ROOT / "tiered_kv", "core") == {}


def test_examples_and_scripts_import_only_core_dependencies() -> None:
    assert _undeclared(ROOT / "examples", "core") == {}
    assert _undeclared(ROOT / "scripts", "core") == {}


def test_engine_imports_core_dependencies_and_the_bench_extra_for_bench_commands() -> None:
    # the bench extra only inside `tiered-kv bench` / `smoke` (lazy: tests/engine/test_cli.py)
    assert _undeclared(ROOT / "engine", "core", "bench") == {}


def test_bench_imports_are_declared() -> None:
    assert _undeclared(ROOT / "bench", "core", "bench") == {}


def test_test_imports_are_declared() -> None:
    assert _undeclared(ROOT / "tests", "core", "test") == {}


def test_an_undeclared_import_is_reported(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("import os\nimport httpx\n\ndef f():\n    from h11 import Request\n")
    assert _undeclared(tmp_path, "bench") == {"h11": ["mod.py"]}
    assert _undeclared(tmp_path, "test") == {"h11": ["mod.py"]}  # the bench extra through tiered-kv[bench]
