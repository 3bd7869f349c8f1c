"""Several requests' prompt chunks through the model in one forward (batched prefill).

Plain attention caches (mlx-lm ``KVCache``) of requests at different lengths are merged into one
``BatchKVCache`` (left-padded to the longest: the padding is masked), the rows' chunks — all of one
length, so no right padding and no position ever computed twice — run in one forward, and each
row's cache is split back out with ``extract``: exactly its own tokens, as if prefilled alone.

Not batched here (:func:`batchable` is False; the batch loop prefills them one request at a time
through :func:`engine.prefill.prefill_steps`): models whose prefill takes checkpoints (recurrent or
sliding-window layers, whose state exists only at the positions it was computed for), and caches
without an exact batched form (quantised KV, ``CacheList`` and the rest).

Ownership: the thread that owns MLX. The leases' caches are replaced by new, evaluated ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

from engine import shapes
from tiered_kv import Lease


def batchable(lease: Lease) -> bool:
    """True when ``lease``'s prefill can share a forward with other requests': every layer a
    plain ``KVCache`` and no checkpoints to take."""
    return not lease.needs_checkpoints and all(type(c) is C.KVCache for c in lease.caches)


def forward(
    model: Any,
    leases: Sequence[Lease],
    chunks: Sequence[Sequence[int]],
    logits: bool = False,
    step_shapes: int = 0,
) -> mx.array | None:
    """Feed ``chunks[i]`` (all of one length) into ``leases[i].caches`` in one forward.

    Each lease gets back caches holding exactly its previous tokens plus its chunk. Returns the
    last position's logits per row (rows x vocabulary) when ``logits``; otherwise the vocabulary
    projection is never evaluated. On an error the leases keep their caches as they were.
    ``step_shapes`` (the prefill step; 0: off): a lease alone runs its step in few attention
    shapes (:mod:`engine.shapes`)."""
    n = len(chunks[0])
    assert n > 0 and all(len(c) == n for c in chunks), "rows of one length"
    if step_shapes and len(leases) == 1 and shapes.applies(leases[0].caches):
        caches, last = shapes.forward(model, leases[0].caches, chunks[0], step_shapes, logits)
        leases[0].caches = caches
        return last
    inputs = mx.array([list(c) for c in chunks])
    if len(leases) == 1:  # alone: straight into its own caches, as engine/prefill.py does
        out = model(inputs, cache=leases[0].caches)
        last = out[:, -1, :] if logits else None
        mx.eval(([last] if last is not None else []) + [c.state for c in leases[0].caches])
        return last
    layers = len(leases[0].caches)
    merged = [C.BatchKVCache.merge([lease.caches[j] for lease in leases]) for j in range(layers)]
    out = model(inputs, cache=merged)
    last = out[:, -1, :] if logits else None
    split = [[m.extract(i) for m in merged] for i in range(len(leases))]
    mx.eval(([last] if last is not None else []) + [c.state for row in split for c in row])
    for lease, caches in zip(leases, split, strict=True):
        lease.caches = caches
    return last
