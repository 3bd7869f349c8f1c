"""Continuous batching through the tiered cache, on the one thread that owns MLX.

Requests join and leave at token boundaries. Each request leases its own prefix from the tiered
cache (:mod:`engine.leasing`), prefills its suffix a chunk at a time between two decode steps of the
running batch, so a long prefill never freezes the other streams — in forwards shared with the other
prefilling requests where their caches allow (:mod:`engine.prefilling`) — joins the decode batch
(:mod:`engine.decoding`), and on finishing or cancelling gives its cache back to the tiered cache as
its own entry (:mod:`engine.inflight`). This module is the loop that steps the three.

Ownership: a BatchLoop and every array it touches belong to the thread that calls ``step``; the
sinks it emits into must be safe to call from that thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from engine.decoding import Decoding, Group, batchable
from engine.events import END, Failed, SamplingParams
from engine.inflight import End, Ends, Hold, Progress, Seq, Sink
from engine.leasing import Leasing
from engine.prefilling import Prefilling
from tiered_kv import Config

__all__ = ["BatchLoop", "Progress", "Sink", "batchable"]

log = logging.getLogger(__name__)


class BatchLoop:
    """The engine's requests in flight: ``add`` them, call ``step`` until ``active`` is 0."""

    def __init__(self, engine: Any, max_batch: int = Config.max_batch) -> None:
        self.engine, self.max_batch = engine, max_batch
        # prompt tokens of prefill per step (the engine resolves TIERED_KV_PREFILL_CHUNK=0, auto)
        self.prefill_budget = engine.config.prefill_chunk
        ends = self.ends = Ends(engine)
        self.decode = Decoding(engine.model, ends)
        self.prefill = Prefilling(engine, ends, self.decode.start, self.decode.join)
        decode = self.decode  # not ``self``: a lambda over the loop, kept by its own leasing, is a cycle
        self.leasing = Leasing(
            engine, ends, self.prefill.seqs, lambda: decode.count > 0, self.prefill.share
        )

    # -- bookkeeping ------------------------------------------------------------------------
    @property
    def decoding(self) -> int:
        return self.decode.count

    @property
    def prefilling(self) -> list[Seq]:
        return self.prefill.seqs

    @property
    def batch(self) -> Group | None:
        return self.decode.batch

    @property
    def active(self) -> int:
        """Requests admitted and not finished (at most ``max_batch``)."""
        waiting = len(self.leasing.waiting) + len(self.leasing.loading)
        return waiting + len(self.prefill.seqs) + self.decode.count

    def has_room(self) -> bool:
        return self.active < self.max_batch

    def add(
        self,
        sink: Sink,
        prompt_ids: list[int],
        params: SamplingParams,
        progress: Progress | None = None,
        enqueued: float | None = None,
    ) -> None:
        """Admit a request; it is leased and prefilled when the prefill order reaches it. A
        prompt holding an id outside the model's vocabulary fails at once (its sink hears a
        ValueError): MLX's embedding gather would read past its table (the CPU's segfaulted)."""
        now = time.perf_counter()
        ids = list(prompt_ids)
        vocab = int(self.engine.vocab_size)
        try:
            arr = np.array(ids, dtype=np.int32)  # an id past 32 bits: OverflowError
            inside = not arr.size or (int(arr.min()) >= 0 and int(arr.max()) < vocab)
        except (OverflowError, TypeError, ValueError):
            inside = False
        if not inside:
            wrong = next((i for i in ids if not (isinstance(i, int) and 0 <= i < vocab)), None)
            sink.emit(Failed(ValueError(f"prompt token id {wrong!r} is outside the model's "
                                        f"vocabulary of {vocab}")))  # fmt: skip
            sink.emit(END)
            return
        seq = Seq(sink, ids, params, progress, enqueued or now, arr)
        self.leasing.waiting.append(seq)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> None:
        """One decode step of every decoding group, then up to ``prefill_budget`` prompt tokens
        of prefill: one chunk of a long prompt, or the whole suffixes of several short ones;
        several requests' chunks share one forward where their caches allow.

        A request's first visible text comes before more prefill of requests with as much
        prompt left as it had: while one has its first token but no text yet (held back; at most
        ``FIRST_TEXT_TOKENS`` tokens), only prompts shorter than its own prefill go on. So a main
        request's first text never waits for the prefill of a title request sent with it, and a
        title that started first does not hold a main request with less left. Prompts of a few
        tokens (``SHORT_PREFILL``) are never held; requests whose bodies went in during the step
        join the decode batch together at its end, their last prompt tokens one forward."""
        self.decode.step()
        self.leasing.poll()
        self.leasing.drop_cancelled()
        self.prefill.drop_cancelled()
        budget = self.prefill_budget
        while budget > 0:
            hold = self._hold()
            self.leasing.lease_ready(hold)
            seq = self.prefill.next(hold)
            if seq is None:
                break
            budget -= self.prefill.advance(seq, budget, hold)
        self.prefill.join_ready()
        if not self.active:  # idle: what the requests' restores observed is settled at no one's cost
            settle = getattr(self.engine, "settle_costs", None)
            if settle is not None:
                settle()

    def _hold(self) -> Hold:
        """Whose prefill waits for first texts: requests with a token but no text yet, and
        those whose body went in this step (:class:`engine.inflight.Hold`)."""
        held = [h for h in (self.decode.text_hold(), self.prefill.ready_hold()) if h is not None]
        return Hold(min(held, default=None))

    def close(self, end: End | None = None) -> None:
        """At shutdown, everything in flight stops: what each request computed is stored, its
        listener gets a 503 (``errors.ShuttingDown``: a finish would read as a whole answer)."""
        self.leasing.close(end)
        self.prefill.close(end)
        self.decode.close(end)

    def abort(self, error: Exception) -> None:
        """After an error out of :meth:`step` itself: every request in flight fails with it,
        nothing it computed stored (its caches may be cut mid-write; a request the step had
        already ended is not ended again). The loop is done; nothing raises out of here."""

        def fail(seq: Seq, caches: list[Any] | None) -> None:
            try:
                self.ends.fail(seq, error, None)
            except Exception:
                log.exception("ending a request after a failed step")

        for part in (self.leasing, self.prefill, self.decode):
            try:
                part.close(fail)
            except Exception:
                log.exception("closing the batch after a failed step")
