"""engine/decoding.py: which caches decode in the batched group; a seeded request samples the same
tokens whatever else decodes beside it; a request decoding alone gives attention no mask, rows of
different lengths keep theirs.

Real tiny mlx-lm models (helpers: tests/engine/batching.py).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text, llama
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache

from engine import shapes
from engine.batch import BatchLoop
from engine.decoding import DecodeKVCache, DecodeRotatingKVCache, batchable, merge
from engine.events import Failed, SamplingParams
from tests.engine.batching import PROMPTS, ModelEngine, Sink, run_until
from tests.fixtures import QuantizedLlama, f32_tol, gemma, make_llama, qwen_next
from tiered_kv.config import Config


def test_which_caches_batch():
    assert batchable(make_prompt_cache(make_llama(seed=4)))
    assert batchable(make_prompt_cache(gemma())) and batchable(make_prompt_cache(qwen_next()))
    assert not batchable(QuantizedLlama().make_cache())


def test_seeded_sampling_same_in_a_batch():
    """A seed gives the same tokens whatever else runs in the batch (each seeded request has its
    own random key; mlx-lm's samplers share the global one)."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=()))
    params = SamplingParams(max_tokens=10, temperature=1.5, seed=1234)
    solo = Sink()
    loop = BatchLoop(engine)
    loop.add(solo, PROMPTS[0], params)
    run_until(loop, lambda: solo.done)
    sinks = [Sink() for _ in range(3)]
    loop.add(sinks[0], PROMPTS[1], SamplingParams(max_tokens=10, temperature=1.0))
    loop.add(sinks[1], PROMPTS[0], params)
    loop.add(sinks[2], PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.7, seed=9))
    run_until(loop, lambda: all(s.done for s in sinks))
    assert sinks[1].ids == solo.ids


def _decode_masks(monkeypatch, module=llama) -> list:
    """The mask of every one-token attention call a ``module`` model makes from now on."""
    masks: list = []
    inner = module.scaled_dot_product_attention

    def spy(queries, keys, values, cache, scale, mask, **kw):
        if queries.shape[2] == 1:
            masks.append(mask)
        return inner(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    monkeypatch.setattr(module, "scaled_dot_product_attention", spy)
    return masks


def test_a_request_decoding_alone_gives_attention_no_mask(monkeypatch):
    """mlx-lm's BatchKVCache builds an array mask for every decode step, and attention with one
    runs a slower kernel (H200: 0.63-0.81x of mlx-lm's generate_step); a lone row has no padding
    to mask. The tokens are those of mlx-lm's own generate_step."""
    model = make_llama(seed=4)
    engine = ModelEngine(model, Config(tiers=()))
    masks = _decode_masks(monkeypatch)
    loop, sink = BatchLoop(engine, max_batch=1), Sink()
    loop.add(sink, PROMPTS[0], SamplingParams(max_tokens=12))
    run_until(loop, lambda: sink.done)
    assert len(masks) >= 11 * 2  # every decode step, every layer
    assert all(m is None for m in masks), {type(m) for m in masks}
    cache = make_prompt_cache(model)
    want = [int(t) for t, _ in generate_step(mx.array(PROMPTS[0]), model, max_tokens=12,
                                             prompt_cache=cache)]  # fmt: skip
    assert sink.ids == want


def test_a_request_decoding_alone_on_a_sliding_window_model_gives_attention_no_mask(monkeypatch):
    """mlx-lm's BatchRotatingKVCache builds an array mask (rolled once the window is full) for
    every decode step of a sliding-window layer, all true for a lone row; mlx-lm's own
    generate_step passes none. The prompt (33 tokens) and the decode outgrow the window (16):
    the window rotates. The tokens are generate_step's."""
    model = gemma()
    engine = ModelEngine(model, Config(tiers=()))
    masks = _decode_masks(monkeypatch, gemma3_text)
    loop, sink = BatchLoop(engine, max_batch=1), Sink()
    loop.add(sink, PROMPTS[0], SamplingParams(max_tokens=24))
    run_until(loop, lambda: sink.done)
    assert len(masks) >= 23 * 4  # every decode step, every layer (two of them sliding)
    assert all(m is None for m in masks), {type(m) for m in masks}
    cache = make_prompt_cache(model)
    want = [int(t) for t, _ in generate_step(mx.array(PROMPTS[0]), model, max_tokens=24,
                                             prompt_cache=cache)]  # fmt: skip
    assert sink.ids == want


def test_a_padded_sliding_window_row_keeps_its_mask_until_rows_change():
    """Left padding only shrinks while rows decode: "no row padded" holds until rows join or
    leave, and a padded batch gets mlx-lm's mask (the same array)."""

    def rotating(n: int) -> RotatingKVCache:
        kv = RotatingKVCache(max_size=16)
        x = mx.random.normal((1, 2, n, 8))
        kv.update_and_fetch(x, x + 1)
        return kv

    lone = merge([rotating(20)])
    assert isinstance(lone, DecodeRotatingKVCache)
    assert lone.make_mask(1, window_size=16) is None
    assert isinstance(lone.make_mask(1, window_size=8), mx.array)  # a narrower window: masked
    pair = merge([rotating(20), rotating(9)])  # the second row left-padded by 7
    want = BatchRotatingKVCache.make_mask(pair, 1, window_size=16)
    got = pair.make_mask(1, window_size=16)
    assert isinstance(got, mx.array) and mx.array_equal(got, want)
    pair.filter([0])  # the padded row leaves
    assert pair.make_mask(1, window_size=16) is None
    pair.extend(merge([rotating(9)]))  # a shorter one joins: padded again
    assert isinstance(pair.make_mask(1, window_size=16), mx.array)


def test_rows_of_different_lengths_keep_their_mask(monkeypatch):
    engine = ModelEngine(make_llama(seed=4), Config(tiers=()))
    masks = _decode_masks(monkeypatch)
    loop = BatchLoop(engine, max_batch=8)
    loop.prefill_budget = 64
    sinks = [Sink() for _ in range(2)]
    loop.add(sinks[0], PROMPTS[0], SamplingParams(max_tokens=4))
    loop.add(sinks[1], PROMPTS[2], SamplingParams(max_tokens=12))
    run_until(loop, lambda: all(s.done for s in sinks))
    arrays = [m for m in masks if isinstance(m, mx.array)]
    assert arrays and all(m.shape[0] == 2 for m in arrays)  # the two rows, padded
    assert masks[-1] is None  # the longer one, alone again after the other left


def test_a_merged_cache_grows_in_whole_steps():
    """merge copies the rows into buffers of exactly their length; mlx-lm's growth then adds
    whole steps to that length (37 + 256 = 293 rows, for ever misaligned: a slower attention
    on the H200). Ours rounds the buffer up to whole steps, and keeps every row."""
    kv = KVCache()
    rows = mx.random.normal((1, 2, 37, 8))
    kv.update_and_fetch(rows, rows + 1)
    batch = merge([kv])
    assert batch.keys.shape[2] == 37
    assert isinstance(batch, DecodeKVCache)
    sizes, added = [], []
    for i in range(300):
        new = mx.full((1, 2, 1, 8), float(i))
        added.append(new)
        k, v = batch.update_and_fetch(new, new + 1)
        sizes.append(int(batch.keys.shape[2]))
    assert all(s % DecodeKVCache.step == 0 for s in sizes), sorted(set(sizes))
    want = mx.concatenate([rows, *added], axis=2)
    assert k.shape[2] == 337 and mx.array_equal(k, want) and mx.array_equal(v, want + 1)


def test_a_merged_cache_grows_to_capacities_that_recur_from_turn_to_turn():
    """Each hot turn merges a cache a little longer than the last turn's; growth by whole steps
    gave its first decode step a buffer length of its own (3000 tokens: 3328; 3100: 3584), and
    mlx-cuda builds a cuDNN decode graph per buffer length (H100, 1B, 8k: a hot turn's median
    TTFT 95 ms against 22 ms with recurring lengths). Ours grows to a capacity
    (engine.shapes.capacity: four lengths an octave, whole steps): turns share buffer lengths."""

    def first_buffer(n: int) -> int:
        kv = KVCache()
        x = mx.zeros((1, 2, n, 8))
        kv.update_and_fetch(x, x)
        batch = merge([kv])
        batch.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
        return int(batch.keys.shape[2])

    lengths = {first_buffer(n) for n in (3000, 3100, 3200, 3300)}
    assert lengths == {3584}, lengths
    assert all(s % DecodeKVCache.step == 0 and shapes.capacity(s) == s for s in lengths)


def test_a_row_leaving_leaves_whole_step_buffers():
    """``filter`` (a row leaves) shifts the buffer left by the smallest padding: a buffer that is
    not whole steps, decoded over until its next growth (up to 255 steps; the request whose
    partner finished decodes alone over a 731-row buffer here). Ours decodes the next step over
    whole steps, every row kept."""

    def cache(n: int, fill: float) -> KVCache:
        kv = KVCache()
        x = mx.full((1, 2, n, 8), fill)
        kv.update_and_fetch(x, x + 1)
        return kv

    def step(batch: DecodeKVCache, value: float) -> tuple[mx.array, mx.array]:
        new = mx.full((batch.offset.size, 2, 1, 8), value)
        return batch.update_and_fetch(new, new + 1)

    batch = merge([cache(300, 1.0), cache(263, 2.0)])  # the second row left-padded by 37
    step(batch, 3.0)
    assert batch.keys.shape[2] % DecodeKVCache.step == 0
    batch.filter([1])  # the long row leaves: the short one's 37 rows of padding go
    k, v = step(batch, 4.0)
    assert batch.keys.shape[2] % DecodeKVCache.step == 0, batch.keys.shape
    want = mx.concatenate([mx.full((1, 2, 263, 8), 2.0), mx.full((1, 2, 1, 8), 3.0),
                           mx.full((1, 2, 1, 8), 4.0)], axis=2)  # fmt: skip
    assert mx.array_equal(k, want) and mx.array_equal(v, want + 1)


def test_logits_processors_apply_to_their_own_row_as_in_mlx_lm():
    """Repetition / presence / frequency penalties and logit bias (mlx_lm.server's request
    fields) shape each request's tokens as mlx-lm's generate_step does with the same processors,
    from the first token on, whatever else decodes in the batch; a request without them is
    unchanged beside them. Before, the engine ignored them."""
    from mlx_lm.sample_utils import make_logits_processors

    model = make_llama(seed=4)
    engine = ModelEngine(model, Config(tiers=()))
    penalised = SamplingParams(max_tokens=12, repetition_penalty=1.5, presence_penalty=0.8,
                               frequency_penalty=0.5, frequency_context_size=8)  # fmt: skip
    biased = SamplingParams(max_tokens=6, logit_bias=((7, 100.0),))
    plain = SamplingParams(max_tokens=12)
    sinks = [Sink() for _ in range(3)]
    loop = BatchLoop(engine)
    loop.add(sinks[0], PROMPTS[0], penalised)
    loop.add(sinks[1], PROMPTS[1], biased)
    loop.add(sinks[2], PROMPTS[2], plain)
    run_until(loop, lambda: all(s.done for s in sinks))

    def mlx_lm(prompt, n, **kw):
        procs = make_logits_processors(**kw)
        steps = generate_step(mx.array(prompt), model, max_tokens=n,
                              prompt_cache=make_prompt_cache(model), logits_processors=procs)
        return [int(t) for t, _ in steps]  # fmt: skip

    want = mlx_lm(PROMPTS[0], 12, repetition_penalty=1.5, presence_penalty=0.8,
                  frequency_penalty=0.5, frequency_context_size=8)  # fmt: skip
    assert sinks[0].ids == want and want != mlx_lm(PROMPTS[0], 12)
    assert sinks[1].ids == [7] * 6
    assert sinks[2].ids == mlx_lm(PROMPTS[2], 12)


def test_a_request_whose_processors_fail_fails_alone_when_joining_with_others():
    """Requests whose prompts go in during one step join the decode batch in one forward; when
    one of them cannot be set up (a logits processor raising: a context size past mlx-lm's 32-bit
    slice), it fails alone and the others decode what they decode alone. Before, every request
    of that forward failed."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=()))
    prompts = [[3, 9, 4], [5, 2, 8]]  # short: both bodies go in during the first step
    plain = SamplingParams(max_tokens=6)
    bad = SamplingParams(max_tokens=6, repetition_penalty=1.1, repetition_context_size=3_000_000_000)
    alone = Sink()
    loop = BatchLoop(engine)
    loop.add(alone, prompts[0], plain)
    run_until(loop, lambda: alone.done)
    good, failing = Sink(), Sink()
    loop.add(good, prompts[0], plain)
    loop.add(failing, prompts[1], bad)
    loop.step()  # both prompts in, and both joined in this step
    assert loop.decoding == 1 and failing.done and isinstance(failing.events[-2], Failed)
    run_until(loop, lambda: good.done)
    assert good.ids == alone.ids and not any(isinstance(e, Failed) for e in good.events)


def test_log_probabilities_are_mlx_lms_for_each_token():
    """A request that asks for log-probabilities gets each sampled token's (and its n likeliest
    alternatives'), equal to what mlx-lm's generate_step gives at that step, first token included,
    in a batch beside a request that did not ask."""
    model = make_llama(seed=4)
    engine = ModelEngine(model, Config(tiers=()))
    asks, other = Sink(), Sink()
    loop = BatchLoop(engine)
    loop.add(asks, PROMPTS[0], SamplingParams(max_tokens=8, logprobs=3))
    loop.add(other, PROMPTS[1], SamplingParams(max_tokens=8))
    run_until(loop, lambda: asks.done and other.done)
    steps = list(generate_step(mx.array(PROMPTS[0]), model, max_tokens=8,
                               prompt_cache=make_prompt_cache(model)))  # fmt: skip
    got = [c.logprob for c in asks.chunks if c.token is not None]
    assert [g.token for g in got] == [int(t) for t, _ in steps] == asks.ids
    for g, (tok, lps) in zip(got, steps, strict=True):
        assert abs(g.logprob - lps[int(tok)].item()) < f32_tol(1e-4)
        assert len(g.top) == 3 and g.top[0][0] == g.token  # greedy: the likeliest
        assert g.top[0][1] >= g.top[1][1] >= g.top[2][1]
    assert all(c.logprob is None for c in other.chunks)
