"""tiered_kv/layers.py: what each mlx-lm cache class supports and each codec's ``cut``, with real
mlx-lm cache classes (every cache type through the tiers: test_cache_types.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from tests.fixtures import EOS, checkpointed_turn, cold_logits, feed, gemma, make_llama, tokens
from tiered_kv import layers
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache


class _Fails:
    """A decoder layer that raises: a failure in the middle of a forward pass (a fault)."""

    use_sliding = False

    def __call__(self, *args, **kwargs):
        raise RuntimeError("injected failure mid-forward")


def test_store_after_a_failed_forward_cuts_a_concatenate_cache_to_its_offset():
    """ConcatenateKVCache must never be trimmed (its trim() keeps the tail in the arrays): after a
    failure mid-forward the stored arrays are exactly as long as the offset, and a continuation
    that takes the entry over equals a cold prefill."""
    model = make_llama(seed=5)
    tc = TieredCache(
        Config(tiers=("hot",), min_continuation_tokens=8),
        lambda: [ConcatenateKVCache() for _ in model.layers],
    )
    p = tokens(41, 30)
    lease = tc.fetch(p)
    feed(model, lease.caches, p[:20])
    inner = model.model.layers
    saved, inner[1] = inner[1], _Fails()
    try:
        with pytest.raises(RuntimeError):
            model(mx.array([p[20:]]), cache=lease.caches)  # layer 0 took 10 more tokens
    finally:
        inner[1] = saved
    assert [c.offset for c in lease.caches] == [30, 20]
    tc.store(lease, p[:20])
    (entry,) = tc.hot.entries.values()
    assert [(c.offset, c.keys.shape[2], c.values.shape[2]) for c in entry.caches] == [(20, 20, 20)] * 2
    lease = tc.fetch(p[:20] + [3, 4])
    assert lease.hit.tokens == 20 and lease.taken is not None  # a continuation: taken over
    got = feed(model, lease.caches, lease.remaining)
    np.testing.assert_allclose(got, cold_logits(model, p[:20] + [3, 4]), rtol=1e-4, atol=1e-4)


# -- reserve ----------------------------------------------------------------------------------
def test_reserve_gives_a_kv_cache_room_in_one_buffer_and_keeps_its_tokens():
    """Room for ``more`` tokens past the offset (rounded up to the step); the tokens held stay, a
    later write lands in the room (no growth), and the arrays held before are not written."""
    c = filled(KVCache, 300)
    before_k = c.keys
    kept_k = np.array(before_k[..., :300, :])
    layers.reserve([c], 1000)
    assert c.offset == 300 and c.keys.shape[2] == c.values.shape[2] == 1536  # 1300 -> 6 x 256
    np.testing.assert_array_equal(np.array(c.keys[..., :300, :]), kept_k)
    k, v = kv(7, 500)
    c.update_and_fetch(k, v)
    mx.eval(c.keys, c.values)
    assert c.offset == 800 and c.keys.shape[2] == 1536
    np.testing.assert_array_equal(np.array(c.keys[..., 300:800, :]), np.array(k))
    np.testing.assert_array_equal(np.array(c.values[..., 300:800, :]), np.array(v))
    np.testing.assert_array_equal(np.array(before_k[..., :300, :]), kept_k)
    assert before_k.shape[2] == 512  # mlx-lm's own capacity for 300 tokens, untouched


def test_reserve_leaves_other_classes_and_empty_or_roomy_caches_alone():
    q = filled(lambda: QuantizedKVCache(group_size=64, bits=8), 40, dim=64)
    r = filled(lambda: RotatingKVCache(max_size=64), 40)
    empty, roomy = KVCache(), filled(KVCache, 10)  # roomy: 256 slots for 10 tokens
    held = [q.keys, r.keys, roomy.keys]
    layers.reserve([CacheList(q, r), empty, roomy], 100)
    assert all(a is b for a, b in zip([q.keys, r.keys, roomy.keys], held, strict=True))
    assert empty.keys is None
    assert roomy.keys.shape[2] == 256


# -- cut, per codec ---------------------------------------------------------------------------
def kv(seed: int, n: int, dim: int = 16) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    k, v = (mx.array(rng.standard_normal((1, 2, n, dim)).astype(np.float32)) for _ in "kv")
    return k, v


def filled(make, n: int, seed: int = 0, dim: int = 16):
    c = make()
    c.update_and_fetch(*kv(seed, n, dim))
    mx.eval(c.state)
    return c


def same_state(a, b) -> bool:
    """Equal valid state: what the cold tier would write (encode slices to the valid tokens)."""
    ea, ma = layers.encode([a])
    eb, mb = layers.encode([b])
    return ma == mb and ea.keys() == eb.keys() and all(mx.array_equal(ea[k], eb[k]) for k in ea)


POSITIONAL = {
    "KVCache": (KVCache, 16),
    "QuantizedKVCache": (lambda: QuantizedKVCache(group_size=64, bits=8), 64),
    "ConcatenateKVCache": (ConcatenateKVCache, 16),
}


@pytest.mark.parametrize("name", list(POSITIONAL))
def test_cut_of_a_positional_cache_continues_like_a_fresh_one(name):
    """Cut back to n, then written on: the same state as a cache that only ever saw those tokens."""
    make, dim = POSITIONAL[name]
    k, v = kv(1, 30, dim)
    c = make()
    c.update_and_fetch(k, v)
    cut = layers.codec_for(c).cut(c, 12)
    assert cut is not None and layers.codec_for(cut).length(cut) == 12
    ref = make()
    ref.update_and_fetch(k[..., :12, :], v[..., :12, :])
    assert same_state(cut, ref)
    more = kv(2, 5, dim)
    cut.update_and_fetch(*more)
    ref.update_and_fetch(*more)
    assert cut.offset == 17 and same_state(cut, ref)


@pytest.mark.parametrize("name", list(POSITIONAL))
def test_cut_past_the_end_is_none(name):
    make, dim = POSITIONAL[name]
    c = filled(make, 10, dim=dim)
    assert layers.codec_for(c).cut(c, 11) is None and c.offset == 10


def test_cut_of_a_concatenate_cache_never_keeps_the_tail():
    c = filled(ConcatenateKVCache, 30)
    cut = layers.codec_for(c).cut(c, 20)
    assert cut.keys.shape[2] == cut.values.shape[2] == cut.offset == 20


def test_cut_of_a_rotating_window_only_before_it_wraps():
    k, v = kv(3, 12)
    c = RotatingKVCache(max_size=16)
    c.update_and_fetch(k, v)
    cut = layers.codec_for(c).cut(c, 7)
    ref = RotatingKVCache(max_size=16)
    ref.update_and_fetch(k[..., :7, :], v[..., :7, :])
    assert cut is not None and same_state(cut, ref)
    wrapped = filled(lambda: RotatingKVCache(max_size=16), 40)
    codec = layers.codec_for(wrapped)
    assert codec.cut(wrapped, 30) is None  # the window at 30 was overwritten
    assert same_state(codec.cut(wrapped, 40), wrapped)  # its own length: as it is


def test_cut_of_recurrent_state_is_none():
    c = ArraysCache(2)
    c[0], c[1] = mx.zeros((1, 3, 8)), mx.ones((1, 4, 4))
    assert layers.codec_for(c).cut(c, 5) is None  # served from a checkpoint instead


def test_cut_of_a_chunked_cache_not_before_its_first_kept_token():
    k, v = kv(4, 20)
    c = ChunkedKVCache(chunk_size=8)
    c.update_and_fetch(k, v)
    c.maybe_trim_front()  # keeps the last 8: tokens 12..19
    assert c.start_position == 12
    codec = layers.codec_for(c)
    assert codec.cut(c, 11) is None
    cut = codec.cut(c, 15)
    assert cut is not None and cut.offset == 15
    assert mx.array_equal(cut.keys_and_values()[0], k[..., 12:15, :])


def test_cut_of_a_cache_list_cuts_each_member():
    caches = [CacheList(filled(KVCache, 20), filled(ConcatenateKVCache, 20, seed=1))]
    cut = layers.cut(caches, 9)
    assert cut is not None and type(cut[0]) is CacheList
    assert [c.offset for c in cut[0].caches] == [9, 9]
    assert cut[0].caches[1].keys.shape[2] == 9


def test_cut_of_a_model_cache_is_all_or_nothing():
    """A layer that cannot be cut leaves every layer as it was (no half-cut cache)."""
    rec = ArraysCache(1)
    rec[0] = mx.zeros((1, 4))
    caches = [filled(KVCache, 20), rec]
    assert layers.cut(caches, 10) is None
    assert caches[0].offset == 20
    assert layers.cut(caches, 20) is not None  # already there: nothing to cut
    assert layers.cut(caches, 20, have=20) is not None
    assert layers.cut([filled(KVCache, 20), rec], 10, have=20) is None  # the recurrent state is at 20


def test_wrapped_rotating_cache_is_never_served_at_a_wrong_length():
    m = gemma()
    caches = make_prompt_cache(m)
    m(mx.array([tokens(7, 40)]), cache=caches)
    assert not layers.can_trim(caches)
    assert layers.view(caches, 30, 40) is None
    assert layers.view(caches, 40, 40) is not None
    tc = TieredCache(Config(tiers=("hot",)), lambda: make_prompt_cache(m))
    p = [t if t != EOS else 3 for t in tokens(8, 40)]  # checkpoints at 16, 32 and 40 only
    checkpointed_turn(tc, m, p)
    got, hit = checkpointed_turn(tc, m, p[:30] + [5, 6])
    assert hit == 16  # the window at 30 was overwritten: fall back to the checkpoint at 16
    np.testing.assert_allclose(got, cold_logits(m, p[:30] + [5, 6]), rtol=2e-4, atol=2e-4)


def _rotating_wrapped() -> RotatingKVCache:
    """A window of 8 past its size, written by single tokens (mlx-lm's in-place path)."""
    c = filled(lambda: RotatingKVCache(max_size=8), 12)
    for i in range(4):
        c.update_and_fetch(*kv(100 + i, 1))
    mx.eval(c.state)
    return c


@pytest.mark.parametrize(
    "make, at",
    [
        (lambda: filled(KVCache, 20), 20),
        (lambda: filled(KVCache, 20), 12),
        (lambda: filled(lambda: QuantizedKVCache(group_size=64, bits=8), 20, dim=64), 20),
        (lambda: filled(lambda: RotatingKVCache(max_size=32), 20), 12),
        (_rotating_wrapped, 16),
    ],
    ids=["kv-whole", "kv-part", "quantized", "rotating-unwrapped", "rotating-wrapped"],
)  # fmt: skip
def test_writes_into_a_view_never_reach_the_stored_state(make, at):
    """A view shares the stored arrays; the request's own writes must not reach them. mlx-lm writes
    a single token by slice assignment, which changes the Python array it is called on: a wrapped
    sliding window handed out its own array objects, and two one-token writes changed a stored
    checkpoint for every later hit on it (and on disk and Redis after it)."""
    c = make()
    stored = {k: np.array(v) for k, v in layers.encode([c])[0].items()}
    view = layers.view([c], at, c.offset)
    assert view is not None
    (v,) = view
    dim = c.keys[0].shape[-1] * 32 // c.bits if isinstance(c, QuantizedKVCache) else 16
    for i in range(3):
        v.update_and_fetch(*kv(200 + i, 1, dim))
        mx.eval(v.state)
    after = layers.encode([c])[0]
    assert after.keys() == stored.keys()
    for k, x in stored.items():
        np.testing.assert_array_equal(np.array(after[k]), x, err_msg=k)


def test_writes_into_a_recurrent_view_never_reach_the_stored_state():
    """mlx-lm's recurrent layers rebind their state; a layer writing into it in place would have
    reached the stored entry and its checkpoints through a view's shared array objects."""
    c = ArraysCache(2)
    c[0], c[1] = mx.ones((1, 3, 4)), mx.zeros((1, 2))
    mx.eval(c.state)
    view = layers.view([c], 5, 5)
    assert view is not None
    (v,) = view
    v.cache[0][..., 0] = 7.0
    v.cache[1][...] = 2.0
    mx.eval(v.cache)
    assert mx.array_equal(c[0], mx.ones((1, 3, 4))) and mx.array_equal(c[1], mx.zeros((1, 2)))


def test_a_hit_on_a_wrapped_window_leaves_its_checkpoint_to_the_next_request():
    """A request restored from a wrapped window's checkpoint and fed one token at a time (a run of
    end-of-message tokens, each cut for a checkpoint) must not change what the next hit gets."""
    m = gemma()
    tc = TieredCache(Config(tiers=("hot",)), lambda: make_prompt_cache(m))
    p = [t if t != EOS else 3 for t in tokens(9, 40)]
    checkpointed_turn(tc, m, p)
    _, hit = checkpointed_turn(tc, m, p + [EOS, EOS, EOS, 5])
    assert hit == 40
    got, hit = checkpointed_turn(tc, m, p + [6, 7])
    assert hit == 40
    np.testing.assert_allclose(got, cold_logits(m, p + [6, 7]), rtol=2e-4, atol=2e-4)


def test_encode_and_decode_leave_no_reference_cycle():
    """What they return is freed when its last reference goes, not at the next cyclic garbage
    collection: a recursive closure over the arrays kept a whole reloaded entry (1 GB in
    bench.sizes) alive until then."""
    import gc
    import weakref

    from mlx_lm.models.cache import CacheList, KVCache

    def cache():
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 2, 8, 4)), mx.ones((1, 2, 8, 4)))
        return c

    caches = [cache(), CacheList(cache(), cache())]
    gc.disable()
    try:
        arrays, meta = layers.encode(caches)
        refs = [weakref.ref(x) for x in arrays.values()]
        back = layers.decode(arrays, meta)
        assert len(back) == 2
        del arrays, meta, back
        assert all(r() is None for r in refs)  # freed by reference counting alone
    finally:
        gc.enable()
