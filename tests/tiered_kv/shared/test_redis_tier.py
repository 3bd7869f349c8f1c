"""SharedTier against a real redis-server: layout, exact-token hits, misses for every fault.

The entry bytes here are a toy format (``tokens ‖ payload ‖ xxh3``, ``tests/fixtures.py``) checked
by ``check``: this module tests the tier's byte mechanics (the publish path's own rules in
test_writes.py, the backoff and counters in test_health.py); tests/tiered_kv/shared/test_link.py
runs the real entry format through the real cold tier.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.fixtures import SHARED_BLOCK as BLOCK
from tests.fixtures import toy_check as check
from tests.fixtures import toy_entry as entry
from tests.fixtures import toy_ids as ids
from tests.fixtures import toy_tier as tier
from tiered_kv import declared
from tiered_kv.shared import redis_tier
from tiered_kv.shared.redis_tier import SharedTier


def test_publish_lookup_fetch_round_trip_in_chunks(redis_server):
    t = tier(redis_server.url)
    toks = ids(1, 100)
    data = entry(toks)
    assert t.publish(data, toks)
    prompt = toks[:70] + [5, 6, 7]
    hit = t.lookup(prompt)
    assert hit is not None and hit.tokens == 70 and hit.entry_tokens == 100
    assert hit.nchunks == -(-len(data) // 1000) > 1
    got = t.fetch(hit)
    assert got is not None and bytes(got.data) == data
    assert got.tokens.tolist() == toks
    s = t.stats()
    assert s["publishes"] == 1 and s["fetches"] == 1 and s["fetch_bytes"] == len(data)


def test_divergence_inside_a_block_is_compared_exactly(redis_server):
    t = tier(redis_server.url)
    toks = ids(2, 64)
    t.publish(entry(toks), toks)
    prompt = toks[:37] + [toks[37] + 1] + toks[38:]
    hit = t.lookup(prompt)
    assert hit is not None and hit.tokens == 37


def test_prompt_shorter_than_a_block_or_unknown_is_a_miss(redis_server):
    t = tier(redis_server.url)
    toks = ids(3, 64)
    t.publish(entry(toks), toks)
    assert t.lookup(toks[:10]) is None
    assert t.lookup(ids(4, 64)) is None


def test_other_fingerprint_shares_nothing(redis_server):
    toks = ids(5, 64)
    tier(redis_server.url, "fp-a").publish(entry(toks), toks)
    assert tier(redis_server.url, "fp-b").lookup(toks) is None
    keys = redis_server.client().keys("*")
    assert keys and all(k.startswith(b"tkv:fp-a:") for k in keys)


def test_missing_chunk_is_a_miss(redis_server):
    t = tier(redis_server.url)
    toks = ids(6, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None
    redis_server.client().delete(t.key("c", hit.entry_id, 1))  # what maxmemory eviction does
    assert t.fetch(hit) is None
    assert t.stats()["misses_evicted"] == 1


    assert t.lookup(toks) is None  # nobody else trips on it


def test_short_chunk_is_corrupt(redis_server):
    t = tier(redis_server.url)
    toks = ids(8, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None
    redis_server.client().set(t.key("c", hit.entry_id, 0), b"short")
    assert t.fetch(hit) is None and t.stats()["corrupt"] == 1


def test_flushed_redis_is_a_miss(redis_server):
    t = tier(redis_server.url)
    toks = ids(9, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    redis_server.client().flushall()
    assert t.lookup(toks) is None
    assert hit is not None and t.fetch(hit) is None


def test_redis_killed_mid_fetch_is_a_miss(redis_server, monkeypatch):
    t = tier(redis_server.url)
    toks = ids(14, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None and hit.nchunks > 2
    real = redis_tier.bulk.get_into
    calls = []

    def get_into(*a, **k):  # the fault: Redis dies after the first chunk came back
        calls.append(1)
        if len(calls) == 2:
            redis_server.kill()
        return real(*a, **k)

    monkeypatch.setattr(redis_tier.bulk, "get_into", get_into)
    assert t.fetch(hit) is None
    assert t.stats()["errors"] == 1 and len(calls) == 2


def test_password_in_url(tmp_path):
    from tests.redis_server import RedisServer

    srv = RedisServer(tmp_path / "r", password="s3cret").start()
    try:
        good = tier(srv.url)
        toks = ids(15, 64)
        assert good.publish(entry(toks), toks) and good.lookup(toks) is not None
        assert "s3cret" not in good.url
        bad = tier(srv.url.replace("s3cret", "wrong"))
        assert bad.lookup(toks) is None and bad.stats()["errors"] == 1
    finally:
        srv.kill()


def test_concurrent_publish_and_lookup(redis_server):
    t = tier(redis_server.url)
    seqs = [ids(100 + i, 48 + 16 * (i % 3)) for i in range(8)]
    threads = [threading.Thread(target=t.publish, args=(entry(s), s)) for s in seqs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for s in seqs:
        hit = t.lookup(s)
        assert hit is not None and hit.tokens == len(s)
        got = t.fetch(hit)
        assert got is not None and got.tokens.tolist() == s


@pytest.mark.parametrize(
    ("url", "shown"),
    [("redis://h", "redis://h"), ("rediss://:pw@h:6380/2", "rediss://:***@h:6380/2"),
     ("redis://u:p@10.0.0.1:1/0", "redis://u:***@10.0.0.1:1/0")],
)  # fmt: skip
def test_redact_hides_only_the_password(url, shown):
    assert redis_tier.redact(url) == shown


def test_claimed_size_past_the_cap_is_never_allocated(redis_server):
    t = SharedTier(redis_server.url, "fp-a", BLOCK, check, timeout=0.5, chunk_bytes=1000,
                   max_bytes=10_000)  # fmt: skip
    toks = ids(16, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None
    redis_server.client().hset(t.key("e", hit.entry_id), mapping={"nbytes": 1 << 40,
                                                                   "nchunks": -(-(1 << 40) // 1000)})
    hit = t.lookup(toks)
    assert hit is not None and t.fetch(hit) is None
    assert t.stats()["too_large"] == 1


def test_a_full_chunk_costs_redis_no_more_than_its_bytes(redis_server):
    """Redis keeps a value in one jemalloc allocation with a few bytes of header: chunks of
    exactly 64 MiB took the 80 MiB size class (a 4 GB entry needed 5 GB under maxmemory and was
    evicted from a Redis sized for it). ``MEMORY USAGE`` counts the allocation."""
    t = tier(redis_server.url, chunk=redis_tier.CHUNK_BYTES)
    toks = ids(9, 64)
    data = entry(toks, payload=redis_tier.CHUNK_BYTES)  # one full chunk and a short one
    assert t.publish(data, toks)
    hit = t.lookup(toks)
    assert hit is not None and hit.nchunks == 2
    usage = redis_server.client().memory_usage(t.key("c", hit.entry_id, 0))
    assert usage is not None and usage <= redis_tier.CHUNK_BYTES * 1.01
    got = t.fetch(hit)
    assert got is not None and bytes(got.data) == data


def test_a_forged_size_allocates_only_what_redis_holds(redis_server):
    """Another writer sets an entry's size facts to 150 GiB (consistent with each other, under a
    200 GB disk budget): the fetch allocated them — a MemoryError out of the request, a 500 —
    before the first chunk showed the bytes were not there. The chunks' lengths come first."""
    t = SharedTier(redis_server.url, "fp-a", BLOCK, check, timeout=0.5, chunk_bytes=1000,
                   max_bytes=200 << 30)  # fmt: skip
    toks = ids(31, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None
    size, chunk = 150 << 30, 512 << 20
    redis_server.client().hset(t.key("e", hit.entry_id), mapping={
        "nbytes": size, "chunk_bytes": chunk, "nchunks": -(-size // chunk)})  # fmt: skip
    hit = t.lookup(toks)
    assert hit is not None and hit.nbytes == size
    assert t.fetch(hit) is None and t.stats()["misses_evicted"] == 1  # chunks 1.. are not there


def test_a_read_past_its_deadline_stops_inside_a_chunk(redis_server):
    """A trickling link never trips the socket's per-recv timeout: a one-chunk entry was read to
    its end whatever the deadline (16 s for 4 MB at 256 KB/s, documented ~0.6 s)."""
    from tiered_kv.shared import bulk

    c = redis_server.client()
    c.set("big", b"x" * (4 << 20))
    out = memoryview(bytearray(4 << 20))
    with pytest.raises(TimeoutError):
        bulk.get_into(c, "big", out, deadline=time.monotonic() - 1)
    assert bulk.get_into(c, "big", out, deadline=time.monotonic() + 30) == 4 << 20


def test_an_entry_not_holding_the_indexed_tokens_is_corrupt(redis_server):
    """Another writer indexed an entry under token ids its bytes do not hold (each checks out
    alone): the fetch handed it over, so a request dropped its memory hit for a "shared hit" of
    0 tokens, and the lying index stayed for every server. The verified ids must be the index's."""
    t = tier(redis_server.url)
    toks, other = ids(34, 64), ids(35, 64)
    assert t.publish(entry(other), toks)
    hit = t.lookup(toks)
    assert hit is not None and hit.tokens == 64
    assert t.fetch(hit) is None and t.stats()["corrupt"] == 1
    assert t.lookup(toks) is None  # unlinked: nobody else fetches it


def test_a_corrupt_entry_is_a_miss_and_leaves_no_chunks_behind(redis_server):
    """A corrupt chunk is a miss, and the entry is unlinked chunks and all: its chunks were kept,
    and under ``noeviction`` (or until LRU reached them) held Redis memory nothing could read."""
    t = tier(redis_server.url)
    toks = ids(36, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None
    redis_server.client().setrange(t.key("c", hit.entry_id, 2), 10, b"\xff")
    assert t.fetch(hit) is None and t.stats()["corrupt"] == 1
    assert redis_server.client().keys(f"*{hit.entry_id}*") == []


def _sent(client) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_huge_block_pointer_is_never_read(redis_server):
    """A block key holding 8 MB (another writer's, or an attacker's) was read whole by the
    lookup's MGET — one per block of the prompt, each up to Redis's 512 MB value limit: a
    lookup could pull gigabytes into the request. An entry id is 32 bytes; nothing more is read."""
    t = tier(redis_server.url)
    toks = ids(37, 64)
    t.publish(entry(toks), toks)
    c = redis_server.client()
    hashes = redis_tier.keys.block_hashes(redis_tier.keys.as_int32(toks), BLOCK, t.seed)
    for h in hashes:
        c.set(t.key("b", f"{h:016x}"), b"0" * (8 << 20))
    before = _sent(c)
    assert t.lookup(toks) is None
    assert _sent(c) - before < 1 << 20


def test_huge_entry_facts_are_never_read(redis_server):
    """An entry's ``e:`` hash with an 8 MB field value was read whole by the lookup's HMGET (four
    fields of up to 512 MB, for each of three candidates). Facts are numbers: longer ones are
    not read, and the entry is no candidate."""
    t = tier(redis_server.url)
    toks = ids(38, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None
    c = redis_server.client()
    c.hset(t.key("e", hit.entry_id), "nbytes", b"1" * (8 << 20))
    before = _sent(c)
    assert t.lookup(toks) is None
    assert _sent(c) - before < 1 << 20


def test_a_key_of_another_type_blocks_neither_lookup_nor_publish(redis_server):
    """An entry's ``t:`` key replaced by a hash (another writer's layout): the lookup's pipeline
    raised WRONGTYPE for all its candidates — every lookup of the prefix an error — and so did
    the publisher's, so the prefix could never be published again."""
    t = tier(redis_server.url)
    toks = ids(39, 64)
    t.publish(entry(toks[:32]), toks[:32])
    old = t.lookup(toks[:32])
    assert old is not None
    c = redis_server.client()
    c.delete(t.key("t", old.entry_id))
    c.hset(t.key("t", old.entry_id), "x", "y")
    assert t.lookup(toks) is None
    assert t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None and hit.tokens == 64 and t.fetch(hit) is not None
    assert t.stats()["errors"] == 0


def test_a_fetch_timing_out_starts_the_backoff(redis_server, monkeypatch):
    """Redis stalls in the middle of a fetch: the read timed out (the fetch's own deadline, or
    the socket's) and was counted, but Redis was not marked down — so the next request paid the
    full timeout again (a trickling link: every request, each up to its whole deadline)."""
    t = tier(redis_server.url, timeout=0.3)
    toks = ids(40, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None and hit.nchunks > 2
    real = redis_tier.bulk.get_into
    calls = []

    def get_into(*a, **k):  # the fault: Redis stops answering after the first chunk
        calls.append(1)
        if len(calls) == 2:
            redis_server.stop_signal(signal.SIGSTOP)
        return real(*a, **k)

    monkeypatch.setattr(redis_tier.bulk, "get_into", get_into)
    try:
        assert t.fetch(hit) is None
        assert t.lookup(toks) is None  # in backoff: not tried
    finally:
        redis_server.stop_signal(signal.SIGCONT)
    s = t.stats()
    assert s["timeouts"] == 1 and s["outages"] == 1 and s["skipped_down"] == 1 and s["up"] == 0


@pytest.mark.parametrize("serving", [declared.Serving(False, (32, 64)), declared.Serving(True, ()),
                                     declared.Serving(False, ())])  # fmt: skip
def test_what_an_entry_serves_is_kept_with_its_facts(redis_server, serving):
    """The publisher's description of an entry (its layers can be cut back, its checkpoints)
    comes back with a lookup, so an entry that cannot serve a prompt is never fetched for it."""
    t = SharedTier(redis_server.url, "fp-s", BLOCK, check, timeout=0.5, chunk_bytes=1000,
                   describe=lambda view: serving)  # fmt: skip
    toks = ids(40, 100)
    assert t.publish(entry(toks), toks)
    hit = t.lookup(toks + [1])
    assert hit is not None and hit.serving == serving and hit.serves == 100
    hit = t.lookup(toks[:70] + [1])
    if serving.trimmable or serving.checkpoints:
        assert hit is not None and hit.serving == serving
    else:  # it serves none of this prompt: no hit
        assert hit is None


def test_an_entry_published_undescribed_or_described_wrongly_serves_what_is_not_known(redis_server):
    """Entries published before the description was kept, or whose fields hold what no publisher
    writes (or too much to read), come back without one: then the fetched entry says."""
    t = tier(redis_server.url)
    toks = ids(41, 100)
    assert t.publish(entry(toks), toks)
    assert t.lookup(toks).serving is None
    r = redis_server.client()
    (e,) = [k for k in r.keys("*") if b":e:" in k]
    for trim, points in ((b"2", b"-"), (b"1", b"3,x"), (b"0", b"1" * 19), (b"1", b"7" * (65 << 10))):
        r.hset(e, mapping={"trimmable": trim, "checkpoints": points})
        hit = t.lookup(toks)
        assert hit is not None and hit.serving is None, (trim, points[:20])
    r.hset(e, mapping={"trimmable": b"0", "checkpoints": b"48,16"})
    assert t.lookup(toks).serving == declared.Serving(False, (16, 48))


@pytest.mark.parametrize(
    ("deep", "chosen", "serves"),
    [(declared.Serving(False, ()), "shallow", 32), (declared.Serving(False, (16,)), "shallow", 32),
     (declared.Serving(False, (48,)), "deep", 48), (declared.Serving(True, ()), "deep", 50)],
)  # fmt: skip
def test_a_lookup_names_the_candidate_serving_the_most(redis_server, deep, chosen, serves):
    """The lookup named the candidate with the longest common prefix. One whose layers cannot be
    cut back (a sliding window, recurrent state) and that diverges from the prompt before its end
    serves only a checkpoint at or before the divergence, or nothing: it was named over a
    shallower candidate serving more, and the tiers then took no shared hit at all. The lookup
    now says what a hit serves (policy.servable, the hot and disk tiers' rule) and names the
    candidate serving the most (tests/tiered_kv/cold/test_lookup.py, the disk's)."""
    prompt = ids(42, 80)
    deep_toks = prompt[:50] + ids(43, 16)  # the prompt's first 3 blocks, then its own
    shallow_toks = prompt[:32] + [prompt[32] + 1] + ids(44, 15)  # the first 2 blocks
    described = {len(deep_toks): deep, len(shallow_toks): declared.Serving(True, ())}
    t = SharedTier(redis_server.url, "fp-r", BLOCK, check, timeout=0.5, chunk_bytes=1000,
                   describe=lambda view: described[len(check(view))])  # fmt: skip
    assert t.publish(entry(deep_toks), deep_toks)
    assert t.publish(entry(shallow_toks), shallow_toks)  # newest at blocks 0-1; deep keeps block 2
    hit = t.lookup(prompt)
    assert hit is not None and hit.serves == serves
    assert hit.entry_tokens == len(deep_toks if chosen == "deep" else shallow_toks)
    assert hit.tokens == (50 if chosen == "deep" else 32)


def test_a_fact_rewritten_during_a_lookup_is_never_read(redis_server, monkeypatch):
    """The lookup read the facts' lengths, then (another round trip) the facts: another writer
    setting a field to 8 MB between the two reads had it read whole. Each length and value is now
    read in one atomic step (a script), so no write falls between them. The fault: the field is
    rewritten once the lookup's reads of the entry have run."""
    t = tier(redis_server.url)
    toks = ids(45, 64)
    t.publish(entry(toks), toks)
    c = redis_server.client()
    (e,) = [k for k in c.keys("*") if b":e:" in k]
    real = type(t.client.pipeline(transaction=False))
    runs = []

    class Pipeline(real):  # type: ignore[misc,valid-type]
        def execute(self, *a, **k):
            out = super().execute(*a, **k)
            runs.append(1)
            if len(runs) == 2:  # block keys, then the entries': another writer strikes
                c.hset(e, "nbytes", b"1" * (8 << 20))
            return out

    monkeypatch.setattr(t.client, "pipeline", lambda transaction=True: Pipeline(
        t.client.connection_pool, t.client.response_callbacks, transaction, None))  # fmt: skip
    before = _sent(c)
    t.lookup(toks)
    assert _sent(c) - before < 1 << 20
