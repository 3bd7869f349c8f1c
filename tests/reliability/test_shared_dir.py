"""Two processes sharing one cache dir: mixed write/read traffic for a bounded time (soak: minutes).
No torn or lost entry, each process hits what the other one wrote; temp files of live processes
survive another process's open; a file superseded under a reader is a miss, not corruption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from tests.reliability.server import soak
from tiered_kv import keys
from tiered_kv.cold import store, verify
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

FP = keys.fingerprint({"model": "shared"})
BLOCK = 16

# Entry content is a pure function of its token ids, so any process can check any entry.
WORKER = textwrap.dedent(
    """
    import json, sys, time
    import mlx.core as mx, numpy as np
    from mlx_lm.models import cache as C
    from tiered_kv.cold.tier import ColdTier
    from tiered_kv.config import Config

    root, fp, me, other, seconds, seed = sys.argv[1:7]
    me, other, seconds, seed = int(me), int(other), float(seconds), int(seed)
    tier = ColdTier(root, fp, Config(cache_dir=root, block_tokens=16, disk_free_floor=0))
    rng = np.random.default_rng(seed)

    def content(ids):
        c = C.KVCache()
        k = mx.array(np.asarray(ids, np.float32)[None, None, :, None] + np.arange(4, dtype=np.float32))
        c.update_and_fetch(k, k * 2)
        return [c]

    def prompt(owner, i, n):
        base = np.random.default_rng(1000 * owner + i).integers(3, 30000, 200)
        return [owner] + base[: n - 1].tolist()

    written, hits_other, hits_own, loads, torn, misses = [], 0, 0, 0, 0, 0
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    deadline = time.time() + seconds
    while time.time() < deadline:
        i = int(rng.integers(0, 12))
        n = int(rng.integers(2, 12)) * 16  # continuations of one another: supersede happens
        op = rng.random()
        if op < 0.35:
            ids = prompt(me, i, n)
            (tier.persist if op < 0.2 else tier.spill)(np.array(ids), content(ids))
            written.append(ids)
        else:
            owner = other if op < 0.75 else me
            ids = prompt(owner, i, n) + [7]
            hit = tier.lookup(ids)
            if hit is None:
                misses += 1
                continue
            got = tier.load(hit)
            if got is None:
                misses += 1
                continue
            loads += 1
            caches, tokens = got.caches, got.tokens
            keys_ = np.array(caches[0].keys[0, 0, : len(tokens), 0])
            if not (np.array_equal(keys_, np.asarray(tokens, np.float32))
                    and list(tokens[: hit.tokens]) == ids[: hit.tokens]):
                torn += 1
            if owner == other:
                hits_other += 1
            else:
                hits_own += 1
    tier.flush()
    st = tier.stats()
    tier.close()
    print(json.dumps({"written": written, "hits_other": hits_other, "hits_own": hits_own,
                      "loads": loads, "torn": torn, "misses": misses,
                      "quarantined": st["quarantined"], "write_errors": st["write_errors"]}))
    """
)


def test_two_processes_share_one_dir(tmp_path):
    seconds = soak(6, 180)
    root = tmp_path / "kv"
    procs = []
    for me, other in ((1, 2), (2, 1)):
        argv = [sys.executable, "-c", WORKER, str(root), FP, str(me), str(other), str(seconds),
                str(me)]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True))  # fmt: skip
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 120)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["torn"] == 0 and r["quarantined"] == 0 and r["write_errors"] == 0, r
        assert r["hits_other"] > 0, r  # sees the other process's later commits
        assert r["loads"] > 0
    # no lost entry: every written prompt is served whole (by itself or a continuation of it)
    tier = ColdTier(root, FP, Config(cache_dir=root, block_tokens=BLOCK, disk_free_floor=0))
    report = tier.verify()
    assert report.clean, report
    written = {tuple(ids) for r in results for ids in r["written"]}
    for ids in written:
        hit = tier.lookup(list(ids))
        assert hit is not None and hit.tokens == len(ids), ids[:3]
    assert tier.stats()["quarantined"] == 0
    tier.close()


def kv_for(ids: list[int]) -> list:
    c = C.KVCache()
    k = mx.array(np.asarray(ids, np.float32)[None, None, :, None] + np.arange(4, dtype=np.float32))
    c.update_and_fetch(k, k * 2)
    return [c]


def make_tier(root: Path) -> ColdTier:
    return ColdTier(root, FP, Config(cache_dir=root, block_tokens=BLOCK, disk_free_floor=0))


def test_lookup_sees_the_other_process_commit_and_removal(tmp_path):
    a, b = make_tier(tmp_path), make_tier(tmp_path)  # two index connections, two mirrors
    ids = list(range(100, 132))
    a.persist(np.array(ids), kv_for(ids))
    hit = b.lookup(ids + [1])
    assert hit is not None and hit.tokens == 32
    longer = ids + list(range(500, 516))
    a.persist(np.array(longer), kv_for(longer))  # supersedes: the file b found is deleted
    assert b.load(hit) is None  # vanished under the reader: a miss, not corruption
    st = b.stats()
    assert st["misses_missing"] == 1 and st["quarantined"] == 0
    hit = b.lookup(longer)
    assert hit is not None and hit.tokens == 48 and b.load(hit) is not None
    a.close()
    b.close()


def test_file_vanishing_between_check_and_load_is_a_miss(tmp_path, monkeypatch):
    a = make_tier(tmp_path)
    ids = list(range(32))
    a.persist(np.array(ids), kv_for(ids))
    hit = a.lookup(ids)
    real = store.read_header

    def check_then_vanish(path: Path, fingerprint: str | None = None) -> store.Header:
        header = real(path, fingerprint)
        path.unlink()  # another process superseded it right after our checks
        return header

    monkeypatch.setattr(store, "read_header", check_then_vanish)
    assert a.load(hit) is None
    assert a.stats()["quarantined"] == 0 and a.stats()["misses_missing"] == 1
    assert not (tmp_path / "quarantine").exists()
    a.close()


def test_open_keeps_temp_files_of_live_processes(tmp_path):
    a = make_tier(tmp_path)
    a.close()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        fresh_live = a.dir / f".x.safetensors.{live.pid}.tmp"
        fresh_dead = a.dir / f".y.safetensors.{dead.pid}.tmp"
        old_live = a.dir / f".z.safetensors.{live.pid}.tmp"
        for p in (fresh_live, fresh_dead, old_live):
            p.write_bytes(b"partial")
        old = time.time() - verify.TEMP_GRACE_SECONDS - 10
        os.utime(old_live, (old, old))
        b = make_tier(tmp_path)  # another process opening the shared dir
        assert fresh_live.exists()  # a live writer's temp file is left alone
        assert not fresh_dead.exists() and not old_live.exists()
        report = b.verify()
        assert report.temp == [] and report.clean  # a live temp file is not a problem
        b.close()
    finally:
        live.kill()
        live.wait()


def test_two_tiers_opening_a_fresh_dir_at_once_rebuild_once(tmp_path):
    """Meta claim is atomic: a second opener does not clear the first one's commits."""
    a = make_tier(tmp_path)
    ids = list(range(48))
    a.persist(np.array(ids), kv_for(ids))
    b = make_tier(tmp_path)
    assert b.lookup(ids) is not None and b.stats()["entries"] == 1
    assert a.stats()["entries"] == 1
    a.close()
    b.close()
