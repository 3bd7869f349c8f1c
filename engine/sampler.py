"""Per-request samplers for a batch: ``logprobs (B, V) -> token ids (B,)``, on the engine thread.

Greedy requests get ``None`` (the batch's shared argmax: one call for all of them). mlx-lm's own
``make_sampler`` draws from MLX's global random state, which every request in a batch shares, so a
request with a ``seed`` gets its own key instead: the same seed gives the same tokens whatever
else runs in the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, make_sampler

from engine.events import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def for_request(p: SamplingParams) -> Sampler | None:
    """The request's sampler, or None for greedy decoding (temperature 0)."""
    if p.temperature == 0:
        return None
    if p.seed is None:
        return make_sampler(temp=p.temperature, top_p=p.top_p)
    key = mx.random.key(p.seed)
    inv_temp, top_p = 1.0 / p.temperature, p.top_p

    def seeded(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return seeded
