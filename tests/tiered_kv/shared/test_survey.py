"""What ``cache stats|ls|verify`` see of the shared tier, against a real redis-server
(``tiered_kv/shared/survey.py``; the CLI around it: ``tests/engine/test_cli_shared.py``). Toy
entries: ``tests/fixtures.py``."""

from __future__ import annotations

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
