"""From admission to a lease: each request looks up its own prefix in the tiered cache.

Requests wait (``waiting``) until the batch loop's prefill wants them, the fewest prompt tokens left
first: where prompts share forwards all that are ready are leased together, else each when it is
the next to prefill (so another's lookup never delays its first token) — short prompts
(``SHORT_PREFILL``) together all the same: they share a forward everywhere. A request
whose prompt shares more with a prefilling one's than the cache holds waits for that one: its
prompt is published when its prefill ends (``cache.share``), and the waiting request then starts
from it. A disk hit that arrives while other requests run is read beside them (``loading``) and
finished step by step, so the read never stops their decode steps.

Ownership: the thread that owns MLX (the batch loop's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine import prefill_batch
from engine import sampler as sampling
from engine.events import END, Hit
from engine.inflight import NO_HOLD, End, Ends, Hold, Seq, short

#: prompt tokens a waiting request must gain from a prefilling one's published prompt to wait for it
SHARE_GAIN = 64


def shared(a: np.ndarray, b: np.ndarray) -> int:
    """Leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class Leasing:
    """``waiting`` and ``loading`` requests; a leased one is appended to ``prefilling`` (the
    prefill's list), its prefill set up. ``decoding()`` says whether other requests decode."""

    def __init__(
        self,
        engine: Any,
        ends: Ends,
        prefilling: list[Seq],
        decoding: Callable[[], bool],
        together: bool = True,
    ) -> None:
        self.engine, self.ends = engine, ends
        self.prefilling, self.decoding = prefilling, decoding
        #: lease every ready request at once (their prompts share forwards); else one at a time,
        #: when it is the next to prefill: a lookup (a disk read, a `both` restore) never delays
        #: the prefill of a request with less prompt left
        self.together = together
        self.waiting: list[Seq] = []  # admitted, no lease yet
        self.loading: list[Seq] = []  # a disk entry being read for them

    def lease_ready(self, hold: Hold = NO_HOLD) -> None:
        """Lease the waiting requests that do not wait for a prefilling one's prompt, the fewest
        prompt tokens left (after its cache hit) first: all of them when prompts share forwards
        (``together``), else the one that would prefill next, if any — only those whose
        prefill ``hold`` lets go on."""
        while True:
            ready = [s for s in self.waiting if not self._shares_with_prefilling(s)]
            if not ready:
                return
            left = {id(s): len(s.prompt_ids) - self.engine.cache.peek(s.tokens) for s in ready}
            seq = min(ready, key=lambda s: (left[id(s)], s.enqueued))
            if not hold.lets(left[id(seq)]):
                return
            if self.together:
                self._start(seq)
                continue
            ahead = min(((s.left, s.enqueued) for s in self.prefilling if not s.ready),
                        default=None)  # fmt: skip
            together = short(left[id(seq)])  # leased with the others: they share a forward
            if together or ahead is None or (left[id(seq)], seq.enqueued) < ahead:
                self._start(seq)
                if together:
                    continue
            return

    def poll(self) -> None:
        """One step of every disk read in flight."""
        if self.loading and not (self.decoding() or self.prefilling):
            time.sleep(0.002)  # only reads in flight: wait for them without spinning
        for seq in list(self.loading):
            self.loading.remove(seq)
            if seq.sink.cancelled():
                assert seq.fetch is not None
                seq.fetch.close()
                self.ends.finish(seq, "cancelled", None)
            else:
                self._fetch_once(seq)

    def drop_cancelled(self) -> None:
        """Waiting requests whose client went away leave at once (nothing computed, nothing
        stored): each held a batch place until its turn to be leased came — a request behind a
        long prefill, for as long as that prefill took."""
        for seq in [s for s in self.waiting if s.sink.cancelled()]:
            self.waiting.remove(seq)
            seq.sink.emit(END)

    def close(self, end: End | None = None) -> None:
        """At shutdown: waiting requests and reads in flight stop, each listener told (a 503;
        ``end``: another ending, e.g. :meth:`BatchLoop.abort`'s)."""
        end = end or self.ends.stop
        for seq in self.waiting:
            end(seq, None)
        self.waiting.clear()
        for seq in self.loading:
            assert seq.fetch is not None
            seq.fetch.close()
            end(seq, None)
        self.loading.clear()

    def _shares_with_prefilling(self, seq: Seq) -> bool:
        """True when ``seq`` gains more from a prefilling request's published prompt than the
        cache gives it now (both continue one conversation, or share a system prompt)."""
        if not self.prefilling:
            return False
        most = max(shared(seq.tokens, p.tokens) for p in self.prefilling)
        return most >= self.engine.cache.peek(seq.tokens) + SHARE_GAIN

    def _start(self, seq: Seq) -> None:
        """Look up ``seq``'s prefix (it leaves ``waiting``). A disk hit read while other requests
        run is read beside them (``loading``); :meth:`poll` finishes it."""
        self.waiting.remove(seq)
        if seq.sink.cancelled():  # gone before it started: nothing computed, nothing stored
            seq.sink.emit(END)
            return
        seq.started = time.perf_counter()
        beside = bool(self.decoding() or self.prefilling or self.loading)
        try:
            seq.fetch = self.engine.cache.fetch_steps(seq.prompt_ids, background=beside)
        except Exception as e:
            self.ends.fail(seq, e, None)
            return
        self._fetch_once(seq)

    def _fetch_once(self, seq: Seq) -> None:
        """One step of ``seq``'s lookup; once it gives the lease, set up its prefill."""
        assert seq.fetch is not None
        try:
            next(seq.fetch)
            self.loading.append(seq)  # its entry is being read: not yet
            return
        except StopIteration as done:
            seq.lease = done.value
        except Exception as e:
            self.ends.fail(seq, e, None)
            return
        try:
            info = seq.lease.hit
            seq.hit = Hit(info.cached, info.tier, info.held)
            seq.sink.emit(seq.hit)
            seq.fed = list(seq.prompt_ids[: info.tokens])
            seq.prefill_from = info.tokens
            seq.text = self.engine.text_stream(seq.params)
            seq.sampler = sampling.for_request(seq.params)
            seq.processors = sampling.processors(seq.params)
            if seq.params.grammar:  # last: nothing after it may lift a token it forbids
                seq.processors.append(
                    self.engine.grammars.processor(seq.params.grammar, len(seq.prompt_ids))
                )
            if not prefill_batch.batchable(seq.lease):  # else its chunks go in shared forwards
                seq.steps = self.engine.prefill_steps(seq.lease, seq.fed, seq.progress)
        except Exception as e:
            self.ends.fail(seq, e, seq.lease.caches)
            return
        self.prefilling.append(seq)
