"""SharedTier: a cold tier shared by many servers, on Redis. Bytes only — never MLX.

Every key lives under ``tkv:<fingerprint>:`` (the cold tier's fingerprint: model, tokenizer, KV
format, stored-KV quantisation, cache salt), so tenants with different fingerprints share nothing::

    c:<eid>:<i>  string  chunk ``i`` of the entry's bytes (the entry file's exact bytes, cut into
                         ``chunk_bytes`` pieces, the last one shorter; ``CHUNK_BYTES``)
    t:<eid>      string  the entry's token ids, int32 little-endian
    e:<eid>      hash    n_tokens, nbytes, nchunks, chunk_bytes, created; trimmable (0 / 1) and
                         checkpoints (ascending positions, comma-separated): what the entry serves
                         (absent from entries published before they were: not known)
    b:<hash>     string  ``<eid>`` of the newest entry holding block ``<hash>`` (the chained block
                         hashes of ``tiered_kv.keys``, seeded with the fingerprint and block size)

**Publish** writes the chunks first, then the index in one MULTI/EXEC, and unlinks the entries
its index write displaced (:mod:`writes`, where the argument for that rule is).
**Lookup** is at most two round trips: the prompt's block keys (only an id's length of each),
then (pipelined) the token prefix and the facts of at most three candidate entries, deepest first
— token ids are compared exactly. What Redis holds is data (any value may be 512 MB): every index
value is read within its bound, a field's length and value in one atomic step (:mod:`reads`). The hit is the candidate serving the most of the
prompt (:func:`served`: the hot and disk tiers' rule over its ``trimmable`` / ``checkpoints``),
not the longest match: one that cannot be cut back and diverges before its end serves only a
checkpoint, or nothing. **Fetch** reads every chunk straight into the
entry's buffer (:mod:`bulk`) and runs ``check`` — the entry format's own checks (header checksum,
fingerprint, data digests) returning its token ids, which must be the index's — before anything is
returned. Capacity and eviction are Redis's own (``maxmemory`` + an LRU policy).

Threads: ``lookup`` runs on the request thread, ``fetch`` there or on a thread of its own beside
the batch (``TieredCache``; its ``stop`` ends it between chunks once its request is gone),
``publish`` on the publisher thread (:mod:`tiered_kv.shared.publisher`); the redis client is
thread-safe (a connection pool), the counters are under a lock (:mod:`health`).

Faults: every call is bounded by the socket timeout (``TIERED_KV_SHARED_TIMEOUT``), resolving the
host name included (:mod:`resolve`); a connection error or timeout (a fetch past its deadline
too) marks Redis down for an exponential backoff (:mod:`health`: the backoff, the counters and
the messages logged once).
A corrupt entry (``check`` raised ``ValueError``) is counted, logged once and unlinked from Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tiered_kv import keys, policy
from tiered_kv.declared import Serving
from tiered_kv.prefix import common_prefix
from tiered_kv.shared import bulk, reads, resolve, writes
from tiered_kv.shared.health import Health, quietly

log = logging.getLogger(__name__)

#: bytes per Redis value: far under Redis's 512 MB value limit, large enough that a 4 GB entry
#: is 64 round trips' worth of values, not thousands — and just under 64 MiB: Redis stores a value
#: with a few bytes of header in one jemalloc allocation, and a value of exactly 64 MiB lands in
#: the 80 MiB size class (25 % of ``maxmemory`` lost; a 4 GB entry then needs 5 GB of Redis)
CHUNK_BYTES = (64 << 20) - 64
_CANDIDATES = 3
MAX_ENTRY_BYTES = 256 << 30  # a claimed size past this is never allocated
_MIN_RATE = 50e6  # bytes/s: a fetch slower than this overall is abandoned (a miss)
MAX_CHUNKS = 1 << 16  # chunks an entry may have (256 GiB in 64 MiB chunks is 4096)
#: chunk names of an entry whose facts are gone asked in its first round trip, doubling up to
#: ``_PROBE_MAX`` (:meth:`unlink_lost`)
_PROBE, _PROBE_MAX = 64, 4096

#: entry bytes → its token ids, after the entry format's own integrity checks; raises ValueError
#: (e.g. ``store.CorruptEntry``) for anything corrupt or foreign
Check = Callable[[memoryview], np.ndarray]


@dataclass(frozen=True)
class SharedHit:
    entry_id: str
    tokens: int  # exact common prefix with the prompt (ids compared, not hashes)
    entry_tokens: int
    nbytes: int
    nchunks: int
    chunk_bytes: int
    #: the index's token ids (int32 LE) as the lookup read them: the verified entry must hold them
    indexed: bytes = field(default=b"", repr=False)
    #: what the entry serves, as its publisher described it; None: not known (published before
    #: the description was, or a description no publisher writes)
    serving: Serving | None = None
    #: prompt tokens it serves (:func:`served`): what the lookup ranked it by
    serves: int = 0


#: entry bytes → whether its layers can be cut back and its checkpoint positions, or None
Describe = Callable[[memoryview], Serving | None]


@dataclass(frozen=True)
class Fetched:
    data: bytearray  # the entry's bytes, verified
    tokens: np.ndarray  # its token ids (int32), from the verified bytes


def redact(url: str) -> str:
    """``url`` without its password (for logs and `cache stats`)."""
    u = urlsplit(url)
    if u.password is None:
        return url
    host = u.hostname or ""
    netloc = f"{u.username or ''}:***@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, "", ""))


def connect(url: str, timeout: float) -> redis.Redis:
    """A client whose every call gives up after ``timeout`` seconds, with no retries of its own
    (the tier's backoff decides when to try again). Its host name is resolved off the calling
    thread, within the same timeout (:mod:`resolve`)."""
    return redis.Redis.from_url(
        url,
        connection_class=resolve.connection_class(urlsplit(url).scheme),
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
        decode_responses=False,
    )


class SharedTier:
    def __init__(
        self,
        url: str,
        fingerprint: str,
        block_tokens: int,
        check: Check,
        timeout: float = 1.0,
        chunk_bytes: int = CHUNK_BYTES,
        max_bytes: int = MAX_ENTRY_BYTES,
        describe: Describe | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing is sent to Redis here: a server starts whether or not Redis is up. Entries
        claiming more than ``max_bytes`` are never fetched (what Redis says is data).
        ``describe``: what a published entry serves, from its bytes (kept with its facts).
        ``clock``: what the backoff after a failure is measured by (:class:`Health`)."""
        self.url = redact(url)
        self.fingerprint = fingerprint
        self.block_tokens = block_tokens
        self.seed = f"{fingerprint}:{block_tokens}"  # the cold tier's seed: same hashes
        self.prefix = f"tkv:{fingerprint}:"
        self.check = check
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.max_bytes = max_bytes
        self.describe = describe
        self.client = connect(url, timeout)
        counts: dict[str, Any] = dict.fromkeys(
            ("lookups", "hits", "misses", "fetches", "fetch_bytes", "misses_evicted", "corrupt",
             "publishes", "publish_bytes", "publish_skipped", "superseded", "displaced_left",
             "errors", "timeouts", "skipped_down", "outages", "too_large", "fetches_stopped"), 0
        )  # fmt: skip
        counts["fetch_seconds"] = 0.0
        self.health = Health(self.url, counts, log, clock)

    # -- keys ------------------------------------------------------------------------------
    def key(self, kind: str, *parts: object) -> str:
        return self.prefix + ":".join((kind, *(str(p) for p in parts)))

    def block_keys(self, hashes: Sequence[int]) -> list[str]:
        return [self.key("b", f"{h:016x}") for h in hashes]

    # -- request thread --------------------------------------------------------------------
    def lookup(self, prompt_ids: Sequence[int] | np.ndarray) -> SharedHit | None:
        """The candidate entry serving the most of ``prompt_ids`` (:func:`served`; the deepest
        on a tie), or None: none serves any token (also when Redis is down, slow, or has evicted
        the entries' index)."""
        tokens = keys.as_int32(prompt_ids)
        hashes = keys.block_hashes(tokens, self.block_tokens, self.seed)
        if not hashes:
            return None
        self.health.count("lookups")
        none: list[SharedHit] = []
        hits = self.health.call("lookup", lambda: self.matches(tokens, hashes), none)
        hit = max(hits, key=lambda h: h.serves, default=None)  # the first on a tie: the deepest
        hit = hit if hit is not None and hit.serves > 0 else None
        self.health.count("hits" if hit is not None else "misses")
        return hit

    def matches(self, tokens: np.ndarray, hashes: Sequence[int]) -> list[SharedHit]:
        """The candidates sharing a prefix with ``tokens`` whose facts read, longest common
        prefix first (the deepest block's entry first on a tie)."""
        cands = self._candidates(hashes)
        if not cands:
            return []
        bounds = {**reads.FACTS, **reads.SERVING}
        pipe = self.client.pipeline(transaction=False)
        for eid in cands:  # each value read within its bound: any value may be 512 MB
            reads.queue_tokens(pipe, self.key("t", eid), len(tokens))
            reads.queue_fields(pipe, self.key("e", eid), bounds)
        replies = pipe.execute(raise_on_error=False)  # a key of another type: that one skipped
        self.health.refused("lookup", replies)
        hits = []
        for i, eid in enumerate(cands):
            raw, got = reads.tokens_of(replies[2 * i]), reads.fields_of(replies[2 * i + 1], bounds)
            facts = reads.facts_of(got.values[: len(reads.FACTS)]) if got is not None else None
            if raw is None or got is None or facts is None:
                continue  # a pointer to an entry Redis evicted (or a half-deleted one): skip it
            n = common_prefix(np.frombuffer(raw, dtype="<i4"), tokens)
            if n > 0:
                serving = reads.serving_of(got.values[len(reads.FACTS) :])
                serves = served(n, len(tokens), facts[0], serving)
                hits.append(SharedHit(eid, n, *facts, indexed=raw, serving=serving, serves=serves))
        hits.sort(key=lambda h: -h.tokens)  # stable: the deepest block's entry first on a tie
        return hits

    def _candidates(self, hashes: Sequence[int]) -> list[str]:
        """Entry ids the prompt's block keys name, deepest first (at most ``_CANDIDATES``). Only
        an id's length is read of each value (a block key is another writer's data: 512 MB)."""
        pipe = self.client.pipeline(transaction=False)
        for name in self.block_keys(hashes):
            reads.queue_eid(pipe, name)  # a block key is another writer's data: 512 MB
        cands: list[str] = []
        for raw in reversed(pipe.execute(raise_on_error=False)):
            eid = reads.eid_of(raw)
            if eid is not None and eid not in cands:
                cands.append(eid)
                if len(cands) == _CANDIDATES:
                    break
        return cands

    def fetch(self, hit: SharedHit, stop: threading.Event | None = None) -> Fetched | None:
        """The entry's verified bytes and token ids, or None: a chunk missing (evicted), corrupt
        bytes (the entry is then unlinked), Redis down / slow / restarted, or ``stop`` set (its
        request went away: the rest of the chunks are not read)."""
        t0 = time.perf_counter()
        got = self.health.call("fetch", lambda: self._fetch(hit, stop), None)
        if got is not None:
            self.health.add(fetches=1, fetch_bytes=len(got.data),
                            fetch_seconds=time.perf_counter() - t0)  # fmt: skip
        return got

    def _fetch(self, hit: SharedHit, stop: threading.Event | None) -> Fetched | None:
        size, chunk = hit.nbytes, hit.chunk_bytes
        if size > self.max_bytes:
            self.health.count("too_large")
            return None
        held = self.held(hit.entry_id, size, chunk, hit.nchunks)
        if held == "incomplete":  # Redis evicted a chunk: the entry is gone for every server
            self.health.count("misses_evicted")
            self.unlink(hit.entry_id, hit.nchunks)
            return None
        if held == "corrupt":
            return self._corrupt(hit, "its facts or chunks are no entry's")
        names = [self.key("c", hit.entry_id, i) for i in range(hit.nchunks)]
        try:
            buf = bytearray(size)
        except MemoryError:
            self.health.count("too_large")
            return None
        view = memoryview(buf)
        deadline = time.monotonic() + self.timeout + size / _MIN_RATE
        for i, name in enumerate(names):  # one round trip per chunk: latency ≪ its transfer
            if stop is not None and stop.is_set():
                self.health.count("fetches_stopped")
                return None
            lo = i * chunk
            try:
                got = bulk.get_into(self.client, name, view[lo : lo + chunk], deadline)
            except ValueError as e:
                return self._corrupt(hit, f"chunk {i}: {e}")
            except TimeoutError:  # as slow as down: a backoff, or every request waits as long
                self.health.once("slow", "shared tier too slow: fetch of %d bytes abandoned (a miss)",
                                 size)  # fmt: skip
                raise
            if got is None:
                self.health.count("misses_evicted")  # evicted meanwhile: the entry is gone
                self.unlink(hit.entry_id, hit.nchunks)
                return None
        try:
            tokens = self.check(view)
        except ValueError as e:
            return self._corrupt(hit, str(e))
        # each checks out alone, but the index named ids the entry does not hold
        if len(tokens) != hit.entry_tokens or tokens.tobytes()[: len(hit.indexed)] != hit.indexed:
            return self._corrupt(hit, "its token ids are not its index's")
        return Fetched(buf, tokens)

    def _corrupt(self, hit: SharedHit, why: str) -> Fetched | None:
        """Count, log once, unlink the entry, chunks too (so no other server trips on it, and
        no byte of it stays where nothing reads it): a miss."""
        self.health.count("corrupt")
        self.health.once("corrupt", "shared entry %s is corrupt, unlinked (a miss): %s",
                         hit.entry_id, why)  # fmt: skip
        self.unlink(hit.entry_id, hit.nchunks)
        return None

    # -- publisher thread ------------------------------------------------------------------
    def publish(self, data: Any, token_ids: Sequence[int] | np.ndarray) -> bool:
        """Store an entry's bytes (a buffer) for ``token_ids`` (:func:`writes.publish`); False
        when skipped (already there, too short, Redis down) or failed (counted). Publisher thread."""
        return writes.publish(self, data, token_ids)

    # -- an entry's keys (fetch, publish, survey) ------------------------------------------
    def held(self, eid: str, nbytes: int, chunk_bytes: int, nchunks: int) -> str:
        """What Redis holds of an entry, asked before a byte is allocated for it (its facts are
        data): "whole", "incomplete" (a chunk evicted) or "corrupt" (facts no entry has, chunks of
        another type, or lengths that do not add up to its size). One round trip."""
        if not consistent(nbytes, chunk_bytes, nchunks) or nchunks > MAX_CHUNKS:
            return "corrupt"
        pipe = self.client.pipeline(transaction=False)
        for i in range(nchunks):
            pipe.strlen(self.key("c", eid, i))
        lengths = pipe.execute(raise_on_error=False)
        if any(not isinstance(n, int) for n in lengths):  # WRONGTYPE: not a string
            return "corrupt"
        if not all(lengths):
            return "incomplete"
        return "whole" if sum(lengths) == nbytes else "corrupt"

    def unlink(self, eid: str, nchunks: int) -> None:
        """An entry's index and chunks; a count Redis gave that no entry can have (a forged
        ``nchunks``: a list of 10**9 names) unlinks the index only."""
        names = [self.key("e", eid), self.key("t", eid)]
        if 0 < nchunks <= MAX_CHUNKS:
            names += [self.key("c", eid, i) for i in range(nchunks)]
        self.client.unlink(*names)

    def unlink_lost(self, eid: str) -> None:
        """An entry whose facts Redis evicted: its token ids and every chunk of it still there.
        Nothing in Redis holds its chunk count any more, and LRU may have taken any run of its
        chunks (the oldest first: chunk 0 on), so no run of missing names ends the search (a
        run of 64 did, and every chunk past it was left for LRU). It ends at the entry's last
        chunk — the one shorter than a full chunk: every chunk before the last is full (this
        tier's ``chunk_bytes``, or the longest seen, for one another server cut larger) — or at
        ``MAX_CHUNKS`` (the last chunk evicted too, or a size of whole chunks): names asked 64
        a round trip, doubling to 4096, so at most ~20 round trips. Each round trip asks the
        names' lengths and unlinks them."""
        full, lo, n = self.chunk_bytes, 0, _PROBE
        while lo < MAX_CHUNKS:
            names = [self.key("c", eid, i) for i in range(lo, min(lo + n, MAX_CHUNKS))]
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            pipe.unlink(*names)
            if lo == 0:
                pipe.unlink(self.key("t", eid))
            replies = pipe.execute(raise_on_error=False)
            refused = [r for r in replies[len(names) :] if isinstance(r, Exception)]
            if refused:
                raise refused[0]
            lengths = [r for r in replies[: len(names)] if isinstance(r, int) and r > 0]
            full = max([full, *lengths])
            if any(x < full for x in lengths):  # its last chunk: nothing of it past this one
                return
            lo, n = lo + n, min(2 * n, _PROBE_MAX)

    # -- health ----------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self.health.up

    def ping(self) -> bool:
        """One round trip (CLI, tests); counts a failure like any call."""
        return bool(self.health.call("ping", self.client.ping, False))

    def stats(self) -> dict[str, Any]:
        out = self.health.stats()
        out["up"] = int(self.up)
        return out

    def close(self) -> None:
        quietly(self.client.close)


def consistent(nbytes: int, chunk_bytes: int, nchunks: int) -> bool:
    """Whether an entry's size facts (as Redis gives them: data) can be an entry's."""
    return 0 < chunk_bytes <= 512 << 20 and 0 < nbytes and nchunks == -(-nbytes // chunk_bytes)


def served(common: int, prompt_len: int, entry_tokens: int, serving: Serving | None) -> int:
    """Prompt tokens an entry with ``common`` ids in common serves (:func:`policy.servable`, the
    hot and disk tiers' rule), where its publisher said what it serves; where not, its common
    prefix (:func:`policy.servable_tokens`): the fetched entry says (``finding`` checks it)."""
    if serving is None:
        return policy.servable_tokens(common, prompt_len)
    return policy.servable(common, prompt_len, entry_tokens, serving.trimmable, serving.checkpoints)

