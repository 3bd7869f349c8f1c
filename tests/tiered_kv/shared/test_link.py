"""tiered_kv/shared/link.py: TieredCache + real ColdTiers in two directories + one real
redis-server: the shared tier end to end in one process (the server-level test is tests/reliability/test_shared_redis.py)."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.fixtures import cold_logits, prefill, prefill_turn, tokens
from tiered_kv.cold import codec, store
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config
from tiered_kv.shared import entry, redis_tier
from tiered_kv.shared.link import SharedLink
from tiered_kv.shared.redis_tier import SharedTier
from tiered_kv.steps import drain
from tiered_kv.tiered import TieredCache

FP = "test-fingerprint"


def open_tc(model, root, url: str | None, fp: str = FP, **kw) -> TieredCache:
    cfg = Config(cache_dir=root, block_tokens=16, shared_url=url or "", shared_timeout=0.5, **kw)
    cold = ColdTier(root, fp, cfg)
    shared = None
    if cfg.shared_enabled:
        shared = SharedLink.open(cfg, cold.fingerprint)
        cold.publish_to(shared.published)
    return TieredCache(cfg, lambda: make_prompt_cache(model), cold, shared=shared)


def entry_file(model, root, ids):
    """The entry file a server without the shared tier writes for ``ids``, and its fingerprint."""
    a = open_tc(model, root, None)
    prefill_turn(a, model, ids)
    a.close()
    (path,) = root.rglob("*.safetensors")
    return path, a.cold.fingerprint


def publish_from_a(model, root, url, ids, **kw) -> None:
    """Server A computes ``ids`` and shuts down: its entry is written locally and published."""
    a = open_tc(model, root / "a", url, **kw)
    prefill_turn(a, model, ids)
    a.close()


def test_entry_computed_on_a_is_a_shared_hit_on_b_then_local(small_model, tmp_path, redis_server):
    p = tokens(60, 70)
    publish_from_a(small_model, tmp_path, redis_server.url, p)
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    ids = p + tokens(61, 7)
    logits, hit = prefill_turn(b, small_model, ids)
    assert hit.tier == "shared" and hit.tokens == len(p) and hit.load_bytes > 0
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), rtol=1e-4, atol=1e-4)
    s = b.stats()
    assert s["hit_tokens_shared"] == len(p) and s["shared_fetches"] == 1
    b.close()
    redis_server.client().flushall()  # B's restart must not need Redis
    b2 = open_tc(small_model, tmp_path / "b", redis_server.url)
    logits, hit = prefill_turn(b2, small_model, ids)
    assert hit.tier == "cold" and hit.tokens >= len(p)
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), rtol=1e-4, atol=1e-4)
    b2.close()


def test_other_salt_or_model_shares_nothing(small_model, tmp_path, redis_server):
    p = tokens(62, 64)
    publish_from_a(small_model, tmp_path, redis_server.url, p, cache_salt="tenant-1")
    for fp, salt in ((FP, "tenant-2"), ("other-model", "tenant-1"), (FP, "")):
        b = open_tc(small_model, tmp_path / f"b-{fp}-{salt}", redis_server.url, fp, cache_salt=salt)
        _, hit = prefill_turn(b, small_model, p + [1])
        assert hit.tier == "none", (fp, salt)
        b.close()
    same = open_tc(small_model, tmp_path / "c", redis_server.url, cache_salt="tenant-1")
    assert prefill_turn(same, small_model, p + [1])[1].tier == "shared"
    same.close()


def _entry_keys(redis_server, kind: str) -> list[bytes]:
    return sorted(k for k in redis_server.client().keys("*") if f":{kind}:".encode() in k)


def assert_miss_then_correct(model, tc, ids) -> None:
    logits, hit = prefill_turn(tc, model, ids)
    assert hit.tier == "none" and hit.tokens == 0
    np.testing.assert_allclose(logits, cold_logits(model, ids), rtol=1e-4, atol=1e-4)


def test_corrupt_chunk_is_a_miss(small_model, tmp_path, redis_server):
    p = tokens(63, 64)
    publish_from_a(small_model, tmp_path, redis_server.url, p)
    chunk = _entry_keys(redis_server, "c")[0]
    size = redis_server.client().strlen(chunk)
    redis_server.client().setrange(chunk, size - 100, b"\x7f\x7f")  # inside the KV data
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    assert_miss_then_correct(small_model, b, p + [3])
    assert b.stats()["shared_corrupt"] == 1 and b.stats()["cold_entries"] == 0
    b.close()


def test_missing_chunk_or_flushed_redis_is_a_miss(small_model, tmp_path, redis_server):
    p = tokens(64, 64)
    publish_from_a(small_model, tmp_path, redis_server.url, p)
    redis_server.client().delete(*_entry_keys(redis_server, "c"))  # evicted under maxmemory
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    assert_miss_then_correct(small_model, b, p + [3])
    assert b.stats()["shared_misses_evicted"] == 1
    b.close()
    publish_from_a(small_model, tmp_path / "again", redis_server.url, p)
    redis_server.client().flushall()  # restarted empty / flushed
    c = open_tc(small_model, tmp_path / "c", redis_server.url)
    assert_miss_then_correct(small_model, c, p + [4, 5])
    c.close()


def test_dead_redis_leaves_local_tiers_answering(small_model, tmp_path, redis_server):
    p = tokens(65, 64)
    publish_from_a(small_model, tmp_path, redis_server.url, p)
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    redis_server.kill()
    assert_miss_then_correct(small_model, b, p + [3])
    _, hit = prefill_turn(b, small_model, p + [3, 8])  # memory still serves
    assert hit.tier == "hot"
    s = b.stats()
    assert s["shared_errors"] >= 1 and s["shared_up"] == 0
    b.close()  # publishing into a dead Redis does not hang shutdown


def test_spilled_entry_is_published_off_the_request_path(small_model, tmp_path, redis_server):
    a = open_tc(small_model, tmp_path / "a", redis_server.url)
    p = tokens(66, 48)
    prefill_turn(a, small_model, p)
    a.hot.budget_bytes = 0
    a.hot.enforce()  # evicted → spilled (writer thread) → published (publisher thread)
    a.cold.flush()
    assert a.shared is not None and a.shared.flush(30)  # type: ignore[attr-defined]
    assert a.stats()["shared_publishes"] == 1 and _entry_keys(redis_server, "e")
    a.close()


def _resigned(raw: bytes, edit) -> bytes:
    """``raw`` with its header edited by ``edit`` and signed again (the checksum is a public xxh3:
    anyone who can write to Redis can make one)."""
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    edit(head)
    new = store.header_bytes(head, meta)
    return struct.pack("<Q", len(new)) + new + raw[8 + n :]


def _floats(key: str):
    def edit(head):
        head["tokens"][key] = [float(v) for v in head["tokens"][key]]

    return edit


def _infinite(head):
    head["tokens"]["shape"] = [float("inf")]


FORGED = {
    "float offsets": lambda raw: _resigned(raw, _floats("data_offsets")),
    "float shape": lambda raw: _resigned(raw, _floats("shape")),
    "infinite shape": lambda raw: _resigned(raw, _infinite),
    "nested header": lambda raw: struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000 + raw,
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_forged_header_is_a_miss_not_a_failed_request(small_model, tmp_path, redis_server, forgery):
    """Entry headers another writer put in Redis, re-signed: JSON numbers that are no integers
    (a TypeError slicing, an OverflowError, MLX's ``std::bad_cast`` building the arrays) or a
    header nested past Python's stack (RecursionError) escaped the checks as exceptions of other
    types than CorruptEntry, out of the shared fetch into the request: a 500. They are corrupt."""
    p = tokens(67, 64)
    path, fp = entry_file(small_model, tmp_path / "a", p)
    other = SharedTier(redis_server.url, fp, 16, entry.checker(fp))
    assert other.publish(FORGED[forgery](path.read_bytes()), p)
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    assert_miss_then_correct(small_model, b, p + [3])
    assert b.stats()["shared_corrupt"] == 1 and b.stats()["cold_entries"] == 0
    b.close()


def test_arrays_mlx_cannot_allocate_for_a_shared_entry_are_a_miss(small_model, tmp_path, redis_server,
                                                                   monkeypatch):
    """On CUDA a fetched entry larger than the free GPU memory fails its allocation
    (RuntimeError): the cold tier's own load counts that as a miss, its ``adopt`` of a shared
    entry let it out of the request — a 500."""
    p = tokens(68, 64)
    publish_from_a(small_model, tmp_path, redis_server.url, p)

    def refused(*a, **k):
        raise RuntimeError("[cuda::malloc] out of memory")

    monkeypatch.setattr(codec, "load_buffer", refused)
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    assert_miss_then_correct(small_model, b, p + [3])
    assert b.stats()["cold_load_errors"] == 1
    assert b.stats()["shared_corrupt"] == 0 and _entry_keys(redis_server, "e")  # not unlinked
    b.close()


def test_a_shared_fetch_runs_beside_the_callers_steps(small_model, tmp_path, redis_server, monkeypatch):
    """A batch loop's fetch_steps: while a large entry crosses the network, each next() returns
    (the loop's decode steps go on); the fetch is a thread of its own, the arrays are built after."""
    p = tokens(66, 70)
    publish_from_a(small_model, tmp_path, redis_server.url, p)
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    started, release, fetchers = threading.Event(), threading.Event(), []
    real = redis_tier.bulk.get_into

    def slow(*a, **k):  # the fault: a link that holds the entry's bytes until released
        fetchers.append(threading.current_thread())
        started.set()
        release.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(redis_tier.bulk, "get_into", slow)
    ids = p + tokens(61, 7)
    steps = b.fetch_steps(ids)
    next(steps)  # the lookups, then the fetch set going
    assert started.wait(10)
    for _ in range(3):  # each returns while the fetch waits on the link
        next(steps)
    assert threading.current_thread() not in fetchers and not release.is_set()
    release.set()
    lease = drain(steps)
    assert lease.hit.tier == "shared" and lease.hit.tokens == len(p)
    fed = ids[: lease.hit.tokens]
    logits = np.array(prefill(small_model, lease, fed, 16))
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), rtol=1e-4, atol=1e-4)
    b.store(lease, fed)
    b.close()


def test_a_shared_entry_that_cannot_be_cut_back_never_displaces_a_hot_hit(tmp_path, redis_server):
    """A sliding-window entry in Redis (gemma-3: past its window it cannot be cut back) shared a
    longer prefix with the prompt than the hot entry but diverged before its end with no
    checkpoint there: fetched, it serves nothing, and it took the request's hot hit with it."""
    from tests.fixtures import gemma

    m = gemma()
    base, a = tokens(93, 40), tokens(94, 20)
    publish_from_a(m, tmp_path, redis_server.url, base + a)  # 60 tokens, no checkpoints
    b = open_tc(m, tmp_path / "b", redis_server.url)
    prefill_turn(b, m, base + a[:10])  # H: 50 tokens, in memory
    ids = base + a[:15] + tokens(95, 10)  # 55 in common with the shared entry (serves 0), 50 with H
    logits, hit = prefill_turn(b, m, ids)
    assert hit.tier == "hot" and hit.tokens == 50
    np.testing.assert_allclose(logits, cold_logits(m, ids), rtol=1e-4, atol=1e-4)
    assert b.stats()["shared_fetches"] == 0  # its publisher said what it serves: never fetched
    b.close()


def test_a_failed_fetch_beside_the_batch_looks_at_memory_again(small_model, tmp_path, redis_server,
                                                                monkeypatch):
    """While a shared fetch crossed the network, another request of the batch replaced the hot
    entry this one would fall back on (a longer entry superseded it). The fetch failed, and the
    request took the hot candidate it had found before the wait: gone, so it got no hit at all."""
    p = tokens(70, 70)
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    prefill_turn(b, small_model, p[:40])  # H: 40 tokens in memory (nothing in Redis yet)
    publish_from_a(small_model, tmp_path, redis_server.url, p)  # S: 70 tokens, shared
    started, release = threading.Event(), threading.Event()

    def trickle(*a, **k):  # the fault: a link that times out once released
        started.set()
        release.wait(10)
        raise TimeoutError("the link trickled past the fetch's deadline")

    monkeypatch.setattr(redis_tier.bulk, "get_into", trickle)
    ids = p + tokens(71, 5)
    steps = b.fetch_steps(ids)
    next(steps)
    assert started.wait(10)
    longer = p[:40] + tokens(72, 10)  # shares only H's 40 with S: no fetch of its own
    _, hit = prefill_turn(b, small_model, longer)  # its 50 tokens supersede H
    assert hit.tier == "hot" and hit.tokens == 40
    release.set()
    lease = drain(steps)
    assert lease.hit.tier == "hot" and lease.hit.tokens == 40
    logits = np.array(prefill(small_model, lease, ids[:40], 16))
    np.testing.assert_allclose(logits, cold_logits(small_model, ids), rtol=1e-4, atol=1e-4)
    b.store(lease, ids)
    b.close()


def test_a_shared_entry_that_failed_is_not_fetched_again_for_the_next_disk_try(
    small_model, tmp_path, redis_server, monkeypatch
):
    """The shared tier was asked again for each disk entry a fetch tried: a shared entry whose
    adoption failed (MLX out of memory) was fetched over the network again after the disk entry
    beside it could not be read — one transfer of up to gigabytes per try."""
    from tiered_kv.cold import fsafe

    p = tokens(73, 70)
    local = open_tc(small_model, tmp_path / "b", None)
    prefill_turn(local, small_model, p[:50] + tokens(74, 10))  # D: shares 50 with the prompt
    local.close()
    publish_from_a(small_model, tmp_path, redis_server.url, p)  # S: shares 70
    (bad,) = [f for f in (tmp_path / "b").rglob("*.safetensors") if not f.name.startswith(".")]
    real = fsafe.open_nofollow

    def refusing(path, flags, mode=0o600):
        if Path(path) == bad:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, flags, mode)

    def refused(*a, **k):
        raise RuntimeError("[cuda::malloc] out of memory")

    monkeypatch.setattr(fsafe, "open_nofollow", refusing)
    monkeypatch.setattr(codec, "load_buffer", refused)
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    assert_miss_then_correct(small_model, b, p + [3])
    s = b.stats()
    assert s["shared_fetches"] == 1 and s["cold_load_errors"] == 2  # S adopted once, D read once
    b.close()


def test_a_fetch_beside_the_batch_stops_when_its_request_goes_away(small_model, tmp_path, redis_server,
                                                                    monkeypatch):
    """A request whose client went away (or a shutdown) closes its fetch_steps; its shared fetch
    read on, every chunk of an entry of up to the disk budget into a buffer nobody would use, for
    up to its deadline. It stops before its next chunk."""
    p = tokens(75, 64)
    path, fp = entry_file(small_model, tmp_path / "a", p)
    other = SharedTier(redis_server.url, fp, 16, entry.checker(fp), chunk_bytes=4096)
    assert other.publish(path.read_bytes(), p)  # an entry of many chunks
    b = open_tc(small_model, tmp_path / "b", redis_server.url)
    started, release, reads = threading.Event(), threading.Event(), []
    real = redis_tier.bulk.get_into

    def slow(*a, **k):  # the fault: a link that holds the first chunk until released
        reads.append(threading.current_thread())
        started.set()
        release.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(redis_tier.bulk, "get_into", slow)
    steps = b.fetch_steps(p + [3])
    next(steps)
    assert started.wait(10)
    steps.close()  # the request went away
    release.set()
    reads[0].join(10)
    assert not reads[0].is_alive() and len(reads) == 1
    assert b.stats()["shared_fetches_stopped"] == 1
    b.close()
