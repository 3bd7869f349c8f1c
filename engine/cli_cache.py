"""`tiered-kv cache …`: inspect and repair the cold tier's files without loading a model.

    tiered-kv cache stats  [--dir DIR]
    tiered-kv cache ls     [--dir DIR]
    tiered-kv cache verify [--fix] [--dir DIR]
    tiered-kv cache clear  [--dir DIR] [--fingerprint FP]

``DIR`` defaults to ``TIERED_KV_DIR`` (``args.config.cache_dir``). Every sub-directory but
``quarantine/`` is one fingerprint and is listed / verified on its own; symlinks inside ``DIR``
are never followed (a linked "fingerprint" is skipped, a linked ``quarantine/`` is removed as a
link by ``clear``). Run ``verify --fix`` and ``clear`` while no server uses the directory.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tiered_kv.cold import fsafe, usage
from tiered_kv.cold.index import Index, IndexUnreadable, UnsafeCacheDir, check_private
from tiered_kv.cold.verify import entry_files, verify_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cache", help="inspect / verify / clear the disk tier")
    sub = p.add_subparsers(dest="cache_command", required=True)
    for name, func, text in (
        ("stats", _stats, "entries and bytes per fingerprint"),
        ("ls", _ls, "list entries (most recently used first)"),
        ("verify", _verify, "check every file (checksums) against the index"),
        ("clear", _clear, "delete cached entries"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("--dir", type=Path, default=None, help="cache dir (default TIERED_KV_DIR)")
        q.set_defaults(func=_refusing_unsafe(func))
        if name == "verify":
            q.add_argument("--fix", action="store_true", help="quarantine bad files, drop orphans")
        if name == "clear":
            q.add_argument("--fingerprint", default=None, help="only this fingerprint")


def _refusing_unsafe(func: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """A cache dir or index that other users can write to: one line on stderr, exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            check_private(_root(args))
            return func(args)
        except UnsafeCacheDir as e:
            print(f"tiered-kv: TIERED_KV_DIR: {e}", file=sys.stderr)
            return 2

    return run


def _root(args: argparse.Namespace) -> Path:
    return Path(args.dir or args.config.cache_dir).expanduser()


def _fingerprints(root: Path) -> list[Path]:
    """Fingerprint dirs: real directories only (a symlink may point at a model's folder)."""
    return [p for p in fsafe.real_subdirs(root) if p.name != usage.QUARANTINE]


@contextmanager
def _index(fp_dir: Path, write: bool = False) -> Iterator[Index | None]:
    """The fingerprint's index, or None when it is absent / unreadable (rebuilt at next open).
    Never creates one: an empty new index would make every file look like an orphan. Opened
    read-only unless ``write`` (verify --fix). Plain sqlite: nothing in it is unpickled."""
    path = fp_dir / "index"
    if not (path / "cache.db").exists():
        yield None
        return
    for p in (fp_dir, path):
        check_private(p)
    try:
        index = Index(path, readonly=not write, create=False)
    except (IndexUnreadable, sqlite3.Error):
        yield None
        return
    try:
        yield index if index.meta is not None else None
    finally:
        index.close()


def _stats(args: argparse.Namespace) -> int:
    root = _root(args)
    print(f"cache dir: {root}")
    for fp_dir in _fingerprints(root):
        size, _ = usage.tree_size(fp_dir)
        files = entry_files(fp_dir)
        with _index(fp_dir) as index:
            n = len(index.records()) if index is not None else "index missing"
        print(f"  {fp_dir.name}: {len(files)} files, {n} indexed entries, {_fmt(size)}")
    q = root / usage.QUARANTINE
    if q.is_dir() and not q.is_symlink():
        print(f"  quarantine: {len(list(q.iterdir()))} files, {_fmt(usage.tree_size(q)[0])}")
    total = usage.tree_size(root)[0] if root.exists() else 0
    print(f"total: {_fmt(total)} of budget {_fmt(args.config.disk_bytes)}")
    if args.config.shared_url:  # [shared tier, issue 17]
        from engine import cli_shared  # imports redis: only when TIERED_KV_SHARED is set

        return cli_shared.stats(args.config)
    return 0


def _ls(args: argparse.Namespace) -> int:
    for fp_dir in _fingerprints(_root(args)):
        print(f"{fp_dir.name}:")
        with _index(fp_dir) as index:
            if index is None:
                for p in entry_files(fp_dir):
                    print(f"  {p.name}  {_fmt(p.stat().st_size)}  (not indexed)")
                continue
            for r in sorted(index.records(), key=lambda r: -r.last_used):
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_used))
                print(f"  {r.entry_id}  {r.n_tokens:>8} tokens  {_fmt(r.nbytes):>10}  {when}")
    if args.config.shared_url:  # [shared tier, issue 17]
        from engine import cli_shared  # imports redis: only when TIERED_KV_SHARED is set

        return cli_shared.ls(args.config)
    return 0


def _verify(args: argparse.Namespace) -> int:
    status = _verify_local(args)
    if args.config.shared_url:  # [shared tier, issue 17]
        from engine import cli_shared  # imports redis: only when TIERED_KV_SHARED is set

        return max(status, cli_shared.verify(args.config, args.fix))
    return status


def _verify_local(args: argparse.Namespace) -> int:
    """Exit 0: everything checked and clean (or fixed); 1: problems found; 2: something could
    not be checked (no readable index, unreadable files) — never 0 for what was not checked."""
    root = _root(args)
    clean, unchecked = True, False
    for fp_dir in _fingerprints(root):
        with _index(fp_dir, write=args.fix) as index:
            report = verify_dir(fp_dir, fp_dir.name, index, root / usage.QUARANTINE, args.fix)
        note = "" if index is not None else " (could not check: no readable index)"
        unchecked = unchecked or index is None
        print(f"{fp_dir.name}: {len(report.ok)} ok{note}")
        for kind in ("orphans", "corrupt", "foreign", "missing", "temp"):
            for name in getattr(report, kind):
                print(f"  {kind}: {name}")
        clean = clean and report.clean
    if unchecked:
        print("not everything could be checked: run `tiered-kv serve` once to rebuild the index")
        return 2
    if args.fix and not clean:
        print("fixed: bad files quarantined, orphans removed, missing records dropped")
        return 0
    return 0 if clean else 1


def _clear(args: argparse.Namespace) -> int:
    root = _root(args)
    if args.fingerprint is not None and not fsafe.is_fingerprint(args.fingerprint):
        print(f"tiered-kv cache clear: --fingerprint {args.fingerprint!r} is not a fingerprint "
              "(32 hex digits, as `tiered-kv cache stats` lists them)", file=sys.stderr)  # fmt: skip
        return 2
    targets = [root / args.fingerprint] if args.fingerprint else [*_fingerprints(root)]
    if not args.fingerprint:
        targets.append(root / usage.QUARANTINE)
    for path in targets:
        if os.path.lexists(path) and fsafe.remove(root, path):
            print(f"removed {path}")
    return 0


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: tiered-kv cache …")
