"""OpenAI response objects: Chat Completions and Completions chunks and bodies, usage, finish
reasons, log-probabilities, the model list (plain dicts; no transport, no MLX).

``engine/respond.py`` decides what goes in them; the ids and timestamps every endpoint's bodies
carry (Anthropic's and Responses' too) come from here.
"""

from __future__ import annotations

import codecs
import datetime
import time
import uuid
from typing import Any, NamedTuple


def new_id(prefix: str) -> str:
    """A fresh id: ``prefix`` (its separator included) and 24 hex digits. The prefixes are the
    providers' own: ``chatcmpl-`` and ``cmpl-`` (Chat Completions, Completions), ``resp_``,
    ``msg_``, ``rs_``, ``fc_`` (a Responses response and its message, reasoning and function call
    items), ``msg_`` (an Anthropic message)."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage_dict(usage: Any) -> dict[str, Any]:
    """engine Usage → OpenAI usage with ``prompt_tokens_details.cached_tokens`` and our ``cache_tier``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "cache_tier": usage.cache_tier,
    }


def openai_finish(reason: str | None, has_tool_calls: bool) -> str | None:
    """Engine finish reason → OpenAI's ("cancelled" happens only when nobody listens)."""
    if reason is None:
        return None
    if has_tool_calls and reason == "stop":
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, Any], finish: str | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [choice],
    }


def usage_chunk(rid: str, created: int, model: str, obj: str, usage: Any) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_dict(usage),
    }


def chat_response(
    rid: str,
    model: str,
    content: str,
    tool_calls: list[dict[str, Any]],
    finish: str | None,
    usage: Any,
    reasoning: str = "",
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content or (None if tool_calls else ""),
    }
    if reasoning:  # OpenAI-compatible clients read reasoning_content; mlx_lm.server sends reasoning
        message["reasoning_content"] = message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": usage_dict(usage),
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish: str | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_response(
    rid: str, model: str, text: str, finish: str | None, usage: Any
) -> dict[str, Any]:
    body = completion_chunk(rid, now(), model, text, finish)
    body["usage"] = usage_dict(usage)
    return body


class Piece(NamedTuple):
    """A generated token as logprobs name it: its text (``bytes:\\xNN…`` for a part of a
    character) and the bytes it adds to the completion."""

    text: str
    raw: bytes


#: a token, its log-probability and the likeliest tokens (and theirs) at its place
LogprobEntry = tuple[Piece, float, list[tuple[Piece, float]]]


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(p: Piece, lp: float) -> dict[str, Any]:
        return {"token": p.text, "logprob": lp, "bytes": list(p.raw)}

    return {"content": [{**one(t, lp), "top_logprobs": [one(a, b) for a, b in top]}
                        for t, lp, top in entries]}  # fmt: skip


class TextOffsets:
    """Character offsets of tokens in a completion's text, fed the tokens' bytes in order: a
    token that ends inside a character starts where that character does (the text counts an
    undecodable byte as one U+FFFD, as the completion's text does)."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def advance(self, raw: bytes) -> int:
        """The offset of the token with bytes ``raw``; moves past it."""
        at = self.chars
        self.chars += len(self._utf8.decode(raw))
        return at


def completion_logprobs(entries: list[LogprobEntry], offsets: TextOffsets) -> dict[str, Any]:
    """The legacy completions' ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset),
    the first token at ``offsets``' place (moved past these tokens)."""
    return {
        "tokens": [t.text for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{p.text: v for p, v in top} for _, _, top in entries],
        "text_offset": [offsets.advance(t.raw) for t, _, _ in entries],
    }


def model_object(model_id: str, created: int) -> dict[str, Any]:
    """The served model as ``/v1/models`` lists it and ``/v1/models/{id}`` returns it: OpenAI's
    fields (``object``, ``created``, ``owned_by``) and Anthropic's (``type``, ``display_name``,
    ``created_at``, ``lifecycle``), one path serving both SDKs' ``models.list`` / ``retrieve``."""
    at = datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat().replace("+00:00", "Z")
    return {"id": model_id, "object": "model", "created": created, "owned_by": "tiered-kv",
            "type": "model", "display_name": model_id, "created_at": at,
            "lifecycle": "active"}  # fmt: skip


def models_response(model_id: str, created: int) -> dict[str, Any]:
    """The list: OpenAI's ``object`` and ``data``, and Anthropic's page fields (one page)."""
    return {"object": "list", "data": [model_object(model_id, created)], "has_more": False,
            "first_id": model_id, "last_id": model_id}  # fmt: skip
