"""Structured output's cost: decode speed of a request with a JSON Schema against one without.

``python -m bench.structured --model DIR [--context 2048] [--tokens 256] [--rounds 3]`` prefills a
``--context``-token chat prompt once (every later request is a hot hit of it) and decodes up to
``--tokens`` greedy tokens two ways, alternating in rounds:

* **free**: no format (the batch loop's ``mx.async_eval`` pipelining);
* **json_schema**: an object holding a list of strings (so the value can run long), enforced by
  ``engine.structured`` (llguidance's mask each step; the sampled token read before the next).

Decode tok/s is tokens after the first over the time from the first to the last. A constrained
request may end before ``--tokens`` (its value complete); its rate is over the tokens it made.
Everything MLX on the calling thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from engine import structured
from engine.events import SamplingParams
from engine.generate import Engine
from tiered_kv import Config

SCHEMA = {"type": "object", "required": ["items"],
          "properties": {"items": {"type": "array", "items": {"type": "string"}}}}  # fmt: skip


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[int, float, str]:
    """(tokens, decode tok/s, text) of one request."""
    stamps, text = [], []
    for chunk in engine.generate(prompt, params):
        if chunk.token is not None:
            stamps.append(time.perf_counter())
        text.append(chunk.text)
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return len(stamps), rate, "".join(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    engine = Engine(args.model, Config(tiers=("hot",)))
    words = " ".join(f"item{i}" for i in range(args.context // 3))  # about three tokens each
    ask = f"Here is a list: {words}. Give the first items as a JSON object with a list 'items'."
    prompt = engine.encode_chat([{"role": "user", "content": ask}])
    grammar = structured.lark(structured.schema_of({"type": "json_schema", "json_schema": {"schema": SCHEMA}}))
    ways = {"free": SamplingParams(max_tokens=args.tokens),
            "json_schema": SamplingParams(max_tokens=args.tokens, grammar=grammar)}  # fmt: skip
    run(engine, prompt, ways["free"])  # the prompt's prefill, once: every run after is a hot hit
    rates: dict[str, list[float]] = {w: [] for w in ways}
    made: dict[str, list[int]] = {w: [] for w in ways}
    sample = ""
    for r in range(args.rounds):
        for way in ways if r % 2 == 0 else reversed(list(ways)):
            n, rate, text = run(engine, prompt, ways[way])
            rates[way].append(rate)
            made[way].append(n)
            if way == "json_schema":
                sample = text
    print(f"# structured output: {args.model.name}, {len(prompt)}-token prompt (hot), "
          f"up to {args.tokens} greedy tokens, {args.rounds} rounds")  # fmt: skip
    print("| way | tokens (each run) | decode tok/s (median) | runs |")
    print("|---|---|---:|---|")
    for way in ways:
        runs = " ".join(f"{x:.1f}" for x in rates[way])
        print(f"| {way} | {' '.join(map(str, made[way]))} | {statistics.median(rates[way]):.1f} | {runs} |")
    try:
        whole = isinstance(json.loads(sample), dict)
    except json.JSONDecodeError:
        whole = False  # cut by --tokens
    print(f"\njson_schema's output (last run, {'a whole value' if whole else 'cut short'}): {sample[:200]}")


if __name__ == "__main__":
    main()
