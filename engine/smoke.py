"""`tiered-kv smoke MODEL_DIR`: the server end to end on MLX's default device (CPU, CUDA or Metal).

One line per step; exit status 1 at the first failed check. Steps: start ``tiered-kv serve`` on a fresh
cache dir; two streamed completions that share a long prefix (the second must report cached tokens from the
``hot`` tier); a streamed chat carrying tools (well-formed SSE ending in ``[DONE]``; tool calls parsed are
counted); SIGTERM (clean exit); a restart on the same cache dir; a third completion on the prefix, served from
disk (tier ``cold``); then the same three completions against ``python -m mlx_lm.server`` for a side-by-side
TTFT and decode tok/s. Runs the servers as subprocesses (`bench/servers.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when the command runs: `tiered-kv serve` loads neither (bench extra)
    import httpx

_WORDS = (
    "cache disk memory token prompt server request block layer key value store load write read file "
    "index hash queue thread budget system user assistant tool call result stream chunk prefix model"
).split()


class SmokeFailure(AssertionError):
    """A smoke step did not do what it must."""


@dataclass(frozen=True)
class Timing:
    prompt_tokens: int
    cached_tokens: int
    tier: str
    completion_tokens: int
    ttft_s: float
    decode_tps: float


def long_prefix(words: int, seed: int = 0) -> str:
    """Deterministic filler text (~1.3 tokens per word on BPE vocabularies)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _sse(response: httpx.Response) -> Iterator[dict]:
    """The stream's events as they arrive; SmokeFailure if it ends without ``[DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line[6:] == "[DONE]":
            return
        yield json.loads(line[6:])
    raise SmokeFailure("stream ended without [DONE]")


def complete(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> Timing:
    """One streamed /v1/completions request, timed on the client side."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    first = 0.0
    pieces = 0
    usage: dict = {}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SmokeFailure(f"/v1/completions answered {r.status_code}: {r.read()[:300]!r}")
        for event in _sse(r):
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices") or ()):
                first = first or time.perf_counter() - t0
                pieces += 1
    end = time.perf_counter() - t0
    completion = int(usage.get("completion_tokens", pieces))
    # as the bench's replay: tokens after the first over the time from the first to the stream's end
    decode = (completion - 1) / (end - first) if first and end > first and completion > 1 else 0.0
    details = usage.get("prompt_tokens_details") or {}
    return Timing(
        int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0),
        str(usage.get("cache_tier", "")), completion, first or end, decode,
    )  # fmt: skip


def chat_with_tools(client: httpx.Client, url: str, model: str) -> tuple[str, int]:
    """A streamed chat that carries a tool and a tool call in its history; (finish, calls parsed)."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }}]  # fmt: skip
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "What is the weather in Paris? Use the tool."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        {"role": "user", "content": "And in Tokyo?"},
    ]
    body = {"model": model, "messages": messages, "tools": tools, "max_tokens": 48,
            "temperature": 0.0, "stream": True}  # fmt: skip
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SmokeFailure(f"/v1/chat/completions answered {r.status_code}: {r.read()[:300]!r}")
        events = list(_sse(r))
    calls = sum(len((c.get("delta") or {}).get("tool_calls") or ()) for e in events
                for c in e.get("choices") or ())  # fmt: skip
    finish = [
        c["finish_reason"] for e in events for c in e.get("choices") or () if c.get("finish_reason")
    ]
    if not finish:
        raise SmokeFailure("chat stream carried no finish_reason")
    return finish[-1], calls


def _line(step: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {step:<34} {detail}", flush=True)


def _fmt(t: Timing) -> str:
    return (f"prompt {t.prompt_tokens} cached {t.cached_tokens} tier {t.tier or '-'} "
            f"ttft {t.ttft_s * 1000:.0f} ms decode {t.decode_tps:.1f} tok/s ({t.completion_tokens} tok)")  # fmt: skip


def run_smoke(model: Path, work: Path, prefix_words: int, max_tokens: int, peer: bool) -> int:
    import httpx

    from bench.servers import ServerProcess, ours_spec, peer_spec

    prefix = long_prefix(prefix_words)
    name = str(model)  # mlx_lm.server loads the "model" it is sent: the same directory
    prompts = [prefix + f"\nQuestion {i}: what comes next?" for i in (1, 2, 3)]
    env = {"TIERED_KV_DIR": str(work / "kv"), "TIERED_KV_TIERS": "hot,cold"}
    ours = ServerProcess(ours_spec("ours", model, env), work / "ours.log")
    rows: dict[str, list[Timing]] = {"ours": []}
    step = "start tiered-kv serve"
    try:
        _line(step, True, f"{ours.start():.1f} s on port {ours.port}")
        with httpx.Client(timeout=600) as client:
            step = "completion 1 (cold prompt)"
            rows["ours"].append(t := complete(client, ours.base_url, name, prompts[0], max_tokens))
            _line(step, t.prompt_tokens > 0, _fmt(t))
            step = "completion 2 (shared prefix, hot)"
            rows["ours"].append(t := complete(client, ours.base_url, name, prompts[1], max_tokens))
            if not (t.cached_tokens > 0 and t.tier == "hot"):
                raise SmokeFailure(_fmt(t))
            _line(step, True, _fmt(t))
            step = "streamed chat with tools"
            finish, calls = chat_with_tools(client, ours.base_url, name)
            _line(step, True, f"finish {finish}, tool calls parsed {calls}")
            step = "SIGTERM"
            proc = ours.proc
            ours.stop()
            assert proc is not None
            # uvicorn re-raises the signal after its graceful shutdown: -SIGTERM is a clean exit
            shut = "Application shutdown complete" in ours.log_path.read_text(errors="replace")
            if proc.returncode not in (0, -signal.SIGTERM) or not shut:
                raise SmokeFailure(f"exit status {proc.returncode}; see {ours.log_path}")
            _line(step, True, f"exit {proc.returncode} after a graceful shutdown (cache flushed)")
            step = "restart on the same cache dir"
            _line(step, True, f"{ours.start():.1f} s")
            step = "completion 3 (after restart, disk)"
            rows["ours"].append(t := complete(client, ours.base_url, name, prompts[2], max_tokens))
            if not (t.cached_tokens > 0 and t.tier == "cold"):
                raise SmokeFailure(_fmt(t))
            up = _metric(client, ours.base_url, "tiered_kv_cache_cold_gpu_upload_bytes")
            _line(step, True, _fmt(t) + (f", {up / 1e6:.0f} MB through the GPU upload" if up else ""))
            ours.stop()
            if peer:
                step = "mlx_lm.server, same prompts"
                other = ServerProcess(peer_spec("peer", model, {}), work / "peer.log")
                other.start()
                try:
                    rows["peer"] = [
                        complete(client, other.base_url, name, p, max_tokens) for p in prompts
                    ]
                finally:
                    other.stop()
                _line(step, True, "; ".join(f"{x.ttft_s * 1000:.0f} ms" for x in rows["peer"]))
    except (SmokeFailure, httpx.HTTPError, RuntimeError, TimeoutError) as e:
        _line(step, False, str(e))
        print(f"server logs and cache dir kept in {work}", file=sys.stderr)
        return 1
    finally:
        ours.stop()
    _table(rows)
    return 0


def _metric(client: httpx.Client, url: str, name: str) -> float:
    """One gauge from the server's ``/metrics`` (0 when absent)."""
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _table(rows: dict[str, list[Timing]]) -> None:
    names = ("completion 1 (cold)", "completion 2 (hot)", "completion 3 (after restart)")
    print(
        "\n| request | ours TTFT ms | ours decode tok/s | ours cached / tier | peer TTFT ms | peer decode tok/s |"
    )
    print("|---|---|---|---|---|---|")
    for i, name in enumerate(names):
        o = rows["ours"][i]
        p = rows["peer"][i] if "peer" in rows else None
        peer = f"{p.ttft_s * 1000:.0f} | {p.decode_tps:.1f}" if p else "- | -"
        print(
            f"| {name} | {o.ttft_s * 1000:.0f} | {o.decode_tps:.1f} | {o.cached_tokens} / {o.tier} | {peer} |"
        )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("smoke", help="end-to-end server check on MLX's default device")
    p.add_argument("model", type=Path, help="mlx-lm model directory")
    p.add_argument("--prefix-words", type=int, default=1500, help="shared prefix length (words)")
    p.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request")
    p.add_argument("--no-peer", action="store_true", help="skip the mlx_lm.server comparison")
    p.add_argument("--keep", action="store_true", help="keep the work dir (cache dir, server logs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    if not (args.model / "config.json").is_file():
        print(f"tiered-kv smoke: no model at {args.model}", file=sys.stderr)
        return 2
    from importlib.metadata import version

    try:
        import bench.servers  # noqa: F401 - needs the bench extra (httpx, psutil)
    except ImportError as e:
        print(f"tiered-kv smoke: {e}; install the bench extra: pip install 'tiered-kv[bench]'",
              file=sys.stderr)  # fmt: skip
        return 2

    print(f"device: {mx.default_device()} (mlx {version('mlx')})", flush=True)
    work = Path(tempfile.mkdtemp(prefix="tiered-kv-smoke-"))
    status = run_smoke(args.model, work, args.prefix_words, args.max_tokens, not args.no_peer)
    if status == 0 and not args.keep:
        shutil.rmtree(work, ignore_errors=True)  # kept on failure: the server logs are there
    return status
