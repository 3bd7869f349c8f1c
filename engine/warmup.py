"""Warm-up at start: the shapes a first request runs, through the model once, before serving.

A process's first forward of each kind loads (and, on a machine that never ran this MLX build,
compiles) its kernels. On the H200 (1B shape, MLX's kernel cache on disk) a restarted server's
first prefill step took 0.27 s instead of 0.011, its first decode step 0.11 s instead of 0.004,
and a first odd-length step 0.07 s instead of 0.05: about 0.4 s added to the one request the
cold tier exists for, the first after a restart. On a machine with no kernel cache yet the first
step took 6.4 s. :func:`run` spends that at start instead: one prefill step, a short step of a
length no step divides, one decode step, and a short step onto the cache cut to its exact length
as a stored entry comes back (a hot or disk hit's suffix), on a fresh cache that is then dropped —
nothing is stored, nothing is learned (the restore costs observe only real prefills).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine import shapes

#: the short step's length: odd, so that no prefill step size divides it
ODD_TOKENS = 37


def run(model: Any, chunk: int, token: int = 0, step_shapes: bool = False) -> float:
    """Forward ``chunk`` tokens, then :data:`ODD_TOKENS`, then one, on a fresh cache; then hand
    the cache back as a stored entry comes back (:func:`_as_stored`) and forward
    :data:`ODD_TOKENS` more, as a hot or disk hit's suffix (engine thread; in few attention
    shapes with ``step_shapes``, as the engine then runs it: :mod:`engine.shapes`); the seconds
    it took."""
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    for n in (max(1, chunk), ODD_TOKENS, 1):
        mx.eval(model(mx.array([[token] * n]), cache=cache))
    _as_stored(cache)
    if step_shapes and shapes.applies(cache):
        shapes.forward(model, cache, [token] * ODD_TOKENS, max(1, chunk))
    else:
        mx.eval(model(mx.array([[token] * ODD_TOKENS]), cache=cache))
    del cache
    mx.clear_cache()
    return time.perf_counter() - t0


def _as_stored(cache: list[Any]) -> None:
    """Each attention layer (``KVCache``) cut to arrays of exactly its length, as a stored entry
    hands them to the next request (decode's ``extract``, a disk load). A cache grown by a fresh
    prefill holds buffers of whole 256-token steps; one continued from an entry grows from its
    exact length, and on the H200 the first step onto such a buffer cost ~0.15 s more the first
    time in a process (other kernels: cuDNN's attention for other strides, we believe), paid by
    the first hot hit after a start.
    Other layer kinds are left as they are."""
    for layer in cache:
        if type(layer) is KVCache and layer.keys is not None:
            n = layer.offset
            layer.keys = mx.contiguous(layer.keys[..., :n, :])
            layer.values = mx.contiguous(layer.values[..., :n, :])
