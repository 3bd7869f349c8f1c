"""OpenAI requests in, OpenAI chunks and bodies out: everything between HTTP and the engine.

No transport and no MLX: ``engine/server.py`` reads the bytes and writes SSE / JSON, the engine
thread produces typed events (``engine/events.py``). Here a request becomes prompt ids (chat
template, forced tool prefix), and each engine :class:`Chunk` becomes the OpenAI objects of its
endpoint through an :class:`Output`: the same object serves streaming (``start`` + ``feed``) and
non-streaming (``feed`` every chunk, then ``body``), so tool calls, finish reasons and usage are
decided once for both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from jinja2 import TemplateError

from engine import api, chat
from engine.api import ApiError, ChatRequest, CompletionRequest
from engine.events import Chunk, Hit, SamplingParams, Usage

log = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]


class Output(Protocol):
    """One request's OpenAI view of the engine's chunks."""

    def start(self) -> list[dict[str, Any]]: ...
    def feed(self, chunk: Chunk) -> list[dict[str, Any]]: ...
    def body(self) -> dict[str, Any]: ...


class _Base:
    obj = ""

    def __init__(self, model: str, include_usage: bool, rid: str) -> None:
        self.rid, self.created, self.model = rid, api.now(), model
        self.include_usage = include_usage
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage: Usage | None = None

    def start(self) -> list[dict[str, Any]]:
        return []

    def _usage_chunk(self) -> list[dict[str, Any]]:
        if self.usage is None or not self.include_usage:
            return []
        return [api.usage_chunk(self.rid, self.created, self.model, self.obj, self.usage)]


class CompletionOutput(_Base):
    obj = "text_completion"

    def __init__(self, model: str, include_usage: bool = False) -> None:
        super().__init__(model, include_usage, api.new_id("cmpl"))

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        self.text.append(chunk.text)
        finish = api.openai_finish(chunk.finish_reason, False)
        out = []
        if chunk.text or finish:
            out.append(api.completion_chunk(self.rid, self.created, self.model, chunk.text, finish))
        if chunk.finish_reason is not None:
            self.finish, self.usage = finish, chunk.usage
            out += self._usage_chunk()
        return out

    def body(self) -> dict[str, Any]:
        return api.completion_response(
            self.rid, self.model, "".join(self.text), self.finish, self.usage
        )


class ChatOutput(_Base):
    """Content deltas, tool calls as they close (the parser holds a call's text back), the finish
    reason ("tool_calls" when the model called one) and usage."""

    obj = "chat.completion.chunk"

    def __init__(
        self, model: str, include_usage: bool, parse_tools: bool, prefix: str, parallel: bool
    ) -> None:
        super().__init__(model, include_usage, api.new_id("chatcmpl"))
        self.parser = chat.ToolCallParser(enabled=parse_tools)
        self.parser.feed(prefix)  # a forced call's opener is held until the model closes it
        self.parallel = parallel
        self.calls: list[dict[str, Any]] = []

    def _delta(self, d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return api.chat_chunk(self.rid, self.created, self.model, d, finish)

    def _calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            if self.calls and not self.parallel:
                break  # parallel_tool_calls=false: the first call only
            out.append(self._delta({"tool_calls": [{"index": len(self.calls), **call}]}))
            self.calls.append(call)
        return out

    def start(self) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""})]

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        text, calls = self.parser.feed(chunk.text)
        out = [self._delta({"content": text})] if text else []
        out += self._calls(calls)
        if chunk.finish_reason is None:
            self.text.append(text)
            return out
        tail, more = self.parser.finish()
        self.text.append(text + tail)
        if tail:
            out.append(self._delta({"content": tail}))
        out += self._calls(more)
        self.finish = api.openai_finish(chunk.finish_reason, bool(self.calls))
        self.usage = chunk.usage
        out.append(self._delta({}, self.finish))
        return out + self._usage_chunk()

    def body(self) -> dict[str, Any]:
        return api.chat_response(
            self.rid, self.model, "".join(self.text), self.calls, self.finish, self.usage
        )


# --- requests → prompt ids ---------------------------------------------------------------------


def chat_prompt(
    tokenizer: Any, encode: Encode, req: ChatRequest, model: str
) -> tuple[list[int], ChatOutput]:
    """The chat template's prompt (plus a forced tool call's opener) as ids, and its Output."""
    tools = req.tool_dicts()
    prefix = chat.forced_prefix(req.tool_choice) if tools else ""
    try:
        text = chat.render_chat(tokenizer, req.message_dicts(), tools)
    except TemplateError as e:  # e.g. "roles must alternate": the messages, not the server
        raise ApiError(
            400, f"the model's chat template rejected the messages: {e}", param="messages"
        ) from None
    parse = bool(req.tools) and req.tool_choice != "none"
    out = ChatOutput(model, req.include_usage, parse, prefix, req.parallel_tool_calls)
    return encode(text + prefix), out


def completion_prompt(
    encode: Encode, req: CompletionRequest, model: str
) -> tuple[list[int], CompletionOutput]:
    ids = encode(req.prompt_text())
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
    return ids, CompletionOutput(model, req.include_usage)


def sampling(req: Any, prompt_tokens: int, context_length: int) -> SamplingParams:
    """The engine's sampling parameters; ``max_tokens`` clamped to what the context leaves."""
    max_tokens = api.check_length(prompt_tokens, req.requested_max(), context_length)
    return SamplingParams(max_tokens, req.temperature, req.top_p, req.seed, req.stop_tuple())


def hit_headers(first: Any) -> dict[str, str]:
    """Response headers naming the cache tier, when the lookup's result came first."""
    if not isinstance(first, Hit):
        return {}
    return {"x-tiered-kv-cache-tier": first.tier, "x-tiered-kv-cached-tokens": str(first.tokens)}


def error_chunk(e: Exception) -> dict[str, Any]:
    """A failure in the middle of a stream, as an OpenAI error object."""
    if isinstance(e, ApiError):
        return e.body()
    log.error("generation failed mid-stream: %s", e)
    return api.error_body(f"internal error: {e}", "server_error")
