"""Streaming chat-completion client: one request → one :class:`Measurement`.

TTFT is the time from sending the request to the first streamed event that carries generated output (content,
tool-call or reasoning delta) — or to the final event when the model produced only empty deltas. Decode
tok/s is ``(completion_tokens - 1) / (total - ttft)``, or 0 when the output arrived in one event
(a server's tool-call parser held it back; then TTFT includes the decode time too). Cached tokens come from
``usage.prompt_tokens_details.cached_tokens``; ``usage.cache_tier`` is ours only ("" for the peer).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import httpx

from bench.session import Request


@dataclass(frozen=True)
class Measurement:
    scenario: str
    label: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache_tier: str
    ttft_s: float
    total_s: float
    decode_tps: float
    start_s: float  # server (re)start seconds before this request; 0 when none (not part of TTFT)
    output_events: int = 0  # streamed events with output; 1 while completion > 1 = output held back
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _has_output(event: dict) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning"):
            return True
    return False


def _finished(event: dict) -> bool:
    return any(c.get("finish_reason") for c in event.get("choices") or ())


def send(
    client: httpx.Client,
    base_url: str,
    request: Request,
    scenario: str,
    model: str,
    start_s: float = 0.0,
    timeout: float = 600.0,
) -> Measurement:
    """POST ``request`` (streaming) and time it; HTTP failures become a Measurement with ``error``."""
    body = {**request.body, "model": model}
    ttft: float | None = None
    usage: dict = {}
    n_out = 0
    t0 = time.perf_counter()
    try:
        with client.stream(
            "POST", base_url + "/v1/chat/completions", json=body, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                resp.read()
                raise httpx.HTTPStatusError(
                    f"{resp.status_code}: {resp.text[:300]}", request=resp.request, response=resp
                )
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                has_output = _has_output(event)
                n_out += has_output
                if ttft is None and (has_output or _finished(event)):
                    ttft = time.perf_counter() - t0
                if event.get("usage"):
                    usage = event["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        total = time.perf_counter() - t0
        return Measurement(
            scenario, request.label, request.turn, 0, 0, 0, "", 0.0, total, 0.0, start_s, 0, str(e)
        )
    total = time.perf_counter() - t0
    ttft = total if ttft is None else ttft
    completion = int(usage.get("completion_tokens", 0))
    details = usage.get("prompt_tokens_details") or {}
    decode_time = total - ttft
    streamed = (
        n_out >= 2
    )  # output sent all at once (held by a parser) has no measurable decode rate
    decode_tps = (
        (completion - 1) / decode_time if streamed and completion > 1 and decode_time > 0 else 0.0
    )
    return Measurement(
        scenario=scenario,
        label=request.label,
        turn=request.turn,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        completion_tokens=completion,
        cache_tier=str(usage.get("cache_tier", "")),
        ttft_s=ttft,
        total_s=total,
        decode_tps=decode_tps,
        start_s=start_s,
        output_events=n_out,
    )


def model_id(client: httpx.Client, base_url: str, fallback: str) -> str:
    """The first id from /v1/models (servers differ in what they accept), else ``fallback``."""
    try:
        data = client.get(base_url + "/v1/models", timeout=10.0).json().get("data") or []
        return str(data[0]["id"]) if data else fallback
    except (httpx.HTTPError, ValueError, KeyError):
        return fallback
