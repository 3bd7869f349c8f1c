"""Per-request samplers and logits processors for a batch, on the engine thread.

A sampler maps ``logprobs (B, V) -> token ids (B,)``. Greedy requests get ``None`` (the batch's
shared argmax: one call for all of them). The filters are mlx-lm's (``make_sampler``: top-p,
min-p, XTC, top-k, in its order), and so are the logits processors (``make_logits_processors``: logit
bias, repetition / presence / frequency penalties over the last tokens), as mlx_lm.server applies
them. mlx-lm's sampler draws from MLX's global random state, which every request in a batch
shares, so a request with a ``seed`` gets its own key instead: the same seed gives the same tokens
whatever else runs in the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    make_logits_processors,
    make_sampler,
)

from engine.events import SamplingParams, TokenLogprob

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]  # (token ids so far, logits (1, V)) -> logits


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


#: float32's smallest normal number: a temperature below it has an inverse float32 cannot hold
#: (the scaled log-probabilities become inf and NaN), a top_p below it rounds to nothing
FLOAT32_TINY = 1.1754944e-38


def for_request(p: SamplingParams) -> Sampler | None:
    """The request's sampler, or None for greedy decoding: temperature 0, or a temperature or
    top_p too small for float32 (drawn, they gave arbitrary tokens; the argmax is their limit)."""
    if p.temperature < FLOAT32_TINY or p.top_p < FLOAT32_TINY:
        return None
    if p.seed is None:
        return make_sampler(
            temp=p.temperature, top_p=p.top_p, min_p=p.min_p, top_k=p.top_k,
            xtc_probability=p.xtc_probability, xtc_threshold=p.xtc_threshold,
            xtc_special_tokens=list(p.xtc_keep),
        )  # fmt: skip
    key = mx.random.key(p.seed)
    inv_temp = 1.0 / p.temperature

    def seeded(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.xtc_probability > 0.0:  # mlx-lm's cut (probability 1), taken on the request's draw
            key, draw = mx.random.split(key)
            cut = apply_xtc(logprobs, 1.0, p.xtc_threshold, list(p.xtc_keep))
            logprobs = mx.where(mx.random.uniform(key=draw) < p.xtc_probability, cut, logprobs)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return seeded


def processors(p: SamplingParams) -> list[Processor]:
    """The request's logits processors, applied to its logits before sampling (empty: none)."""
    return make_logits_processors(
        dict(p.logit_bias) or None,
        p.repetition_penalty or None,
        p.repetition_context_size,
        p.presence_penalty or None,
        p.presence_context_size,
        p.frequency_penalty or None,
        p.frequency_context_size,
    )


def token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    """``token``'s entry of a row's ``logprobs`` (V,), with the ``top`` likeliest tokens'."""
    top = min(top, int(logprobs.shape[-1]))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        idx = mx.argpartition(-logprobs, kth=top - 1)[:top]
        ids: list[int] = idx.tolist()  # type: ignore[assignment]
        values: list[float] = logprobs[idx].astype(mx.float32).tolist()  # type: ignore[assignment]
        best = tuple(sorted(zip(ids, values, strict=True), key=lambda p: -p[1]))
    value: float = logprobs[token].astype(mx.float32).item()  # type: ignore[assignment]
    return TokenLogprob(token, value, best)


def process(procs: list[Processor], tokens: list[int], logits: mx.array) -> mx.array:
    """``logits`` (V,) of the request that has fed ``tokens`` through its processors."""
    if not procs:
        return logits
    context, out = mx.array(tokens), logits[None]
    for proc in procs:
        out = proc(context, out)
    return out[0]
