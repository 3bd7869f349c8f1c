"""Main-request TTFT next to a title request, inside the engine (no HTTP): where the time goes.

``python -m bench.title_trace --model DIR [--scale 0.5] [--repeats 3]`` prints, for a new session's
main request on a cached system prompt + tools: the time from its admission to its first token and to
its first text, alone, with its title request admitted in the same step ("together"), and with the
title admitted one loop step earlier ("title first": it arrived sooner, e.g. tokenised faster); plus
the render + tokenise time of each prompt (done on the HTTP side, before admission). Runs anywhere
(CPU here, CUDA on a GPU host); everything MLX on the calling thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.concurrency import _session, twin
from engine.batch import BatchLoop
from engine.events import Chunk, Event, SamplingParams
from engine.generate import Engine
from tiered_kv import Config


class _Timed:
    def __init__(self) -> None:
        self.events: list[tuple[float, Event]] = []

    def emit(self, event: Event) -> None:
        self.events.append((time.perf_counter(), event))

    def cancelled(self) -> bool:
        return False

    def first(self, t0: float, text: bool) -> float:
        for t, e in self.events:
            if isinstance(e, Chunk) and (not text or e.text or e.finish_reason):
                return t - t0
        return float("nan")


def _run(
    engine: Engine, reqs: list[list[int]], stagger: bool, max_tokens: int
) -> tuple[float, float]:
    """(first token, first text) seconds of the last of ``reqs`` from the first admission."""
    loop, sinks = BatchLoop(engine), [_Timed() for _ in reqs]
    t0 = time.perf_counter()
    for sink, ids in zip(sinks, reqs, strict=True):
        loop.add(sink, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        if stagger:
            loop.step()
    while loop.active:
        loop.step()
    return sinks[-1].first(t0, False), sinks[-1].first(t0, True)


def trace(model: Path, scale: float, repeats: int, max_tokens: int) -> str:
    engine = Engine(model, Config(tiers=("hot",)))

    def ids(req: Any) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out = engine.encode_chat(req.body["messages"], req.body.get("tools"))
        return out, time.perf_counter() - t0

    _run(engine, [ids(_session(0, 999, 1, max_tokens, scale).turns[0])[0]], False, max_tokens)
    rows: dict[str, list[tuple[float, float]]] = {"alone": [], "together": [], "title first": []}
    enc: dict[str, list[float]] = {"main": [], "title": []}
    for i in range(repeats):
        s = _session(0, 8000 + i, 1, max_tokens, scale)  # one main prompt length per repeat
        for j, name in enumerate(("alone", "together", "title first")):
            main, t_main = ids(twin(s.turns[0], f"[{j}/{i}]"))
            title, t_title = ids(twin(s.title, f"[{j}/{i}]"))
            enc["main"].append(t_main)
            enc["title"].append(t_title)
            reqs = [main] if name == "alone" else [title, main]
            rows[name].append(_run(engine, reqs, name == "title first", max_tokens))
    lines = [
        f"model {model.name}, scale {scale}, main prompt {len(main)} tokens, title {len(title)}",
        f"render + tokenise (median): main {statistics.median(enc['main']):.4f} s, "
        f"title {statistics.median(enc['title']):.4f} s",
        "",
        "| main request | first token (s) | first text (s) | ratio to alone (text) |",
        "|---|---|---|---|",
    ]
    alone = statistics.median(b for _, b in rows["alone"])
    for name, v in rows.items():
        tok, text = statistics.median(a for a, _ in v), statistics.median(b for _, b in v)
        lines.append(f"| {name} | {tok:.3f} | {text:.3f} | {text / alone:.2f} |")
    engine.close()
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--scale", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    print(trace(args.model, args.scale, args.repeats, args.max_tokens))


if __name__ == "__main__":
    main()
