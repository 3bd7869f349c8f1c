"""Warm-up at start: the shapes a first request runs, through the model once, before serving.

A process's first forward of each kind loads (and, on a machine that never ran this MLX build,
compiles) its kernels. On the H200 (1B shape, MLX's kernel cache on disk) a restarted server's
first prefill step took 0.27 s instead of 0.011, its first decode step 0.11 s instead of 0.004,
and a first odd-length step 0.07 s instead of 0.05: about 0.4 s added to the one request the
cold tier exists for, the first after a restart. On a machine with no kernel cache yet the first
step took 6.4 s. :func:`run` spends that at start instead: one prefill step, a short step of a
length no step divides, one decode step, on a fresh cache that is then dropped — nothing is
stored, nothing is learned (the restore costs observe only real prefills).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

#: the short step's length: odd, so that no prefill step size divides it
ODD_TOKENS = 37


def run(model: Any, chunk: int, token: int = 0) -> float:
    """Forward ``chunk`` tokens, then :data:`ODD_TOKENS`, then one, on a fresh cache (engine
    thread); the seconds it took."""
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    for n in (max(1, chunk), ODD_TOKENS, 1):
        mx.eval(model(mx.array([[token] * n]), cache=cache))
    del cache
    mx.clear_cache()
    return time.perf_counter() - t0
