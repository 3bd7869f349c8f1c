"""The README's env-var table, generated from the ``#:`` field docs of ``tiered_kv.config.Config``.

    python scripts/env_table.py            # print the table
    python scripts/env_table.py --write    # replace the table in README.md (make env-table)
    python scripts/env_table.py --check    # exit 1 when README.md differs (a test does this too)

A field doc starts ``TIERED_KV_NAME — meaning`` (continued on further ``#:`` lines); an optional
``Default:`` line gives the default as shown where the field's value is not (paths, auto). The
table sits between the ``<!-- env-table -->`` and ``<!-- /env-table -->`` markers.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, also when run as a file

from tiered_kv import config  # noqa: E402

README = ROOT / "README.md"
START, END = "<!-- env-table -->", "<!-- /env-table -->"
_FIELD = re.compile(r"^    (\w+): ")
_DOC = re.compile(r"^    #: ?(.*)$")
_HEAD = re.compile(r"^(TIERED_KV_\w+) — (.*)$")
_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


@dataclass(frozen=True)
class Row:
    variable: str
    default: str
    meaning: str


def rows(source: str | None = None) -> list[Row]:
    """One row per documented variable, in field order. Raises ValueError on a malformed doc."""
    text = source if source is not None else Path(config.__file__).read_text(encoding="utf-8")
    body = text[text.index("class Config:") :]
    defaults = config.Config()
    sizes = {attr for attr, parse, _ in config._SPEC.values() if parse is config._size}
    out: list[Row] = []
    doc: list[str] = []
    for line in body.splitlines()[1:]:
        if line and not line.startswith(" "):
            break  # the end of the class body
        if m := _DOC.match(line):
            doc.append(m.group(1))
            continue
        m = _FIELD.match(line)
        if m and doc:
            out.append(_row(doc, m.group(1), getattr(defaults, m.group(1)), m.group(1) in sizes))
        doc = []
    return out


def _row(doc: list[str], attr: str, value: object, is_size: bool) -> Row:
    head = _HEAD.match(doc[0])
    if head is None:
        raise ValueError(f"Config.{attr}: its doc must start 'TIERED_KV_NAME — meaning'")
    shown = [d.removeprefix("Default:").strip() for d in doc[1:] if d.startswith("Default:")]
    meaning = " ".join([head.group(2)] + [d for d in doc[1:] if not d.startswith("Default:")])
    default = shown[0] if shown else shown_default(value, is_size)
    return Row(head.group(1), default, meaning)


def shown_default(value: object, is_size: bool = False) -> str:
    """A field's default as the README shows it: `4GiB`, `0`/`1`, `hot,cold`, empty."""
    if value == "" or value == ():
        return "empty"
    if isinstance(value, bool):
        text = "1" if value else "0"
    elif isinstance(value, tuple):
        text = ",".join(str(v) for v in value)
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, int) and is_size and value:
        text = next((f"{value // u}{name}" for name, u in _UNITS if value % u == 0), str(value))
    else:
        text = str(value)
    return f"`{text}`"


def table(source: str | None = None) -> str:
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{r.variable}` | {r.default} | {r.meaning} |" for r in rows(source)]
    return "\n".join(lines)


def in_readme(readme: str) -> str:
    """The table between the markers of ``readme`` (ValueError when they are missing)."""
    start, end = readme.index(START) + len(START), readme.index(END)
    return readme[start:end].strip("\n")


def with_table(readme: str, new: str) -> str:
    start, end = readme.index(START) + len(START), readme.index(END)
    return readme[:start] + "\n" + new + "\n" + readme[end:]


def main(argv: list[str]) -> int:
    new = table()
    if "--write" in argv:
        README.write_text(with_table(README.read_text(encoding="utf-8"), new), encoding="utf-8")
    elif "--check" in argv:
        if in_readme(README.read_text(encoding="utf-8")) != new:
            print("README.md's env-var table differs: run python scripts/env_table.py --write")
            return 1
    else:
        print(new)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
