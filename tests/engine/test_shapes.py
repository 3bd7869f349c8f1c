"""engine/shapes.py: a prefill step in few attention shapes gives the plain step's caches and logits,
and over a conversation's turns attention sees a few (query, key) shapes instead of a new one a turn.

A real mlx-lm llama with tiny random weights (float32), real mlx-lm caches, the real Engine.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine import shapes
from engine.generate import Engine, SamplingParams
from tests.fixtures import f32_tol, make_llama, tokens
from tiered_kv.config import Config


def test_query_rows_are_powers_of_two_from_16():
    assert [shapes.query_rows(n) for n in (1, 15, 16, 17, 100, 1000, 1024, 2047, 2048)] == [
        16, 16, 16, 32, 128, 1024, 1024, 2048, 2048,
    ]  # fmt: skip


def test_capacity_is_four_lengths_an_octave_from_256_in_grains_up_to_8192():
    ends = (1, 256, 257, 1024, 1025, 4096, 4097, 6000, 8192, 8193, 32769, 70000, 131073)
    want = (256, 256, 512, 1024, 1280, 4096, 5120, 6144, 8192, 10240, 40960, 73728, 139264)
    assert tuple(shapes.capacity(e) for e in ends) == want
    for end in range(1, 300000, 997):  # never under the tokens, at most a quarter (or 255) over
        cap = shapes.capacity(end)
        assert end <= cap <= min(max(end + 255, end * 1.25), end + 8191)
        assert shapes.capacity(cap) == cap


@pytest.mark.parametrize(
    ("start", "n", "step", "want"),
    [
        (0, 5000, 2048, 2048),  # from an aligned start: a whole step
        (300, 5000, 2048, 1748),  # up to the next multiple of the step
        (300, 100, 2048, 100),  # all that is left, in one step
        (300, 2048, 2048, 2048),  # one (padded) step rather than two
        (2048, 2048, 2048, 2048),
        (4095, 2049, 2048, 1),
    ],
)
def test_chunk_is_one_step_or_ends_at_the_next_multiple_of_the_step(start, n, step, want):
    assert shapes.chunk(start, n, step) == want


def test_whole_steps_are_aligned_steps_of_the_step_length():
    assert shapes.whole(0, 2048, 2048) and shapes.whole(4096, 2048, 2048)
    assert not shapes.whole(300, 2048, 2048) and not shapes.whole(2048, 100, 2048)


def _plain(model, prefix: list[int], chunk: list[int]):
    caches = make_prompt_cache(model)
    if prefix:
        model(mx.array([prefix]), cache=caches)
    out = model(mx.array([chunk]), cache=caches)
    mx.eval(out, [c.state for c in caches])
    return caches, np.array(out[0, -1])


@pytest.mark.parametrize(
    ("prefix", "n"), [(0, 5), (0, 64), (7, 1), (7, 9), (30, 17), (64, 64), (300, 40), (4090, 20)]
)
def test_a_step_gives_the_plain_steps_caches_and_logits(prefix, n):
    """Padded (query to a power of two, keys the whole buffer under a mask) or whole aligned
    (64 tokens from 0 or 64 with a 64-token step: causal), from empty caches or a prefix, across a
    grain boundary (4090 + 20): the same logits and exactly the same tokens in the caches."""
    model = make_llama(seed=3)
    ids = tokens(5, prefix + n)
    want_caches, want = _plain(model, ids[:prefix], ids[prefix:])
    caches = make_prompt_cache(model)
    if prefix:
        model(mx.array([ids[:prefix]]), cache=caches)
        mx.eval([c.state for c in caches])
    before = [c.offset for c in caches]
    new, last = shapes.forward(model, caches, ids[prefix:], 64, logits=True)
    assert last is not None
    np.testing.assert_allclose(np.array(last[0]), want, rtol=f32_tol(1e-5), atol=f32_tol(1e-5))
    assert [c.offset for c in caches] == before  # the caches given are left as they were
    for c, w in zip(new, want_caches, strict=True):
        assert type(c) is KVCache and c.offset == w.offset == prefix + n
        assert shapes.capacity(c.keys.shape[2]) == c.keys.shape[2]  # a capacity long
        for got_a, want_a in ((c.keys, w.keys), (c.values, w.values)):
            np.testing.assert_allclose(
                np.array(got_a[..., : c.offset, :]), np.array(want_a[..., : w.offset, :]),
                rtol=f32_tol(1e-5), atol=f32_tol(1e-5),
            )  # fmt: skip


def test_steps_after_a_padded_one_continue_its_caches():
    """A padded step, then a whole aligned one, then a padded one again, onto the same caches
    (buffers of whole grains, a padded step's extra keys past the offset): the plain steps' logits."""
    model = make_llama(seed=3)
    ids = tokens(6, 64 + 64 + 9)
    caches, want_caches = make_prompt_cache(model), make_prompt_cache(model)
    for a, b in ((0, 50), (50, 64), (64, 128), (128, 137)):
        caches, last = shapes.forward(model, caches, ids[a:b], 64, logits=True)
        out = model(mx.array([ids[a:b]]), cache=want_caches)
        assert last is not None
        np.testing.assert_allclose(
            np.array(last[0]), np.array(out[0, -1]), rtol=f32_tol(1e-5), atol=f32_tol(1e-5)
        )


def test_only_plain_kv_caches_are_padded():
    from tests.fixtures import QuantizedLlama, gemma

    assert shapes.applies(make_prompt_cache(make_llama()))
    assert not shapes.applies(make_prompt_cache(gemma()))  # sliding-window layers
    assert not shapes.applies(QuantizedLlama().make_cache())


def test_a_model_that_takes_the_cache_masks_takes_padded_steps():
    assert shapes.works(make_llama(seed=2), 64)


def test_a_model_that_builds_its_own_masks_keeps_mlx_lms_steps(tiny_model_dir, monkeypatch):
    """A model that asks for a causal mask without the cache's ``make_mask`` would attend, in a
    padded step, bottom-right aligned over the whole buffer (keys past the tokens included): the
    check at start finds the logits parted, and the engine keeps the plain steps."""
    from mlx_lm.models import llama

    monkeypatch.setattr(llama, "create_attention_mask", lambda h, cache=None, **kw: "causal")
    assert not shapes.works(make_llama(seed=2), 64)
    engine = Engine(tiny_model_dir, Config(tiers=(), step_shapes="on"))
    assert not engine.step_shapes


def test_a_windowed_mask_over_a_plain_cache_is_refused_in_a_padded_step():
    cache = shapes.PaddedKVCache(64)
    cache.update_and_fetch(mx.zeros((1, 2, 5, 8)), mx.zeros((1, 2, 5, 8)))
    with pytest.raises(shapes.NotPadded):
        cache.make_mask(9, window_size=4)
    cache.make_mask(1, window_size=4)  # a one-token step is not padded: mlx-lm's mask


@pytest.fixture
def attention_shapes(monkeypatch):
    """(query, key) lengths of every many-token attention call (the real kernel runs)."""
    seen: list[tuple[int, int]] = []
    real = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        if q.shape[2] > 1:
            seen.append((int(q.shape[2]), int(k.shape[2])))
        return real(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    return seen


def _turns(engine: Engine) -> list[list[int]]:
    """A conversation: a 300-token prompt, then each turn's prompt is the last one plus its answer
    and a new message of 9-130 tokens (hot hits)."""
    prompt, out = tokens(11, 300), []
    for i, extra in enumerate((9, 33, 70, 5, 130)):
        chunks = list(engine.generate(prompt, SamplingParams(max_tokens=6)))
        answer = [c.token for c in chunks if c.token is not None]
        out.append(answer)
        prompt = prompt + answer + tokens(20 + i, extra)
    return out


def test_a_conversation_attends_in_few_shapes(tiny_model_dir, attention_shapes):
    """With TIERED_KV_STEP_SHAPES=on every prefill step of a 300-token prompt and five hot turns
    after it hands attention either a whole aligned step (64 tokens onto a multiple of 64: the
    shapes of any long prefill) or a power-of-two query over a capacity's key length, where the
    plain steps had a key length of their own every turn (a cuDNN graph build each on CUDA).
    Greedy tokens equal the plain engine's."""
    config = dict(tiers=("hot",), min_continuation_tokens=16, prefill_chunk=64)
    plain = Engine(tiny_model_dir, Config(step_shapes="off", **config))
    padded = Engine(tiny_model_dir, Config(step_shapes="on", **config))  # its check at start
    assert padded.step_shapes and not plain.step_shapes
    attention_shapes.clear()
    want = _turns(plain)
    plain_keys = {k for _, k in attention_shapes if k % 64}
    attention_shapes.clear()
    assert _turns(padded) == want
    for q, k in attention_shapes:
        whole = q == 64 and k % 64 == 0
        assert whole or (shapes.capacity(k) == k and q & (q - 1) == 0), attention_shapes
    short = {(q, k) for q, k in attention_shapes if q != 64}
    assert 0 < len(short) <= 3, short  # (16, 512), (32, 512): every turn's suffix in two shapes
    assert len(plain_keys) >= 6, plain_keys  # without it: a key length per turn's steps


def test_step_shapes_auto_is_off_on_the_cpu(tiny_model_dir):
    engine = Engine(tiny_model_dir, Config(tiers=()))
    assert engine.step_shapes == (mx.default_device().type == mx.gpu and mx.cuda.is_available())


def test_entries_from_padded_steps_reach_disk_at_their_length_and_serve_after_a_restart(
    tiny_model_dir, tmp_path
):
    """A turn prefilled in few shapes (buffers longer than the tokens) is written with its tokens
    only (the file the plain engine writes for it, to the byte count), and a restarted engine's
    disk hit continues it to the same greedy tokens as a plain engine."""
    config = dict(block_tokens=16, disk_free_floor=0, restore="load", cold_deadline=30.0,
                  prefill_chunk=64)  # fmt: skip
    first = tokens(31, 150)
    sizes, answers = {}, {}
    for mode in ("off", "on"):
        engine = Engine(tiny_model_dir, Config(cache_dir=tmp_path / mode, step_shapes=mode, **config))
        answers[mode] = [c.token for c in engine.generate(first, SamplingParams(max_tokens=4))]
        engine.close()
        (entry,) = (tmp_path / mode).glob("*/*.safetensors")
        sizes[mode] = entry.stat().st_size
    assert sizes["on"] == sizes["off"] and answers["on"] == answers["off"]
    engine = Engine(tiny_model_dir, Config(cache_dir=tmp_path / "on", step_shapes="on", **config))
    second = first + [t for t in answers["on"] if t is not None] + tokens(32, 23)
    got = list(engine.generate(second, SamplingParams(max_tokens=8)))
    engine.close()
    assert got[-1].usage is not None and got[-1].usage.cache_tier == "cold"
    plain = Engine(tiny_model_dir, Config(tiers=(), step_shapes="off"))
    want = list(plain.generate(second, SamplingParams(max_tokens=8)))
    assert [c.token for c in got] == [c.token for c in want]


def test_the_server_serves_hot_turns_in_few_shapes(tiny_model_dir, tmp_path, monkeypatch):
    """Over HTTP, on the server's engine thread (its own MLX stream), with TIERED_KV_STEP_SHAPES=on:
    hot turns give the text of a server without a cache, hit the cache, and prefill in padded
    steps."""
    pytest.importorskip("openai")
    from tests.serving import hot_config, serve

    steps: list[int] = []
    real = shapes.forward

    def counted(model, caches, tokens, step, logits=False):
        steps.append(len(tokens))
        return real(model, caches, tokens, step, logits)

    monkeypatch.setattr(shapes, "forward", counted)

    padded = hot_config(tmp_path / "on", step_shapes="on")
    none = Config(cache_dir=tmp_path / "none", tiers=())
    messages: list[dict] = [{"role": "user", "content": "what is the weather like in paris today?"}]
    with serve(lambda: Engine(tiny_model_dir, padded), padded) as on, \
            serve(lambda: Engine(tiny_model_dir, none), none) as plain:  # fmt: skip
        for turn in range(3):
            a, b = (
                s.client.chat.completions.create(
                    model="t", messages=messages, max_tokens=10, temperature=0
                )
                for s in (on, plain)
            )
            assert a.choices[0].message.content == b.choices[0].message.content
            assert a.usage is not None and a.usage.prompt_tokens_details is not None
            assert (a.usage.prompt_tokens_details.cached_tokens or 0) > 0 or turn == 0
            messages += [{"role": "assistant", "content": a.choices[0].message.content or ""},
                         {"role": "user", "content": f"and on day {turn + 2}?"}]  # fmt: skip
    assert len(steps) >= 3, steps  # (and the check at start)
