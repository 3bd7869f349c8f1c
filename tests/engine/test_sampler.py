"""engine/sampler.py: temperature 0 is the batch's shared argmax (no sampler); a seeded request
draws from its own key, so the same seed gives the same ids whatever else was sampled meanwhile."""

from __future__ import annotations

import mlx.core as mx

from engine.events import SamplingParams
from engine.sampler import for_request, greedy, process, processors


def logprobs(seed: int) -> mx.array:
    x = mx.random.normal((2, 50), key=mx.random.key(seed))
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def test_greedy_is_none_and_argmax():
    assert for_request(SamplingParams(temperature=0.0)) is None
    lp = logprobs(0)
    assert greedy(lp).tolist() == mx.argmax(lp, axis=-1).tolist()


def test_same_seed_same_ids_whatever_runs_between():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    a, b = for_request(params), for_request(params)
    assert a is not None and b is not None
    first = [a(logprobs(i)).tolist() for i in range(5)]
    second = []
    for i in range(5):
        mx.random.categorical(logprobs(99))  # another request's draw from the global state
        second.append(b(logprobs(i)).tolist())
    assert first == second


def test_top_k_and_min_p_filter_the_draw_seeded_or_not():
    """top_k 1 (and min_p 1: only the likeliest survives) leave the argmax whatever the
    temperature; mlx-lm's filters, in its order. Before, both were ignored."""
    lp = logprobs(3)
    for params in (SamplingParams(temperature=2.0, top_k=1),
                   SamplingParams(temperature=2.0, top_k=1, seed=5),
                   SamplingParams(temperature=2.0, min_p=1.0),
                   SamplingParams(temperature=2.0, min_p=1.0, seed=5)):  # fmt: skip
        s = for_request(params)
        assert s is not None
        assert [s(lp).tolist() for _ in range(8)] == [greedy(lp).tolist()] * 8, params


def test_xtc_cuts_the_top_choices_but_the_kept_tokens_seeded_or_not():
    """XTC at probability 1 cuts every token likelier than the least likely one above the
    threshold: the draw comes from the rest, or a kept token (a newline, the end of sequence).
    Before, xtc_probability and xtc_threshold were ignored."""
    probs = mx.array([[0.5, 0.3, 0.15, 0.05]])
    lp = mx.log(probs)
    for seed in (None, 5):
        s = for_request(SamplingParams(temperature=1.0, seed=seed, xtc_probability=1.0,
                                       xtc_threshold=0.1))  # fmt: skip
        assert s is not None
        assert {int(s(lp).item()) for _ in range(40)} <= {2, 3}, seed  # 0 and 1 cut
        kept = for_request(SamplingParams(temperature=1.0, seed=seed, xtc_probability=1.0,
                                          xtc_threshold=0.1, xtc_keep=(0,)))  # fmt: skip
        assert kept is not None
        assert 0 in {int(kept(lp).item()) for _ in range(60)}, seed
        never = for_request(SamplingParams(temperature=0.01, seed=seed, xtc_probability=0.0))
        assert never is not None and int(never(lp).item()) == 0


def test_processors_are_mlx_lms_and_none_by_default():
    assert processors(SamplingParams()) == []
    procs = processors(SamplingParams(logit_bias=((3, 50.0),), repetition_penalty=1.2))
    assert len(procs) == 2
    logits = mx.zeros((50,))
    out = process(procs, [1, 2, 3], logits)
    assert int(mx.argmax(out)) == 3 and out.shape == (50,)


def test_a_temperature_or_top_p_below_float32s_range_is_greedy():
    """A temperature whose inverse float32 cannot hold (1e-40: the scaled log-probabilities were
    inf and NaN) and a top_p float32 rounds to nothing drew arbitrary tokens ("boundaries steel
    retro whichever" for "hi"); sampling at such a setting is the argmax, its limit."""
    lp = logprobs(3)
    for params in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-40, seed=5),
                   SamplingParams(temperature=1.0, top_p=1e-46),
                   SamplingParams(temperature=1.0, top_p=1e-46, seed=5)):  # fmt: skip
        s = for_request(params) or greedy
        assert [s(lp).tolist() for _ in range(8)] == [greedy(lp).tolist()] * 8, params
    assert for_request(SamplingParams(temperature=1e-30)) is not None  # a real (if cold) one
