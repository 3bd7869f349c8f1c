"""The shared tier's part of `tiered-kv cache stats|ls|verify` (when ``TIERED_KV_SHARED`` is set).

Kept apart from ``engine/cli_cache.py`` (the local disk tier): each prints its own section of
what ``tiered_kv.CacheAdmin.shared`` reads. A Redis that does not answer is reported (exit status
2 for verify), never a traceback; redis is imported only when the shared tier is set.
"""

from __future__ import annotations

import time
from collections import Counter

from tiered_kv import SharedAdmin, SharedUnreachable


def stats(shared: SharedAdmin) -> int:
    print(f"shared tier: {shared.where}")
    try:
        found, srv = shared.stats()
    except SharedUnreachable as e:
        print(f"  unreachable: {e}")
        return 2
    count, size = Counter[str](), Counter[str]()
    for info in found:
        count[info.fingerprint] += 1
        size[info.fingerprint] += info.nbytes
    for fp in sorted(count):
        print(f"  {fp}: {count[fp]} entries, {_fmt(size[fp])}")
    cap = _fmt(srv["maxmemory"]) if srv["maxmemory"] else "no maxmemory (unbounded)"
    print(f"redis: {_fmt(srv['used_memory'])} used of {cap}, policy {srv['maxmemory_policy']}, "
          f"{srv['evicted_keys']} keys evicted")  # fmt: skip
    return 0


def ls(shared: SharedAdmin) -> int:
    print(f"shared tier: {shared.where}")
    try:
        found = shared.entries()
    except SharedUnreachable as e:
        print(f"  unreachable: {e}")
        return 2
    fp = None
    for info in sorted(found, key=lambda i: (i.fingerprint, -i.created)):
        if info.fingerprint != fp:
            fp = info.fingerprint
            print(f"{fp}:")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.created))
        print(f"  {info.entry_id}  {info.n_tokens:>8} tokens  {_fmt(info.nbytes):>10}  {when}  "
              "(shared)")  # fmt: skip
    return 0


def verify(shared: SharedAdmin, fix: bool) -> int:
    """0: all clean (or fixed); 1: problems found; 2: Redis did not answer."""
    print(f"shared tier: {shared.where}")
    try:
        reports = shared.verify(fix)
    except SharedUnreachable as e:
        print(f"  unreachable: {e}")
        return 2
    clean = True
    for fp, r in sorted(reports.items()):
        print(f"{fp}: {len(r.ok)} ok (shared)")
        for kind in ("corrupt", "incomplete", "unreachable"):
            for eid in getattr(r, kind):
                print(f"  {kind}: {eid}")
        if r.orphan_chunks:
            print(f"  orphan chunks: {r.orphan_chunks}")
        if r.orphan_tokens:
            print(f"  orphan token ids (their entry's facts evicted): {r.orphan_tokens}")
        clean = clean and r.clean
    if fix and not clean:
        print("fixed: bad, incomplete and unreachable shared entries, orphan chunks and token ids "
              "unlinked")  # fmt: skip
        return 0
    return 0 if clean else 1


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
