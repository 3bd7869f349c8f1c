"""engine/batch.py: N concurrent greedy requests through one batch loop give what each gives alone
(plain KV, quantised stored KV, a sliding-window model, a recurrent model, a model whose own cache is
quantised); prefill is interleaved with decode; a cancelled request leaves the others unchanged and
stores what it computed.

Real mlx-lm model classes with tiny random weights (tests/tiered_kv/test_cache_types.py) and a real
TieredCache; the loop runs on the test's thread (the thread that made the models' arrays).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.batch import BatchLoop, batchable
from engine.events import END, Chunk, Event, Hit, SamplingParams
from engine.prefill import checkpoint_positions, prefill_steps
from tests.fixtures import EOS, EVERY, QuantizedLlama, gemma, make_llama, qwen_next, tokens
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache


class IdText:
    """Token ids as text ("12 7 "): what the equivalence compares is the ids themselves."""

    def __init__(self, params: SamplingParams) -> None:
        self.p, self.completion = params, 0

    def add(self, tok: int) -> tuple[str, str | None]:
        self.completion += 1
        return f"{tok} ", ("length" if self.completion >= self.p.max_tokens else None)

    def tail(self) -> str:
        return ""


class Recorded:
    """The real model, with the shape (rows, tokens) of every forward it runs recorded."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, inputs: Any, *a: Any, **kw: Any) -> Any:
        self.shapes.append(tuple(inputs.shape))
        return self.inner(inputs, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prompt_rows(self) -> int:
        """The most rows of one forward of several prompt tokens (a decode step feeds one)."""
        return max((rows for rows, n in self.shapes if n > 1), default=0)


class ModelEngine:
    """What the batch loop needs of an Engine, over a bare mlx-lm model and a TieredCache."""

    def __init__(self, model: Any, config: Config) -> None:
        self.model, self.config = Recorded(model), replace(config, prefill_chunk=8)
        make = model.make_cache if hasattr(model, "make_cache") else None
        self.cache = TieredCache(config, make or (lambda: make_prompt_cache(model)))

    def prefill_steps(self, lease, fed, on_progress=None):
        cuts = (
            checkpoint_positions(len(fed), lease.remaining, {EOS}, EVERY)
            if lease.needs_checkpoints
            else []
        )
        return prefill_steps(self.model, lease, fed, self.config.prefill_chunk, cuts, on_progress)

    def text_stream(self, params: SamplingParams) -> IdText:
        return IdText(params)


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.cancel = False

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def cancelled(self) -> bool:
        return self.cancel

    @property
    def chunks(self) -> list[Chunk]:
        return [e for e in self.events if isinstance(e, Chunk)]

    @property
    def ids(self) -> list[int]:
        return [c.token for c in self.chunks if c.token is not None]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] is END


def run_until(loop: BatchLoop, cond: Callable[[], bool], limit: int = 5000) -> None:
    for _ in range(limit):
        if cond():
            return
        loop.step()
    raise AssertionError("the batch loop did not get there")


SHARED = tokens(40, 24)  # a system prompt every request starts with
PROMPTS = [SHARED + tokens(41 + i, 9 + 5 * i) for i in range(4)]
MAX = [12, 20, 7, 16]


def quantized_store_llama() -> tuple[Any, dict[str, Any]]:
    return make_llama(seed=4), {"kv_bits": 8, "kv_group_size": 32}


SETTINGS: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "llama": lambda: (make_llama(seed=4), {}),
    "llama-kv-bits-8": quantized_store_llama,
    "gemma3_text-sliding": lambda: (gemma(), {}),
    "qwen3_next-recurrent": lambda: (qwen_next(), {}),
    "llama-quantized-cache": lambda: (QuantizedLlama(), {}),
}


def warmed(model: Any, extra: dict[str, Any]) -> ModelEngine:
    """A fresh engine whose cache holds the shared prompt (so every request starts from a hit)."""
    cfg = Config(tiers=("hot",), min_continuation_tokens=16, **extra)
    engine = ModelEngine(model, cfg)
    alone(engine, SHARED + [5], 1)
    return engine


def alone(engine: ModelEngine, ids: list[int], max_tokens: int) -> Sink:
    loop, sink = BatchLoop(engine, max_batch=1), Sink()
    loop.add(sink, ids, SamplingParams(max_tokens=max_tokens))
    run_until(loop, lambda: sink.done)
    return sink


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


def test_which_caches_batch():
    assert batchable(make_prompt_cache(make_llama(seed=4)))
    assert batchable(make_prompt_cache(gemma())) and batchable(make_prompt_cache(qwen_next()))
    assert not batchable(QuantizedLlama().make_cache())


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


def test_short_suffixes_prefill_together():
    """Per step, prefill takes up to TIERED_KV_PREFILL_CHUNK prompt tokens: several short prompts
    in one step rather than one per decode step of the running batch."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=()))
    loop = BatchLoop(engine)
    sinks = [Sink() for _ in range(3)]
    for i, s in enumerate(sinks):
        loop.add(s, tokens(60 + i, 2), SamplingParams(max_tokens=5))
    loop.step()
    assert all(s.ids for s in sinks)  # 3 prompts of 2 tokens, budget 8: all in the first step


def hit_of(sink: Sink) -> Hit:
    return next(e for e in sink.events if isinstance(e, Hit))


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


def test_requests_sharing_a_new_prompt_wait_for_the_first_ones_prefill():
    """Two requests on one uncached system prompt, sent together: the second waits for the first's
    prefill and starts from its published prompt instead of prefilling the shared part again."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",), min_continuation_tokens=16))
    system = tokens(80, 100)
    loop, a, b = BatchLoop(engine), Sink(), Sink()
    loop.add(a, system + tokens(81, 5), SamplingParams(max_tokens=3))
    loop.add(b, system + tokens(82, 4), SamplingParams(max_tokens=3))
    run_until(loop, lambda: a.done and b.done)
    first, second = sorted([hit_of(a).tokens, hit_of(b).tokens])
    assert first == 0 and second >= len(system)


def test_a_disk_hit_is_read_beside_the_running_streams(tmp_path, monkeypatch):
    """A request whose prefix comes from the cold tier does not stop another stream: the file is
    read by the scan thread (here a disk made slow) while the running request keeps decoding, and
    the arrays built a slice at a time give what the load of a request alone gives."""
    from tiered_kv.cold import store
    from tiered_kv.cold.tier import ColdTier

    model = make_llama(seed=4)
    cfg = Config(cache_dir=tmp_path, block_tokens=16, restore="load")

    def restarted() -> ModelEngine:
        e = ModelEngine(model, cfg)
        e.cache = TieredCache(
            e.config, lambda: make_prompt_cache(model), ColdTier(tmp_path, "fp", cfg)
        )
        return e

    on_disk = tokens(90, 64)
    first = restarted()
    alone(first, on_disk + [5], 1)
    first.cache.close()  # spilled: the entry is on disk only
    asked = on_disk + tokens(91, 5)
    ref = alone(restarted(), asked, 6)
    assert hit_of(ref).tier == "cold"

    def slow(fn: Callable) -> Callable:
        def wrapped(*a: Any) -> Any:
            time.sleep(0.2)
            return fn(*a)

        return wrapped

    monkeypatch.setattr(store, "read_into", slow(store.read_into))  # every read of the scan
    engine = restarted()
    loop, running, restored = BatchLoop(engine), Sink(), Sink()
    loop.add(running, tokens(92, 8), SamplingParams(max_tokens=100_000))
    run_until(loop, lambda: len(running.ids) >= 2)
    loop.add(restored, asked, SamplingParams(max_tokens=6))
    before = len(running.ids)
    run_until(loop, lambda: any(isinstance(e, Hit) for e in restored.events), limit=10**6)
    assert len(running.ids) - before >= 5  # it kept decoding while the entry was read
    run_until(loop, lambda: restored.done, limit=10**6)
    got, want = hit_of(restored), hit_of(ref)
    assert (got.tokens, got.tier) == (want.tokens, "cold") and restored.ids == ref.ids
    loop.close()


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


def test_a_first_token_is_followed_by_the_next_before_more_prefill():
    """Once a request has its first token, its second comes before any more prefill of another
    prompt: a client's first visible text often needs it (a partial UTF-8 character, whitespace
    held back before a possible marker), so a concurrent title request's prefill must not sit
    between them (issue 14: main-request TTFT next to a title request)."""
    engine = warmed(make_llama(seed=4), {})
    order: list[tuple[str, Any]] = []

    class Logged(Sink):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def emit(self, event: Event) -> None:
            super().emit(event)
            order.append((self.name, event))

    loop, title, main = BatchLoop(engine), Logged("title"), Logged("main")
    progress = lambda done, total: order.append(("title prefill", done))  # noqa: E731
    loop.add(title, tokens(70, 60), SamplingParams(max_tokens=4), progress)
    loop.add(main, SHARED + tokens(71, 6), SamplingParams(max_tokens=4))
    run_until(loop, lambda: main.done and title.done)
    tokens_of_main = [i for i, (n, e) in enumerate(order) if n == "main" and isinstance(e, Chunk)]
    first, second = tokens_of_main[:2]
    assert not title.chunks or order.index(("title", title.chunks[0])) > first
    assert [n for n, _ in order[first:second]] == ["main"]
