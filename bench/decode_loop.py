"""Single-request decode speed: the engine's batch loop against mlx-lm's own ``generate_step``.

``python -m bench.decode_loop --model DIR [--context 8192] [--tokens 512] [--rounds 3]`` prefills
a ``--context``-token prompt and decodes ``--tokens`` greedy tokens (end-of-sequence ignored), in
rounds that alternate three ways, so that a machine's drift falls on all of them:

* **generate_step**: mlx-lm's loop over a plain ``KVCache`` (the peer's single-request decode);
* **engine**: ``Engine.generate`` (a miss: the prompt is prefilled, then the batch loop decodes
  it through mlx-lm's ``GenerationBatch`` over :class:`engine.decoding.DecodeKVCache`);
* **engine, mlx-lm's BatchKVCache**: the same with mlx-lm's own batch cache, which hands every
  decode step's attention an array mask and keeps a merged cache's buffers at lengths of no
  whole step (the engine before ``DecodeKVCache``).

Decode tok/s is tokens after the first over the time from the first to the last (the engine's:
its usage's ``decode_seconds``). Everything MLX on the calling thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from bench import step_shapes
from engine import decoding
from engine.events import SamplingParams
from engine.generate import Engine
from tiered_kv import Config

WAYS = ("generate_step", "engine", "engine, mlx-lm's BatchKVCache")


def _generate_step(engine: Engine, prompt: list[int], tokens: int) -> float:
    cache = make_prompt_cache(engine.model)
    stamps = []
    for _ in generate_step(mx.array(prompt), engine.model, max_tokens=tokens, prompt_cache=cache):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _engine(engine: Engine, prompt: list[int], tokens: int) -> float:
    stamps = []  # as generate_step's: from the first token to the last
    for chunk in engine.generate(prompt, SamplingParams(max_tokens=tokens)):
        if chunk.token is not None:
            stamps.append(time.perf_counter())
    assert len(stamps) == tokens, len(stamps)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _mlx_batch_cache(engine: Engine, prompt: list[int], tokens: int) -> float:
    merge = decoding.merge
    decoding.merge = lambda layer: layer[0].merge(layer)  # mlx-lm's own BatchKVCache
    try:
        return _engine(engine, prompt, tokens)
    finally:
        decoding.merge = merge


RUN: dict[str, Callable[[Engine, list[int], int], float]] = {
    WAYS[0]: _generate_step,
    WAYS[1]: _engine,
    WAYS[2]: _mlx_batch_cache,
}


def measure(model_dir: Path, context: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    """Decode tok/s of each way, one figure per round."""
    engine = Engine(model_dir, Config(tiers=()))
    engine.tokenizer.eos_token_ids = []  # random weights: decode the whole length
    engine.warm_up()
    out: dict[str, list[float]] = {w: [] for w in WAYS}
    try:
        for r in range(rounds):
            for k, way in enumerate(WAYS):
                ids = step_shapes.prompt(context, r * len(WAYS) + k)
                out[way].append(RUN[way](engine, ids, tokens))
    finally:
        engine.close()
    return out


def table(res: dict[str, list[float]], context: int, tokens: int) -> str:
    base = statistics.median(res[WAYS[0]])
    out = [
        f"device {mx.default_device()}, {context}-token prompt, {tokens} tokens decoded",
        "",
        "| way | decode tok/s (median) | runs | x generate_step |",
        "|---|---:|---|---:|",
    ]
    for way, runs in res.items():
        med = statistics.median(runs)
        out.append(f"| {way} | {med:.1f} | {' '.join(f'{x:.1f}' for x in runs)} | {med / base:.2f} |")
    return "\n".join(out)


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    print(table(measure(a.model, a.context, a.tokens, a.rounds), a.context, a.tokens))


if __name__ == "__main__":
    main()
