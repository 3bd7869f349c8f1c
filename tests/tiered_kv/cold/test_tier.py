"""tiered_kv/cold/tier.py: ColdTier round trips, lookup, spill / persist, restart (the read path's
failures: test_loads.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import numpy as np

from tests.fixtures import (
    TIER_FP,
    cold_tier,
    entry_file,
    kv_cache,
    make_llama,
    with_tensors,
)
from tiered_kv import keys
from tiered_kv.cold import store


def _model():
    return make_llama(seed=3)


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
    tier = cold_tier(tmp_path)
    tier.spill(np.array(prompt[:30]), caches)
    tier.flush()
    hit = tier.lookup(prompt)
    assert hit is not None and hit.tokens == 30
    got = tier.load(hit)
    assert got is not None
    loaded = got.caches
    warm = _greedy(model, loaded, prompt[30:], 8)
    cold = _greedy(model, make_prompt_cache(model), prompt, 8)
    assert warm == cold
    tier.close()


def test_forced_collision_never_serves_the_wrong_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(keys, "block_hashes", lambda t, b, s: [keys.BlockHash(1)] * (len(t) // b))
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(12), [kv_cache(12)])
    assert tier.lookup([50 + i for i in range(12)]) is None  # same "hashes", other ids
    hit = tier.lookup([0, 1, 2, 99] + list(range(8)))
    assert hit is not None and hit.tokens == 3  # exact token-level common prefix only
    tier.close()


def test_partial_block_extends_the_hit_and_continuation_supersedes(tmp_path):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(10), [kv_cache(10)])
    tier.persist(np.arange(14), [kv_cache(14)])  # starts with the whole older entry → replaces it
    st = tier.stats()
    assert st["entries"] == 1 and st["superseded"] == 1
    assert len(list(tier.dir.glob("*.safetensors"))) == 1
    hit = tier.lookup(list(range(13)) + [5])
    assert hit is not None and hit.tokens == 13 and hit.entry_tokens == 14
    tier.close()


def test_an_entry_keeps_how_many_of_its_ids_were_the_prompt(tmp_path):
    """``prompt_tokens`` goes into the file's metadata and comes back with the load (the hot
    tier's continuation of a re-rendered turn needs it after a restart); an entry written
    without it, or all prompt, loads with None."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(12), [kv_cache(12)], prompt_tokens=9)
    tier.persist(np.arange(12) + 100, [kv_cache(12)])
    tier.persist(np.arange(12) + 200, [kv_cache(12)], prompt_tokens=12)
    got = {}
    for first in (0, 100, 200):
        hit = tier.lookup(list(range(first, first + 12)))
        assert hit is not None
        loaded = tier.load(hit)
        assert loaded is not None
        got[first] = loaded.prompt_tokens
    assert got == {0: 9, 100: None, 200: None}
    tier.close()


def test_a_prompt_length_that_is_not_one_is_not_believed():
    from tiered_kv.cold.store import prompt_of

    assert prompt_of({"prompt_tokens": "9"}, 12) == 9
    for raw in ("0", "12", "13", "-1", "9.5", " 9", "abc", "", "1" * 40, "٣"):
        assert prompt_of({"prompt_tokens": raw}, 12) is None, raw
    assert prompt_of({}, 12) is None


def test_files_and_dirs_are_private(tmp_path):
    tier = cold_tier(tmp_path / "kv")
    tier.persist(np.arange(8), [kv_cache(8)])
    assert entry_file(tier).stat().st_mode & 0o777 == 0o600
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
        [sys.executable, "-c", CHILD, str(tmp_path), TIER_FP], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "durable"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    tier = cold_tier(tmp_path)
    hit = tier.lookup(list(range(8)) + [1])
    assert hit is not None and hit.tokens == 8
    got = tier.load(hit)
    assert got is not None
    caches = got.caches
    assert mx.array_equal(caches[0].keys, mx.arange(64, dtype=mx.float32).reshape(1, 2, 8, 4))
    tier.close()


def test_a_file_listing_many_undeclared_tensors_is_refused_before_anything_is_allocated(tmp_path):
    """A re-signed header (its checksum is public xxh3) listing ~200k one-byte tensors beside an
    entry's own kept the engine thread in ``landing.allocate`` for ~14 s (on CUDA each got a
    4 KiB-aligned slot: ~781 MiB of padding), then the load served the entry. Tensors that the
    layers metadata does not declare make the header corrupt: the planted file is quarantined
    where the tier first reads it (adopting an orphan at open), never loaded."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    path = entry_file(tier)
    tier.close()
    planted = with_tensors(path.read_bytes(), {f"0.x{i}": b"\x01" for i in range(20_000)})
    path.unlink()
    path.with_name("planted" + store.SUFFIX).write_bytes(planted)
    t0 = time.perf_counter()
    tier = cold_tier(tmp_path)
    hit = tier.lookup(list(range(8)))
    assert hit is None or tier.load(hit) is None
    assert tier.stats()["quarantined"] == 1 and tier.stats()["entries"] == 0
    assert time.perf_counter() - t0 < 10
    tier.close()
