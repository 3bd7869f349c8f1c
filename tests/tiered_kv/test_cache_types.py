"""Every cache type mlx-lm models make: reuse through the hot tier equals a cold prefill.

Real mlx-lm model classes with tiny random weights: llama (KVCache), gemma3_text (sliding-window
RotatingKVCache + KVCache), qwen3_next (recurrent ArraysCache + KVCache) and llama with
QuantizedKVCache. Non-positional layers are served only from checkpoints at exact positions.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from tests.fixtures import (
    CUDA_QUANTIZED_GAP,
    EOS,
    QuantizedLlama,
    checkpointed_turn,
    gemma,
    make_llama,
    qwen_next,
    tokens,
)
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache

MODELS = {
    "llama": lambda: make_llama(seed=4),
    "gemma3_text-sliding": gemma,
    "qwen3_next-recurrent": qwen_next,
    "llama-quantized-kv": QuantizedLlama,
}


NO_QMM = pytest.mark.skipif(CUDA_QUANTIZED_GAP, reason="mlx-cuda has no float32 quantized_matmul here")


@pytest.fixture(scope="module",
                params=[pytest.param(k, marks=NO_QMM) if "quantized" in k else k for k in MODELS])  # fmt: skip
def model(request):
    return MODELS[request.param]()


def cold_logits(model, ids):
    lease_caches = make_prompt_cache(model)
    out = model(mx.array([ids]), cache=lease_caches)
    return np.array(out[0, -1, :])


def with_eos(seed: int, n: int) -> list[int]:
    ids = tokens(seed, n)
    for i in range(9, n, 10):  # an end-of-message token every 10 ids
        ids[i] = EOS
    return [t if t != EOS or (i % 10 == 9) else 3 for i, t in enumerate(ids)]


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("cont", [10**9, 24], ids=["view", "take"])
def test_reuse_equals_cold(model, cont):
    tc = TieredCache(
        Config(tiers=("hot",), min_continuation_tokens=cont), lambda: make_prompt_cache(model)
    )
    p = with_eos(1, 40)
    cases = [
        p,  # exact hit
        p + with_eos(2, 12),  # prefix hit / continuation
        p[:25] + with_eos(3, 15),  # diverges after a checkpoint (10, 16, 20 …)
        p[:5] + with_eos(4, 15),  # diverges before the first checkpoint
        p + with_eos(2, 12) + with_eos(5, 9),  # continuation of a continuation
    ]
    checkpointed_turn(tc, model, p)
    for ids in cases:
        got, hit = checkpointed_turn(tc, model, ids)
        close(got, cold_logits(model, ids))
        assert hit < len(ids)


def test_non_positional_layers_served_only_at_checkpoints():
    m = qwen_next()
    tc = TieredCache(Config(tiers=("hot",)), lambda: make_prompt_cache(m))
    p = with_eos(6, 40)
    checkpointed_turn(tc, m, p)
    (entry,) = tc.hot.entries.values()
    assert not entry.trimmable and set(entry.checkpoints) >= {10, 16, 20, 30, 32, 40}
    _, hit = checkpointed_turn(tc, m, p[:27] + [7, 7, 7])
    assert hit == 20  # the nearest checkpoint at or before the common prefix (27)
    _, hit = checkpointed_turn(tc, m, p + [7])
    assert hit == 40  # the entry's own full length needs no checkpoint


def test_checkpoints_stay_within_their_budget_share():
    m = qwen_next()
    tc = TieredCache(
        Config(tiers=("hot",), checkpoint_share=0.01, hot_bytes=10**7), lambda: make_prompt_cache(m)
    )
    checkpointed_turn(tc, m, with_eos(9, 64))
    (entry,) = tc.hot.entries.values()
    assert entry.checkpoint_bytes <= 0.01 * 10**7
    assert all(p > 10 for p in entry.checkpoints)  # the earliest ones went first


@NO_QMM
def test_kv_quantization_of_stored_entries():
    m = QuantizedLlama().inner  # plain KVCache model, head_dim 64
    tc = TieredCache(
        Config(tiers=("hot",), kv_bits=8, kv_group_size=64), lambda: make_prompt_cache(m)
    )
    p = tokens(10, 40)
    checkpointed_turn(tc, m, p)
    (entry,) = tc.hot.entries.values()
    assert all(isinstance(c, QuantizedKVCache) for c in entry.caches)
    got, hit = checkpointed_turn(tc, m, p + [5, 6, 7])
    assert hit == 40
    ref = cold_logits(m, p + [5, 6, 7])
    assert np.abs(got - ref).max() < 0.05 * max(1.0, np.abs(ref).max())


def test_reuse_after_disk_reload_equals_cold(model, tmp_path):
    from tiered_kv.cold.tier import ColdTier

    def open_tc():
        cfg = Config(cache_dir=tmp_path, block_tokens=16)
        return TieredCache(cfg, lambda: make_prompt_cache(model), ColdTier(tmp_path, "fp", cfg))

    p = with_eos(1, 40)
    tc = open_tc()
    checkpointed_turn(tc, model, p)
    tc.close()  # spills the entry with its checkpoints
    cases = [p, p + with_eos(2, 12), p[:25] + with_eos(3, 15), p[:5] + with_eos(4, 15)]
    tiers = []
    for ids in cases:
        tc = open_tc()  # a restart: nothing in memory
        got, _ = checkpointed_turn(tc, model, ids)
        close(got, cold_logits(model, ids))
        tiers.append(tc.stats()["hit_tokens_cold"] > 0)
        tc.hot.entries.clear()  # keep the disk as the first run left it
        tc.cold.close()
    assert tiers[0] and tiers[1]  # exact and prefix hits come from disk for every cache type


def test_checkpoints_on_disk_keep_to_their_share(tmp_path):
    from tiered_kv.cold.tier import ColdTier

    m = qwen_next()
    cfg = Config(cache_dir=tmp_path, block_tokens=16, checkpoint_share=0.05)
    tc = TieredCache(cfg, lambda: make_prompt_cache(m), ColdTier(tmp_path, "fp", cfg))
    checkpointed_turn(tc, m, with_eos(11, 64))
    (entry,) = tc.hot.entries.values()
    on_disk = tc._disk_checkpoints(entry)
    assert 0 < len(on_disk) < len(entry.checkpoints)
    assert max(on_disk) == max(entry.checkpoints)  # the latest are kept
    tc.close()
    tc = TieredCache(cfg, lambda: make_prompt_cache(m), ColdTier(tmp_path, "fp", cfg))
    got = tc.cold.load(tc.cold.lookup(with_eos(11, 64) + [5]))  # a prompt the entry serves
    assert sorted(got.checkpoints) == sorted(on_disk)
    tc.cold.close()


class ConcatLlama:
    """A llama whose cache is mlx-lm's ConcatenateKVCache (afm7 uses it for one slot)."""

    def __init__(self) -> None:
        self.inner = make_llama(seed=5)
        self.layers = self.inner.layers

    def __call__(self, x, cache):
        return self.inner(x, cache=cache)

    def make_cache(self):
        from mlx_lm.models.cache import ConcatenateKVCache

        return [ConcatenateKVCache() for _ in self.layers]


@pytest.mark.parametrize("cont", [10**9, 24], ids=["view", "take"])
def test_concatenate_kv_cache_reuse_equals_cold(cont, tmp_path):
    from tiered_kv.cold.tier import ColdTier

    m = ConcatLlama()
    cfg = Config(cache_dir=tmp_path, block_tokens=16, min_continuation_tokens=cont)
    tc = TieredCache(cfg, lambda: make_prompt_cache(m), ColdTier(tmp_path, "fp", cfg))
    p = with_eos(12, 40)
    for ids in (p, p, p[:30] + [4, 5, 6], p + [7, 8, 9]):
        got, _ = checkpointed_turn(tc, m, ids)
        close(got, cold_logits(m, ids))
    tc.close()
    tc = TieredCache(cfg, lambda: make_prompt_cache(m), ColdTier(tmp_path, "fp", cfg))
    got, hit = checkpointed_turn(tc, m, p + [7, 8, 9, 10])
    assert hit > 0
    close(got, cold_logits(m, p + [7, 8, 9, 10]))
    tc.close()
