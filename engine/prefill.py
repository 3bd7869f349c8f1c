"""Suffix-only prefill: feed the ids a cache lease lacks, in evaluated chunks.

Runs on the thread that owns MLX. Chunks end at checkpoint positions when the model has
recurrent / sliding-window layers, whose state is then recorded in ``lease.checkpoints``
(where and how: :mod:`tiered_kv.checkpoints`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import mlx.core as mx
import mlx.nn as nn

from tiered_kv import Lease, checkpoint_positions, reserve_room, take_checkpoint

__all__ = ["PrefillStopped", "checkpoint_positions", "fill", "prefill", "prefill_steps"]

Progress = Callable[[int, int], None]


class PrefillStopped(Exception):
    """should_stop() turned true between two chunks; ``fed`` holds what was evaluated."""


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
    prompt token alone (fed as its own step), not for every position of every chunk. After the
    first step the caches get room for the rest of the prompt in one buffer, as in :func:`fill`.
    """
    rem = lease.remaining
    start, total = len(fed), len(fed) + len(rem)
    body = len(rem) - 1  # every token but the last: only their KV is needed
    i = 0
    while i < body:
        end = min([i + chunk_size, body] + [c - start for c in cuts if c - start > i])
        _step(model, lease, fed, rem[i:end], cuts, on_progress, total)
        if not i and end < body:  # more steps follow (a prompt of one step grows as it did)
            reserve_room(lease.caches, len(rem) - end)
        i = end
        if body > chunk_size:
            mx.clear_cache()
        yield
    out = model(mx.array([rem[-1:]]), cache=lease.caches)
    logits = out[0, -1, :]
    mx.eval([logits] + [c.state for c in lease.caches])
    fed.append(rem[-1])
    take_checkpoint(lease.checkpoints, len(fed), cuts, lease.caches)
    if on_progress:
        on_progress(len(fed), total)
    return logits


def fill(model: nn.Module, lease: Lease, chunk_size: int) -> Generator[None, None, None]:
    """Feed ``lease.remaining`` into ``lease.caches`` in whole steps of ``chunk_size`` from its
    start, with no logits (no last-token step): KV only, for a restore's computed head and the
    calibration. Its steps are the shapes of a long prefill's body steps; on CUDA the first
    forward of a new (step length, offset) compiles and allocates (1B shape: a 2048-token head fed
    as 2047 + 1 tokens took 0.55 s the first time; a 4096-token head in whole steps, 0.03 s).
    Step-wise: it yields between its steps (a `both`'s head beside running streams: the batch
    loop decodes between them, and a cancel closes it there). After its first step the caches get
    room for the rest in one buffer (:func:`tiered_kv.reserve_room`): no later step allocates a
    larger copy of them (on CUDA those allocations slowed the read beside a `both`'s head)."""
    rem, fed = lease.remaining, list[int]()
    for i in range(0, len(rem), chunk_size):
        if i:
            yield
        _step(model, lease, fed, rem[i : i + chunk_size], [], None, len(rem))
        if not i:
            reserve_room(lease.caches, len(rem) - len(fed))
        if len(rem) > chunk_size:
            mx.clear_cache()


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
    take_checkpoint(lease.checkpoints, len(fed), cuts, lease.caches)
    if on_progress:
        on_progress(len(fed), total)
