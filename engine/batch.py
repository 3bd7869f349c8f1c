"""Continuous batching through the tiered cache, on the one thread that owns MLX.

Requests join and leave at token boundaries. Each request leases its own prefix from the tiered
cache, prefills its suffix one chunk per :meth:`BatchLoop.step` (between two decode steps of the
running batch, so a long prefill never freezes the other streams), joins the decode batch, and on
finishing or cancelling gives its cache back to the tiered cache as its own entry.

Decode uses mlx-lm's ``GenerationBatch`` (``mx.async_eval`` pipelining, join by ``extend``, leave
by ``filter``) over caches merged with mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache`` /
``ArraysCache.merge`` and split back with ``extract``. Prefill is ours (``engine/prefill.py``), the
request with the least prompt left first (:meth:`BatchLoop._next_prefill`): it takes the recurrent
/ sliding-window checkpoints at our positions, which mlx-lm's prompt batch cannot. Caches without a
batched form (quantised KV, chunked or concatenating KV) decode in a group of their own, stepped in
the same loop.

Ownership: a BatchLoop and every array it touches belong to the thread that calls ``step``; the
sinks it emits into must be safe to call from that thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.models import cache as C

from engine import prefill_batch
from engine import sampler as sampling
from engine.events import END, Chunk, Event, Failed, Hit, SamplingParams, Usage
from tiered_kv import Lease

log = logging.getLogger(__name__)
NO_LIMIT = 1 << 62  # GenerationBatch's own max_tokens: ours (TextStream) ends requests
Progress = Callable[[int, int], None]
# cache classes whose mlx-lm ``merge`` / ``extract`` make a batch and split it back
BATCHABLE = (C.KVCache, C.RotatingKVCache, C.ArraysCache)
#: prompt tokens a waiting request must gain from a prefilling one's published prompt to wait for it
SHARE_GAIN = 64


class Sink(Protocol):
    """Where one request's events go (the worker's Job, or a list for the synchronous API)."""

    def emit(self, event: Event) -> None: ...
    def cancelled(self) -> bool: ...


def batchable(caches: list[Any]) -> bool:
    """True when every layer (CacheList members included) has an exact batched form."""
    for c in caches:
        if type(c) is C.CacheList:
            if not batchable(list(c.caches)):
                return False
        elif type(c) not in BATCHABLE:
            return False
    return True


def _left(seq: _Seq) -> int:
    """Prompt tokens ``seq`` has still to prefill."""
    return len(seq.prompt_ids) - len(seq.fed)


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    """Leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(eq=False)
class _Seq:
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
    steps: Generator[None, None, mx.array] | None = None  # the prefill, chunk by chunk
    text: Any = None  # engine.textout.TextStream
    sampler: sampling.Sampler | None = None
    hit: Hit = Hit()
    t_prefill: float = 0.0
    t_first: float = 0.0
    prefill_busy: float = 0.0  # seconds inside this request's own prefill chunks
    prefill_from: int = 0  # tokens the cache served (where its prefill started)

    def usage(self, now: float) -> Usage:
        t = now - self.started
        first = self.t_first or t
        return Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=self.text.completion if self.text else 0,
            cached_tokens=self.hit.tokens,
            cache_tier=self.hit.tier,
            ttft_seconds=first,
            prefill_seconds=self.t_prefill,
            decode_seconds=max(0.0, t - first),
            load_seconds=self.hit.load_seconds,
            queue_seconds=max(0.0, self.started - self.enqueued),
        )


@dataclass(eq=False)
class _Group:
    """Requests that decode together: merged caches (``batched``) or one request's own caches."""

    gen: Any  # mlx_lm.generate.GenerationBatch
    seqs: list[_Seq]
    batched: bool


class BatchLoop:
    """The engine's requests in flight: ``add`` them, call ``step`` until ``active`` is 0.

    Prefill order, the one rule (:meth:`_next_prefill`): the request with the fewest prompt tokens
    left to prefill goes first — counted after its cache hit, and a started prefill may be
    overtaken at a chunk boundary. So a main request whose long prompt is cached (a few hundred
    new tokens) gets its first token before a concurrent title request (a fresh ~600-token
    prompt) has prefilled, instead of after. A waiting request whose prompt shares more with a
    prefilling one's than the cache holds waits for it: that one's prompt is published when its
    prefill ends (``cache.share``), and the waiting request then starts from it.
    """

    def __init__(self, engine: Any, max_batch: int = 8) -> None:
        self.engine, self.max_batch = engine, max_batch
        # prompt tokens of prefill per step (the engine resolves TIERED_KV_PREFILL_CHUNK=0, auto)
        self.prefill_budget = getattr(engine, "prefill_chunk", 0) or engine.config.prefill_chunk
        self.waiting: list[_Seq] = []  # admitted, no lease yet
        self.loading: list[_Seq] = []  # a disk entry being read for them
        self.prefilling: list[_Seq] = []  # leased, prefill under way
        self.batch: _Group | None = None  # the batched group
        self.solo: list[_Group] = []  # requests whose caches cannot be batched

    # -- bookkeeping ------------------------------------------------------------------------
    @property
    def decoding(self) -> int:
        return (len(self.batch.seqs) if self.batch else 0) + len(self.solo)

    @property
    def active(self) -> int:
        """Requests admitted and not finished (at most ``max_batch``)."""
        return len(self.waiting) + len(self.loading) + len(self.prefilling) + self.decoding

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
        """Admit a request; its prefill starts when :meth:`_next_prefill` picks it."""
        now = time.perf_counter()
        ids = list(prompt_ids)
        seq = _Seq(sink, ids, params, progress, enqueued or now, np.array(ids, dtype=np.int32))
        self.waiting.append(seq)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> None:
        """One decode step of every decoding group, then up to ``prefill_budget`` prompt tokens
        of prefill: one chunk of a long prompt, or the whole suffixes of several short ones;
        several requests' chunks share one forward where their caches allow
        (:mod:`engine.prefill_batch`). Once a request has its first token, the step ends, so that
        its next tokens come before other prompts' prefill (:meth:`_prefill_phase`)."""
        for group in [g for g in (self.batch, *self.solo) if g is not None]:
            self._decode(group)
        self._poll_loading()
        for gone in [s for s in self.prefilling if s.sink.cancelled()]:
            self.prefilling.remove(gone)
            self._finish(gone, "cancelled", gone.lease.caches if gone.lease else None)
        self._prefill_phase()

    def _prefill_phase(self) -> None:
        budget = self.prefill_budget
        while budget > 0:
            seq = self._next_prefill()
            if seq is None:
                return
            decoding = self.decoding
            if seq.steps is None:  # plain KV: its chunks share forwards with the others'
                budget -= self._prefill_rows(self._rows(seq), budget)
            else:
                before = len(seq.fed)
                self._prefill_once(seq)
                budget -= max(1, len(seq.fed) - before)
            if self.decoding > decoding:
                return  # a first token: the request's next tokens before more prefill

    def close(self) -> None:
        """Cancel everything in flight: what each request computed is stored, listeners get
        a "cancelled" finish."""
        for seq in self.waiting:
            seq.sink.emit(END)
        self.waiting.clear()
        for seq in self.loading:
            assert seq.fetch is not None
            seq.fetch.close()
            self._finish(seq, "cancelled", None)
        self.loading.clear()
        for seq in self.prefilling:
            self._finish(seq, "cancelled", seq.lease.caches if seq.lease else None)
        self.prefilling.clear()
        for group in [g for g in (self.batch, *self.solo) if g is not None]:
            self._leave(group, list(range(len(group.seqs))), ["cancelled"] * len(group.seqs))
        self.batch, self.solo = None, []

    # -- prefill ----------------------------------------------------------------------------
    def _next_prefill(self) -> _Seq | None:
        """The request to prefill next: the fewest prompt tokens left first (arrival order on a
        tie). Waiting requests are leased here, all that are ready (so that their prompts can
        share forwards), in the same order. None when nothing is left to prefill."""
        while True:
            ready = [s for s in self.waiting if not self._shares_with_prefilling(s)]
            if not ready:
                break
            left = {id(s): len(s.prompt_ids) - self.engine.cache.peek(s.tokens) for s in ready}
            self._start(min(ready, key=lambda s: (left[id(s)], s.enqueued)))
        if not self.prefilling:
            return None
        return min(self.prefilling, key=lambda s: (_left(s), s.enqueued))

    def _rows(self, seq: _Seq) -> list[_Seq]:
        """``seq`` and the requests whose prompt chunks share its forwards (least left first):
        those without a prefill of their own (``steps``: caches that cannot be batched)."""
        others = [s for s in self.prefilling if s is not seq and s.steps is None]
        return [seq] + sorted(others, key=lambda s: (_left(s), s.enqueued))

    def _prefill_rows(self, rows: list[_Seq], budget: int) -> int:
        """One forward over ``rows``: a chunk of each one's prompt body, or — once the first has
        only its last prompt token left — the last tokens of all that are there, whose logits
        give their first tokens. Returns the prompt tokens it fed."""
        if _left(rows[0]) == 1:
            rows = [s for s in rows if _left(s) == 1]
            logits = self._forward(rows, [s.prompt_ids[-1:] for s in rows], logits=True)
            for i, seq in enumerate(rows if logits is not None else []):
                self._prefilled(seq, logits[i])  # type: ignore[index]
            return len(rows)
        # every row has body left (rows[0] has the least); one length for all: no padding
        n = max(1, min(min(_left(s) - 1 for s in rows), budget // len(rows)))
        self._forward(rows, [s.prompt_ids[len(s.fed) : len(s.fed) + n] for s in rows])
        if any(_left(s) > 1 for s in rows):
            mx.clear_cache()
        return n * len(rows)

    def _forward(
        self, rows: list[_Seq], chunks: list[list[int]], logits: bool = False
    ) -> mx.array | None:
        """:func:`engine.prefill_batch.forward` for ``rows``: their ``fed`` grow by their chunk;
        on an error every row fails (its cache as it was before the forward is stored)."""
        leases = [s.lease for s in rows if s.lease is not None]
        t0 = time.perf_counter()
        try:
            out = prefill_batch.forward(self.engine.model, leases, chunks, logits)
        except Exception as e:
            for seq in rows:
                self.prefilling.remove(seq)
                self._fail(seq, e, seq.lease.caches if seq.lease else None)
            return None
        busy, total = time.perf_counter() - t0, sum(len(c) for c in chunks)
        for seq, chunk in zip(rows, chunks, strict=True):
            seq.fed.extend(chunk)
            seq.prefill_busy += busy * len(chunk) / total  # the forward's time, shared by tokens
            if seq.progress:
                seq.progress(len(seq.fed), len(seq.prompt_ids))
        return out

    def _shares_with_prefilling(self, seq: _Seq) -> bool:
        """True when ``seq`` gains more from a prefilling request's published prompt than the
        cache gives it now (both continue one conversation, or share a system prompt)."""
        if not self.prefilling:
            return False
        most = max(_shared(seq.tokens, p.tokens) for p in self.prefilling)
        return most >= self.engine.cache.peek(seq.tokens) + SHARE_GAIN

    def _prefill_once(self, seq: _Seq) -> None:
        """One chunk of ``seq``'s prefill; its first token when that was the last one."""
        assert seq.steps is not None and seq.lease is not None
        t0 = time.perf_counter()
        try:
            next(seq.steps)
            seq.prefill_busy += time.perf_counter() - t0
            return
        except StopIteration as done:
            logits = done.value
        except Exception as e:
            self.prefilling.remove(seq)
            self._fail(seq, e, seq.lease.caches)
            return
        seq.prefill_busy += time.perf_counter() - t0
        self._prefilled(seq, logits)

    def _prefilled(self, seq: _Seq, logits: mx.array) -> None:
        """``seq``'s prompt is all in its caches: publish it, then its first token."""
        assert seq.lease is not None
        self.prefilling.remove(seq)
        seq.t_prefill = time.perf_counter() - seq.started
        done_hook = getattr(self.engine, "prefill_done", None)
        if done_hook is not None:
            new = len(seq.fed) - seq.prefill_from
            done_hook(seq.lease, seq.prefill_from, new, seq.prefill_busy)
        try:
            # the requests prefilling after this one may share its prompt: publish it now
            self.engine.cache.share(seq.lease, seq.fed)
            self._first_token(seq, logits)
        except Exception as e:
            self._fail(seq, e, seq.lease.caches)

    def _start(self, seq: _Seq) -> bool:
        """Look up ``seq``'s prefix (it leaves ``waiting``); True when its prefill is set up. A
        disk hit read while other requests run is read beside them (``loading``), so the read
        never stops their decode steps; :meth:`_poll_loading` finishes it."""
        self.waiting.remove(seq)
        if seq.sink.cancelled():  # gone before it started: nothing computed, nothing stored
            seq.sink.emit(END)
            return False
        seq.started = time.perf_counter()
        beside = bool(self.decoding or self.prefilling or self.loading)
        try:
            seq.fetch = self.engine.cache.fetch_steps(seq.prompt_ids, background=beside)
        except Exception as e:
            self._fail(seq, e, None)
            return False
        return self._fetch_once(seq)

    def _poll_loading(self) -> None:
        if self.loading and not (self.decoding or self.prefilling):
            time.sleep(0.002)  # only reads in flight: wait for them without spinning
        for seq in list(self.loading):
            self.loading.remove(seq)
            if seq.sink.cancelled():
                assert seq.fetch is not None
                seq.fetch.close()
                self._finish(seq, "cancelled", None)
            else:
                self._fetch_once(seq)

    def _fetch_once(self, seq: _Seq) -> bool:
        """One step of ``seq``'s lookup; once it gives the lease, set up its prefill."""
        assert seq.fetch is not None
        try:
            next(seq.fetch)
            self.loading.append(seq)  # its entry is being read: not yet
            return False
        except StopIteration as done:
            seq.lease = done.value
        except Exception as e:
            self._fail(seq, e, None)
            return False
        try:
            info = seq.lease.hit
            seq.hit = Hit(info.tokens, info.tier, info.load_seconds)
            seq.sink.emit(seq.hit)
            seq.fed = list(seq.prompt_ids[: info.tokens])
            seq.prefill_from = info.tokens
            seq.text = self.engine.text_stream(seq.params)
            seq.sampler = sampling.for_request(seq.params)
            if not prefill_batch.batchable(seq.lease):  # else its chunks go in shared forwards
                seq.steps = self.engine.prefill_steps(seq.lease, seq.fed, seq.progress)
        except Exception as e:
            self._fail(seq, e, seq.lease.caches)
            return False
        self.prefilling.append(seq)
        return True

    def _first_token(self, seq: _Seq, logits: mx.array) -> None:
        """Sample the first token from the prefill's logits, then join a decode group."""
        assert seq.lease is not None
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        sampled = (seq.sampler or sampling.greedy)(logprobs[None])
        tok = int(sampled.astype(mx.int32)[0].item())  # type: ignore[arg-type]
        seq.t_first = time.perf_counter() - seq.started
        reason = self._on_token(seq, tok)
        if reason is not None:
            self._finish(seq, reason, seq.lease.caches)
            return
        caches = seq.lease.caches
        together = batchable(caches)
        layer_caches = [c.merge([c]) for c in caches] if together else list(caches)
        gen = GenerationBatch(
            self.engine.model,
            [id(seq)],
            mx.array([tok]),
            layer_caches,
            [seq.fed],  # GenerationBatch appends each token it feeds: ``fed`` stays exact
            [seq.sampler],
            sampling.greedy,
            [()],
            [StopSequences()],
            [NO_LIMIT],
        )
        if not together:
            self.solo.append(_Group(gen, [seq], batched=False))
        elif self.batch is None:
            self.batch = _Group(gen, [seq], batched=True)
        else:
            self.batch.gen.extend(gen)
            self.batch.seqs.append(seq)

    # -- decode -----------------------------------------------------------------------------
    def _decode(self, group: _Group) -> None:
        try:
            responses = group.gen.next()
        except Exception as e:
            log.exception("decode step failed")
            for seq in group.seqs:
                self._fail(seq, e, None)
            self._drop(group)
            return
        done: list[int] = []
        reasons: list[str] = []
        for i, (seq, r) in enumerate(zip(group.seqs, responses, strict=True)):
            reason = self._on_token(seq, int(r.token))
            if reason is not None:
                done.append(i)
                reasons.append(reason)
        if done:
            self._leave(group, done, reasons)

    def _on_token(self, seq: _Seq, tok: int) -> str | None:
        """Emit the text ``tok`` brings; the finish reason when the request ends with it."""
        assert seq.text is not None
        text, reason = seq.text.add(tok)
        if tok not in getattr(seq.text, "eos", ()):  # an end-of-sequence token is no output
            seq.sink.emit(Chunk(text, tok))
        if reason is None and seq.sink.cancelled():
            reason = "cancelled"
        return reason

    def _leave(self, group: _Group, idx: list[int], reasons: list[str]) -> None:
        """Finish ``group.seqs[idx]``: split their caches out, store them, drop them."""
        for i, reason in zip(idx, reasons, strict=True):
            seq = group.seqs[i]
            caches = (
                [c.extract(i) for c in group.gen.prompt_cache]
                if group.batched
                else group.gen.prompt_cache
            )
            self._finish(seq, reason, caches)
        keep = [i for i in range(len(group.seqs)) if i not in set(idx)]
        if not keep:
            self._drop(group)
            return
        group.gen.filter(keep)
        group.seqs = [group.seqs[i] for i in keep]

    def _drop(self, group: _Group) -> None:
        if group is self.batch:
            self.batch = None
        else:
            self.solo.remove(group)

    # -- the end of a request ---------------------------------------------------------------
    def _finish(self, seq: _Seq, reason: str, caches: list[Any] | None) -> None:
        """Last chunk (held-back text + usage), then store the request's cache as its entry."""
        tail = seq.text.tail() if seq.text is not None else ""
        seq.sink.emit(Chunk(tail, None, reason, seq.usage(time.perf_counter())))
        self._store(seq, caches)
        seq.sink.emit(END)

    def _fail(self, seq: _Seq, error: Exception, caches: list[Any] | None) -> None:
        log.error("generation failed: %s", error, exc_info=error)
        seq.sink.emit(Failed(error))
        self._store(seq, caches)
        seq.sink.emit(END)

    def _store(self, seq: _Seq, caches: list[Any] | None) -> None:
        if seq.lease is None or caches is None:
            return
        seq.lease.caches = list(caches)
        try:
            self.engine.cache.store(seq.lease, seq.fed)
        except Exception:  # a failed store loses a cache entry, never the response
            log.exception("storing the cache entry failed")
        seq.lease = None
