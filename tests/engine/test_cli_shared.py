"""engine/cli_shared.py: `tiered-kv cache stats|ls|verify` show the shared tier (real Redis)."""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from engine import cli_cache
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config
from tiered_kv.shared import survey
from tiered_kv.shared.link import SharedLink


def _run(capsys, root, url, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli_cache.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv, "--dir", str(root)])
    args.config = Config(cache_dir=root, shared_url=url)
    rc = args.func(args)
    return rc, capsys.readouterr().out


def _publish_two(root, url) -> None:
    cfg = Config(cache_dir=root, block_tokens=4, shared_url=url)
    tier = ColdTier(root, "fpA", cfg)
    link = SharedLink.open(cfg, tier.fingerprint)
    tier.publish_to(link.published)
    c = C.KVCache()
    x = mx.ones((1, 2, 8, 4))
    c.update_and_fetch(x, x)
    tier.persist(np.arange(8), [c])
    tier.persist(np.arange(8) + 9, [c])
    tier.close()
    assert link.close(30) and link.stats()["publishes"] == 2


def test_stats_ls_verify_fix_show_the_shared_tier(tmp_path, capsys, redis_server, monkeypatch):
    _publish_two(tmp_path, redis_server.url)
    rc, out = _run(capsys, tmp_path, redis_server.url, "stats")
    assert rc == 0 and "shared tier: redis://127.0.0.1" in out and "fpA: 2 entries" in out
    assert "policy allkeys-lru" in out
    rc, out = _run(capsys, tmp_path, redis_server.url, "ls")
    assert rc == 0 and out.count("(shared)") == 2
    rc, out = _run(capsys, tmp_path, redis_server.url, "verify")
    assert rc == 0 and "fpA: 2 ok (shared)" in out
    r = redis_server.client()
    chunk = sorted(k for k in r.keys("*") if b":c:" in k)[0]
    r.setrange(chunk, r.strlen(chunk) - 3, b"\x01")
    orphan = b"tkv:fpA:c:" + b"0" * 32 + b":0"
    r.set(orphan, b"orphan")
    rc, out = _run(capsys, tmp_path, redis_server.url, "verify")
    assert rc == 1 and "corrupt: " in out and "orphan chunks: 1" in out
    rc, out = _run(capsys, tmp_path, redis_server.url, "verify", "--fix")
    assert rc == 0 and r.exists(orphan)  # fresh: a running publish's, its index not yet written
    monkeypatch.setattr(survey, "ORPHAN_GRACE_SECONDS", 0)  # (Redis cannot age a key for a test)
    rc, out = _run(capsys, tmp_path, redis_server.url, "verify", "--fix")
    assert rc == 0 and not r.exists(orphan)
    rc, out = _run(capsys, tmp_path, redis_server.url, "verify")
    assert rc == 0 and "fpA: 1 ok (shared)" in out


@pytest.mark.parametrize("plant", ["wrong-type", "nan-created", "huge-size"])
def test_hostile_keys_in_the_layout_are_corrupt_not_a_crash(tmp_path, capsys, redis_server, plant):
    """Another writer on the same Redis: an index key that is no hash made stats / ls / verify say
    Redis was unreachable; a NaN ``created`` crashed ls; a forged 100 GiB size made verify
    allocate it (MemoryError). Each is now one corrupt entry, removed by ``--fix``."""
    _publish_two(tmp_path, redis_server.url)
    r = redis_server.client()
    bad = b"tkv:fpA:e:" + b"f" * 32
    if plant == "wrong-type":
        r.set(bad, b"not a hash")
    else:
        meta = {"n_tokens": 8, "nbytes": 100, "nchunks": 1, "chunk_bytes": 100, "created": "nan"}
        if plant == "huge-size":
            meta.update(nbytes=100 << 30, chunk_bytes=512 << 20, nchunks=200, created="1.0")
        r.hset(bad, mapping=meta)
    for cmd in ("stats", "ls"):
        rc, out = _run(capsys, tmp_path, redis_server.url, cmd)
        assert rc == 0 and "unreachable" not in out, (cmd, out)
    rc, out = _run(capsys, tmp_path, redis_server.url, "verify")
    assert rc == 1 and "f" * 32 in out and "fpA: 2 ok (shared)" in out
    rc, out = _run(capsys, tmp_path, redis_server.url, "verify", "--fix")
    assert not r.exists(bad)


def test_unreachable_redis_is_reported_not_raised(tmp_path, capsys, redis_server):
    url = redis_server.url
    redis_server.kill()
    rc, out = _run(capsys, tmp_path, url, "stats")
    assert rc == 2 and "unreachable" in out
    rc, out = _run(capsys, tmp_path, url, "verify")
    assert rc == 2 and "unreachable" in out


@pytest.mark.parametrize("plant", ["created", "n_tokens", "tokens"])
def test_an_oversized_index_value_is_damaged_not_read_whole(tmp_path, capsys, redis_server, plant):
    """Another writer sets an entry's ``created`` / ``n_tokens`` field or its token ids to 8 MB:
    stats, ls and verify read each whole (HMGET, GET; Redis allows 512 MB a value), where the
    request path reads within bounds. They now read through the same bounded readers
    (tiered_kv/shared/reads.py), and the entry is a corrupt one."""
    _publish_two(tmp_path, redis_server.url)
    r = redis_server.client()
    e = sorted(k for k in r.keys("*") if b":e:" in k)[0]
    eid = e.rsplit(b":", 1)[1].decode()
    if plant == "tokens":
        r.set(e.replace(b":e:", b":t:"), b"\x00" * (8 << 20))
    else:
        r.hset(e, plant, b"1" * (8 << 20))
    for cmd in ("stats", "ls", "verify"):
        before = int(r.info("stats")["total_net_output_bytes"])
        rc, out = _run(capsys, tmp_path, redis_server.url, cmd)
        sent = int(r.info("stats")["total_net_output_bytes"]) - before
        assert sent < 1 << 20, (cmd, sent)
    assert rc == 1 and f"corrupt: {eid}" in out and "fpA: 1 ok (shared)" in out


def test_verify_fix_on_a_redis_that_refuses_scripts_unlinks_nothing(tmp_path, capsys, redis_server):
    """The survey reads each entry's fields through the lookup's bounded script: a Redis (an ACL
    user without @scripting, a proxy) that refuses it answered every entry with an error, which
    the survey took for an index key of another type — every entry reported corrupt, and
    ``verify --fix`` unlinked the index of every one. A refusal is the tier unreadable, a 2."""
    _publish_two(tmp_path, redis_server.url)
    r = redis_server.client()
    before = sorted(r.keys("*"))
    r.acl_setuser("default", enabled=True, nopass=True, keys=["*"], channels=["*"],
                  commands=["+@all", "-@scripting"])  # fmt: skip
    rc, out = _run(capsys, tmp_path, redis_server.url, "verify", "--fix")
    assert rc == 2 and "corrupt" not in out, out
    assert sorted(r.keys("*")) == before
    rc, out = _run(capsys, tmp_path, redis_server.url, "stats")
    assert rc == 2 and "fpA" not in out, out
