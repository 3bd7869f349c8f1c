"""scripts/design_doc.py: docs/DESIGN.md's module table and door are drawn from the code, and stay so."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("design_doc", ROOT / "scripts" / "design_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_design_md_is_up_to_date():
    r = subprocess.run([sys.executable, "scripts/design_doc.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_stale_table_is_rewritten():
    doc = load_script()
    stale = "x\n<!-- generated: door -->\nold\n<!-- end generated -->\n" \
            "<!-- generated: modules -->\n| old |\n<!-- end generated -->\n"  # fmt: skip
    new = doc.render(stale)
    assert "| old |" not in new and "\nold\n" not in new
    assert "`tiered_kv/tiered.py`" in new and "def open_cache(" in new
    assert doc.render(new) == new  # rendering is idempotent


def test_every_module_row_names_its_imports():
    doc = load_script()
    table = doc.module_table()
    row = next(r for r in table.splitlines() if r.startswith("| `engine/generate.py`"))
    assert "`tiered_kv`" in row and "`prefill`" in row
