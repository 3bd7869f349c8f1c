"""Every cache type mlx-lm models make: reuse through the hot tier equals a cold prefill.

Real mlx-lm model classes with tiny random weights: llama (KVCache), gemma3_text (sliding-window
RotatingKVCache + KVCache), qwen3_next (recurrent ArraysCache + KVCache) and llama with
QuantizedKVCache. Non-positional layers are served only from checkpoints at exact positions.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gemma3_text, qwen3_next
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from engine.prefill import checkpoint_positions, prefill
from tests.tiered_kv.conftest import make_llama, tokens
from tiered_kv import layers
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache

EOS = 2
EVERY = 16


def gemma():
    mx.random.seed(1)
    m = gemma3_text.Model(
        gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=4,
            head_dim=16,
            num_key_value_heads=2,
            vocab_size=256,
            sliding_window=16,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
        )
    )
    mx.eval(m.parameters())
    return m


def qwen_next():
    mx.random.seed(2)
    m = qwen3_next.Model(
        qwen3_next.ModelArgs(
            model_type="qwen3_next",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=4,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=0,
            num_experts_per_tok=1,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=128,
            mlp_only_layers=[0, 1, 2, 3],
            moe_intermediate_size=64,
            rms_norm_eps=1e-5,
            vocab_size=256,
            num_key_value_heads=2,
            rope_theta=10000.0,
            partial_rotary_factor=0.5,
            max_position_embeddings=4096,
            head_dim=16,
            full_attention_interval=2,
        )
    )
    mx.eval(m.parameters())
    return m


class QuantizedLlama:
    """A llama whose model cache is mlx-lm's QuantizedKVCache (8-bit, group 64)."""

    def __init__(self) -> None:
        from mlx_lm.models import llama

        mx.random.seed(3)
        self.inner = llama.Model(
            llama.ModelArgs(
                model_type="llama",
                hidden_size=128,
                num_hidden_layers=2,
                intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                rms_norm_eps=1e-5,
                vocab_size=256,
            )
        )
        mx.eval(self.inner.parameters())
        self.layers = self.inner.layers

    def __call__(self, x, cache):
        return self.inner(x, cache=cache)

    def make_cache(self):
        return [QuantizedKVCache(group_size=64, bits=8) for _ in self.layers]


MODELS = {
    "llama": lambda: make_llama(seed=4),
    "gemma3_text-sliding": gemma,
    "qwen3_next-recurrent": qwen_next,
    "llama-quantized-kv": QuantizedLlama,
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def cold_logits(model, ids):
    lease_caches = make_prompt_cache(model)
    out = model(mx.array([ids]), cache=lease_caches)
    return np.array(out[0, -1, :])


def run(tc: TieredCache, model, ids: list[int]):
    lease = tc.fetch(ids)
    fed = ids[: lease.hit.tokens]
    cuts = (
        checkpoint_positions(len(fed), lease.remaining, {EOS}, EVERY)
        if lease.needs_checkpoints
        else []
    )
    logits = prefill(model, lease, fed, 8, cuts)
    tc.store(lease, fed)
    return np.array(logits), lease.hit.tokens


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
    run(tc, model, p)
    for ids in cases:
        got, hit = run(tc, model, ids)
        close(got, cold_logits(model, ids))
        assert hit < len(ids)


def test_non_positional_layers_served_only_at_checkpoints():
    m = qwen_next()
    tc = TieredCache(Config(tiers=("hot",)), lambda: make_prompt_cache(m))
    p = with_eos(6, 40)
    run(tc, m, p)
    (entry,) = tc.hot.entries.values()
    assert not entry.trimmable and set(entry.checkpoints) >= {10, 16, 20, 30, 32, 40}
    _, hit = run(tc, m, p[:27] + [7, 7, 7])
    assert hit == 20  # the nearest checkpoint at or before the common prefix (27)
    _, hit = run(tc, m, p + [7])
    assert hit == 40  # the entry's own full length needs no checkpoint


def test_wrapped_rotating_cache_is_never_served_at_a_wrong_length():
    m = gemma()
    caches = make_prompt_cache(m)
    m(mx.array([tokens(7, 40)]), cache=caches)
    assert not layers.can_trim(caches)
    assert layers.view(caches, 30, 40) is None
    assert layers.view(caches, 40, 40) is not None
    tc = TieredCache(Config(tiers=("hot",)), lambda: make_prompt_cache(m))
    p = [t if t != EOS else 3 for t in tokens(8, 40)]  # checkpoints at 16, 32 and 40 only
    run(tc, m, p)
    got, hit = run(tc, m, p[:30] + [5, 6])
    assert hit == 16  # the window at 30 was overwritten: fall back to the checkpoint at 16
    close(got, cold_logits(m, p[:30] + [5, 6]))


def test_checkpoints_stay_within_their_budget_share():
    m = qwen_next()
    tc = TieredCache(
        Config(tiers=("hot",), checkpoint_share=0.01, hot_bytes=10**7), lambda: make_prompt_cache(m)
    )
    run(tc, m, with_eos(9, 64))
    (entry,) = tc.hot.entries.values()
    assert entry.checkpoint_bytes <= 0.01 * 10**7
    assert all(p > 10 for p in entry.checkpoints)  # the earliest ones went first


def test_kv_quantization_of_stored_entries():
    m = QuantizedLlama().inner  # plain KVCache model, head_dim 64
    tc = TieredCache(
        Config(tiers=("hot",), kv_bits=8, kv_group_size=64), lambda: make_prompt_cache(m)
    )
    p = tokens(10, 40)
    run(tc, m, p)
    (entry,) = tc.hot.entries.values()
    assert all(isinstance(c, QuantizedKVCache) for c in entry.caches)
    got, hit = run(tc, m, p + [5, 6, 7])
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
    run(tc, model, p)
    tc.close()  # spills the entry with its checkpoints
    cases = [p, p + with_eos(2, 12), p[:25] + with_eos(3, 15), p[:5] + with_eos(4, 15)]
    tiers = []
    for ids in cases:
        tc = open_tc()  # a restart: nothing in memory
        got, _ = run(tc, model, ids)
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
    run(tc, m, with_eos(11, 64))
    (entry,) = tc.hot.entries.values()
    on_disk = tc._disk_checkpoints(entry)
    assert 0 < len(on_disk) < len(entry.checkpoints)
    assert max(on_disk) == max(entry.checkpoints)  # the latest are kept
    tc.close()
    tc = TieredCache(cfg, lambda: make_prompt_cache(m), ColdTier(tmp_path, "fp", cfg))
    got = tc.cold.load(tc.cold.lookup(with_eos(11, 64)))
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
        got, _ = run(tc, m, ids)
        close(got, cold_logits(m, ids))
    tc.close()
    tc = TieredCache(cfg, lambda: make_prompt_cache(m), ColdTier(tmp_path, "fp", cfg))
    got, hit = run(tc, m, p + [7, 8, 9, 10])
    assert hit > 0
    close(got, cold_logits(m, p + [7, 8, 9, 10]))
    tc.close()
