"""Helpers of the batch loop's tests (tests/engine/test_batch.py, test_prefilling.py, test_leasing.py,
test_decoding.py): what the loop needs of an Engine over a bare mlx-lm model and a real TieredCache,
a sink that records events, and a request run alone for reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from engine.batch import BatchLoop
from engine.events import END, Chunk, Event, Hit, SamplingParams
from engine.prefill import checkpoint_positions, prefill_steps
from tests.fixtures import EOS, EVERY, tokens
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


async def drain(job: Any) -> list[Event]:
    """Every event of a Worker job until its end (a 30 s silence fails: the worker stalled)."""
    out = []
    while (item := await job.get(30)) is not END:
        assert item is not None, "worker stalled"
        out.append(item)
    return out


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

    share_prefill = True  # requests prefilling together share forwards (the tests exercise it)
    step_shapes = False

    def __init__(self, model: Any, config: Config) -> None:
        self.model, self.config = Recorded(model), replace(config, prefill_chunk=8)
        self.vocab_size = int(model.args.vocab_size)
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


def hit_of(sink: Sink) -> Hit:
    return next(e for e in sink.events if isinstance(e, Hit))
