"""The shared tier's write path: an entry's chunks, then its index in one MULTI/EXEC.

**Publish** writes the chunks first, then ``t:`` / ``e:`` / ``b:`` (the layout:
:mod:`redis_tier`) in one MULTI/EXEC: a reader that finds an index key finds every chunk, unless
Redis evicted one since — then the hit is a miss.
An entry is reachable only through its block keys, each naming the newest entry holding its
block; so once another index write takes an entry's *deepest* block key, that writer holds all
the entry's blocks and took every key naming it in the same step: it is unreachable for good
(only its own publish ever names it). The same MULTI/EXEC reads what each block key named just
before, and the writer unlinks every entry whose deepest key it took. One rule covers a
continuation's older entry, an older entry whose ids differ only past its last whole block, and
the same entry published by two servers at once (each looked it up before either wrote: the
later index write unlinks the earlier). Refusing the second write instead (WATCH on the block
keys, or a script checking for an identical entry) costs more and covers less: a WATCH fails on
any write to a shared prefix's block keys (every publish on the same system prompt), a script
would read keys it cannot name in advance, and neither touches the other two cases; what this
leaves is the loser's bytes sent once.

A failure after the index write (unlinking what it displaced) leaves the publish standing: the
entry is published, the displaced ones stay (unreachable) until LRU or ``verify --fix`` takes
them, each counted ``displaced_left`` (entries, not failed calls).

An entry already there whole (the lookup's longest match holds the same ids, every chunk of it
in Redis) is not sent again; chunks written before a failure are unlinked (never indexed).
Publisher thread only (:mod:`tiered_kv.shared.publisher`, through ``SharedTier.publish``);
bytes only, never MLX. What it uses of the tier is :class:`Tier` (a Protocol: the tier calls this
module, so this module imports nothing of it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import redis

from tiered_kv import keys
from tiered_kv.declared import Serving
from tiered_kv.shared import bulk, reads
from tiered_kv.shared.health import Health, quietly


class Match(Protocol):
    """An entry a lookup found (:class:`redis_tier.SharedHit`): what the skip check reads."""

    @property
    def entry_id(self) -> str: ...
    @property
    def tokens(self) -> int: ...  # ids in common with the entry to publish
    @property
    def entry_tokens(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def nchunks(self) -> int: ...


class Tier(Protocol):
    """What the write path uses of :class:`redis_tier.SharedTier` (see there)."""

    client: redis.Redis
    health: Health
    block_tokens: int
    seed: str
    chunk_bytes: int
    describe: Callable[[memoryview], Serving | None] | None

    def key(self, kind: str, *parts: object) -> str: ...
    def block_keys(self, hashes: Sequence[int]) -> list[str]: ...
    def matches(self, tokens: np.ndarray, hashes: Sequence[int]) -> Sequence[Match]: ...
    def held(self, eid: str, nbytes: int, chunk_bytes: int, nchunks: int) -> str: ...
    def unlink(self, eid: str, nchunks: int) -> None: ...
    def unlink_lost(self, eid: str) -> None: ...


def publish(tier: Tier, data: Any, token_ids: Sequence[int] | np.ndarray) -> bool:
    """Store an entry's bytes (a buffer) for ``token_ids``; False when skipped (already
    there, too short, Redis down) or failed (counted). Publisher thread."""
    tokens = keys.as_int32(token_ids)
    hashes = keys.block_hashes(tokens, tier.block_tokens, tier.seed)
    if not hashes:
        return False
    view = memoryview(data).cast("B")
    done = tier.health.call("publish", lambda: _publish(tier, view, tokens, hashes), None)
    if done is None:
        return False
    # published (its index committed): a failure from here on leaves what it displaced for LRU
    # or verify --fix (unreachable: no lookup finds it), and the publish stands
    # the entries it displaced, not unlinked yet: every one it took a block key from until their
    # facts are read (an unlink skipped, Redis found down meanwhile, leaves them all)
    took = _took(*done)
    left = list(took)
    if not tier.health.call("unlink displaced", lambda: _unlink_displaced(tier, took, left), False):
        tier.health.count("displaced_left", len(left))  # entries, not failed calls
    return True


def _publish(
    tier: Tier, view: memoryview, tokens: np.ndarray, hashes: Sequence[int]
) -> tuple[Sequence[Any], str] | None:
    """Chunks, then the index: (what the block keys named just before, the new entry's id), or
    None where skipped (the same entry is there whole)."""
    old = next(iter(tier.matches(tokens, hashes)), None)  # the longest match
    if old is not None and old.tokens == old.entry_tokens == len(tokens):
        if tier.held(old.entry_id, old.nbytes, old.chunk_bytes, old.nchunks) == "whole":
            tier.health.count("publish_skipped")  # the same entry is there (another server wrote it)
            return None
        # a chunk evicted: published again, its index write displaces the old one (below)
    eid = uuid.uuid4().hex
    size, chunk = len(view), tier.chunk_bytes
    nchunks = -(-size // chunk)
    chunk_keys = [tier.key("c", eid, i) for i in range(nchunks)]
    try:
        for i in range(nchunks):  # chunks first ...
            bulk.set_from(tier.client, chunk_keys[i], view[i * chunk : (i + 1) * chunk])
        meta = {"n_tokens": len(tokens), "nbytes": size, "nchunks": nchunks,
                "chunk_bytes": chunk, "created": repr(time.time())}  # fmt: skip
        serving = tier.describe(view) if tier.describe is not None else None
        if serving is not None:
            meta["trimmable"] = int(serving.trimmable)
            meta["checkpoints"] = ",".join(map(str, serving.checkpoints)) or "-"
        names = tier.block_keys(hashes)
        pipe = tier.client.pipeline(transaction=True)  # ... the index last, atomically,
        for name in names:  # with the ids it displaces (read in the same step)
            reads.queue_eid(pipe, name)
        pipe.set(tier.key("t", eid), tokens.tobytes())
        pipe.hset(tier.key("e", eid), mapping=meta)  # type: ignore[arg-type]
        pipe.mset(dict.fromkeys(names, eid))
        replies = pipe.execute(raise_on_error=False)  # a block key of another type: no id
        failed = [r for r in replies[len(names) :] if isinstance(r, Exception)]
        if failed:
            raise failed[0]
    except BaseException:
        quietly(lambda: tier.client.unlink(*chunk_keys))  # never indexed: orphans
        raise
    tier.health.add(publishes=1, publish_bytes=size)
    return replies[: len(names)], eid


def _unlink_displaced(tier: Tier, deepest: dict[str, int], left: list[str]) -> bool:
    """Unlink each entry whose deepest block key the new entry ``eid``'s index write took
    (``deepest``: :func:`_took` of what the block keys named just before): it holds no block ``eid`` does not, so
    every block key that named it names ``eid`` now — no lookup can find it again (a
    continuation's older entry; the same entry published by another server at the same
    moment, whichever index write came first). Only an entry's own publish names it in a
    block key, so nothing makes it reachable again. One whose facts Redis evicted (its ``e:``
    hash gone) is unlinked too, by its id and chunk naming: a lookup reads the facts first, so
    it was unreachable already. One round trip when any was displaced.
    True when done; a failure raises (:meth:`Health.call` counts it), ``left`` then holds the
    entries not unlinked: those it displaced, or, where reading which it displaced failed, every
    entry of ``deepest`` (as the caller gives it: which of them it displaced is known once their
    facts are read)."""
    if not deepest:
        return True
    pipe = tier.client.pipeline(transaction=False)
    for other in deepest:
        reads.queue_fields(pipe, tier.key("e", other), reads.FACTS)
    displaced: list[tuple[str, int | None]] = []  # (id, chunk count; None: its facts evicted)
    for (other, depth), reply in zip(deepest.items(), pipe.execute(raise_on_error=False),
                                     strict=True):  # fmt: skip
        got = reads.fields_of(reply, reads.FACTS)
        facts = reads.facts_of(got.values) if got is not None else None
        if facts is not None and facts[0] // tier.block_tokens == depth + 1:
            displaced.append((other, facts[2]))
        elif got is not None and got.gone:  # its facts evicted: no lookup serves it, at any depth
            displaced.append((other, None))
    left[:] = [other for other, _ in displaced]
    for other, nchunks in displaced:
        if nchunks is None:
            tier.unlink_lost(other)
        else:
            tier.unlink(other, nchunks)
        left.remove(other)
        tier.health.count("superseded")
    return True


def _took(was: Sequence[Any], eid: str) -> dict[str, int]:
    """{entry id: its deepest block} of the entries other than ``eid`` that ``was`` (what the
    block keys named before ``eid``'s index write, in block order) names."""
    deepest: dict[str, int] = {}
    for depth, raw in enumerate(was):
        other = reads.eid_of(raw)
        if other is not None and other != eid:
            deepest[other] = depth
    return deepest
