"""One request inside the batch loop: its state, the text each sampled token brings, and its end.

Every request ends here, one way: a last chunk (held-back text + usage) or a failure, then its cache
stored back into the tiered cache as its own entry (the ids actually fed to the model), then END.

Ownership: the thread that owns MLX (the batch loop's); the sinks must be safe to call from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from engine import sampler as sampling
from engine.errors import ShuttingDown
from engine.events import END, Chunk, Event, Failed, Hit, SamplingParams, Usage
from tiered_kv import Lease

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]
#: prompts with at most this many tokens left are never held: their prefill costs about a decode
#: step, and they join the decode batch in the same step as the request that holds them
SHORT_PREFILL = 64


def short(left: int) -> bool:
    """A prompt with at most :data:`SHORT_PREFILL` tokens left: never held, leased with the
    others and sharing their forward (on the CPU too), where its prefill costs about a decode
    step. The one definition the leasing, the prefill order and :class:`Hold` ask."""
    return left <= SHORT_PREFILL


@dataclass(frozen=True)
class Hold:
    """Which prompts may prefill now. While requests await their first text, a prompt with as
    many tokens left as the least any of them prefilled (``below``) waits: it went first for
    having less, and its text comes before more prefill of longer ones — so a main request's
    first text never waits for the prefill of a title request sent with it. Short prompts
    (:data:`SHORT_PREFILL`) are never held. ``below`` None: nothing is held."""

    below: int | None = None

    def lets(self, left: int) -> bool:
        return self.below is None or left < self.below or short(left)


NO_HOLD = Hold()


class Sink(Protocol):
    """Where one request's events go (the worker's Job, or a list for the synchronous API)."""

    def emit(self, event: Event) -> None: ...
    def cancelled(self) -> bool: ...


@dataclass(eq=False)
class Seq:
    """One request inside the loop."""

    sink: Sink
    prompt_ids: list[int]
    params: SamplingParams
    progress: Progress | None
    enqueued: float
    tokens: Any = None  # prompt_ids as an int32 array, for prefix comparisons
    started: float = 0.0
    lease: Lease | None = None
    fed: list[int] = field(default_factory=list)  # ids whose KV the request's caches hold
    fetch: Generator[None, None, Lease] | None = None  # the cache lookup, step by step
    steps: Generator[None, None, mx.array] | None = None  # its own prefill (caches not batchable)
    text: Any = None  # engine.textout.TextStream
    sampler: sampling.Sampler | None = None
    processors: list[sampling.Processor] = field(default_factory=list)  # its logits processors
    hit: Hit = Hit()
    t_prefill: float = 0.0
    t_first: float = 0.0
    prefill_busy: float = 0.0  # seconds inside this request's own prefill chunks
    prefill_from: int = 0  # tokens the cache served (where its prefill started)
    sampled: int = 0  # tokens sampled so far
    shown: bool = False  # some of them became text (a client sees output)

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt_ids) - len(self.fed)

    @property
    def ready(self) -> bool:
        """Its body is in its plain-KV caches; its last prompt token goes in with the decode
        batch (:meth:`engine.decoding.Decoding.join`)."""
        return self.steps is None and self.left == 1

    @property
    def prefilled(self) -> int:
        """Prompt tokens its own prefill computes (those its cache hit did not serve)."""
        return len(self.prompt_ids) - self.prefill_from

    def on_token(self, tok: int, logprobs: Any = None) -> str | None:
        """Emit the text ``tok`` brings (and its log-probability, from its row's ``logprobs``,
        when the request asked); the finish reason when the request ends with it."""
        assert self.text is not None
        text, reason = self.text.add(tok)
        self.sampled += 1
        self.shown = self.shown or bool(text)
        if tok not in getattr(self.text, "eos", ()):  # an end-of-sequence token is no output
            n = self.params.logprobs
            lp = sampling.token_logprob(logprobs, tok, n) if n >= 0 and logprobs is not None else None
            self.sink.emit(Chunk(text, tok, logprob=lp))
        if reason is None and self.sink.cancelled():
            reason = "cancelled"
        return reason

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=self.text.completion if self.text else 0,
            cached_tokens=self.hit.tokens,
            cache_tier=self.hit.tier,
            ttft_seconds=self.t_first or None,
            queue_seconds=max(0.0, self.started - self.enqueued),
            held_tokens=self.hit.held,
        )


#: how one request in flight ends: (the request, its caches or None)
End = Callable[[Seq, list[Any] | None], None]


class Ends:
    """How requests end: their caches go into ``engine.cache`` (the tiered cache)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def finish(self, seq: Seq, reason: str, caches: list[Any] | None) -> None:
        """Last chunk (held-back text + usage), then store the request's cache as its entry."""
        tail = seq.text.tail() if seq.text is not None else ""
        stop = getattr(seq.text, "stopped_by", None)
        seq.sink.emit(Chunk(tail, None, reason, seq.usage(), stop_sequence=stop))
        self.store(seq, caches)
        seq.sink.emit(END)

    def stop(self, seq: Seq, caches: list[Any] | None) -> None:
        """At shutdown: store what the request computed, then tell its listener it was not
        served whole (a 503; a finish would read as a complete answer)."""
        self.store(seq, caches)
        seq.sink.emit(Failed(ShuttingDown(), seq.usage()))
        seq.sink.emit(END)

    def fail(self, seq: Seq, error: Exception, caches: list[Any] | None) -> None:
        log.error("generation failed: %s", error, exc_info=error)
        seq.sink.emit(Failed(error, seq.usage()))
        self.store(seq, caches)
        seq.sink.emit(END)

    def store(self, seq: Seq, caches: list[Any] | None) -> None:
        if seq.lease is None or caches is None:
            return
        seq.lease.caches = list(caches)
        try:
            self.engine.cache.store(seq.lease, seq.fed)
        except Exception:  # a failed store loses a cache entry, never the response
            log.exception("storing the cache entry failed")
        seq.lease = None
