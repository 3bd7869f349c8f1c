"""Anthropic Messages requests in, Anthropic events and bodies out (``POST /v1/messages``).

Agent clients written for Claude (Claude Code, the ``anthropic`` SDK) speak this API: a ``system``
beside the turns, content as typed blocks (``text``, ``tool_use``, ``tool_result``, ``thinking``),
tools with an ``input_schema``, and a stream of named events (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). ``thinking``
turns the chat template's ``enable_thinking`` on or off, ``output_config.effort`` is its
``reasoning_effort``; sampling fields the API has dropped (``temperature``, ``top_p``, ``top_k``) are
still taken where a client sends them. A request becomes the OpenAI chat request the rest of the
server already serves (:func:`to_chat`: the same template, tool-call parsers, sampling and cache),
and the chat output parser's deltas become content blocks (:class:`MessagesOutput`, through
``items.Items``). No transport and no MLX.

Usage is Anthropic's split: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those served from the cache (either tier), ``cache_creation_input_tokens``
0 (every prompt is cached without breakpoints; ``cache_control`` is accepted and ignored).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field

from engine import api, output
from engine.api import ChatRequest
from engine.errors import ApiError, invalid
from engine.events import Chunk, Hit, Usage
from engine.items import Items
from engine.openai_bodies import new_id

#: engine finish reason → Anthropic's ``stop_reason`` (a called tool wins, as OpenAI's "tool_calls", unless
#: the output was cut: max_tokens)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}
_UNSUPPORTED = ("image", "document", "search_result", "container_upload")
BLOCK = {"reasoning": "thinking", "content": "text", "tool": "tool_use"}  # items.Items channel → block
#: what the ids the server makes for ``tool_use`` blocks begin with: Anthropic's (``toolu_…``), not
#: OpenAI's ``call_``; an id the model wrote itself (Kimi's ``functions.NAME:N``) and the 9
#: alphanumerics Mistral's templates require stay as they are, since the template renders them back
CALL_ID_PREFIX = "toolu_"


class CountTokensRequest(api.RequestBody):
    """A ``/v1/messages/count_tokens`` body: a Messages request whose ``max_tokens`` is optional."""

    sizes: ClassVar[dict[str, int]] = {"tools": api.MAX_TOOLS}

    model: str | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stop_sequences: list[str] | None = Field(default=None, max_length=4)
    stream: bool = False
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    @classmethod
    def turns(cls, data: dict[str, Any]) -> int:
        """Each message is a chat message at least (:func:`to_chat`)."""
        return len(api.listed(data, "messages"))


class MessagesRequest(CountTokensRequest):
    """A ``/v1/messages`` body: ``max_tokens`` is required, as Anthropic's (a request without it
    generated to the end of the context)."""

    max_tokens: int = Field(gt=0)


def parse(
    raw: bytes, model: type[CountTokensRequest] = MessagesRequest, context_length: int | None = None
) -> ChatRequest:
    """A Messages body (``model``: what it must hold) as the chat request it asks for. Raises
    ApiError (400 / 413 as for chat; more turns than ``context_length``: ``api.check_turns``)."""
    return to_chat(api.parse_body(raw, model, context_length), context_length)


def to_chat(req: CountTokensRequest, context_length: int | None = None) -> ChatRequest:
    """The OpenAI chat request of ``req``: system first, each ``tool_result`` block a ``tool``
    message (in its place, before the user's text), each ``tool_use`` an assistant tool call,
    ``thinking`` blocks the assistant's ``reasoning_content``; a ``system`` turn among the messages
    stays a system message where it is (most templates render it there)."""
    msgs: list[dict[str, Any]] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        msgs += _turn(m, f"messages.{i}")
    body: dict[str, Any] = {
        "messages": msgs,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "stream": req.stream,
    }
    if req.tools:
        body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body.update(_choice(req.tool_choice))
    thinking = (req.thinking or {}).get("type")
    if thinking in ("enabled", "adaptive", "between_tools", "disabled"):  # Qwen3's and others' switch
        body["chat_template_kwargs"] = {"enable_thinking": thinking != "disabled"}
    effort = (req.output_config or {}).get("effort")
    if isinstance(effort, str):  # gpt-oss's template reads reasoning_effort
        body["reasoning_effort"] = effort
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:  # structured output: {"type": "json_schema", "schema": {...}}
        body["response_format"] = fmt
    if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls"):
        body["continue_final_message"] = True  # a prefill: the model goes on from its text
    chat: ChatRequest = api.validate(body, ChatRequest, context_length)
    return chat


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise invalid("content must be a string or a list of content blocks", param)
    for j, b in enumerate(content):
        if b.get("type") in _UNSUPPORTED:
            raise invalid(f"{b['type']} blocks are not supported: the model reads text", f"{param}.{j}")
    return content


def _text(content: Any, param: str) -> str:
    """The text of ``content`` (a string, or text blocks joined by blank lines)."""
    parts = []
    for j, b in enumerate(_blocks(content, param)):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise invalid(f"expected a text block, got {b.get('type')!r}", f"{param}.{j}")
        parts.append(b["text"])
    return "\n\n".join(parts)


def _turn(m: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise invalid('each message needs "role": "user", "assistant" or "system"', f"{param}.role")
    if m["role"] == "system":  # Claude Code sends its environment so, after the first user turn
        return [{"role": "system", "content": _text(m.get("content"), f"{param}.content")}]
    blocks = _blocks(m.get("content"), f"{param}.content")
    text: list[str] = []
    if m["role"] == "user":
        out: list[dict[str, Any]] = []
        for j, b in enumerate(blocks):
            where = f"{param}.content.{j}"
            if b.get("type") == "tool_result":
                result = _text(b.get("content") or "", where + ".content")
                if b.get("is_error"):
                    result = "Error: " + result
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": result})  # fmt: skip
            else:
                text.append(_text([b], where))
        if text or not out:
            out.append({"role": "user", "content": "\n\n".join(text)})
        return out
    calls, reasoning = [], []
    for j, b in enumerate(blocks):
        where = f"{param}.content.{j}"
        kind = b.get("type")
        if kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise invalid('a tool_use block needs "name" and an object "input"', where)
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})  # fmt: skip
        elif kind == "thinking":
            reasoning.append(str(b.get("thinking", "")))
        elif kind != "redacted_thinking":
            text.append(_text([b], where))
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "\n\n".join(reasoning)
    return [turn]


def _tool(t: Any, param: str) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise invalid('each tool needs a "name" (and an "input_schema")', param)
    if not isinstance(t.get("input_schema") or {}, dict):  # it was named tools.N.function.parameters
        raise invalid("a tool's input_schema is a JSON Schema object", param + ".input_schema")
    return api.function_tool(t["name"], t.get("input_schema"), t.get("description"))


def _choice(c: dict[str, Any]) -> dict[str, Any]:
    kind = c.get("type")
    out: dict[str, Any] = {"parallel_tool_calls": not c.get("disable_parallel_tool_use", False)}
    if kind == "tool":
        if not isinstance(c.get("name"), str):
            raise invalid('tool_choice {"type": "tool"} needs a "name"', "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": c["name"]}}
    elif kind in ("auto", "any", "none"):
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise invalid('tool_choice type must be "auto", "any", "tool" or "none"', "tool_choice")
    return out


# --- output -------------------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, cached: int, output_tokens: int, tier: str = "none") -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
        "cache_tier": tier,
    }


def _input(arguments: str) -> dict[str, Any]:
    """A parsed call's JSON arguments as a tool_use ``input`` object."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class MessagesOutput:
    """One request's Anthropic view of the engine's chunks, streamed (``start`` + ``feed``: named
    events) or whole (``feed`` every chunk, then ``body``), from the chat output parser."""

    named_events = True

    def __init__(self, model: str, parser: output.OutputParser, prompt_tokens: int) -> None:
        self.id, self.model, self.parser = new_id("msg_"), model, parser
        self.prompt_tokens = prompt_tokens
        self.blocks: list[dict[str, Any]] = []  # the body's content, as streamed
        self.items = Items()  # which block is open, streaming
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None

    def start(self, hit: Hit | None = None) -> list[dict[str, Any]]:
        cached = hit.tokens if hit is not None else 0
        tier = hit.tier if hit is not None else "none"
        return [{"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage_dict(self.prompt_tokens, cached, 0, tier)}}]  # fmt: skip

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        out = self._delta(self.parser.feed(chunk.text))
        if chunk.finish_reason is not None:
            tail, _ = self.parser.finish(chunk.finish_reason, chunk.stop_sequence is not None)
            out += self._delta(tail)
            out += self._close()
            self.usage = chunk.usage
            if chunk.finish_reason == "length":
                self.stop_reason = "max_tokens"  # cut: a call before the cut does not end the turn
            elif any(b["type"] == "tool_use" for b in self.blocks):
                self.stop_reason = "tool_use"
            elif chunk.stop_sequence is not None:
                self.stop_reason, self.stop_sequence = "stop_sequence", chunk.stop_sequence
            else:
                self.stop_reason = STOP_REASONS.get(chunk.finish_reason, "end_turn")
            out.append({"type": "message_delta",
                        "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                        "usage": self._usage()})  # fmt: skip
            out.append({"type": "message_stop"})
        return out

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": self.blocks, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
            "usage": self._usage(),
        }  # fmt: skip

    def error(self, e: Exception) -> dict[str, Any]:
        """A failure in the middle of a stream, as Anthropic's ``error`` event."""
        return error_body(e)

    def _usage(self) -> dict[str, Any]:
        u = self.usage
        if u is None:
            return usage_dict(self.prompt_tokens, 0, 0)
        return usage_dict(u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.cache_tier)

    def _delta(self, d: output.Delta) -> list[dict[str, Any]]:
        return self._render(self.items.steps(d))

    def _close(self) -> list[dict[str, Any]]:
        return self._render(self.items.close())

    def _render(self, steps: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for step, channel, value in steps:
            kind = BLOCK[channel]
            index = len(self.blocks) - 1
            if step == "open":
                block: dict[str, Any] = {"type": kind, kind: ""}
                if kind == "thinking":
                    block["signature"] = ""
                out.append(self._start_block(block))
            elif step == "text":
                self.blocks[-1][kind] += value
                out.append({"type": "content_block_delta", "index": index,
                            "delta": {"type": f"{kind}_delta", kind: value}})  # fmt: skip
            elif step == "close":
                out.append({"type": "content_block_stop", "index": index})
            else:  # a whole call: its block opens, takes its input and stops at once
                fn = value["function"]
                block = {"type": "tool_use", "id": value["id"], "name": fn["name"], "input": {}}
                out.append(self._start_block(block))
                block["input"] = _input(fn["arguments"])
                partial = json.dumps(block["input"], ensure_ascii=False)
                out.append({"type": "content_block_delta", "index": index + 1,
                            "delta": {"type": "input_json_delta", "partial_json": partial}})  # fmt: skip
                out.append({"type": "content_block_stop", "index": index + 1})
        return out

    def _start_block(self, block: dict[str, Any]) -> dict[str, Any]:
        self.blocks.append(block)
        return {"type": "content_block_start", "index": len(self.blocks) - 1,
                "content_block": dict(block)}  # fmt: skip


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}  # fmt: skip


def error_body(e: Exception) -> dict[str, Any]:
    """Anthropic's error object for ``e`` (an ApiError keeps its status's type and message)."""
    if isinstance(e, ApiError):
        kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": e.message}}
    return {"type": "error", "error": {"type": "api_error", "message": f"internal error: {e}"}}
