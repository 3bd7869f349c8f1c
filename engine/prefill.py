"""Suffix-only prefill: feed the ids a cache lease lacks, in evaluated chunks.

Runs on the thread that owns MLX. Chunks end at checkpoint positions when the model has
recurrent / sliding-window layers, whose state is then recorded in ``lease.checkpoints``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable

import mlx.core as mx
import mlx.nn as nn

from tiered_kv import Lease, snapshot

Progress = Callable[[int, int], None]


class PrefillStopped(Exception):
    """should_stop() turned true between two chunks; ``fed`` holds what was evaluated."""


def checkpoint_positions(
    start: int, rem: list[int], eos_ids: Iterable[int], every: int
) -> list[int]:
    """Where to snapshot non-positional layers: after each end-of-message token, every ``every``
    tokens, and at the end of the prompt (positions in ``(start, start + len(rem)]``)."""
    eos = set(eos_ids)
    end = start + len(rem)
    cuts = {start + j + 1 for j, t in enumerate(rem) if t in eos}
    cuts.update(range((start // every + 1) * every, end, every))
    cuts.add(end)
    return sorted(c for c in cuts if start < c <= end)


def prefill(
    model: nn.Module,
    lease: Lease,
    fed: list[int],
    chunk_size: int,
    cuts: list[int] = (),  # type: ignore[assignment]
    on_progress: Progress | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> mx.array:
    """Feed ``lease.remaining`` into ``lease.caches``; ``fed`` (ids the caches hold) grows with
    each evaluated chunk. Returns the last position's logits (1-D). Raises PrefillStopped."""
    steps = prefill_steps(model, lease, fed, chunk_size, cuts, on_progress)
    while True:
        if should_stop():
            steps.close()
            raise PrefillStopped
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def prefill_steps(
    model: nn.Module,
    lease: Lease,
    fed: list[int],
    chunk_size: int,
    cuts: list[int] = (),  # type: ignore[assignment]
    on_progress: Progress | None = None,
) -> Generator[None, None, mx.array]:
    """:func:`prefill` one evaluated chunk per ``next()``: the batch loop interleaves these with
    decode steps of other requests. The generator's return value is the last position's logits.

    Only the cache state of each chunk is evaluated; the vocabulary projection runs for the last
    prompt token alone (fed as its own step), not for every position of every chunk.
    """
    rem = lease.remaining
    start, total = len(fed), len(fed) + len(rem)
    body = len(rem) - 1  # every token but the last: only their KV is needed
    i = 0
    while i < body:
        end = min([i + chunk_size, body] + [c - start for c in cuts if c - start > i])
        _step(model, lease, fed, rem[i:end], cuts, on_progress, total)
        i = end
        if body > chunk_size:
            mx.clear_cache()
        yield
    out = model(mx.array([rem[-1:]]), cache=lease.caches)
    logits = out[0, -1, :]
    mx.eval([logits] + [c.state for c in lease.caches])
    fed.append(rem[-1])
    if len(fed) in cuts:
        lease.checkpoints[len(fed)] = snapshot(lease.caches)
    if on_progress:
        on_progress(len(fed), total)
    return logits


def _step(
    model: nn.Module,
    lease: Lease,
    fed: list[int],
    chunk: list[int],
    cuts: list[int],
    on_progress: Progress | None,
    total: int,
) -> None:
    model(mx.array([chunk]), cache=lease.caches)  # logits stay unevaluated (lazy): never computed
    mx.eval([c.state for c in lease.caches])
    fed.extend(chunk)
    if len(fed) in cuts:
        lease.checkpoints[len(fed)] = snapshot(lease.caches)
    if on_progress:
        on_progress(len(fed), total)
