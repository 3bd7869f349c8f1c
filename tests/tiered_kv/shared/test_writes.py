"""The publish path against a real redis-server: chunks, then the index in one MULTI/EXEC, and the
entries that index write displaced unlinked (``tiered_kv/shared/writes.py``). Toy entries:
``tests/fixtures.py``."""

from __future__ import annotations

import threading

import pytest

from tests.fixtures import toy_entry as entry
from tests.fixtures import toy_ids as ids
from tests.fixtures import toy_tier as tier
from tests.redis_server import CuttingProxy
from tiered_kv.shared import writes
from tiered_kv.shared.redis_tier import MAX_CHUNKS, SharedTier


def test_continuation_supersedes_and_identical_publish_is_skipped(redis_server):
    t = tier(redis_server.url)
    toks = ids(10, 100)
    t.publish(entry(toks[:48]), toks[:48])
    old = t.lookup(toks[:48])
    assert t.publish(entry(toks), toks)
    assert not t.publish(entry(toks), toks)  # the same entry again: skipped
    hit = t.lookup(toks[:48] + [1])
    assert old is not None and hit is not None and hit.entry_id != old.entry_id
    assert hit.tokens == 48
    assert not redis_server.client().exists(t.key("c", old.entry_id, 0))
    s = t.stats()
    assert s["superseded"] == 1 and s["publish_skipped"] == 1


def test_an_evicted_chunk_unlinks_its_entry_so_it_can_be_published_again(redis_server):
    """A chunk evicted (allkeys-lru): the entry's index stayed, each lookup found it and missed,
    and a publish of the same entry was skipped as "already there" — for good."""
    t = tier(redis_server.url)
    toks = ids(32, 64)
    t.publish(entry(toks), toks)
    hit = t.lookup(toks)
    assert hit is not None
    redis_server.client().delete(t.key("c", hit.entry_id, 1))
    assert t.publish(entry(toks), toks)  # not skipped: the old one is not whole
    hit = t.lookup(toks)
    assert hit is not None and t.fetch(hit) is not None
    redis_server.client().delete(t.key("c", hit.entry_id, 2))
    assert t.fetch(hit) is None and t.lookup(toks) is None  # the fetch unlinked it


@pytest.mark.parametrize("forged", [MAX_CHUNKS + 1, 10**9])
def test_a_forged_chunk_count_is_never_listed(redis_server, forged):
    """A superseded entry whose ``nchunks`` another writer set to 10**9: the publisher built a
    list of 10**9 key names to unlink it (gigabytes, then a MemoryError). A count no entry can
    have unlinks its index only: Redis's command log (every command, its arguments) shows the
    UNLINK naming its ``e:`` and ``t:`` keys, no chunk. (The smallest such count: a list
    built of it fails here at once instead of exhausting memory.)"""
    t = tier(redis_server.url)
    toks = ids(33, 64)
    t.publish(entry(toks[:32]), toks[:32])
    old = t.lookup(toks[:32])
    assert old is not None
    c = redis_server.client()
    c.hset(t.key("e", old.entry_id), "nchunks", forged)
    c.config_set("slowlog-log-slower-than", 0)  # log every command
    c.config_set("slowlog-max-len", 10_000)
    c.slowlog_reset()
    assert t.publish(entry(toks), toks)  # a continuation: supersedes the forged one
    assert t.stats()["superseded"] == 1
    assert not c.exists(t.key("e", old.entry_id))
    unlinks = [e["command"].split() for e in c.slowlog_get(10_000)
               if e["command"].upper().startswith(b"UNLINK ")]  # fmt: skip
    named = [t.key(k, old.entry_id).encode() for k in ("e", "t")]
    assert [u[1:] for u in unlinks if any(old.entry_id.encode() in n for n in u)] == [named]


def _unreachable(t: SharedTier, client) -> list[str]:
    """Entries indexed (an ``e:`` key) that no block key names: no lookup can ever find them."""
    named = {v.decode() for k in client.keys(t.key("b", "*")) if (v := client.get(k))}
    indexed = {k.decode().rsplit(":", 1)[1] for k in client.keys(t.key("e", "*"))}
    return sorted(indexed - named)


def test_identical_publishes_at_the_same_moment_leave_nothing_unreachable(redis_server, monkeypatch):
    """Two servers publish the same entry at once: each looked it up (not there), wrote its chunks
    and its index; the second index write took every block key, and the first entry — its facts,
    token ids and chunks — stayed in Redis, indexed yet named by no block key, until LRU took it
    (``verify --fix`` removes only chunks without an index). The fault: each publisher waits at
    its first chunk until the other has looked the entry up too."""
    toks = ids(46, 64)
    a, b = tier(redis_server.url), tier(redis_server.url)
    both = threading.Barrier(2, timeout=30)
    real = writes.bulk.set_from
    first: set[int] = set()

    def set_from(client, key, value):
        if threading.get_ident() not in first:
            first.add(threading.get_ident())
            both.wait()
        return real(client, key, value)

    monkeypatch.setattr(writes.bulk, "set_from", set_from)
    done = [threading.Thread(target=x.publish, args=(entry(toks), toks)) for x in (a, b)]
    for th in done:
        th.start()
    for th in done:
        th.join()
    c = redis_server.client()
    assert a.stats()["publishes"] + b.stats()["publishes"] == 2  # both ran to their index
    assert _unreachable(a, c) == []
    hit = a.lookup(toks)
    assert hit is not None and a.fetch(hit) is not None
    assert {k for k in c.keys("*") if b":b:" not in k and hit.entry_id.encode() not in k} == set()


def test_an_entry_whose_every_block_a_newer_one_holds_is_unlinked(redis_server):
    """A newer entry holding all of an older one's blocks (its ids past its last whole block
    differ) takes every block key naming the older one: it was left indexed and unreachable
    (only an entry wholly contained in the new one was unlinked)."""
    t = tier(redis_server.url)
    toks = ids(47, 64)
    old = toks[:40]  # blocks 0-1 and 8 ids more
    assert t.publish(entry(old), old)
    assert t.publish(entry(toks[:32] + ids(48, 32)), toks[:32] + ids(48, 32))
    c = redis_server.client()
    assert _unreachable(t, c) == [] and t.stats()["superseded"] == 1
    assert len(c.keys(t.key("e", "*"))) == 1


@pytest.mark.parametrize("fault", ["connection-dropped", "unlink-refused"])
def test_a_failed_unlink_of_a_displaced_entry_leaves_the_publish_published(redis_server, fault):
    """The index write committed, then unlinking the entry it displaced failed (the connection
    dropped at the UNLINK; an ACL user without UNLINK): publish returned False and counted no
    publish, though the new entry was written and every lookup found it. The displaced entry is
    left (unreachable) for LRU, counted; the failure is counted as any Redis call's."""
    toks = ids(61, 64)
    direct = tier(redis_server.url)
    assert direct.publish(entry(toks[:32]), toks[:32])
    old = direct.lookup(toks[:32])
    assert old is not None
    proxy = CuttingProxy(redis_server.port, b"UNLINK") if fault == "connection-dropped" else None
    if proxy is None:
        redis_server.client().acl_setuser("default", enabled=True, nopass=True, keys=["*"],
                                          channels=["*"], commands=["+@all", "-unlink"])  # fmt: skip
    t = tier(proxy.url if proxy is not None else redis_server.url)
    try:
        assert t.publish(entry(toks), toks)  # the entry is published
    finally:
        if proxy is not None:
            proxy.close()
    assert proxy is None or proxy.cuts == 1  # the fault happened where it should
    s = t.stats()
    assert s["publishes"] == 1 and s["displaced_left"] == 1 and s["superseded"] == 0
    assert s["errors"] == 1 and s["outages"] == s["up"] ^ 1 == (1 if proxy is not None else 0)
    hit = direct.lookup(toks)
    assert hit is not None and hit.entry_id != old.entry_id and direct.fetch(hit) is not None
    assert redis_server.client().exists(direct.key("e", old.entry_id))  # left for LRU


def test_a_displaced_entry_whose_facts_redis_evicted_is_unlinked_all_the_same(redis_server):
    """Redis evicted an entry's ``e:`` hash (allkeys-lru takes any key): the publish that
    displaced it read no facts, so unlinked nothing — its token ids and chunks stayed until LRU
    took them too. Its id and chunk naming are enough to unlink them."""
    t = tier(redis_server.url)
    toks = ids(62, 64)
    assert t.publish(entry(toks[:32], payload=70_000), toks[:32])  # 71 chunks: two batches
    old = t.lookup(toks[:32])
    assert old is not None and old.nchunks == 71
    c = redis_server.client()
    c.delete(t.key("e", old.entry_id))  # evicted
    assert t.publish(entry(toks), toks)
    assert c.keys(f"*{old.entry_id}*") == []
    hit = t.lookup(toks)
    assert hit is not None and t.fetch(hit) is not None


def test_displaced_left_counts_the_entries_left_not_the_failed_unlinks(redis_server):
    """A publish displacing two entries whose unlink Redis refused counted one ``displaced_left``
    (one failed call), though two entries stayed in Redis unreachable."""
    t = tier(redis_server.url)
    toks = ids(67, 64)
    assert t.publish(entry(toks[:48]), toks[:48])  # blocks 0-2
    assert t.publish(entry(toks[:32]), toks[:32])  # blocks 0-1: takes their keys, not block 2's
    c = redis_server.client()
    assert len(c.keys(t.key("e", "*"))) == 2
    c.acl_setuser("default", enabled=True, nopass=True, keys=["*"], channels=["*"],
                  commands=["+@all", "-unlink"])  # fmt: skip
    assert t.publish(entry(toks), toks)  # blocks 0-3: the deepest key of each of them
    s = t.stats()
    assert s["publishes"] == 3 and s["superseded"] == 0 and s["displaced_left"] == 2, s
    assert len(c.keys(t.key("e", "*"))) == 3


def test_a_displaced_entry_whose_facts_and_first_64_chunks_redis_evicted_is_unlinked_whole(
    redis_server,
):
    """Redis evicted an entry's facts and its first 64 chunks: the displacing publish looked for
    its chunks 64 names a round trip and stopped at the first round trip that found none, leaving
    every chunk past that run (here 7) for LRU."""
    t = tier(redis_server.url)
    toks = ids(68, 64)
    assert t.publish(entry(toks[:32], payload=70_000), toks[:32])  # 71 chunks
    old = t.lookup(toks[:32])
    assert old is not None and old.nchunks == 71
    c = redis_server.client()
    c.delete(t.key("e", old.entry_id), *(t.key("c", old.entry_id, i) for i in range(64)))
    assert t.publish(entry(toks), toks)
    assert c.keys(f"*{old.entry_id}*") == [] and t.stats()["superseded"] == 1


def test_displaced_left_counts_entries_left_when_redis_went_down_before_their_unlink(
    redis_server, monkeypatch
):
    """Another thread found Redis down (a lookup timed out) between the index write and the
    unlink of what it displaced: the unlink was skipped (backoff), the displaced entry left in
    Redis, and ``displaced_left`` counted 0 — no entry had been read into its list yet."""
    t = tier(redis_server.url)
    toks = ids(69, 64)
    assert t.publish(entry(toks[:32]), toks[:32])
    real = writes._publish

    def then_down(*args):  # the fault: a request thread's lookup timed out meanwhile
        done = real(*args)
        t.health._down("lookup", TimeoutError("timed out"))
        return done

    monkeypatch.setattr(writes, "_publish", then_down)
    assert t.publish(entry(toks), toks)  # published; its unlink skipped (Redis in backoff)
    s = t.stats()
    assert s["skipped_down"] == 1 and s["superseded"] == 0
    assert len(redis_server.client().keys(t.key("e", "*"))) == 2  # the displaced one is left
    assert s["displaced_left"] == 1, s
