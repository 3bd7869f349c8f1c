"""What ``cache stats|ls|verify`` see of the shared tier, against a real redis-server
(``tiered_kv/shared/survey.py``; the CLI around it: ``tests/engine/test_cli_shared.py``). Toy
entries: ``tests/fixtures.py``."""

from __future__ import annotations

import redis

from tests.fixtures import toy_check
from tests.fixtures import toy_entry as entry
from tests.fixtures import toy_ids as ids
from tests.fixtures import toy_tier as tier
from tiered_kv.shared import survey


def test_verify_fix_unlinks_the_token_ids_of_an_entry_whose_facts_redis_evicted(
    redis_server, monkeypatch
):
    """Redis evicted an entry's ``e:`` hash: ``verify --fix`` unlinked its chunks (orphans) but
    never its ``t:`` key, which stayed until LRU took it. A ``t:`` key is written with its
    ``e:`` (one MULTI/EXEC): without it, it is no running publish's."""
    t = tier(redis_server.url)
    toks = ids(63, 64)
    assert t.publish(entry(toks), toks)
    keep = ids(64, 64)
    assert t.publish(entry(keep), keep)
    gone = t.lookup(toks)
    assert gone is not None
    c = redis_server.client()
    c.delete(t.key("e", gone.entry_id))  # evicted
    seen = survey.verify(c, redis_server.url, lambda fp: toy_check)["fp-a"]
    assert c.exists(t.key("t", gone.entry_id))  # verify alone unlinks nothing
    monkeypatch.setattr(survey, "ORPHAN_GRACE_SECONDS", 0)  # (Redis cannot age a key for a test)
    survey.verify(c, redis_server.url, lambda fp: toy_check, fix=True)
    assert c.keys(f"*{gone.entry_id}*") == []
    assert seen.orphan_chunks == gone.nchunks and seen.orphan_tokens == 1 and not seen.clean
    report = survey.verify(c, redis_server.url, lambda fp: toy_check)["fp-a"]
    assert report.clean and len(report.ok) == 1
    hit = t.lookup(keep)
    assert hit is not None and t.fetch(hit) is not None


def _left_unreachable(redis_server, t, toks):
    """Publish ``toks[:32]``, then its continuation ``toks`` while Redis refuses UNLINK: the
    continuation's index write displaced the older entry, whose unlink failed (``displaced_left``);
    the older entry's facts, token ids and chunks stay, named by no block key. Its id."""
    assert t.publish(entry(toks[:32]), toks[:32])
    old = t.lookup(toks[:32])
    assert old is not None
    c = redis_server.client()
    c.acl_setuser("default", enabled=True, nopass=True, keys=["*"], channels=["*"],
                  commands=["+@all", "-unlink"])  # fmt: skip
    assert t.publish(entry(toks), toks)
    c.acl_setuser("default", enabled=True, nopass=True, keys=["*"], channels=["*"],
                  commands=["+@all"])  # fmt: skip
    assert t.stats()["displaced_left"] == 1 and c.exists(t.key("e", old.entry_id))
    return old.entry_id


def test_verify_fix_unlinks_an_entry_nothing_can_reach(redis_server):
    """An entry displaced by a newer publish whose unlink failed stayed whole in Redis — facts,
    token ids, every chunk — named by no block key: no lookup could find it, ``verify`` called it
    ok and ``--fix`` left it for LRU. Now it is reported unreachable and ``--fix`` unlinks it all."""
    t = tier(redis_server.url)
    toks = ids(65, 64)
    gone = _left_unreachable(redis_server, t, toks)
    c = redis_server.client()
    seen = survey.verify(c, redis_server.url, lambda fp: toy_check)["fp-a"]
    assert seen.unreachable == [gone] and gone not in seen.ok and not seen.clean
    assert c.exists(t.key("e", gone))  # verify alone unlinks nothing
    survey.verify(c, redis_server.url, lambda fp: toy_check, fix=True)
    assert c.keys(f"*{gone}*") == []
    report = survey.verify(c, redis_server.url, lambda fp: toy_check)["fp-a"]
    assert report.clean and len(report.ok) == 1
    hit = t.lookup(toks)
    assert hit is not None and t.fetch(hit) is not None


class _PublishAfterEachScan(redis.Redis):
    """A real client whose every SCAN walk, once done, lets another server publish (the fault:
    a publish that lands between two of ``verify``'s walks, deterministically)."""

    def __init__(self, *args, after, **kw) -> None:
        super().__init__(*args, **kw)
        self.after = after

    def scan_iter(self, *args, **kw):
        yield from super().scan_iter(*args, **kw)
        self.after()


def test_verify_fix_never_unlinks_an_entry_published_between_its_walks(redis_server):
    """``verify --fix`` reads the entries' facts in one walk and the block keys naming them in
    another: an entry published between the two (its facts seen, its block keys not, or the
    reverse) must not be taken for unreachable. After each of verify's walks another server
    publishes: a new entry, and a continuation displacing it."""
    t, other = tier(redis_server.url), tier(redis_server.url)
    left = _left_unreachable(redis_server, t, ids(66, 64))
    published: list[list[int]] = []

    def publish() -> None:
        toks = ids(100 + len(published), 64)
        assert other.publish(entry(toks[:32]), toks[:32])
        assert other.publish(entry(toks[:48]), toks[:48])  # continues (and displaces) it
        published.append(toks[:48])

    c = _PublishAfterEachScan(host="127.0.0.1", port=redis_server.port, after=publish)
    survey.verify(c, redis_server.url, lambda fp: toy_check, fix=True)
    assert len(published) >= 3  # one after each walk
    for toks in published + [ids(66, 64)]:
        hit = t.lookup(toks)
        assert hit is not None and hit.entry_tokens == len(toks) and t.fetch(hit) is not None
    assert c.keys(f"*{left}*") == []
    report = survey.verify(redis_server.client(), redis_server.url, lambda fp: toy_check)["fp-a"]
    assert report.clean and len(report.ok) == len(published) + 1
