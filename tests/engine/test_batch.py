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
from engine.decoding import FIRST_TEXT_TOKENS
from engine.errors import ShuttingDown
from engine.events import Chunk, Event, Failed, Hit, SamplingParams
from engine.inflight import SHORT_PREFILL
from tests.engine.batching import (
    MAX,
    PROMPTS,
    SHARED,
    IdText,
    ModelEngine,
    Sink,
    alone,
    run_until,
    warmed,
)
from tests.fixtures import (
    CUDA_QUANTIZED_GAP,
    EVERY,
    QuantizedLlama,
    gemma,
    make_llama,
    qwen_next,
    tokens,
)
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


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.skipif(CUDA_QUANTIZED_GAP, reason="mlx-cuda: no float32 quantized_matmul"))
    if n == "llama-quantized-cache" else n for n in SETTINGS
])  # fmt: skip
def test_concurrent_greedy_equals_alone(name):
    model, extra = SETTINGS[name]()
    ref = [alone(warmed(model, extra), p, m).ids for p, m in zip(PROMPTS, MAX, strict=True)]
    engine = warmed(model, extra)
    loop, sinks = BatchLoop(engine, max_batch=8), [Sink() for _ in PROMPTS]
    loop.prefill_budget = 64  # room for all four suffixes' chunks in one step
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
    loop.close()  # at shutdown: it is told it was cut short (a 503), not handed a finish
    assert long_gen.done and long_gen.chunks[-1].finish_reason is None
    assert [type(e.error) for e in long_gen.events if isinstance(e, Failed)] == [ShuttingDown]


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


class HeldText(IdText):
    """:class:`IdText` whose first ``hold`` tokens show no text (held back, as a partial UTF-8
    character or whitespace before a possible marker is); the text comes out with the next one."""

    def __init__(self, params: SamplingParams, hold: int) -> None:
        super().__init__(params)
        self.hold, self.pending = hold, ""

    def add(self, tok: int) -> tuple[str, str | None]:
        text, reason = super().add(tok)
        self.pending += text
        if self.completion <= self.hold and reason is None:
            return "", None
        out, self.pending = self.pending, ""
        return out, reason


class Holding(ModelEngine):
    """Requests whose SamplingParams are in ``hold`` (by identity) show no text for that many
    tokens."""

    hold: dict[int, int] = {}

    def text_stream(self, params: SamplingParams) -> IdText:
        return HeldText(params, self.hold.get(id(params), 0))


class Logged(Sink):
    """A sink that also appends (its name, each event) to a log shared with other sinks."""

    def __init__(self, name: str, log: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.name, self.log = name, log

    def emit(self, event: Event) -> None:
        super().emit(event)
        self.log.append((self.name, event))


@pytest.mark.parametrize("hold", [0, 1, 3, 6])
def test_first_visible_text_before_more_prefill_of_others(hold):
    """Issue 14, main-request TTFT next to a title request: once a request has its first token, no
    other prompt is prefilled until it has shown text (its first tokens may bring none: a partial
    character, whitespace before a possible marker), for at most FIRST_TEXT_TOKENS tokens; a
    request whose first token shows text lets the others' prefill go on in the same step."""
    engine = Holding(make_llama(seed=4), Config(tiers=("hot",), min_continuation_tokens=16))
    alone(engine, SHARED + [5], 1)
    order: list[tuple[str, Any]] = []
    loop, title, main = BatchLoop(engine), Logged("title", order), Logged("main", order)
    main_params = SamplingParams(max_tokens=10)
    engine.hold = {id(main_params): hold}
    progress = lambda done, total: order.append(("title prefill", done))  # noqa: E731
    loop.add(title, tokens(70, SHORT_PREFILL + 40), SamplingParams(max_tokens=4), progress)
    loop.add(main, SHARED + tokens(71, 6), main_params)
    run_until(loop, lambda: main.done and title.done)
    mains = [i for i, (n, e) in enumerate(order) if n == "main" and isinstance(e, Chunk)]
    text = next(i for i in mains if order[i][1].text)  # main's first visible text
    assert text == mains[min(hold, len(mains) - 1)]
    titled = [i for i, (n, _) in enumerate(order) if n == "title prefill"]
    waited = not any(mains[0] < i < text for i in titled)
    assert waited == (hold < FIRST_TEXT_TOKENS)  # past FIRST_TEXT_TOKENS the others go on
    if hold == 0:  # text with the first token: the title's prefill goes on before main's next
        assert any(mains[0] < i < mains[1] for i in titled)


def test_a_title_admitted_first_holds_no_main_with_less_prompt_left():
    """Issue 14, title + main when the title arrives first: its prompt is all prefilled and its
    first tokens bring no text yet; a main request admitted next whose prompt is mostly cached
    (fewer tokens left than the title prefilled) is prefilled and gets its first token before
    the title's first text — the hold is only for prompts with as much left."""
    engine = Holding(make_llama(seed=4), Config(tiers=("hot",), min_continuation_tokens=16))
    alone(engine, SHARED + [5], 1)
    events: list[tuple[str, Any]] = []
    loop, title, main = BatchLoop(engine), Logged("title", events), Logged("main", events)

    def chunks() -> list[tuple[str, bool]]:  # (whose, shows text), in emission order
        return [(n, bool(e.text)) for n, e in events if isinstance(e, Chunk)]

    title_params = SamplingParams(max_tokens=8)
    engine.hold = {id(title_params): FIRST_TEXT_TOKENS - 1}
    loop.add(title, tokens(70, SHORT_PREFILL + 40), title_params)
    run_until(loop, lambda: bool(chunks()))  # the title's whole prompt: its first token, no text
    assert chunks() == [("title", False)]
    loop.add(main, SHARED + tokens(71, 6), SamplingParams(max_tokens=4))
    run_until(loop, lambda: main.done and title.done)
    order = chunks()
    assert any(n == "main" for n, _ in order[: order.index(("title", True))])


def test_held_prompts_do_not_ride_along_in_shared_forwards():
    """The text hold is one rule for every forward: while a request awaits its first text, a
    prompt with as much left as it had is neither prefilled next nor carried as a row of the
    shared forward of a shorter one (forwards are shared here, as on a GPU) — also when its
    prefill was under way before the hold began."""
    engine = Holding(make_llama(seed=4), Config(tiers=("hot",), min_continuation_tokens=16))
    assert engine.share_prefill  # Prefilling shares forwards for this engine
    alone(engine, SHARED + [5], 1)
    events: list[tuple[str, Any]] = []
    fed = lambda name: lambda done, total: events.append((f"{name} prefill", done))  # noqa: E731
    loop = BatchLoop(engine)
    loop.prefill_budget = 8
    main, short, long = Logged("main", events), Logged("short", events), Logged("long", events)
    loop.add(long, tokens(70, SHORT_PREFILL + 40), SamplingParams(max_tokens=2), fed("long"))
    loop.step()  # the long prompt's prefill is under way
    assert ("long prefill", 8) in events
    main_params = SamplingParams(max_tokens=8)
    engine.hold = {id(main_params): FIRST_TEXT_TOKENS - 1}
    loop.add(main, SHARED + tokens(71, 6), main_params)
    run_until(loop, lambda: bool(main.chunks))  # main's first token, no text yet
    first = len(events)
    loop.add(short, tokens(72, 3), SamplingParams(max_tokens=2), fed("short"))
    run_until(loop, lambda: main.done and short.done and long.done)
    text = next(i for i, (n, e) in enumerate(events) if n == "main" and getattr(e, "text", ""))
    held = {n for n, _ in events[first:text]}
    assert "short prefill" in held  # fewer tokens left than main prefilled: it goes on
    assert "long prefill" not in held


def test_a_finished_loop_is_freed_without_the_cyclic_collector():
    """Engine.generate makes a BatchLoop per call: when the last reference goes, the loop and its
    parts go with it (a lambda over the loop, handed to its own leasing, made a cycle of every
    part of every loop, freed only by the next cyclic garbage collection)."""
    import gc
    import weakref

    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",)))
    gc.disable()
    try:
        loop = BatchLoop(engine, max_batch=2)
        sink = Sink()
        loop.add(sink, tokens(53, 12), SamplingParams(max_tokens=3))
        run_until(loop, lambda: sink.done)
        loop.close()
        parts = [weakref.ref(x) for x in (loop, loop.leasing, loop.prefill, loop.decode)]
        del loop
        assert all(r() is None for r in parts)  # freed by reference counting alone
    finally:
        gc.enable()
