"""engine/prefilling.py: the prefill order (the fewest prompt tokens left first), prompts of several
requests in shared forwards (exact per request: outputs equal each alone, stored entries serve
later turns), and a first token followed by the request's next before more prefill.

Real tiny mlx-lm llama, real TieredCache, the whole batch loop (helpers: tests/engine/batching.py).
"""

from __future__ import annotations

import pytest

from engine.batch import BatchLoop
from engine.events import SamplingParams
from engine.inflight import SHORT_PREFILL
from tests.engine.batching import (
    SHARED,
    ModelEngine,
    Sink,
    alone,
    hit_of,
    run_until,
    warmed,
)
from tests.fixtures import gemma, make_llama, tokens
from tiered_kv.config import Config


def test_short_suffixes_prefill_together():
    """Per step, prefill takes up to TIERED_KV_PREFILL_CHUNK prompt tokens: several short prompts
    in one step rather than one per decode step of the running batch."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=()))
    loop = BatchLoop(engine)
    sinks = [Sink() for _ in range(3)]
    for i, s in enumerate(sinks):
        loop.add(s, tokens(60 + i, 2), SamplingParams(max_tokens=5))
    loop.step()  # 3 prompts of 2 tokens, budget 8: all prefilled in the first step
    assert loop.decoding == 3 and not loop.prefilling
    loop.step()  # their first tokens come with the decode batch's next step
    assert all(s.ids for s in sinks)


@pytest.mark.parametrize("title_started", [False, True])
def test_cached_main_request_prefills_before_a_fresh_title(title_started):
    """The least prompt left goes first: a main request whose long prompt is cached gets its first
    token before a concurrent title request (fresh prompt) has prefilled — whether they arrive
    together or the title's prefill is already under way (overtaken at a chunk boundary)."""
    engine = warmed(make_llama(seed=4), {})
    main_ids, title_ids = SHARED + tokens(71, 6), tokens(70, 60)  # 6 new tokens vs 60 (8 chunks)
    ref = alone(warmed(make_llama(seed=4), {}), main_ids, 5).ids
    loop, title, main = BatchLoop(engine), Sink(), Sink()
    loop.add(title, title_ids, SamplingParams(max_tokens=20))
    if title_started:
        loop.step()
        assert loop.prefilling and not title.ids  # one chunk of the title done
    loop.add(main, main_ids, SamplingParams(max_tokens=5))
    run_until(loop, lambda: bool(main.ids))
    assert not title.ids  # the title is still prefilling
    assert hit_of(main).tokens == len(SHARED)
    run_until(loop, lambda: main.done and title.done)
    assert main.ids == ref


def test_prompts_at_different_hits_prefill_together_exactly():
    """Requests with different cached prefixes (40, 30, 20 tokens, none) and suffixes prefill in
    shared forwards (the model sees their prompt chunks as rows of one batch), greedy outputs equal
    each request's alone, and each stored entry holds exactly its own tokens: it serves the next
    turn of that conversation, whose output equals an uncached run's."""
    model = make_llama(seed=4)
    a, b = tokens(100, 40), tokens(101, 20)

    def engine_with_entries() -> ModelEngine:
        e = ModelEngine(model, Config(tiers=("hot",), min_continuation_tokens=16))
        alone(e, a + [5], 1)
        alone(e, b + [5], 1)
        return e

    prompts = [a + tokens(110, 3), a[:30] + tokens(111, 25), b + tokens(112, 12), tokens(113, 17)]
    most = [9, 4, 14, 6]
    ref = [alone(engine_with_entries(), p, m).ids for p, m in zip(prompts, most, strict=True)]
    engine = engine_with_entries()
    loop, sinks = BatchLoop(engine), [Sink() for _ in prompts]
    for sink, p, m in zip(sinks, prompts, most, strict=True):
        loop.add(sink, p, SamplingParams(max_tokens=m))
    run_until(loop, lambda: all(s.done for s in sinks))
    assert [hit_of(s).tokens for s in sinks] == [40, 30, 20, 0]
    assert engine.model.prompt_rows() == 4  # all four prompts in one forward
    assert [s.ids for s in sinks] == ref
    # the next turns: each from its own stored entry, as if run without any cache
    follow = [
        p + s.ids + tokens(120 + i, 4) for i, (p, s) in enumerate(zip(prompts, sinks, strict=True))
    ]
    fresh = ModelEngine(model, Config(tiers=()))
    want = [alone(fresh, f, 5).ids for f in follow]
    nxt = [Sink() for _ in follow]
    for sink, f in zip(nxt, follow, strict=True):
        loop.add(sink, f, SamplingParams(max_tokens=5))
    run_until(loop, lambda: all(s.done for s in nxt))
    for p, s, n in zip(prompts, sinks, nxt, strict=True):
        assert hit_of(n).tokens >= len(p) + len(s.ids) - 1
    assert [n.ids for n in nxt] == want


def test_without_shared_forwards_each_prompt_has_its_own():
    """An engine that does not share prefill forwards (the CPU default: a row costs what a request
    alone does) prefills each prompt in forwards of its own, with the same outputs."""
    model = make_llama(seed=4)
    prompts = [SHARED + tokens(130 + i, SHORT_PREFILL + 5 + 3 * i) for i in range(3)]
    ref = [alone(warmed(model, {}), p, 6).ids for p in prompts]
    engine = warmed(model, {})
    engine.share_prefill = False
    loop, sinks = BatchLoop(engine), [Sink() for _ in prompts]
    for sink, p in zip(sinks, prompts, strict=True):
        loop.add(sink, p, SamplingParams(max_tokens=6))
    run_until(loop, lambda: all(s.done for s in sinks))
    assert engine.model.prompt_rows() == 1
    assert [s.ids for s in sinks] == ref


def test_without_shared_forwards_short_prompts_still_share_one():
    """Issue 14, decode on the CPU: short prompts (``SHORT_PREFILL``) sent together share their
    body's forward even where rows are not shared (a forward of a few tokens costs its fixed part)
    and join the decode batch together — bodies in one forward, last prompt tokens in one more,
    as mlx_lm.server does — with the outputs each has alone."""
    model = make_llama(seed=4)
    prompts = [SHARED + tokens(140 + i, 3) for i in range(3)]
    ref = [alone(warmed(model, {}), p, 6).ids for p in prompts]
    engine = warmed(model, {})
    engine.share_prefill = False
    engine.model.shapes.clear()
    loop, sinks = BatchLoop(engine), [Sink() for _ in prompts]
    for sink, p in zip(sinks, prompts, strict=True):
        loop.add(sink, p, SamplingParams(max_tokens=6))
    run_until(loop, lambda: all(s.done for s in sinks))
    assert engine.model.shapes[:2] == [(3, 2), (3, 1)]
    assert [s.ids for s in sinks] == ref


def test_a_last_prompt_token_is_the_first_decode_step():
    """Issue 14, decode speed: a request that joins a running batch feeds its last prompt token as
    its first decode step (as mlx-lm's ``BatchGenerator`` does): two forwards of its own (its body,
    that step), then it decodes in the batch's — not three (the body, the last token alone for
    logits, then the sampled token's own forward before joining)."""
    model = make_llama(seed=4)
    first, later = tokens(150, 6), tokens(151, 6)
    ref = alone(ModelEngine(model, Config(tiers=())), later, 4).ids
    engine = ModelEngine(model, Config(tiers=()))
    loop, running, joining = BatchLoop(engine), Sink(), Sink()
    loop.add(running, first, SamplingParams(max_tokens=30))
    run_until(loop, lambda: len(running.ids) >= 2)
    engine.model.shapes.clear()
    loop.add(joining, later, SamplingParams(max_tokens=4))
    run_until(loop, lambda: joining.done)
    shapes = engine.model.shapes
    assert shapes[: shapes.index((2, 1))] == [(1, 1), (1, 5), (1, 1)]  # a step, body, last token
    assert joining.ids == ref


class _Learning(ModelEngine):
    """An engine that learns from each prefill, as engine.generate.Engine does (a refit of its
    costs, the cost file written): what the loop and the request's sink held when it was told."""

    def __init__(self, model, config, sink) -> None:
        super().__init__(model, config)
        self.sink = sink
        self.loop: BatchLoop | None = None
        self.seen: list[tuple[int, int]] = []

    def prefill_done(self, lease, start, new, seconds) -> None:
        assert self.loop is not None
        self.seen.append((self.loop.decoding, len(self.sink.ids)))


@pytest.mark.parametrize("model", ["llama", "gemma"])  # shared forwards / a prefill of its own
def test_the_engine_learns_from_a_prefill_after_its_first_step(model):
    """Learning from a prefill costs a refit and, first after a start, a write of the cost file:
    not inside the time to first token. A prefill of its own (gemma's rotating layers) learns once
    its first token is out; a row of shared forwards (llama) once it has joined the decode batch,
    whose forward, queued, then runs on the device beside the learning."""
    sink = Sink()
    engine = _Learning(make_llama(seed=4) if model == "llama" else gemma(), Config(tiers=()), sink)
    loop = BatchLoop(engine)
    engine.loop = loop
    loop.add(sink, tokens(80, 30), SamplingParams(max_tokens=3))
    run_until(loop, lambda: sink.done)
    ((decoding, first),) = engine.seen
    assert decoding == 1 and first == (1 if model == "gemma" else 0)
