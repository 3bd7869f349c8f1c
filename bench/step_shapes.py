"""What one prefill step costs by its shape: the first time in the process, again, and one token further.

``python -m bench.step_shapes --model DIR [--contexts 0,8192,32768] [--steps 10,100,1000,2048]``
builds a cache of each context length (whole 2048-token steps), then for each step size ``n``
times one forward of ``n`` tokens onto it three ways: **first** (a (query, key) shape this
process has not run), **again** (the same shape: the cache trimmed back by ``n``), **shifted**
(one token further: the cache trimmed back by ``n - 1``, a new shape again). Every cache is
trimmed back to its context after each row.

Why: on CUDA, mlx-cuda's cuDNN attention builds a graph per exact (query, key) shape and keeps it
in a per-process LRU, so a prefill step of a shape not seen before pays the build (H200, 1B shape:
50-85 ms against 5-7 ms again), and a hot hit's suffix step is such a shape on nearly every
turn. ``MLX_CUDA_USE_CUDNN_SDPA=0`` in the environment times MLX's attention without cuDNN. On
the CPU the three columns are equal (nothing is built per shape). Everything MLX on the calling
thread.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine.loading import load_model

STEP = 2048  # the context's build step (the GPU's prefill step)


def prompt(n: int, salt: int) -> list[int]:
    """``n`` token ids of a synthetic prompt (ids 3..4002, ``salt`` shifts them): the benches'
    prompts for random-weight models (also :mod:`bench.decode_loop`)."""
    return [(i * 7919 + salt) % 4000 + 3 for i in range(n)]


def _forward(model: Any, cache: list[Any], n: int, salt: int) -> float:
    t0 = time.perf_counter()
    mx.eval(model(mx.array([prompt(n, salt)]), cache=cache))
    return time.perf_counter() - t0


def measure(model_dir: Path, contexts: list[int], steps: list[int]) -> list[dict[str, Any]]:
    """One row per (context, step): seconds first, again and shifted (see module doc), and the
    context each of the three forwards started from."""
    model, _ = load_model(model_dir)
    _forward(model, make_prompt_cache(model), 1, 0)  # the process's first forward is not a shape's
    rows = []
    for c in contexts:
        cache = make_prompt_cache(model)
        for s in range(0, c, STEP):
            _forward(model, cache, min(STEP, c - s), s)
        for n in steps:
            starts = [cache[0].offset]
            first = _forward(model, cache, n, 1)
            trim_prompt_cache(cache, n)
            starts.append(cache[0].offset)
            again = _forward(model, cache, n, 2)
            trim_prompt_cache(cache, n - 1)
            starts.append(cache[0].offset)
            shifted = _forward(model, cache, n, 3)
            trim_prompt_cache(cache, n + 1)  # back to c
            rows.append({"context": c, "tokens": n, "first": first, "again": again,
                         "shifted": shifted, "starts": starts})  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    env = os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "unset")
    out = [
        f"device {mx.default_device()}, MLX_CUDA_USE_CUDNN_SDPA={env}",
        "",
        "| context | step tokens | first ms | again ms | shifted ms | again tok/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['context']} | {r['tokens']} | {r['first'] * 1e3:.1f} | {r['again'] * 1e3:.1f} "
            f"| {r['shifted'] * 1e3:.1f} | {r['tokens'] / r['again']:.0f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--contexts", default="0,8192,32768")
    ap.add_argument("--steps", default="10,100,1000,2048")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    print(table(measure(a.model, ints(a.contexts), ints(a.steps))))


if __name__ == "__main__":
    main()
