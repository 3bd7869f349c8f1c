"""The test tree mirrors the code: every module under ``tiered_kv/`` and ``engine/`` has its tests
at the mirrored path (``tiered_kv/cold/verify.py`` → ``tests/tiered_kv/cold/test_verify.py``), and
the library's tests run without the server (nothing under ``tests/tiered_kv/`` imports ``engine``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tiered_kv", "engine")

# module → why it has no mirrored test file (one line each; keep this list short)
NO_TEST_FILE = {
    "engine/cli_serve.py": "`tiered-kv serve` runs as a subprocess in test_server_restart.py and reliability/",
    "engine/cli_bench.py": "the benchmark driver: run by `make bench`, never asserted on (STYLE.md 12)",
    "engine/events.py": "typed values without behaviour",
    "engine/models/templates.py": "downloads data; its family dirs drive test_output.py and test_server.py",
    "tiered_kv/shared/entry.py": "the shared tier's entry check: corrupt entries in shared/test_link.py",
}


def modules() -> list[str]:
    found = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if p.name != "__init__.py":
                found.append(rel)
    return found


def mirrored(module: str) -> Path:
    path = Path(module)
    return ROOT / "tests" / path.parent / f"test_{path.name}"


def test_every_module_has_its_mirrored_test_file():
    missing = [m for m in modules() if m not in NO_TEST_FILE and not mirrored(m).is_file()]
    assert not missing, "no test file at the mirrored path: " + ", ".join(
        mirrored(m).relative_to(ROOT).as_posix() for m in missing
    )


def test_the_allow_list_names_only_existing_modules():
    # an entry whose module has since gained its test file is harmless (and worth removing)
    stale = [m for m in NO_TEST_FILE if m not in modules()]
    assert not stale, f"remove from NO_TEST_FILE: {stale}"


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_library_tests_do_not_import_the_engine():
    library = [
        ROOT / "tests" / "fixtures.py",
        *sorted((ROOT / "tests" / "tiered_kv").rglob("*.py")),
    ]
    bad = {
        p.relative_to(ROOT).as_posix(): sorted(
            n for n in imported(p) if n.split(".")[0] == "engine"
        )
        for p in library
    }
    assert not {k: v for k, v in bad.items() if v}, "the library's tests import the engine"
