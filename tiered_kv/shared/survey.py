"""What the shared tier holds, for `tiered-kv cache stats|ls|verify` (no model needed).

Walks the ``tkv:<fingerprint>:`` namespaces with SCAN (never KEYS: a shared Redis keeps serving
while we look). ``verify`` fetches every entry's chunks and runs the entry format's checks; with
``fix`` it unlinks corrupt and incomplete entries, unreachable ones (indexed, but named by no
block key: displaced by a newer publish whose unlink of them failed, or whose block keys Redis
evicted — no lookup can find them again, :func:`_named` says why none is taken for one while a
publish runs), orphan chunks idle for ten minutes (a
publish that died between its chunks and its index; a running one's are fresh) and the token ids
of entries whose facts Redis evicted (``t:`` without ``e:``). Keys of the
layout holding what no publisher writes (another type, a time no clock gives) are corrupt, never
a reason to stop; a read Redis refuses (an ACL user or proxy that runs no scripts) says nothing
of the entries and stops the survey (``SharedUnreachable``: nothing is reported or unlinked as
corrupt). Every index value is read within its bound by the lookup's own readers
(:mod:`reads`), each chunk into its place at its length (:mod:`bulk`): a value another writer set
to 512 MB makes its entry corrupt, and is never read whole. Bytes only, one thread.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from tiered_kv.shared import bulk, reads
from tiered_kv.shared.redis_tier import Check, SharedTier

_E = re.compile(rb"^tkv:([^:]{1,128}):e:([0-9a-f]{32})$")
_C = re.compile(rb"^tkv:([^:]{1,128}):c:([0-9a-f]{32}):\d+$")
_T = re.compile(rb"^tkv:([^:]{1,128}):t:([0-9a-f]{32})$")
_B = re.compile(rb"^tkv:([^:]{1,128}):b:[0-9a-f]{1,32}$")
_BATCH = 1000  # block keys read per round trip
_BOUNDS = {**reads.FACTS, **reads.CREATED}
#: an orphan chunk younger than this may be a running publish's (its index not written yet)
ORPHAN_GRACE_SECONDS = 600


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
    unreachable: list[str] = field(default_factory=list)  # indexed, named by no block key
    orphan_chunks: int = 0
    orphan_tokens: int = 0  # token ids (``t:``) of an entry whose facts Redis evicted

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.incomplete or self.unreachable or self.orphan_chunks
                    or self.orphan_tokens)  # fmt: skip


def entries(client: redis.Redis) -> list[EntryInfo]:
    """Every indexed entry of every fingerprint, newest first."""
    return _survey(client)[0]


def _survey(client: redis.Redis) -> tuple[list[EntryInfo], list[tuple[str, str]]]:
    """(the entries, newest first; the (fingerprint, id) of index keys that hold no entry's facts:
    another type, or values no publisher writes — another writer's, or damaged)."""
    found = [(m.group(1).decode(), m.group(2).decode())
             for k in client.scan_iter(match="tkv:*:e:*", count=1000) if (m := _E.match(k))]  # fmt: skip
    pipe = client.pipeline(transaction=False)
    for fp, eid in found:  # each field within its bound (any value may be 512 MB): the lookup's
        reads.queue_fields(pipe, f"tkv:{fp}:e:{eid}", _BOUNDS)
    out, bad = [], []
    replies = pipe.execute(raise_on_error=False) if found else []
    refused = reads.refusal(replies)
    if refused is not None:  # says nothing of the entries (no scripts here): none is corrupt
        raise refused
    for (fp, eid), reply in zip(found, replies, strict=True):
        got = reads.fields_of(reply, _BOUNDS)  # None: not a hash
        info = _info(fp, eid, got.values) if got is not None and not got.oversized else None
        if info is not None:
            out.append(info)
        elif got is None or not got.gone:  # not just gone
            bad.append((fp, eid))
    return sorted(out, key=lambda e: -e.created), bad


def _info(fp: str, eid: str, meta: tuple[bytes | None, ...]) -> EntryInfo | None:
    facts = reads.facts_of(meta[: len(reads.FACTS)])
    try:
        created = float(meta[len(reads.FACTS)])  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if facts is None:
        return None
    n, size, nch, chunk = facts
    if not (math.isfinite(created) and 0 <= created < 1e11):  # a time no clock gives
        return None
    return EntryInfo(fp, eid, n, size, nch, chunk, created)


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
    """Per fingerprint: every entry a block key names fetched and checked, the others
    unreachable; ``fix`` unlinks what is bad or unreachable."""
    reports: dict[str, SharedReport] = defaultdict(SharedReport)
    known: set[tuple[str, str]] = set()
    tiers: dict[str, SharedTier] = {}
    found, bad = _survey(client)
    named = _named(client)  # after the survey: see there
    for fp, eid in bad:  # an index key no publisher wrote so: corrupt (its chunks age out below)
        known.add((fp, eid))
        reports[fp].corrupt.append(eid)
        if fix:
            client.unlink(f"tkv:{fp}:e:{eid}", f"tkv:{fp}:t:{eid}")
    for e in found:
        known.add((e.fingerprint, e.entry_id))
        tier = tiers.get(e.fingerprint)
        if tier is None:
            tier = tiers[e.fingerprint] = SharedTier(url, e.fingerprint, 1 << 30,
                                                     check_for(e.fingerprint), timeout=30.0)  # fmt: skip
        reachable = (e.fingerprint, e.entry_id) in named
        verdict = _check_one(client, tier, e) if reachable else "unreachable"
        getattr(reports[e.fingerprint], verdict).append(e.entry_id)
        if fix and verdict != "ok":
            tier.unlink(e.entry_id, e.nchunks)
    _orphan_tokens(client, reports, known, fix)
    orphans: list[bytes] = []
    for k in client.scan_iter(match="tkv:*:c:*", count=1000):
        m = _C.match(k)
        if m and (m.group(1).decode(), m.group(2).decode()) not in known:
            reports[m.group(1).decode()].orphan_chunks += 1
            orphans.append(k)
    if fix and orphans:  # only those of a publish that died: a running one's are fresh
        stale = [k for k, idle in zip(orphans, _idle(client, orphans), strict=True)
                 if idle is not None and idle >= ORPHAN_GRACE_SECONDS]  # fmt: skip
        if stale:
            client.unlink(*stale)
    for t in tiers.values():
        t.close()
    return dict(reports)


def _named(client: redis.Redis) -> set[tuple[str, str]]:
    """Every (fingerprint, entry id) a block key names now; read *after* the survey of the
    entries. An entry is reachable only through its block keys, and only its own publish names
    it in one, in the MULTI/EXEC that writes its facts: so every key naming an entry the survey
    found existed before this walk began (SCAN returns every key there all along), and a key
    that stops naming it never names it again. An entry named by some key when the walk ends
    was named by it throughout, and is seen; one not seen is unreachable for good. (Read the
    other way round, an entry published between the two walks would have facts and no key.)"""
    out: set[tuple[str, str]] = set()
    batch: list[tuple[str, str]] = []

    def read() -> None:
        pipe = client.pipeline(transaction=False)
        for _, k in batch:
            reads.queue_eid(pipe, k)  # a block key is another writer's data: 512 MB
        for (fp, _), raw in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            if (eid := reads.eid_of(raw)) is not None:
                out.add((fp, eid))
        batch.clear()

    for k in client.scan_iter(match="tkv:*:b:*", count=1000):
        if m := _B.match(k):
            batch.append((m.group(1).decode(), k.decode()))
            if len(batch) == _BATCH:
                read()
    if batch:
        read()
    return out


def _orphan_tokens(client: redis.Redis, reports: dict[str, SharedReport],
                   known: set[tuple[str, str]], fix: bool) -> None:  # fmt: skip
    """Count (``fix``: unlink) the ``t:`` keys whose ``e:`` is gone (Redis evicted it). Both are
    written in one MULTI/EXEC, so a ``t:`` key alone is no running publish's; one published since
    the survey read the ``e:`` keys has its ``e:`` now (asked again, in one round trip)."""
    found = [(k, m.group(1).decode(), m.group(2).decode())
             for k in client.scan_iter(match="tkv:*:t:*", count=1000)
             if (m := _T.match(k)) and (m.group(1).decode(), m.group(2).decode()) not in known]  # fmt: skip
    if not found:
        return
    pipe = client.pipeline(transaction=False)
    for _, fp, eid in found:
        pipe.exists(f"tkv:{fp}:e:{eid}")
    lone = [(k, fp) for (k, fp, _), there in zip(found, pipe.execute(), strict=True) if not there]
    for _, fp in lone:
        reports[fp].orphan_tokens += 1
    if fix and lone:
        client.unlink(*(k for k, _ in lone))


def _idle(client: redis.Redis, names: list[bytes]) -> list[int | None]:
    """Seconds since each key was last written or read (None where Redis does not track it:
    an LFU eviction policy, or the key gone)."""
    pipe = client.pipeline(transaction=False)
    for k in names:
        pipe.object("idletime", k)
    return [v if isinstance(v, int) else None for v in pipe.execute(raise_on_error=False)]


def _check_one(client: redis.Redis, tier: SharedTier, e: EntryInfo) -> str:
    """"ok", "incomplete" (a chunk is missing) or "corrupt" — read-only. Nothing is allocated
    for bytes Redis does not hold (a forged size)."""
    if e.nbytes > tier.max_bytes:
        return "corrupt"
    held = tier.held(e.entry_id, e.nbytes, e.chunk_bytes, e.nchunks)
    if held != "whole":
        return held
    buf = bytearray(e.nbytes)
    view = memoryview(buf)
    for i, name in enumerate(tier.key("c", e.entry_id, i) for i in range(e.nchunks)):
        lo = i * e.chunk_bytes
        try:  # into its place, no longer than its share (a chunk rewritten since: corrupt)
            got = bulk.get_into(client, name, view[lo : lo + e.chunk_bytes])
        except (ValueError, redis.exceptions.ResponseError):
            return "corrupt"
        if got is None:
            return "incomplete"
    try:
        tokens = tier.check(view)
    except ValueError:
        return "corrupt"
    pipe = client.pipeline(transaction=False)  # one id more than it holds: a longer value is not its
    reads.queue_tokens(pipe, tier.key("t", e.entry_id), len(tokens) + 1)
    stored = reads.tokens_of(pipe.execute(raise_on_error=False)[0])
    return "ok" if tokens.tobytes() == stored else "corrupt"
