"""Disk usage of the whole cache dir, as deletable units for :mod:`budget` (I/O, no policy).

No symlink under the cache dir is followed: a link counts as its own few bytes and is removed
as a link (see :mod:`fsafe`)."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tiered_kv.cold import fsafe
from tiered_kv.cold.budget import Item
from tiered_kv.cold.rows import Record

QUARANTINE = "quarantine"


@dataclass(frozen=True)
class Usage:
    used: int  # every byte under the cache dir
    items: list[Item]  # deletable units; keys: ("entry", id) | ("path", Path)
    #: of ``used``: what lay loose in own's directory (neither indexed nor the caller's to
    #: measure: temp files, another process's entry not indexed yet, orphans), bytes per name
    loose: dict[str, int] = field(default_factory=dict)


def tree_size(path: Path) -> tuple[int, float]:
    """(bytes, newest mtime) of a file or directory tree; vanished files count as 0."""
    total, newest = 0, 0.0
    stack = [path]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        newest = max(newest, st.st_mtime)
        if os.path.isdir(p) and not os.path.islink(p):
            try:
                stack.extend(Path(e.path) for e in os.scandir(p))
            except FileNotFoundError:
                continue
        else:
            total += st.st_blocks * 512 if st.st_blocks else st.st_size
    return total, newest


def scan(root: Path, own: str, records: Iterable[Record]) -> Usage:
    """Own entries by index ``last_used``; other fingerprint dirs as whole units; quarantined
    files one by one (mtime). The live index and temp files count but are kept. Nothing else
    under ``root`` is the cache's (``TIERED_KV_DIR`` may be a folder that also holds models, or
    a home directory): it is neither counted nor ever a unit to delete."""
    recs = list(records)
    items = [Item(("entry", r.entry_id), r.nbytes, r.last_used) for r in recs]
    rest = beside(root, own, {r.file for r in recs})
    return Usage(sum(i.nbytes for i in items) + rest.used, items + rest.items)


def beside(root: Path, own: str, indexed: Collection[str], measured: Collection[str] = ()) -> Usage:
    """:func:`scan` of all but the entries: what lies beside own's ``indexed`` files (and beside
    ``measured``, names in own's directory that the caller measures itself)."""
    used = 0
    items: list[Item] = []
    loose: dict[str, int] = {}
    try:
        children = list(os.scandir(root))
    except FileNotFoundError:
        return Usage(used, items)
    for child in children:
        path = Path(child.path)
        if child.name == own and child.is_dir(follow_symlinks=False):
            for sub in os.scandir(path):
                if sub.name not in indexed and sub.name not in measured:
                    loose[sub.name] = tree_size(Path(sub.path))[0]
                    used += loose[sub.name]
        elif child.name == QUARANTINE and child.is_dir(follow_symlinks=False):
            for sub in os.scandir(path):
                size, mtime = tree_size(Path(sub.path))
                items.append(Item(("path", Path(sub.path)), size, mtime))
                used += size
        elif child.name == QUARANTINE or (  # (a quarantine that is a link goes, as a link)
            fsafe.is_fingerprint(child.name) and child.is_dir(follow_symlinks=False)
        ):
            size, mtime = tree_size(path)
            items.append(Item(("path", path), size, mtime))
            used += size
    return Usage(used, items, loose)


def remove_path(path: Path, root: Path | None = None) -> bool:
    """Delete an item :func:`scan` listed, only if it resolves inside the cache dir ``root``
    (default: the dir it was listed from, ``root/<name>`` or ``root/quarantine/<name>``)."""
    if root is None:
        root = path.parent.parent if path.parent.name == QUARANTINE else path.parent
    return fsafe.remove(root, path)
