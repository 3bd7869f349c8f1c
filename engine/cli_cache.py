"""`tiered-kv cache …`: inspect and repair the cold tier's files without loading a model.

    tiered-kv cache stats  [--dir DIR]
    tiered-kv cache ls     [--dir DIR]
    tiered-kv cache verify [--fix] [--dir DIR]
    tiered-kv cache clear  [--dir DIR] [--fingerprint FP]

``DIR`` defaults to ``TIERED_KV_DIR`` (``args.config.cache_dir``). What is read and repaired is
``tiered_kv.CacheAdmin``'s (every fingerprint on its own, symlinks never followed); this module
only prints. Run ``verify --fix`` and ``clear`` while no server uses the directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tiered_kv import CacheAdmin, NotAFingerprint, UnsafeCacheDir


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


def _refusing_unsafe(func: Callable[[CacheAdmin, argparse.Namespace], int]) -> Callable[..., int]:
    """A cache dir or index that other users can write to: one line on stderr, exit 2."""

    def run(args: argparse.Namespace) -> int:
        admin = CacheAdmin(args.config, args.dir)
        try:
            admin.check_private()
            return func(admin, args)
        except UnsafeCacheDir as e:
            print(f"tiered-kv: TIERED_KV_DIR: {e}", file=sys.stderr)
            return 2

    return run


def _stats(admin: CacheAdmin, args: argparse.Namespace) -> int:
    print(f"cache dir: {admin.root}")
    for d in admin.summaries():
        n = d.indexed if d.indexed is not None else "index missing"
        print(f"  {d.name}: {d.files} files, {n} indexed entries, {_fmt(d.nbytes)}")
    q = admin.quarantine()
    if q is not None:
        print(f"  quarantine: {q[0]} files, {_fmt(q[1])}")
    print(f"total: {_fmt(admin.total_bytes())} of budget {_fmt(args.config.disk_bytes)}")
    if admin.shared is not None:  # [shared tier, issue 17]
        from engine import cli_shared

        return cli_shared.stats(admin.shared)
    return 0


def _ls(admin: CacheAdmin, args: argparse.Namespace) -> int:
    for listing in admin.listings():
        print(f"{listing.name}:")
        if listing.records is None:
            for name, size in listing.files:
                print(f"  {name}  {_fmt(size)}  (not indexed)")
            continue
        for r in listing.records:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_used))
            print(f"  {r.entry_id}  {r.n_tokens:>8} tokens  {_fmt(r.nbytes):>10}  {when}")
    if admin.shared is not None:  # [shared tier, issue 17]
        from engine import cli_shared

        return cli_shared.ls(admin.shared)
    return 0


def _verify(admin: CacheAdmin, args: argparse.Namespace) -> int:
    status = _verify_local(admin, args.fix)
    if admin.shared is not None:  # [shared tier, issue 17]
        from engine import cli_shared

        return max(status, cli_shared.verify(admin.shared, args.fix))
    return status


def _verify_local(admin: CacheAdmin, fix: bool) -> int:
    """Exit 0: everything checked and clean (or fixed); 1: problems found; 2: something could
    not be checked (no readable index, unreadable files, no cache directory) — never 0 for what
    was not checked."""
    if not admin.root.is_dir():
        print(f"{admin.root}: no cache directory here, nothing checked")
        return 2
    clean, unchecked = True, False
    for c in admin.verify(fix):
        note = "" if c.checked else " (could not check: no readable index)"
        unchecked = unchecked or not c.checked or bool(c.report.unreadable)
        print(f"{c.name}: {len(c.report.ok)} ok{note}")
        for kind in ("orphans", "corrupt", "foreign", "missing", "temp", "unreadable"):
            for name in getattr(c.report, kind):
                print(f"  {kind}: {name}")
        clean = clean and c.report.clean
    if unchecked:
        print("not everything could be checked: run `tiered-kv serve` once to rebuild the index")
        return 2
    if fix and not clean:
        print("fixed: bad files quarantined, orphans removed, missing records dropped")
        return 0
    return 0 if clean else 1


def _clear(admin: CacheAdmin, args: argparse.Namespace) -> int:
    try:
        removed = admin.clear(args.fingerprint)
    except NotAFingerprint:
        print(f"tiered-kv cache clear: --fingerprint {args.fingerprint!r} is not a fingerprint "
              "(32 hex digits, as `tiered-kv cache stats` lists them)", file=sys.stderr)  # fmt: skip
        return 2
    for path in removed:
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
