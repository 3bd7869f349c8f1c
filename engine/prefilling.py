"""The prefill side of the batch loop: which prompt tokens go through the model next.

The one rule of order (:meth:`Prefilling.next`): the request with the fewest prompt tokens left to
prefill goes first — counted after its cache hit, and a started prefill may be overtaken at a chunk
boundary. So a main request whose long prompt is cached (a few hundred new tokens) gets its first
token before a concurrent title request (a fresh ~600-token prompt) has prefilled, instead of after.

Requests whose caches are plain KV share forwards (:mod:`engine.prefill_batch`): the first
request's chunk is what it would be alone (its body left, up to the step's budget), and the next
ones in the order ride along with a chunk of that same length, as many as the budget holds, each as
one row of a batch (on the CPU, where a row costs what a request alone does, only short chunks:
``SHORT_PREFILL``). Their prefill stops before the last prompt token: the requests whose bodies
went in during a loop step join the decode batch together at its end, with their last prompt
tokens as their first decode step (:meth:`Prefilling.join_ready`). Others (checkpointed or
quantised caches) prefill alone in their own chunks (``Seq.steps``,
:func:`engine.prefill.prefill_steps`), last token included, and sample their first token from it.

Ownership: the thread that owns MLX (the batch loop's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from engine import prefill_batch, shapes
from engine.inflight import NO_HOLD, End, Ends, Hold, Seq, short


class Prefilling:
    """Leased requests whose prompt is not all in their caches yet (``seqs``). ``join(seqs)``
    takes plain-KV requests whose body is in (their last prompt token is their first decode
    step); ``first(seq, logits)`` takes each one whose own prefill is done (its first token)."""

    def __init__(self, engine: Any, ends: Ends, first: Callable[[Seq, mx.array], None],
                 join: Callable[[list[Seq]], None]) -> None:  # fmt: skip
        self.engine, self.ends, self.first, self.join = engine, ends, first, join
        self.seqs: list[Seq] = []
        # rows ride along only where they cost little (a GPU); on the CPU a forward's cost grows
        # with its rows, and riding rows only delay the first request's first token
        self.share = bool(engine.share_prefill)
        # the prefill step when a request's steps run in few attention shapes (CUDA), else 0
        self.step_shapes = engine.prefill_chunk if engine.step_shapes else 0

    def next(self, hold: Hold = NO_HOLD) -> Seq | None:
        """The request to prefill next: the fewest prompt tokens left (arrival order on a tie),
        not counting those :meth:`join_ready` takes; None when ``hold`` holds it."""
        seq = min((s for s in self.seqs if not s.ready), key=lambda s: (s.left, s.enqueued),
                  default=None)  # fmt: skip
        return seq if seq is None or hold.lets(seq.left) else None

    def advance(self, seq: Seq, budget: int, hold: Hold = NO_HOLD) -> int:
        """Prefill a chunk of ``seq`` (with the requests that share its forwards, those ``hold``
        lets go on) within about ``budget`` prompt tokens; returns the tokens fed."""
        if seq.steps is None:  # plain KV: its chunks share forwards with the others'
            return self._rows(self._together(seq, hold), budget)
        before = len(seq.fed)
        self._alone(seq)
        return max(1, len(seq.fed) - before)

    def ready_hold(self) -> int | None:
        """The least prompt tokens prefilled by a request whose body is in (it awaits its first
        text like a decoding one: :meth:`engine.decoding.Decoding.text_hold`)."""
        return min((s.prefilled for s in self.seqs if s.ready), default=None)

    def join_ready(self) -> None:
        """Every request whose body is in joins the decode batch, together: their last prompt
        tokens are the new rows' first decode step, one forward for all of them
        (:meth:`engine.decoding.Decoding.join`). The loop calls it once per step, after the
        step's prefill: requests whose bodies went in during the step join in one forward."""
        rows = [s for s in self.seqs if s.ready]
        rows = [s for s in rows if s.t_prefill or self._publish(s)]  # a whole hit: no body fed
        for seq in rows:
            self.seqs.remove(seq)
        if rows:
            self.join(rows)
        for seq in rows:  # their first tokens are out: now the engine learns from their prefills
            self._learn(seq)

    def drop_cancelled(self) -> None:
        for gone in [s for s in self.seqs if s.sink.cancelled()]:
            self.seqs.remove(gone)
            self.ends.finish(gone, "cancelled", gone.lease.caches if gone.lease else None)

    def close(self, end: End | None = None) -> None:
        """At shutdown: each prefilling request's cache is stored, its listener told (a 503;
        ``end``: another ending)."""
        end = end or self.ends.stop
        for seq in self.seqs:
            end(seq, seq.lease.caches if seq.lease else None)
        self.seqs.clear()

    # -- shared forwards --------------------------------------------------------------------
    def _together(self, seq: Seq, hold: Hold) -> list[Seq]:
        """``seq`` and the requests whose prompt chunks share its forwards (least left first):
        those without a prefill of their own (``steps``: caches that cannot be batched), with
        their body not all in yet, that ``hold`` lets go on. Where rows cost what a request
        alone does (``share`` off: the CPU), only short chunks are shared (a forward of a few
        tokens costs its fixed part, whatever its rows)."""
        if not self.share and not short(seq.left):
            return [seq]
        others = [s for s in self.seqs if s is not seq and s.steps is None and not s.ready
                  and hold.lets(s.left)]  # fmt: skip
        return [seq] + sorted(others, key=lambda s: (s.left, s.enqueued))

    def _rows(self, rows: list[Seq], budget: int) -> int:
        """One forward over ``rows``: a chunk of each one's prompt body (never its last token).
        A row whose body is in is published at once (the requests after it may share its
        prompt) and joins the decode batch at the end of the step. Returns the tokens fed."""
        assert rows[0].left > 1
        # the first row's chunk is what it would be alone (the least prompt left keeps its pace);
        # the others ride along with as much while the budget lasts. Each has at least that much
        # body left (rows[0] has the least): one length for all, no padding.
        n = max(1, min(rows[0].left - 1, budget))
        if self.step_shapes:  # the steps after this one whole aligned ones (engine.shapes)
            n = shapes.chunk(len(rows[0].fed), n, self.step_shapes)
        rows = rows[: max(1, budget // n)]
        self._forward(rows, [s.prompt_ids[len(s.fed) : len(s.fed) + n] for s in rows])
        for seq in rows:
            if seq.ready and seq in self.seqs:  # published now: others may share its prompt
                self._publish(seq)
        if any(s.left > 1 for s in rows):
            mx.clear_cache()
        return n * len(rows)

    def _forward(self, rows: list[Seq], chunks: list[list[int]]) -> None:
        """:func:`engine.prefill_batch.forward` for ``rows``: their ``fed`` grow by their chunk;
        on an error every row fails (its cache as it was before the forward is stored)."""
        leases = [s.lease for s in rows if s.lease is not None]
        t0 = time.perf_counter()
        try:
            prefill_batch.forward(self.engine.model, leases, chunks, step_shapes=self.step_shapes)
        except Exception as e:
            for seq in rows:
                self.seqs.remove(seq)
                self.ends.fail(seq, e, seq.lease.caches if seq.lease else None)
            return
        busy, total = time.perf_counter() - t0, sum(len(c) for c in chunks)
        for seq, chunk in zip(rows, chunks, strict=True):
            seq.fed.extend(chunk)
            seq.prefill_busy += busy * len(chunk) / total  # the forward's time, shared by tokens
            if seq.progress:
                seq.progress(len(seq.fed), len(seq.prompt_ids))

    # -- a prefill of its own ---------------------------------------------------------------
    def _alone(self, seq: Seq) -> None:
        """One chunk of ``seq``'s own prefill; its first token when that was the last one."""
        assert seq.steps is not None and seq.lease is not None
        t0 = time.perf_counter()
        try:
            next(seq.steps)
            seq.prefill_busy += time.perf_counter() - t0
            return
        except StopIteration as done:
            logits = done.value
        except Exception as e:
            self.seqs.remove(seq)
            self.ends.fail(seq, e, seq.lease.caches)
            return
        seq.prefill_busy += time.perf_counter() - t0
        self._done(seq, logits)

    def _done(self, seq: Seq, logits: mx.array) -> None:
        """``seq``'s prompt is all in its caches (a prefill of its own): publish it, then its
        first token."""
        if not self._publish(seq):
            return
        self.seqs.remove(seq)
        try:
            self.first(seq, logits)
        except Exception as e:
            self.ends.fail(seq, e, seq.lease.caches if seq.lease else None)
        self._learn(seq)

    def _learn(self, seq: Seq) -> None:
        """The engine learns prefill speed (and a disk restore's outcome) from ``seq``'s prefill:
        once its first token is out, not before — a refit and, the first time after a start, a
        write of the cost file, kept out of the time to first token."""
        done_hook = getattr(self.engine, "prefill_done", None)
        if done_hook is not None and seq.lease is not None:
            new = len(seq.fed) - seq.prefill_from
            done_hook(seq.lease, seq.prefill_from, new, seq.prefill_busy)

    def _publish(self, seq: Seq) -> bool:
        """``seq``'s prefill is over (``t_prefill`` set): its prompt is published for the
        requests prefilling after it (they may share its prefix). False when that failed
        (``seq`` failed and left)."""
        assert seq.lease is not None
        seq.t_prefill = time.perf_counter() - seq.started
        try:
            self.engine.cache.share(seq.lease, seq.fed)
        except Exception as e:
            self.seqs.remove(seq)
            self.ends.fail(seq, e, seq.lease.caches)
            return False
        return True
