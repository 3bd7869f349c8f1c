"""engine/batch.py: N concurrent greedy requests through one batch loop give what each gives alone
(plain KV, quantised stored KV, a sliding-window model, a recurrent model, a model whose own cache is
quantised); prefill is interleaved with decode; a cancelled request leaves the others unchanged and
stores what it computed.

Real mlx-lm model classes with tiny random weights (tests/tiered_kv/test_cache_types.py) and a real
TieredCache; the loop runs on the test's thread (the thread that made the models' arrays). Helpers:
tests/engine/batching.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engine.batch import BatchLoop
from engine.events import Hit, SamplingParams
from tests.engine.batching import (
    MAX,
    PROMPTS,
    ModelEngine,
    Sink,
    alone,
    run_until,
    warmed,
)
from tests.fixtures import EVERY, QuantizedLlama, gemma, make_llama, qwen_next, tokens
from tiered_kv.config import Config


def quantized_store_llama() -> tuple[Any, dict[str, Any]]:
    return make_llama(seed=4), {"kv_bits": 8, "kv_group_size": 32}


SETTINGS: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "llama": lambda: (make_llama(seed=4), {}),
    "llama-kv-bits-8": quantized_store_llama,
    "gemma3_text-sliding": lambda: (gemma(), {}),
    "qwen3_next-recurrent": lambda: (qwen_next(), {}),
    "llama-quantized-cache": lambda: (QuantizedLlama(), {}),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_concurrent_greedy_equals_alone(name):
    model, extra = SETTINGS[name]()
    ref = [alone(warmed(model, extra), p, m).ids for p, m in zip(PROMPTS, MAX, strict=True)]
    engine = warmed(model, extra)
    loop, sinks = BatchLoop(engine, max_batch=8), [Sink() for _ in PROMPTS]
    for sink, p, m in zip(sinks, PROMPTS, MAX, strict=True):
        loop.add(sink, p, SamplingParams(max_tokens=m))
    biggest = 0
    while not all(s.done for s in sinks):
        loop.step()
        biggest = max(biggest, len(loop.batch.seqs) if loop.batch else 0, loop.decoding)
    assert [s.ids for s in sinks] == ref
    assert biggest >= 3  # they did decode together
    # plain KV prompts share forwards; checkpointed or quantised caches prefill one at a time
    plain = name in ("llama", "llama-kv-bits-8")
    assert (engine.model.prompt_rows() >= 2) == plain, engine.model.shapes
    for s in sinks:
        hit = next(e for e in s.events if isinstance(e, Hit))
        assert hit.tokens >= EVERY and hit.tier == "hot"  # non-positional layers: a checkpoint
        assert s.chunks[-1].usage.cached_tokens == hit.tokens


def test_prefill_interleaves_with_decode_and_short_request_finishes_first():
    """A long prefill does not freeze a running stream, and a short request that arrives during a
    long generation gets its first token (and its end) before the long one finishes."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",)))
    loop = BatchLoop(engine, max_batch=8)
    long_gen, long_prompt, short = Sink(), Sink(), Sink()
    loop.add(long_gen, tokens(50, 10), SamplingParams(max_tokens=400))
    run_until(loop, lambda: len(long_gen.ids) >= 3)
    loop.add(long_prompt, tokens(51, 200), SamplingParams(max_tokens=2))  # 25 chunks of 8
    before = len(long_gen.ids)
    run_until(loop, lambda: bool(long_prompt.ids))
    assert len(long_gen.ids) - before >= 20  # one decode step per prefill chunk (8 tokens)
    loop.add(short, tokens(52, 6), SamplingParams(max_tokens=3))
    run_until(loop, lambda: short.done)
    assert not long_gen.done and len(long_gen.ids) < 400
    loop.close()
    assert long_gen.chunks[-1].finish_reason == "cancelled"


def test_cancel_one_others_unchanged_and_stored():
    model = make_llama(seed=4)
    ref = [alone(warmed(model, {}), p, m).ids for p, m in zip(PROMPTS, MAX, strict=True)]
    engine = warmed(model, {})
    loop, sinks = BatchLoop(engine, max_batch=8), [Sink() for _ in PROMPTS]
    for sink, p, m in zip(sinks, PROMPTS, MAX, strict=True):
        loop.add(sink, p, SamplingParams(max_tokens=m))
    run_until(loop, lambda: len(sinks[1].ids) >= 4)
    sinks[1].cancel = True
    run_until(loop, lambda: all(s.done for s in sinks))
    last = sinks[1].chunks[-1]
    assert last.finish_reason == "cancelled" and last.usage.completion_tokens < MAX[1]
    assert [s.ids for i, s in enumerate(sinks) if i != 1] == [
        r for i, r in enumerate(ref) if i != 1
    ]
    assert sinks[1].ids == ref[1][: len(sinks[1].ids)]
    # what the cancelled request computed is an entry: its prompt + the tokens it generated
    again = engine.cache.fetch(PROMPTS[1] + sinks[1].ids + [7])
    assert again.hit.tokens >= len(PROMPTS[1]) + len(sinks[1].ids) - 1
