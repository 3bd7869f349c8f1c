"""What the shared tier holds, for `tiered-kv cache stats|ls|verify` (no model needed).

Walks the ``tkv:<fingerprint>:`` namespaces with SCAN (never KEYS: a shared Redis keeps serving
while we look). ``verify`` fetches every entry's chunks and runs the entry format's checks; with
``fix`` it unlinks corrupt and incomplete entries and orphan chunks (a publish that died between
its chunks and its index). Bytes only, one thread.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from tiered_kv.shared.redis_tier import Check, SharedTier

_E = re.compile(rb"^tkv:([^:]{1,128}):e:([0-9a-f]{32})$")
_C = re.compile(rb"^tkv:([^:]{1,128}):c:([0-9a-f]{32}):\d+$")


@dataclass(frozen=True)
class EntryInfo:
    fingerprint: str
    entry_id: str
    n_tokens: int
    nbytes: int
    nchunks: int
    chunk_bytes: int
    created: float


@dataclass
class SharedReport:
    ok: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)  # a chunk evicted
    orphan_chunks: int = 0

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.incomplete or self.orphan_chunks)


def entries(client: redis.Redis) -> list[EntryInfo]:
    """Every indexed entry of every fingerprint, newest first."""
    found = [(m.group(1).decode(), m.group(2).decode())
             for k in client.scan_iter(match="tkv:*:e:*", count=1000) if (m := _E.match(k))]  # fmt: skip
    pipe = client.pipeline(transaction=False)
    for fp, eid in found:
        pipe.hmget(f"tkv:{fp}:e:{eid}", ["n_tokens", "nbytes", "nchunks", "chunk_bytes", "created"])
    out = []
    for (fp, eid), meta in zip(found, pipe.execute() if found else [], strict=True):
        try:
            n, size, nch, chunk = (int(v) for v in meta[:4])
            created = float(meta[4])
        except (TypeError, ValueError):
            continue  # half-deleted or evicted meanwhile
        out.append(EntryInfo(fp, eid, n, size, nch, chunk, created))
    return sorted(out, key=lambda e: -e.created)


def server(client: redis.Redis) -> dict[str, Any]:
    """Redis's own capacity facts: used / max memory, eviction policy, evicted keys."""
    mem = client.info("memory")
    st = client.info("stats")
    return {"used_memory": int(mem.get("used_memory", 0)),
            "maxmemory": int(mem.get("maxmemory", 0)),
            "maxmemory_policy": str(mem.get("maxmemory_policy", "?")),
            "evicted_keys": int(st.get("evicted_keys", 0))}  # fmt: skip


def verify(
    client: redis.Redis, url: str, check_for: Callable[[str], Check], fix: bool = False
) -> dict[str, SharedReport]:
    """Per fingerprint: every entry fetched and checked; ``fix`` unlinks what is bad."""
    reports: dict[str, SharedReport] = defaultdict(SharedReport)
    known: set[tuple[str, str]] = set()
    tiers: dict[str, SharedTier] = {}
    for e in entries(client):
        known.add((e.fingerprint, e.entry_id))
        tier = tiers.get(e.fingerprint)
        if tier is None:
            tier = tiers[e.fingerprint] = SharedTier(url, e.fingerprint, 1 << 30,
                                                     check_for(e.fingerprint), timeout=30.0)  # fmt: skip
        verdict = _check_one(client, tier, e)
        getattr(reports[e.fingerprint], verdict).append(e.entry_id)
        if fix and verdict != "ok":
            tier._unlink(e.entry_id, e.nchunks)
    orphans: list[bytes] = []
    for k in client.scan_iter(match="tkv:*:c:*", count=1000):
        m = _C.match(k)
        if m and (m.group(1).decode(), m.group(2).decode()) not in known:
            reports[m.group(1).decode()].orphan_chunks += 1
            orphans.append(k)
    if fix and orphans:
        client.unlink(*orphans)
    for t in tiers.values():
        t.close()
    return dict(reports)


def _check_one(client: redis.Redis, tier: SharedTier, e: EntryInfo) -> str:
    """"ok", "incomplete" (a chunk is missing) or "corrupt" — read-only."""
    if e.nchunks != -(-e.nbytes // max(1, e.chunk_bytes)) or e.nbytes > tier.max_bytes:
        return "corrupt"
    buf = bytearray(e.nbytes)
    for i in range(e.nchunks):
        part = client.get(tier.key("c", e.entry_id, i))
        if not isinstance(part, bytes):
            return "incomplete"
        lo = i * e.chunk_bytes
        if len(part) != min(e.chunk_bytes, e.nbytes - lo):
            return "corrupt"
        buf[lo : lo + len(part)] = part
    try:
        tokens = tier.check(memoryview(buf))
    except ValueError:
        return "corrupt"
    stored = client.get(tier.key("t", e.entry_id))
    return "ok" if tokens.tobytes() == stored else "corrupt"
