"""Regenerate the parts of docs/DESIGN.md that are drawn from the code: the module table and the door.

    python scripts/design_doc.py           # rewrite docs/DESIGN.md in place
    python scripts/design_doc.py --check   # exit 1 (and say so) when DESIGN.md is out of date

The module table: one row per module of ``tiered_kv/``, ``engine/``, ``bench/`` and
``examples/`` — what it owns (the first paragraph of its docstring) and the project modules it imports
(read from its code, function-level imports included). The door: the signature of every name
``tiered_kv`` exports. Each generated part sits between ``<!-- generated: NAME -->`` and
``<!-- end generated -->``; the rest of the file is written by hand.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
PACKAGES = ("tiered_kv", "engine", "bench", "examples")
PROJECT = ("tiered_kv", "engine", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> list[Path]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(p.read_text())
            if p.name == "__init__.py" and not tree.body:
                continue  # an empty package marker
            out.append(p)
    return out


def owns(tree: ast.Module) -> str:
    """The docstring's first paragraph on one line (``|`` escaped for the table)."""
    doc = ast.get_docstring(tree) or "—"
    first = doc.strip().split("\n\n")[0]
    return " ".join(first.split()).replace("|", "\\|")


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """Project modules imported anywhere in ``tree``; ``from pkg import sub`` counts as ``pkg.sub``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            out.update(subs or [node.module])
            if subs and len(subs) < len(node.names):
                out.add(node.module)  # names that are not submodules come from the package itself
    return {m for m in out if m.split(".")[0] in PROJECT}


def short(name: str, home: str) -> str:
    """``name`` relative to the top package of ``home`` (``tiered_kv.cold.tier`` from
    ``tiered_kv.tiered`` reads ``cold.tier``); other packages in full."""
    top = home.split(".")[0]
    return name[len(top) + 1 :] if name.startswith(top + ".") else name


def module_table() -> str:
    paths = modules()
    known = {module_name(p) for p in paths}
    rows = ["| module | owns (its docstring) | imports (project modules, from its code) |", "|---|---|---|"]
    for p in paths:
        tree = ast.parse(p.read_text())
        name = module_name(p)
        deps = sorted(short(m, name) for m in imports(tree, known) if m != name)
        rel = p.relative_to(ROOT).as_posix()
        rows.append(f"| `{rel}` | {owns(tree)} | {', '.join(f'`{d}`' for d in deps) or '—'} |")
    return "\n".join(rows)


def _ann(a: object) -> str:
    return a if isinstance(a, str) else getattr(a, "__name__", repr(a))


def _sig(obj: object, many: int = 8) -> str:
    """``(a: T = 1, ...) -> R`` as written in the source (annotations are strings there);
    more than ``many`` parameters (a config dataclass) are summarised."""
    sig = inspect.signature(obj)  # type: ignore[arg-type]
    params = []
    for p in sig.parameters.values():
        stars: dict[Any, str] = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        text = stars.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_ann(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        params.append(text)
    if len(params) > many:
        params = [f"<{len(params)} fields>"]
    ret = "" if sig.return_annotation in (sig.empty, "None", None) else f" -> {_ann(sig.return_annotation)}"
    return f"({', '.join(params)}){ret}"


def door() -> str:
    sys.path.insert(0, str(ROOT))
    import tiered_kv

    lines = ["```python"]
    for name in tiered_kv.__all__:
        obj = getattr(tiered_kv, name)
        home = getattr(obj, "__module__", "")
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):  # a type alias
            lines.append(f"{name} = {obj!r}  # {tiered_kv._HOME[name]}")
        elif inspect.isclass(obj) and issubclass(obj, BaseException):
            lines.append(f"class {name}({obj.__bases__[0].__name__})  # {home}")
        elif inspect.isclass(obj):
            lines.append(f"class {name}{_sig(obj)}  # {home}")
            for meth, fn in vars(obj).items():
                if meth.startswith("_"):
                    continue
                if isinstance(fn, classmethod):
                    lines.append(f"    @classmethod {meth}{_sig(fn.__func__)}")
                elif isinstance(fn, property):
                    lines.append(f"    {meth}  # property")
                elif inspect.isfunction(fn):
                    lines.append(f"    {meth}{_sig(fn)}")
        else:
            lines.append(f"def {name}{_sig(obj)}  # {home}")
    lines.append("```")
    return "\n".join(lines)


def render(text: str) -> str:
    for name, body in (("modules", module_table), ("door", door)):
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end generated -->)", re.S)
        m = pattern.search(text)
        if m is None:
            raise SystemExit(f"{DESIGN}: no '<!-- generated: {name} -->' block")
        text = text[: m.end(1)] + body() + "\n" + text[m.start(2) :]
    return text


def main(argv: list[str]) -> int:
    old = DESIGN.read_text()
    new = render(old)
    if "--check" in argv:
        if new != old:
            print(f"{DESIGN.relative_to(ROOT)} is out of date: run `python scripts/design_doc.py`")
            return 1
        return 0
    DESIGN.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
