"""tiered_kv/__init__.py: the one door. Servers, the CLI, examples and benchmarks import ``tiered_kv``
and nothing deeper (tests may); every exported name resolves; reading the config loads no MLX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tiered_kv

ROOT = Path(__file__).resolve().parents[2]
#: the library's users: everything here goes through the door
USERS = ("engine", "examples", "bench")
#: a benchmark that measures one module alone may import it: file name → the modules it measures
MEASURED_ALONE = {
    "micro.py": {"tiered_kv.cold.tier"},  # cold tier write / reload throughput
    "sizes.py": {"tiered_kv.cold.tier"},  # cold tier write / reload by entry size
    "restore.py": {"tiered_kv.cold.pages", "tiered_kv.restore.restorer",
                   "tiered_kv.hot"},  # page-cache probe, calibration, a hot entry put in place  # fmt: skip
    # both's read + join alone: ranged reads into landing buffers, the Restorer's join
    "write_pass.py": {"tiered_kv.cold"},  # encode + FileBackend.put alone (the writer's pass)
    "join.py": {"tiered_kv.cold", "tiered_kv.cold.backend", "tiered_kv.restore",
                "tiered_kv.restore.costs", "tiered_kv.restore.restorer"},  # fmt: skip
    "shared_reload.py": {"tiered_kv.cold.tier", "tiered_kv.shared.link"},  # publish / fetch alone
    "hot_lookup.py": {"tiered_kv.hot", "tiered_kv.memory", "tiered_kv.prefix"},  # hot lookup alone
    "hit_cost.py": {"tiered_kv.layers"},  # view / restore cost per cache class
    "hit_vs_prefill.py": {"tiered_kv.layers"},
    "prefix_stability.py": {"tiered_kv.prefix"},  # common-prefix of real agent traces
    "cold_lookup.py": {"tiered_kv.cold.index", "tiered_kv.cold.rows",
                       "tiered_kv.cold.tier"},  # index lookup, reload vs dd  # fmt: skip
    "tails.py": {"tiered_kv.cold", "tiered_kv.cold.backend"},  # ranged reads of encoded files alone
}


def deep_imports(path: Path) -> set[str]:
    """``tiered_kv.x`` modules that ``path`` imports (``from tiered_kv.x import`` / ``import tiered_kv.x``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n.startswith("tiered_kv."))
    return out


def test_users_import_only_the_door():
    files = [p for d in USERS for p in sorted((ROOT / d).rglob("*.py"))]
    assert any(p.parts[-2] == "engine" for p in files), "the scan found no engine module"
    leaks = {}
    for p in files:
        deep = deep_imports(p) - MEASURED_ALONE.get(p.name, set())
        if deep:
            leaks[str(p.relative_to(ROOT))] = sorted(deep)
    assert not leaks, f"import these through `tiered_kv` (add to its exports if needed): {leaks}"


def test_the_scan_sees_both_import_forms(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import tiered_kv\nimport tiered_kv.cold.tier\nfrom tiered_kv.hot import HotTier\n"
                 "from tiered_kv import Config\n")  # fmt: skip
    assert deep_imports(f) == {"tiered_kv.cold.tier", "tiered_kv.hot"}


def test_every_export_resolves():
    for name in tiered_kv.__all__:
        assert getattr(tiered_kv, name) is not None, name
    assert sorted(dir(tiered_kv)) == sorted(tiered_kv.__all__)


def test_config_from_env_is_the_module_function():
    c = tiered_kv.Config.from_env({"TIERED_KV_TIERS": "hot"})
    assert c.tiers == ("hot",) and not c.cold_enabled


def test_reading_the_config_loads_no_mlx():
    code = "import sys; from tiered_kv import Config; Config.from_env({}); print('mlx' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
