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

**Publish** writes the chunks first, then ``t:`` / ``e:`` / ``b:`` in one MULTI/EXEC: a reader that
finds an index key finds every chunk, unless Redis evicted one since — then the hit is a miss.
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
thread-safe (a connection pool), the counters are under a lock.

Faults: every call is bounded by the socket timeout (``TIERED_KV_SHARED_TIMEOUT``), resolving the
host name included (:mod:`resolve`); a connection error or timeout (a fetch past its deadline
too) marks Redis down for an exponential backoff (1 s doubling to 30 s) during which calls are
skipped at once (counted ``skipped_down``); the outage is logged once and its end once.
A corrupt entry (``check`` raised ``ValueError``) is counted, logged once and unlinked from Redis.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tiered_kv import keys, policy
from tiered_kv.declared import Serving
from tiered_kv.prefix import common_prefix
from tiered_kv.shared import bulk, reads, resolve

log = logging.getLogger(__name__)
T = TypeVar("T")

#: bytes per Redis value: far under Redis's 512 MB value limit, large enough that a 4 GB entry
#: is 64 round trips' worth of values, not thousands — and just under 64 MiB: Redis stores a value
#: with a few bytes of header in one jemalloc allocation, and a value of exactly 64 MiB lands in
#: the 80 MiB size class (25 % of ``maxmemory`` lost; a 4 GB entry then needs 5 GB of Redis)
CHUNK_BYTES = (64 << 20) - 64
_CANDIDATES = 3
MAX_ENTRY_BYTES = 256 << 30  # a claimed size past this is never allocated
_BACKOFF_MIN, _BACKOFF_MAX = 1.0, 30.0
_MIN_RATE = 50e6  # bytes/s: a fetch slower than this overall is abandoned (a miss)
MAX_CHUNKS = 1 << 16  # chunks an entry may have (256 GiB in 64 MiB chunks is 4096)

#: entry bytes → its token ids, after the entry format's own integrity checks; raises ValueError
#: (e.g. ``store.CorruptEntry``) for anything corrupt or foreign
Check = Callable[[memoryview], np.ndarray]
_NET = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


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
    ) -> None:
        """Nothing is sent to Redis here: a server starts whether or not Redis is up. Entries
        claiming more than ``max_bytes`` are never fetched (what Redis says is data).
        ``describe``: what a published entry serves, from its bytes (kept with its facts)."""
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
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(
            ("lookups", "hits", "misses", "fetches", "fetch_bytes", "misses_evicted", "corrupt",
             "publishes", "publish_bytes", "publish_skipped", "superseded", "errors", "timeouts",
             "skipped_down", "outages", "too_large", "fetches_stopped"), 0
        )  # fmt: skip
        self._fetch_seconds = 0.0
        self._failures = 0
        self._down_until = 0.0
        self._logged: set[str] = set()

    # -- keys ------------------------------------------------------------------------------
    def key(self, kind: str, *parts: object) -> str:
        return self.prefix + ":".join((kind, *(str(p) for p in parts)))

    def _block_keys(self, hashes: Sequence[int]) -> list[str]:
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
        self._count("lookups")
        none: list[SharedHit] = []
        hits = self._call("lookup", lambda: self._matches(tokens, hashes), none)
        hit = max(hits, key=lambda h: h.serves, default=None)  # the first on a tie: the deepest
        hit = hit if hit is not None and hit.serves > 0 else None
        self._count("hits" if hit is not None else "misses")
        return hit

    def _matches(self, tokens: np.ndarray, hashes: Sequence[int]) -> list[SharedHit]:
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
        self._refused("lookup", replies)
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
        for name in self._block_keys(hashes):
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
        got = self._call("fetch", lambda: self._fetch(hit, stop), None)
        if got is not None:
            with self._lock:
                self._stats["fetches"] += 1
                self._stats["fetch_bytes"] += len(got.data)
                self._fetch_seconds += time.perf_counter() - t0
        return got

    def _fetch(self, hit: SharedHit, stop: threading.Event | None) -> Fetched | None:
        size, chunk = hit.nbytes, hit.chunk_bytes
        if size > self.max_bytes:
            self._count("too_large")
            return None
        held = self.held(hit.entry_id, size, chunk, hit.nchunks)
        if held == "incomplete":  # Redis evicted a chunk: the entry is gone for every server
            self._count("misses_evicted")
            self._unlink(hit.entry_id, hit.nchunks)
            return None
        if held == "corrupt":
            return self._corrupt(hit, "its facts or chunks are no entry's")
        names = [self.key("c", hit.entry_id, i) for i in range(hit.nchunks)]
        try:
            buf = bytearray(size)
        except MemoryError:
            self._count("too_large")
            return None
        view = memoryview(buf)
        deadline = time.monotonic() + self.timeout + size / _MIN_RATE
        for i, name in enumerate(names):  # one round trip per chunk: latency ≪ its transfer
            if stop is not None and stop.is_set():
                self._count("fetches_stopped")
                return None
            lo = i * chunk
            try:
                got = bulk.get_into(self.client, name, view[lo : lo + chunk], deadline)
            except ValueError as e:
                return self._corrupt(hit, f"chunk {i}: {e}")
            except TimeoutError:  # as slow as down: a backoff, or every request waits as long
                self._once("slow", "shared tier too slow: fetch of %d bytes abandoned (a miss)", size)
                raise
            if got is None:
                self._count("misses_evicted")  # evicted meanwhile: the entry is gone
                self._unlink(hit.entry_id, hit.nchunks)
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
        self._count("corrupt")
        self._once("corrupt", "shared entry %s is corrupt, unlinked (a miss): %s", hit.entry_id, why)
        self._unlink(hit.entry_id, hit.nchunks)
        return None

    # -- publisher thread ------------------------------------------------------------------
    def publish(self, data: Any, token_ids: Sequence[int] | np.ndarray) -> bool:
        """Store an entry's bytes (a buffer) for ``token_ids``; False when skipped (already
        there, too short, Redis down) or failed (counted). Publisher thread."""
        tokens = keys.as_int32(token_ids)
        hashes = keys.block_hashes(tokens, self.block_tokens, self.seed)
        if not hashes:
            return False
        view = memoryview(data).cast("B")
        return bool(self._call("publish", lambda: self._publish(view, tokens, hashes), False))

    def _publish(self, view: memoryview, tokens: np.ndarray, hashes: Sequence[int]) -> bool:
        old = next(iter(self._matches(tokens, hashes)), None)  # the longest match
        if old is not None and old.tokens == old.entry_tokens == len(tokens):
            if self.held(old.entry_id, old.nbytes, old.chunk_bytes, old.nchunks) == "whole":
                self._count("publish_skipped")  # the same entry is there (another server wrote it)
                return False
            # a chunk evicted: published again, its index write displaces the old one (below)
        eid = uuid.uuid4().hex
        size, chunk = len(view), self.chunk_bytes
        nchunks = -(-size // chunk)
        chunk_keys = [self.key("c", eid, i) for i in range(nchunks)]
        try:
            for i in range(nchunks):  # chunks first ...
                bulk.set_from(self.client, chunk_keys[i], view[i * chunk : (i + 1) * chunk])
            meta = {"n_tokens": len(tokens), "nbytes": size, "nchunks": nchunks,
                    "chunk_bytes": chunk, "created": repr(time.time())}  # fmt: skip
            serving = self.describe(view) if self.describe is not None else None
            if serving is not None:
                meta["trimmable"] = int(serving.trimmable)
                meta["checkpoints"] = ",".join(map(str, serving.checkpoints)) or "-"
            names = self._block_keys(hashes)
            pipe = self.client.pipeline(transaction=True)  # ... the index last, atomically,
            for name in names:  # with the ids it displaces (read in the same step)
                reads.queue_eid(pipe, name)
            pipe.set(self.key("t", eid), tokens.tobytes())
            pipe.hset(self.key("e", eid), mapping=meta)  # type: ignore[arg-type]
            pipe.mset(dict.fromkeys(names, eid))
            replies = pipe.execute(raise_on_error=False)  # a block key of another type: no id
            failed = [r for r in replies[len(names) :] if isinstance(r, Exception)]
            if failed:
                raise failed[0]
        except BaseException:
            _quietly(lambda: self.client.unlink(*chunk_keys))  # never indexed: orphans
            raise
        self._unlink_displaced(replies[: len(names)], eid)
        with self._lock:
            self._stats["publishes"] += 1
            self._stats["publish_bytes"] += size
        return True

    def _unlink_displaced(self, was: Sequence[Any], eid: str) -> None:
        """Unlink each entry whose deepest block key ``eid``'s index write took (``was``: what the
        block keys named just before, in block order): it holds no block ``eid`` does not, so
        every block key that named it names ``eid`` now — no lookup can find it again (a
        continuation's older entry; the same entry published by another server at the same
        moment, whichever index write came first). Only an entry's own publish names it in a
        block key, so nothing makes it reachable again. One round trip when any was displaced."""
        deepest: dict[str, int] = {}
        for depth, raw in enumerate(was):
            other = reads.eid_of(raw)
            if other is not None and other != eid:
                deepest[other] = depth
        if not deepest:
            return
        pipe = self.client.pipeline(transaction=False)
        for other in deepest:
            reads.queue_fields(pipe, self.key("e", other), reads.FACTS)
        for (other, depth), reply in zip(deepest.items(), pipe.execute(raise_on_error=False),
                                         strict=True):  # fmt: skip
            got = reads.fields_of(reply, reads.FACTS)
            facts = reads.facts_of(got.values) if got is not None else None
            if facts is not None and facts[0] // self.block_tokens == depth + 1:
                self._unlink(other, facts[2])
                self._count("superseded")

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

    def _unlink(self, eid: str, nchunks: int) -> None:
        """An entry's index and chunks; a count Redis gave that no entry can have (a forged
        ``nchunks``: a list of 10**9 names) unlinks the index only."""
        names = [self.key("e", eid), self.key("t", eid)]
        if 0 < nchunks <= MAX_CHUNKS:
            names += [self.key("c", eid, i) for i in range(nchunks)]
        self.client.unlink(*names)

    # -- health ----------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        """``fn()`` unless Redis is in backoff; a network failure starts / extends the backoff."""
        if time.monotonic() < self._down_until:
            self._count("skipped_down")
            return default
        try:
            out = fn()
        except _NET as e:
            self._down(what, e)
            return default
        except redis.exceptions.RedisError as e:  # e.g. OOM under maxmemory noeviction
            self._count("errors")
            self._once(f"error:{what}", "shared tier %s failed: %s", what, e)
            return default
        if self._failures:
            with self._lock:
                self._failures = 0
                self._logged.discard("down")
            log.warning("shared tier %s is reachable again", self.url)
        return out

    def _down(self, what: str, e: BaseException) -> None:
        with self._lock:
            self._stats["errors"] += 1
            if isinstance(e, (redis.exceptions.TimeoutError, TimeoutError)):
                self._stats["timeouts"] += 1
            if self._failures == 0:
                self._stats["outages"] += 1
            self._failures += 1
            wait = min(_BACKOFF_MAX, _BACKOFF_MIN * 2 ** (self._failures - 1))
            self._down_until = time.monotonic() + wait
        self._once("down", "shared tier %s unreachable (%s: %s); local tiers only, retrying "
                   "with backoff", self.url, what, e)  # fmt: skip

    @property
    def up(self) -> bool:
        return self._failures == 0

    def ping(self) -> bool:
        """One round trip (CLI, tests); counts a failure like any call."""
        return bool(self._call("ping", self.client.ping, False))

    # -- counters --------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _refused(self, what: str, replies: Sequence[Any]) -> None:
        """Count and log (once) a pipeline's replies Redis refused for another reason than a key
        of another type (another writer's data, skipped): e.g. a server or proxy that runs no
        scripts, where every lookup would otherwise be a silent miss."""
        for r in replies:
            if isinstance(r, redis.exceptions.RedisError) and not str(r).startswith("WRONGTYPE"):
                self._count("errors")
                self._once(f"refused:{what}", "shared tier %s: Redis refused a read: %s", what, r)
                return

    def _once(self, kind: str, msg: str, *args: object) -> None:
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.warning(msg, *args)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
            out["fetch_seconds"] = self._fetch_seconds
        out["up"] = int(self.up)
        return out

    def close(self) -> None:
        _quietly(self.client.close)


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


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except (redis.exceptions.RedisError, OSError):
        pass
