"""`tiered-kv bench --concurrency 1,2,4,8`: concurrent agent sessions, ours vs mlx_lm.server.

For each K, on each server in turn (never both at once, so they do not share the CPU / GPU):

* **sessions**: K agent sessions start together, each its own conversation on one shared system
  prompt + tools, each sending its turns one after the other (streaming). TTFT p50 / p95 of turns
  2..N over all sessions, and the aggregate rate of the run (completion tokens / wall seconds).
* **decode**: K requests with short distinct prompts and ``decode_tokens`` to generate, sent together:
  aggregate decode tok/s (completion tokens / wall seconds) — the batch's decode speed.
* **title + main** (once): a new session's main request alone, then the same shape of request
  (another session) sent together with its title request; main TTFT median over ``repeats``.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.replay import Measurement, send
from bench.session import Request, Session, build_session


def _session(seed: int, own: int, turns: int, max_tokens: int, scale: float) -> Session:
    """Session ``own``'s conversation on session ``seed``'s system prompt and tools."""
    base = build_session(1, seed, max_tokens, scale).turns[0].body
    s = build_session(turns, own, max_tokens, scale)
    for req in s.turns:
        req.body["messages"][0] = base["messages"][0]
        req.body["tools"] = base["tools"]
        # tools stay in the prompt; "none" keeps a tool-call parser from holding the random model's
        # text back, so TTFT is the first token on both servers
        req.body["tool_choice"] = "none"
    return s


def shared_sessions(k: int, turns: int, seed: int, max_tokens: int, scale: float) -> list[Session]:
    """K sessions that share session ``seed``'s system prompt and tools; the rest is their own."""
    return [_session(seed, seed + 1000 + i, turns, max_tokens, scale) for i in range(k)]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


@dataclass
class Row:
    server: str
    k: int
    ttft_p50: float = 0.0
    ttft_p95: float = 0.0
    session_tps: float = 0.0
    decode_tps: float = 0.0
    errors: int = 0
    cached: list[int] = field(default_factory=list)


def _together(fn: Any, items: list[Any]) -> tuple[list[Any], float]:
    """Run ``fn(item)`` for every item on its own thread, all started together; (results, wall)."""
    results: list[Any] = [None] * len(items)
    go = threading.Barrier(len(items))

    def one(i: int) -> None:
        go.wait()
        results[i] = fn(items[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def run_sessions(base_url: str, model: str, name: str, sessions: list[Session]) -> Row:
    def session(s: Session) -> list[Measurement]:
        with httpx.Client() as client:
            return [send(client, base_url, r, name, model) for r in s.turns]

    got, wall = _together(session, sessions)
    ms = [m for ms in got for m in ms]
    later = [m.ttft_s for m in ms if m.turn >= 2 and not m.error]
    return Row(
        name,
        len(sessions),
        _pct(later, 0.5),
        _pct(later, 0.95),
        sum(m.completion_tokens for m in ms) / wall,
        errors=sum(bool(m.error) for m in ms),
        cached=[m.cached_tokens for m in ms],
    )


def run_decode(base_url: str, model: str, name: str, k: int, tokens: int, seed: int) -> float:
    reqs = [
        Request(
            "decode",
            1,
            {
                "messages": [{"role": "user", "content": f"Story {seed}-{i}: tell it slowly."}],
                "max_tokens": tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        for i in range(k)
    ]

    def one(r: Request) -> Measurement:
        with httpx.Client() as client:
            return send(client, base_url, r, name, model)

    got, wall = _together(one, reqs)
    return sum(m.completion_tokens for m in got) / wall


def title_main(
    base_url: str, model: str, name: str, seed: int, max_tokens: int, scale: float, repeats: int
) -> tuple[float, float]:
    """(main TTFT alone, main TTFT with its title request sent together), medians over
    ``repeats``; every main request is a new session on the shared system prompt and tools."""

    def one(r: Request) -> Measurement:
        with httpx.Client() as c:
            return send(c, base_url, r, name, model)

    alone, paired = [], []
    for i in range(repeats):
        s = _session(seed, seed + 8000 + i, 1, max_tokens, scale)
        alone.append(one(twin(s.turns[0], f"[a{i}]")).ttft_s)
        got, _ = _together(one, [s.title, twin(s.turns[0], f"[b{i}]")])
        paired.append(got[1].ttft_s)
    return statistics.median(alone), statistics.median(paired)


def twin(req: Request, tag: str) -> Request:
    """``req`` with its last user message opened by ``tag``: a new prompt of the same length, so a
    main request alone and one sent with its title have the same suffix to prefill after the
    cached system prompt (sessions of other seeds differ in length, and on a CPU the prefill time
    with them: the ratio measured the seeds)."""
    body = copy.deepcopy(req.body)
    last = body["messages"][-1]
    last["content"] = f"{tag} {last['content']}"
    return Request(req.label, req.turn, body)


def table(
    rows: list[Row], pattern: dict[str, tuple[float, float]], single: dict[str, float]
) -> str:
    lines = [
        "| server | K | TTFT p50 turns 2..N (s) | TTFT p95 (s) | sessions tok/s | decode tok/s (aggregate) | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.server} | {r.k} | {r.ttft_p50:.2f} | {r.ttft_p95:.2f} | {r.session_tps:.1f} "
            f"| {r.decode_tps:.1f} | {r.errors} |"
        )
    lines += [
        "",
        "| server | main TTFT alone (s) | with a concurrent title (s) | ratio |",
        "|---|---|---|---|",
    ]
    for name, (a, b) in pattern.items():
        lines.append(f"| {name} | {a:.2f} | {b:.2f} | {b / a if a else 0:.2f} |")
    if single:
        lines += ["", "| server | single-request decode tok/s |", "|---|---|"]
        lines += [f"| {name} | {v:.1f} |" for name, v in single.items()]
    return "\n".join(lines)
