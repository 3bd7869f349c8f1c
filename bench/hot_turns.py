"""Hot turns of a growing conversation: TTFT with prefill steps in few attention shapes, without, and mlx-lm's.

``python -m bench.hot_turns --model DIR [--context 8192] [--turns 10] [--rounds 2]`` replays a
conversation that starts with a ``--context``-token prompt and grows each turn by the answer (8
tokens) and a new message (10 to 2000 tokens, a fixed list) — every turn a hot hit with a suffix of
a length and a key length that no turn before it had. Three ways, each on conversations of its own
(other token ids, so none hits another's entries), alternating turn by turn so a machine's drift
falls on all of them:

* **shapes on**: ``Engine.generate`` with ``TIERED_KV_STEP_SHAPES=on`` (:mod:`engine.shapes`);
* **shapes off**: the same engine with it off (mlx-lm's steps: a new attention shape each turn);
* **mlx-lm**: ``generate_step`` on a prompt cache trimmed back to each turn's prompt (what
  ``mlx_lm.server`` does with its prompt cache), the suffix fed as its prefill.

TTFT is the engine's ``usage.ttft_seconds`` (the first token sampled) and the time to
``generate_step``'s first token. Round 1 is a process's first conversation (attention graphs
built on the way); later rounds start from another context length (``--context`` + 777 × round),
so their key lengths are new again, while a padded step's shapes recur. On CUDA the difference is
the cuDNN graph build (README); on the CPU nothing is built per shape. Everything MLX on the
calling thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from bench.step_shapes import prompt as synthetic
from engine.events import SamplingParams
from engine.generate import Engine
from tiered_kv import Config

WAYS = ("shapes on", "shapes off", "mlx-lm generate_step")
NEW = (10, 37, 300, 1000, 150, 700, 64, 2000, 12, 500)  # each turn's new message, tokens
ANSWER = 8


def _engine_turn(engine: Engine, on: bool, ids: list[int], first: bool) -> tuple[float, list[int]]:
    engine.step_shapes = on  # read by each generate's batch loop
    usage, out = None, []
    for chunk in engine.generate(ids, SamplingParams(max_tokens=ANSWER)):
        usage = chunk.usage or usage
        out += [chunk.token] if chunk.token is not None else []
    assert usage is not None and (first or usage.cache_tier == "hot"), usage  # a hot hit
    assert usage.ttft_seconds is not None, usage  # it sampled tokens
    return usage.ttft_seconds, out


class _Peer:
    """mlx-lm's own loop over one prompt cache, trimmed back to each turn's prompt."""

    def __init__(self, model: Any) -> None:
        self.model, self.cache, self.held = model, make_prompt_cache(model), 0

    def turn(self, ids: list[int]) -> tuple[float, list[int]]:
        trim_prompt_cache(self.cache, self.cache[0].offset - self.held)
        t0, first, out = time.perf_counter(), 0.0, []
        steps = generate_step(mx.array(ids[self.held :]), self.model, max_tokens=ANSWER,
                              prompt_cache=self.cache)  # fmt: skip
        for tok, _ in steps:
            first = first or time.perf_counter() - t0
            out.append(int(tok))
        self.held = len(ids)
        return first, out


def measure(model_dir: Path, context: int, turns: int, rounds: int) -> dict[str, list[list[float]]]:
    """TTFT seconds per way, per round, per turn (turn 0 is the conversation's first, a miss)."""
    engine = Engine(model_dir, Config(tiers=("hot",), hot_bytes=64 * 1024**3))
    engine.tokenizer.eos_token_ids = []  # random weights: every answer is ANSWER tokens
    if engine.warmup:
        engine.warm_up()
    out: dict[str, list[list[float]]] = {w: [] for w in WAYS}
    try:
        for r in range(rounds):
            start = context + 777 * r
            prompts = {w: synthetic(start, 1000 * r + 100 * k + 1) for k, w in enumerate(WAYS)}
            peer = _Peer(engine.model)
            for w in WAYS:
                out[w].append([])
            for t in range(turns + 1):
                for k, w in enumerate(WAYS):
                    ids = prompts[w]
                    if w == WAYS[2]:
                        ttft, answer = peer.turn(ids)
                    else:
                        ttft, answer = _engine_turn(engine, w == WAYS[0], ids, t == 0)
                    out[w][r].append(ttft)
                    new = synthetic(NEW[t % len(NEW)], 1000 * r + 100 * k + 7 * t + 3)
                    prompts[w] = ids + answer + new
    finally:
        engine.close()
    return out


def table(res: dict[str, list[list[float]]], context: int) -> str:
    lines = [
        f"device {mx.default_device()}, a conversation from {context} tokens (+777 a round), "
        f"turns adding {', '.join(map(str, NEW))} tokens",
        "",
        "| round | way | miss ms | hot turns: median ms | each hot turn, ms |",
        "|---:|---|---:|---:|---|",
    ]
    for r in range(len(res[WAYS[0]])):
        for w in WAYS:
            ms = [x * 1e3 for x in res[w][r]]
            hot = ms[1:]
            lines.append(f"| {r + 1} | {w} | {ms[0]:.0f} | {statistics.median(hot):.1f} | "
                         f"{' '.join(f'{x:.0f}' for x in hot)} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    print(table(measure(a.model, a.context, a.turns, a.rounds), a.context), flush=True)


if __name__ == "__main__":
    main()
