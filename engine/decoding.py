"""The decode side of the batch loop: requests that have their first token, stepped together.

Decode uses mlx-lm's ``GenerationBatch`` (``mx.async_eval`` pipelining, join by ``extend``, leave
by ``filter``) over caches merged with mlx-lm's ``BatchKVCache`` (as :class:`DecodeKVCache`) /
``BatchRotatingKVCache`` / ``ArraysCache.merge`` and split back with ``extract``. Caches without a
batched form (quantised KV, chunked or concatenating KV) decode in a group of their own, stepped in
the same loop.

Ownership: the thread that owns MLX (the batch loop's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.models import cache as C

from engine import sampler as sampling
from engine import shapes
from engine.inflight import End, Ends, Seq

log = logging.getLogger(__name__)
NO_LIMIT = 1 << 62  # GenerationBatch's own max_tokens: ours (TextStream) ends requests
# cache classes whose mlx-lm ``merge`` / ``extract`` make a batch and split it back
BATCHABLE = (C.KVCache, C.RotatingKVCache, C.ArraysCache)
#: tokens a request may sample without text (held back: a partial UTF-8 character, whitespace
#: before a possible marker, a possible stop string) while other prompts' prefill waits for its text
FIRST_TEXT_TOKENS = 4


class _PaddingSeen:
    """Whether any row of a batched cache is left-padded, looked at once (one sync) per
    ``left_padding`` array: mlx-lm makes a new one whenever rows join or leave (merge, extend,
    filter, prepare, finalize, a state set), so a lone row's decode steps do not sync."""

    left_padding: mx.array
    _seen: mx.array | None = None  # the left_padding array last looked at
    _padded = True

    def _any_padding(self) -> bool:
        lp = self.left_padding
        if lp is not self._seen:
            self._seen, self._padded = lp, bool(mx.any(lp > 0).item())
        return self._padded


class DecodeKVCache(_PaddingSeen, C.BatchKVCache):
    """mlx-lm's ``BatchKVCache`` with two changes to how a decode step's attention sees it; the
    tokens are the same (greedy output equals mlx-lm's ``generate_step``), the speed is not.

    * **No mask while no row is left-padded** (a request decoding alone, or rows of one length):
      a query of one token attends to every key the cache returns, so no mask is exact. mlx-lm's
      builds an array mask for every step, and on CUDA attention with an array mask runs a
      slower kernel (H200, 8B shape, 8k context: 13.3 against 10.1 ms a synchronous step).
    * **Buffers grown to whole steps** (multiples of ``step``, 256 rows). ``merge`` copies the
      rows into buffers of exactly their length, and mlx-lm's growth adds whole steps to the
      length it finds, so a batch merged at 32767 tokens decoded in buffers of 33023, 33279...
      rows for ever; on the H200 (8B shape, 32k context) attention over those took a step
      12.7-14.0 ms against 5.6-6.3 ms over buffers of whole steps. The growth copies the buffer
      anyway (mlx-lm's too); here it rounds up, to a capacity (:func:`engine.shapes.capacity`:
      four lengths an octave, whole steps), so that buffer lengths recur from turn to turn:
      mlx-cuda builds a cuDNN decode graph per buffer length, and a hot turn's first decode
      step over a length of its own paid that build (H100, 1B, 8k context, ``bench.hot_turns``
      round 2: a hot turn's median TTFT 95 ms with prefill steps in few shapes alone, 22 ms
      with decode grown to capacities too). A row leaving (``filter`` shifts the buffer
      left by the smallest padding) leaves it cut back to its rows, so the next step's growth
      makes it whole steps again (``extend`` pads to the larger buffer: whole steps already,
      or a merge's exact length, which the next step outgrows).

    With both, the engine's single-request decode on the H200 went from 0.45-0.62x of mlx-lm's
    ``generate_step`` to 0.86-1.01x (8B / 1B shapes, 8k / 32k contexts: ``bench.decode_loop``,
    README). Rows of different lengths keep mlx-lm's mask (it masks their padding)."""

    keys: mx.array | None  # mlx-lm's buffers (None until the first rows)
    values: mx.array | None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self._idx, int(keys.shape[2])
        buf_k, buf_v = self.keys, self.values
        if buf_k is not None and buf_v is not None and prev + n > int(buf_k.shape[2]):
            # room for a step of decoding (as mlx-lm's growth), at a capacity: whole steps, and
            # a buffer length that recurs from turn to turn (engine.shapes)
            size = shapes.capacity(prev + n + self.step)
            self.keys, self.values = shapes.grown(buf_k, prev, size), shapes.grown(buf_v, prev, size)
        return super().update_and_fetch(keys, values)  # room now: written in place

    def filter(self, batch_indices: Any) -> None:
        super().filter(batch_indices)  # shifts the rows left by the smallest padding
        self._cut_to_rows()

    def _cut_to_rows(self) -> None:
        """A buffer that is not whole steps any more is cut back to the rows it holds (a view):
        the next step grows it to whole steps, one copy of those rows."""
        if self.keys is not None and self.values is not None and self.keys.shape[2] % self.step:
            self.keys = self.keys[..., : self._idx, :]
            self.values = self.values[..., : self._idx, :]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if N == 1 and not return_array and kwargs.get("window_size") is None:
            if not self._any_padding():
                return None
        return super().make_mask(N, return_array=return_array, **kwargs)


class DecodeRotatingKVCache(_PaddingSeen, C.BatchRotatingKVCache):
    """mlx-lm's ``BatchRotatingKVCache`` (a sliding-window layer's batched cache) whose decode
    step gives attention no mask while no row is left-padded, as :class:`DecodeKVCache`'s does;
    the tokens are the same (greedy output equals mlx-lm's ``generate_step``, which passes no
    mask there either).

    mlx-lm's builds an array mask for every step (a roll of it once the window is full). For one
    query over a window no smaller than the buffer, with no row padded, every entry of that mask
    is true. Once the window rotates, each one-token step makes a new ``left_padding`` (lowered
    by one): what was seen of the last one still holds (padding only shrinks), so it is carried
    over rather than looked at again."""

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        if N == 1 and not return_array and (window_size or self.max_size) >= self.max_size:
            if not self._any_padding():
                return None
        return super().make_mask(N, window_size=window_size, return_array=return_array)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        carried = keys.shape[2] == 1 and self._seen is self.left_padding
        out = super().update_and_fetch(keys, values)
        if carried:  # a one-token step only lowers left padding
            self._seen = self.left_padding
        return out


def merge(layer: list[Any]) -> Any:
    """One layer's caches of the rows as one batched cache: plain KV as :class:`DecodeKVCache`,
    sliding-window KV as :class:`DecodeRotatingKVCache`, every other class by its own mlx-lm
    ``merge``."""
    if all(type(c) is C.KVCache for c in layer):
        return DecodeKVCache.merge(layer)
    if all(type(c) is C.RotatingKVCache for c in layer):
        return DecodeRotatingKVCache.merge(layer)
    return layer[0].merge(layer)


def batchable(caches: list[Any]) -> bool:
    """True when every layer (CacheList members included) has an exact batched form."""
    for c in caches:
        if type(c) is C.CacheList:
            if not batchable(list(c.caches)):
                return False
        elif type(c) not in BATCHABLE:
            return False
    return True


@dataclass(eq=False)
class Group:
    """Requests that decode together: merged caches (``batched``) or one request's own caches."""

    gen: Any  # mlx_lm.generate.GenerationBatch
    seqs: list[Seq]
    batched: bool


class Decoding:
    """The decoding requests: one batched group, and a group of its own for each request whose
    caches cannot be batched."""

    def __init__(self, model: Any, ends: Ends) -> None:
        self.model, self.ends = model, ends
        self.batch: Group | None = None  # the batched group
        self.solo: list[Group] = []  # requests whose caches cannot be batched

    @property
    def count(self) -> int:
        return (len(self.batch.seqs) if self.batch else 0) + len(self.solo)

    def text_hold(self) -> int | None:
        """While a decoding request has sampled tokens but shown no text yet (fewer than
        :data:`FIRST_TEXT_TOKENS`), the prompt tokens it prefilled — its first visible text comes
        before more prefill of any request with at least as much prompt left (it went first for
        having less); a request with less left than that goes on. None when no request waits
        for its text."""
        held = [
            s.prefilled
            for g in self.groups()
            for s in g.seqs
            if not s.shown and s.sampled < FIRST_TEXT_TOKENS
        ]
        return min(held, default=None)

    def groups(self) -> list[Group]:
        return [g for g in (self.batch, *self.solo) if g is not None]

    def start(self, seq: Seq, logits: mx.array) -> None:
        """Sample ``seq``'s first token from its prefill's logits (a prefill of its own), then
        join a decode group (or finish, when that token ends the request)."""
        assert seq.lease is not None
        logits = sampling.process(seq.processors, seq.fed, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        sampled = (seq.sampler or sampling.greedy)(logprobs[None])
        tok = int(sampled.astype(mx.int32)[0].item())  # type: ignore[arg-type]
        seq.t_first = time.perf_counter() - seq.started
        reason = seq.on_token(tok, logprobs)
        if reason is not None:
            self.ends.finish(seq, reason, seq.lease.caches)
            return
        self._enter([seq], [tok])

    def join(self, seqs: list[Seq]) -> None:
        """``seqs`` (plain KV, each with only its last prompt token left) join the decode batch
        with that token as their input: its forward is the new rows' first decode step, one for
        all of them, and their first tokens come with the batch's next step (as in mlx-lm's
        ``BatchGenerator``) — no forward of their own for the last token and another for the
        first sampled one. Should the step fail (one request's sampler or logits processors
        raising), each enters alone, so only the failing one fails: the step ran on merged
        copies of their caches and fed none of them."""
        try:
            self._enter(seqs, [s.prompt_ids[-1] for s in seqs])
        except Exception as e:
            if len(seqs) > 1:
                for seq in seqs:
                    self.join([seq])
                return
            self.ends.fail(seqs[0], e, seqs[0].lease.caches if seqs[0].lease else None)

    def _enter(self, seqs: list[Seq], inputs: list[int]) -> None:
        """A ``GenerationBatch`` over ``seqs`` fed ``inputs`` (its first forward starts now),
        extended into the batched group, or a group of its own when the caches cannot be
        batched (one request)."""
        caches = [s.lease.caches for s in seqs if s.lease is not None]
        assert len(caches) == len(seqs)
        together = all(batchable(c) for c in caches)
        assert together or len(seqs) == 1
        if together:  # one merged cache per layer (mlx-lm's Batch*Cache.merge pads the rows)
            layers = [merge(list(layer)) for layer in zip(*caches, strict=True)]
        else:
            layers = list(caches[0])
        gen = GenerationBatch(
            self.model,
            [id(s) for s in seqs],
            mx.array(inputs),
            layers,
            [s.fed for s in seqs],  # GenerationBatch appends each token it feeds: ``fed`` stays exact
            [s.sampler for s in seqs],
            sampling.greedy,
            [s.processors for s in seqs],
            [StopSequences() for _ in seqs],
            [NO_LIMIT] * len(seqs),
        )
        if not together:
            self.solo.append(Group(gen, list(seqs), batched=False))
        elif self.batch is None:
            self.batch = Group(gen, list(seqs), batched=True)
        else:
            self.batch.gen.extend(gen)
            self.batch.seqs.extend(seqs)

    def step(self) -> None:
        """One decode step of every group."""
        for group in self.groups():
            self._decode(group)

    def close(self, end: End | None = None) -> None:
        """At shutdown: every decoding request's cache is stored and its listener told it was
        cut short (:meth:`Ends.stop`; ``end``: another ending)."""
        for group in self.groups():
            for i, seq in enumerate(group.seqs):
                if end is None:
                    self.ends.stop(seq, _caches_of(group, i))
                else:  # another ending (an abort): the group's caches are not touched
                    end(seq, None)
        self.batch, self.solo = None, []

    def _decode(self, group: Group) -> None:
        try:
            responses = group.gen.next()
        except Exception as e:
            log.exception("decode step failed")
            for seq in group.seqs:
                self.ends.fail(seq, e, None)
            self._drop(group)
            return
        done: list[int] = []
        reasons: list[str] = []
        for i, (seq, r) in enumerate(zip(group.seqs, responses, strict=True)):
            if not seq.t_first:  # joined with its last prompt token: this is its first token
                seq.t_first = time.perf_counter() - seq.started
            reason = seq.on_token(int(r.token), r.logprobs)
            if reason is not None:
                done.append(i)
                reasons.append(reason)
        if done:
            self._leave(group, done, reasons)

    def _leave(self, group: Group, idx: list[int], reasons: list[str]) -> None:
        """Finish ``group.seqs[idx]``: split their caches out, store them, drop them."""
        for i, reason in zip(idx, reasons, strict=True):
            self.ends.finish(group.seqs[i], reason, _caches_of(group, i))
        keep = [i for i in range(len(group.seqs)) if i not in set(idx)]
        if not keep:
            self._drop(group)
            return
        group.gen.filter(keep)
        group.seqs = [group.seqs[i] for i in keep]

    def _drop(self, group: Group) -> None:
        if group is self.batch:
            self.batch = None
        else:
            self.solo.remove(group)


def _caches_of(group: Group, i: int) -> list[Any]:
    """Row ``i``'s caches, split out of a batched group's (a solo group's are its own)."""
    return [c.extract(i) for c in group.gen.prompt_cache] if group.batched else group.gen.prompt_cache
