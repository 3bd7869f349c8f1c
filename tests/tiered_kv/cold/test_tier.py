"""tiered_kv/cold/tier.py: ColdTier round trips, lookup, faults, budget, restart."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tiered_kv import keys, layers
from tiered_kv.cold import store
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

FP = keys.fingerprint({"model": "test"})
B = 4  # block tokens


def make_tier(root: Path, **kw) -> ColdTier:
    # a loaded test machine can take longer than the 0.5 s lookup deadline: a miss there is not
    # what these tests check (tests/tiered_kv/cold/test_reader.py tests the deadline itself)
    kw.setdefault("cold_deadline", 30.0)
    cfg = Config(cache_dir=root, block_tokens=B, **kw)
    return ColdTier(root, FP, cfg)


def kv(n: int, d: int = 8, dtype=mx.bfloat16) -> C.KVCache:
    c = C.KVCache()
    x = mx.random.normal((1, 2, n, d)).astype(dtype)
    c.update_and_fetch(x, x * 2)
    return c


def rotating(n: int) -> C.RotatingKVCache:
    c = C.RotatingKVCache(max_size=8, keep=0)
    c.update_and_fetch(mx.random.normal((1, 2, 4, 8)), mx.random.normal((1, 2, 4, 8)))
    for _ in range(n - 4):
        c.update_and_fetch(mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8)))
    return c


def quantized(n: int) -> C.QuantizedKVCache:
    c = C.QuantizedKVCache(group_size=32, bits=4)
    c.update_and_fetch(mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
    return c


def arrays_cache() -> C.ArraysCache:
    c = C.ArraysCache(2)
    c[0] = mx.random.normal((1, 3, 4))
    c[1] = mx.arange(6, dtype=mx.float16).reshape(1, 6)
    return c


CASES = {
    "kv": lambda: [kv(10), kv(10, dtype=mx.float16)],
    "quantized": lambda: [quantized(10)],
    "rotating": lambda: [rotating(6)],
    "rotating_wrapped": lambda: [rotating(13)],
    "arrays": lambda: [arrays_cache()],
    "cachelist": lambda: [C.CacheList(kv(10), rotating(13)), kv(10, dtype=mx.float32)],
}


def assert_same(a: list, b: list) -> None:
    (xa, ma), (xb, mb) = layers.encode(a), layers.encode(b)
    assert ma == mb and sorted(xa) == sorted(xb)
    for k in xa:
        assert xa[k].dtype == xb[k].dtype and mx.array_equal(xa[k], xb[k]).item(), k


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_through_disk(tmp_path, case):
    mx.random.seed(0)
    caches = CASES[case]()
    ids = np.arange(10, dtype=np.int32)
    tier = make_tier(tmp_path)
    tier.persist(ids, caches)
    hit = tier.lookup(list(range(10)) + [77])
    assert hit is not None and hit.tokens == 10 and hit.entry_tokens == 10
    got = tier.load(hit)
    assert got is not None
    assert_same(caches, got[0])
    assert got[1].tolist() == ids.tolist()
    tier.close()


def _model():
    from mlx_lm.models import llama

    mx.random.seed(3)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
    )  # fmt: skip
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _greedy(model, caches, ids: list[int], n: int) -> list[int]:
    out = []
    logits = model(mx.array([ids]), cache=caches)
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=caches)
    return out


def test_generation_after_disk_reload_equals_cold_prefill(tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    model = _model()
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, 256, 40)]
    caches = make_prompt_cache(model)
    model(mx.array([prompt[:30]]), cache=caches)
    mx.eval([c.state for c in caches])
    tier = make_tier(tmp_path)
    tier.spill(np.array(prompt[:30]), caches)
    tier.flush()
    hit = tier.lookup(prompt)
    assert hit is not None and hit.tokens == 30
    loaded, _, _ = tier.load(hit)
    warm = _greedy(model, loaded, prompt[30:], 8)
    cold = _greedy(model, make_prompt_cache(model), prompt, 8)
    assert warm == cold
    tier.close()


def test_forced_collision_never_serves_the_wrong_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(keys, "block_hashes", lambda t, b, s: [keys.BlockHash(1)] * (len(t) // b))
    tier = make_tier(tmp_path)
    tier.persist(np.arange(12), [kv(12)])
    assert tier.lookup([50 + i for i in range(12)]) is None  # same "hashes", other ids
    hit = tier.lookup([0, 1, 2, 99] + list(range(8)))
    assert hit is not None and hit.tokens == 3  # exact token-level common prefix only
    tier.close()


def test_partial_block_extends_the_hit_and_continuation_supersedes(tmp_path):
    tier = make_tier(tmp_path)
    tier.persist(np.arange(10), [kv(10)])
    tier.persist(np.arange(14), [kv(14)])  # starts with the whole older entry → replaces it
    st = tier.stats()
    assert st["entries"] == 1 and st["superseded"] == 1
    assert len(list(tier.dir.glob("*.safetensors"))) == 1
    hit = tier.lookup(list(range(13)) + [5])
    assert hit is not None and hit.tokens == 13 and hit.entry_tokens == 14
    tier.close()


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _file(tier: ColdTier) -> Path:
    (path,) = tier.dir.glob("*.safetensors")
    return path


@pytest.mark.parametrize("damage", ["truncate", "header_flip", "data_flip", "version", "random"])
def test_damaged_file_is_a_miss_and_quarantined(tmp_path, damage):
    tier = make_tier(tmp_path)
    tier.persist(np.arange(8), [kv(8)])
    path = _file(tier)
    hdr_len = int.from_bytes(path.read_bytes()[:8], "little")
    if damage == "truncate":
        os.truncate(path, path.stat().st_size - 7)
    elif damage == "header_flip":
        _flip(path, 8 + hdr_len // 2)
    elif damage == "data_flip":
        _flip(path, path.stat().st_size - 3)
    elif damage == "version":
        _rewrite_meta(path, format_version="0")
    else:
        path.write_bytes(os.urandom(300))
    hit = tier.lookup(list(range(8)))
    assert hit is not None
    assert tier.load(hit) is None
    assert tier.stats()["quarantined"] == 1 and tier.stats()["entries"] == 0
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    assert tier.lookup(list(range(8))) is None
    tier.close()


def _rewrite_meta(path: Path, **changes: str) -> None:
    """Re-sign a file with changed metadata (a well-formed foreign file)."""
    import json
    import struct

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    meta.update(changes)
    new = store.header_bytes(head, meta)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_file_of_another_fingerprint_is_refused(tmp_path):
    tier = make_tier(tmp_path)
    tier.persist(np.arange(8), [kv(8)])
    _rewrite_meta(_file(tier), fingerprint="someone-else")
    with pytest.raises(store.ForeignEntry):
        store.read_header(_file(tier), tier.fingerprint)
    assert tier.load(tier.lookup(list(range(8)))) is None
    assert tier.stats()["quarantined"] == 1
    tier.close()


def test_enospc_during_spill_is_counted_not_raised(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "replace", full)
    tier.spill(np.arange(8), [kv(8)])
    tier.persist(np.arange(9), [kv(9)])
    tier.flush()
    st = tier.stats()
    assert st["write_errors"] == 2 and st["entries"] == 0
    assert not list(tier.dir.glob("*.safetensors")) and not list(tier.dir.glob(".*.tmp"))
    monkeypatch.undo()
    tier.persist(np.arange(8), [kv(8)])
    assert tier.stats()["entries"] == 1
    tier.close()


def test_cache_dir_deleted_during_operation(tmp_path):
    import shutil

    tier = make_tier(tmp_path / "kv")
    shutil.rmtree(tmp_path / "kv")
    tier.persist(np.arange(8), [kv(8)])  # must not raise
    tier.spill(np.arange(8), [kv(8)])
    tier.flush()
    st = tier.stats()  # re-created with a fresh index: logged once, counted, nothing lost
    assert st["dir_recreated"] == 1 and st["write_errors"] == 0 and st["entries"] == 1
    assert tier.load(tier.lookup(list(range(8)))) is not None
    tier.close()
    tier = make_tier(tmp_path / "kv")
    assert tier.lookup(list(range(8))) is not None and tier.verify().clean
    tier.close()


def test_budget_evicts_least_recently_used(tmp_path):
    from tiered_kv.cold import evict, usage

    tier = make_tier(tmp_path / "kv", disk_free_floor=0)
    for i in range(3):
        tier.persist(np.arange(8) + 100 * i, [kv(8, d=64)])
    assert tier.load(tier.lookup(list(range(8)))) is not None  # touch entry 0
    tier.flush()
    used = usage.scan(tier.root, tier.fingerprint, tier.index.records()).used
    # the tier's estimate: data, tokens, header slack and the entry's index rows
    incoming = 2 * (2 * 8 * 64 * 2) + 4 * 8 + evict.HEADER_SLACK + evict.index_bytes(8, B)
    tier.remover.disk_bytes = used + incoming - 1
    tier.persist(np.arange(8) + 300, [kv(8, d=64)])
    assert tier.lookup(list(range(8))) is not None  # recently used: kept
    assert tier.lookup(list(range(100, 108))) is None  # least recently used: evicted
    assert tier.lookup(list(range(200, 208))) is not None
    assert tier.stats()["evictions"] == 1 and tier.stats()["entries"] == 3
    tier.close()


def test_queue_full_drops_oldest_spill(tmp_path):
    tier = make_tier(tmp_path, spill_queue_bytes=2 * (2 * 2 * 8 * 8 * 2) + 10)  # two entries
    import threading

    gate = threading.Event()
    tier.writer.submit(gate.wait, 0, droppable=False)
    for i in range(4):
        tier.spill(np.arange(8) + 100 * i, [kv(8)])
    gate.set()
    tier.flush()
    st = tier.stats()
    assert st["drops"] == 2 and st["entries"] == 2
    assert tier.lookup(list(range(8))) is None and tier.lookup(list(range(300, 308))) is not None
    tier.close()


@pytest.mark.parametrize("how", ["deleted", "garbage"])
def test_lost_index_is_rebuilt_from_files(tmp_path, how):
    tier = make_tier(tmp_path)
    tier.persist(np.arange(8), [kv(8)])
    tier.persist(np.arange(8) + 50, [kv(8)])
    tier.close()
    index = tier.dir / "index"
    if how == "deleted":
        import shutil

        shutil.rmtree(index)
    else:
        for p in index.glob("cache.db*"):
            p.write_bytes(os.urandom(4096))
    tier = make_tier(tmp_path)
    assert tier.stats()["entries"] == 2
    assert tier.load(tier.lookup(list(range(8)))) is not None
    tier.close()


def test_reopen_reconciles_orphans_and_missing_files(tmp_path):
    tier = make_tier(tmp_path)
    tier.persist(np.arange(8), [kv(8)])
    tier.persist(np.arange(8) + 50, [kv(8)])
    tier.close()
    files = sorted(tier.dir.glob("*.safetensors"))
    files[0].unlink()
    (tier.dir / "stray.safetensors").write_bytes(b"x")
    (tier.dir / ".partial.123.tmp").write_bytes(b"x")
    tier = make_tier(tmp_path)
    assert tier.stats()["entries"] == 1
    assert {p.name for p in tier.dir.iterdir()} == {"index", files[1].name}
    assert tier.verify().clean
    tier.close()


def test_verify_reports_and_fixes(tmp_path):
    tier = make_tier(tmp_path)
    tier.persist(np.arange(8), [kv(8)])
    tier.persist(np.arange(8) + 50, [kv(8)])
    a, b = sorted(tier.dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    _flip(b, b.stat().st_size - 1)
    report = tier.verify()
    assert report.corrupt == [b.name] and report.ok == [a.name] and not report.clean
    report = tier.verify(fix=True)
    assert tier.verify().clean and tier.stats()["entries"] == 1
    tier.close()


def test_recent_lists_most_recently_used(tmp_path):
    tier = make_tier(tmp_path)
    for i in range(3):
        tier.persist(np.arange(8) + 100 * i, [kv(8)])
    tier.load(tier.lookup(list(range(8))))
    got = tier.recent(2, 0)
    assert [h.tokens for h in got] == [8, 8] and got[0].entry_id == tier.lookup(range(8)).entry_id
    assert tier.recent(0, 0) == [] and len(tier.recent(0, 10**9)) == 3
    tier.close()


def test_unknown_format_version_is_refused_at_rebuild(tmp_path):
    tier = make_tier(tmp_path)
    tier.persist(np.arange(8), [kv(8)])
    tier.close()
    _rewrite_meta(_file(tier), format_version="999")
    import shutil

    shutil.rmtree(tier.dir / "index")
    tier = make_tier(tmp_path)
    assert tier.stats()["entries"] == 0 and tier.stats()["quarantined"] == 1
    tier.close()


def test_files_and_dirs_are_private(tmp_path):
    tier = make_tier(tmp_path / "kv")
    tier.persist(np.arange(8), [kv(8)])
    assert _file(tier).stat().st_mode & 0o777 == 0o600
    assert tier.dir.stat().st_mode & 0o777 == 0o700
    tier.close()


CHILD = textwrap.dedent(
    """
    import os, sys, time
    import mlx.core as mx, numpy as np
    from mlx_lm.models import cache as C
    from tiered_kv.cold.tier import ColdTier
    from tiered_kv.config import Config
    root = sys.argv[1]
    tier = ColdTier(root, sys.argv[2], Config(cache_dir=root, block_tokens=4))
    c = C.KVCache(); x = mx.arange(64, dtype=mx.float32).reshape(1, 2, 8, 4)
    c.update_and_fetch(x, x + 1)
    tier.persist(np.arange(8), [c])
    print("durable", flush=True)
    time.sleep(60)
    """
)


def test_restart_after_sigkill_finds_the_entry(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), FP], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "durable"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    tier = make_tier(tmp_path)
    hit = tier.lookup(list(range(8)) + [1])
    assert hit is not None and hit.tokens == 8
    caches, ids, _ = tier.load(hit)
    assert mx.array_equal(caches[0].keys, mx.arange(64, dtype=mx.float32).reshape(1, 2, 8, 4))
    tier.close()
