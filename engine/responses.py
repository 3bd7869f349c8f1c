"""OpenAI Responses requests in, Responses events and bodies out (``POST /v1/responses``).

OpenAI's Codex CLI speaks only this API to a custom provider (``wire_api = "responses"``; "chat" is
refused since 2025): ``instructions`` beside typed ``input`` items (``message`` with ``input_text``
parts, ``function_call``, ``function_call_output``, ``reasoning``), flat function tools (Codex's
``namespace`` tools hold more of them), and a stream of named, numbered events (``response.created``,
``response.output_item.added`` / ``.done``, ``response.output_text.delta``,
``response.function_call_arguments.done``, ``response.completed``). A request becomes the chat
request the rest of the server serves (:func:`to_chat`: the same template, tool-call parsers,
sampling and cache) and the chat output parser's deltas become output items
(:class:`ResponsesOutput`). No transport and no MLX. Nothing is stored: ``previous_response_id`` is
refused (a client sends the whole input, as Codex does with ``store: false``); hosted tools
(``web_search``, ``file_search``, …) are dropped from the tool list, as the server cannot run them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from engine import api, output
from engine.api import ChatRequest
from engine.errors import ApiError, error_body, invalid
from engine.events import Chunk, Hit, Usage
from engine.items import Items
from engine.openai_bodies import new_id, now

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_OWN_TURN = ("message", "function_call_output")  # input item types each a chat message
_TOKENS = (*_OWN_TURN, "function_call")  # and each a token at least (a call: a tool call)
ITEM = {"reasoning": "reasoning", "content": "message"}  # items.Items channel → output item type


class ResponsesRequest(api.RequestBody):
    prompt_param: ClassVar[str] = "input"
    sizes: ClassVar[dict[str, int]] = {"tools": api.MAX_TOOLS}
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    #: ``{"format": {"type": "json_schema", "name": ..., "schema": {...}}}`` (or ``json_object``,
    #: ``text``): structured output, as chat's ``response_format``
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("previous_response_id is not supported (nothing is stored): send the whole input")
        return v

    @classmethod
    def turns(cls, data: dict[str, Any]) -> int:
        """Input items that render a token at least (:func:`to_chat`): a message, a
        function_call_output (each a chat message of its own), a function_call (a tool call, of
        the turn before it); a reasoning item joins the turn after."""
        return sum(isinstance(x, dict) and x.get("type", "message") in _TOKENS
                   for x in api.listed(data, "input"))  # fmt: skip

    @classmethod
    def entries(cls, field: str, value: list[Any] | dict[str, Any]) -> int:
        """``tools`` counts as :func:`_tools` flattens them: a namespace its tools (each a chat
        tool), any other tool one. A namespace counted as one entry let a request past
        ``api.MAX_TOOLS`` have its tools walked and flattened before the chat request refused them."""
        if field != "tools" or not isinstance(value, list):
            return super().entries(field, value)
        n, lists = 0, [value]
        while lists:
            for t in lists.pop():
                if isinstance(t, dict) and t.get("type") == "namespace":
                    lists.append(_listed(t.get("tools")))
                else:
                    n += 1
        return n


class ResponsesChat(ChatRequest):
    """The chat request a Responses body asks for, with the Codex tool namespace of each function
    that one holds (a call of such a function names its namespace)."""

    prompt_param: ClassVar[str] = "input"
    namespaces: dict[str, str] = {}
    instructions: str | None = None  # echoed in the response, as OpenAI's
    text_format: dict[str, Any] | None = None  # the request's ``text.format``, echoed too


def parse(raw: bytes, context_length: int | None = None) -> ResponsesChat:
    """A Responses body as the chat request it asks for. Raises ApiError (400 / 413 as for chat;
    more turns than ``context_length``: ``api.check_turns``)."""
    return to_chat(api.parse_body(raw, ResponsesRequest, context_length), context_length)


def to_chat(req: ResponsesRequest, context_length: int | None = None) -> ResponsesChat:
    """The chat request of ``req``: ``instructions`` as the system message, then the input items in
    order (a ``function_call`` joins the assistant turn before it, a ``reasoning`` item becomes the
    next assistant turn's ``reasoning_content``, a ``function_call_output`` a tool message)."""
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid('a message needs "role": "user", "system", "developer" or "assistant"', where)
            msgs.append({"role": role, "content": _text(item.get("content"), where + ".content")})
            if role == "assistant" and reasoning:
                msgs[-1]["reasoning_content"], reasoning = "\n\n".join(reasoning), []
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise invalid('a function_call needs a "name" and "arguments" (a JSON string)', where)
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}  # fmt: skip
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                msgs.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = "\n\n".join(reasoning), []
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": _text(item.get("output"), where + ".output")})  # fmt: skip
        elif kind == "reasoning":
            text = _text(item.get("content") or item.get("summary") or [], where)
            if text:
                reasoning.append(text)
        else:
            raise invalid(f"input items of type {kind!r} are not supported", where + ".type")
    if not items:
        raise invalid("input is empty", "input")
    body: dict[str, Any] = {
        "messages": msgs,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    tools = _tools(req.tools or [])
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = _choice(req.tool_choice)
    effort = (req.reasoning or {}).get("effort")
    if isinstance(effort, str):  # gpt-oss's template reads reasoning_effort
        body["reasoning_effort"] = effort
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        body["response_format"] = response_format(fmt)
        body["text_format"] = fmt
    body["namespaces"] = namespaces(req.tools)
    body["instructions"] = req.instructions
    chat: ResponsesChat = api.validate(body, ResponsesChat, context_length)
    return chat


def response_format(fmt: Any) -> Any:
    """The chat ``response_format`` of a Responses ``text.format`` (whose ``json_schema`` holds
    its ``name`` and ``schema`` flat); what is not one is handed on as sent, to be refused there."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return fmt


def namespaces(tools: list[dict[str, Any]] | None) -> dict[str, str]:
    """Function name → the Codex tool namespace that holds it."""
    out = {}
    for t in tools or []:
        if isinstance(t, dict) and t.get("type") == "namespace" and isinstance(t.get("name"), str):
            for inner in _listed(t.get("tools")):
                if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                    out[inner["name"]] = t["name"]
    return out


def _tools(tools: list[Any], where: str = "tools") -> list[dict[str, Any]]:
    """Function tools (a namespace's flattened) in chat form; hosted tools dropped. ``where``: the
    path of ``tools`` in the body (a namespace's tool is named by its own: ``tools.3.tools.0``)."""
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            continue
        if t.get("type") == "namespace":
            out += _tools(_listed(t.get("tools")), f"{where}.{i}.tools")
        elif t.get("type") == "function":
            if not isinstance(t.get("name"), str):
                raise invalid('a function tool needs a "name"', f"{where}.{i}")
            if not isinstance(t.get("parameters") or {}, dict):  # else named by its chat form's path
                raise invalid("a function tool's parameters are a JSON Schema object", f"{where}.{i}.parameters")
            out.append(api.function_tool(t["name"], t.get("parameters"), t.get("description")))
    return out


def _listed(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _choice(c: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(c, str):
        return c  # auto / none / required, checked by the chat request
    if c.get("type") == "function" and isinstance(c.get("name"), str):
        return {"type": "function", "function": {"name": c["name"]}}
    raise invalid('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
           "tool_choice")  # fmt: skip


def _text(content: Any, param: str) -> str:
    """Text of a string or a list of text parts; images and files are a 400."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of parts", param)
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in (*_TEXT_PARTS, "refusal"):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise invalid(f"content parts of type {kind!r} are not supported: the model reads text",
                   f"{param}.{j}")  # fmt: skip
        value = p.get("refusal") if p.get("type") == "refusal" else p.get("text")
        if not isinstance(value, str):
            raise invalid("a text part needs its text", f"{param}.{j}")
        parts.append(value)
    return "".join(parts)


# --- output -------------------------------------------------------------------------------------


def usage_dict(u: Usage | None, prompt_tokens: int) -> dict[str, Any]:
    prompt, cached = (u.prompt_tokens, u.cached_tokens) if u is not None else (prompt_tokens, 0)
    out = u.completion_tokens if u is not None else 0
    # cache_write_tokens 0: every prompt is cached, none written on request (as Anthropic's
    # cache_creation_input_tokens, engine/messages.py)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + out, "cache_tier": u.cache_tier if u is not None else "none"}  # fmt: skip


class ResponsesOutput:
    """One request's Responses view of the engine's chunks: streamed (``start`` + ``feed``: named,
    numbered events) or whole (``feed`` every chunk, then ``body``), from the chat output parser."""

    named_events = True

    def __init__(self, model: str, parser: output.OutputParser, prompt_tokens: int, chat: ResponsesChat) -> None:
        self.id, self.created, self.model = new_id("resp_"), now(), model
        self.parser, self.prompt_tokens = parser, prompt_tokens
        self.namespaces = chat.namespaces
        self.echo = {"parallel_tool_calls": chat.parallel_tool_calls, "temperature": chat.temperature,
                     "top_p": chat.top_p, "tool_choice": _echo_choice(chat.tool_choice),
                     "tools": [{"type": "function", **t["function"]} for t in chat.tool_dicts() or []],
                     "max_output_tokens": chat.requested_max(),
                     "instructions": chat.instructions,
                     "text": {"format": chat.text_format or {"type": "text"}}}  # fmt: skip
        self.output: list[dict[str, Any]] = []
        self.items = Items()
        self.status = "in_progress"
        self.usage: Usage | None = None
        self.incomplete: dict[str, Any] | None = None
        self.closing = "completed"  # the status of an item the end of the output closes
        self.seq = 0

    def response(self) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "model": self.model, "output": self.output, "error": None,
                "incomplete_details": self.incomplete, "metadata": {},
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": usage_dict(self.usage, self.prompt_tokens) if self.status != "in_progress" else None,
                **self.echo}  # fmt: skip

    def start(self, hit: Hit | None = None) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]  # fmt: skip

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        out = self._render(self.items.steps(self.parser.feed(chunk.text)))
        if chunk.finish_reason is not None:
            tail, _ = self.parser.finish(chunk.finish_reason, chunk.stop_sequence is not None)
            out += self._render(self.items.steps(tail))
            if chunk.finish_reason == "length":  # the item cut short is incomplete, as OpenAI's
                self.closing = "incomplete"
            out += self._render(self.items.close())
            self.usage = chunk.usage
            if chunk.finish_reason == "length":
                self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
                out.append(self._event("response.incomplete", response=self.response()))
            else:
                self.status = "completed"
                out.append(self._event("response.completed", response=self.response()))
        return out

    def body(self) -> dict[str, Any]:
        return self.response()

    def error(self, e: Exception) -> dict[str, Any]:
        """A failure in the middle of a stream, as the Responses ``error`` event."""
        body = e.body()["error"] if isinstance(e, ApiError) else error_body(
            f"internal error: {e}", "server_error")["error"]  # fmt: skip
        return self._event("error", code=body["code"] or body["type"], message=body["message"],
                           param=body["param"])  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _render(self, steps: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for step, channel, value in steps:
            index = len(self.output) - 1
            if step == "open":
                out += self._open(ITEM[channel])
            elif step == "text":
                item = self.output[-1]
                item["content"][0]["text"] += value
                kind = "response.output_text.delta" if channel == "content" else "response.reasoning_text.delta"
                extra: dict[str, Any] = {"logprobs": []} if channel == "content" else {}
                out.append(self._event(kind, item_id=item["id"], output_index=index, content_index=0,
                                       delta=value, **extra))  # fmt: skip
            elif step == "close":
                out += self._done(self.output[-1], index)
            else:
                out += self._call(value)
        return out

    def _open(self, kind: str) -> list[dict[str, Any]]:
        item: dict[str, Any]
        part: dict[str, Any]
        if kind == "message":
            item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": []}  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        index = len(self.output) - 1
        out = [self._event("response.output_item.added", output_index=index, item=_copy(item))]
        item["content"].append(part)  # (a reasoning item's reasoning_text part as a message's part)
        out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part=dict(part)))  # fmt: skip
        return out

    def _done(self, item: dict[str, Any], index: int) -> list[dict[str, Any]]:
        part = item["content"][0]
        item["status"] = self.closing
        if item["type"] == "message":
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"], logprobs=[])]  # fmt: skip
        else:
            out = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"])]  # fmt: skip
        out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=dict(part)))  # fmt: skip
        return out + [self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call["function"]
        item: dict[str, Any] = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                                "call_id": call["id"], "name": fn["name"], "arguments": ""}  # fmt: skip
        if fn["name"] in self.namespaces:
            item["namespace"] = self.namespaces[fn["name"]]
        self.output.append(item)
        index = len(self.output) - 1
        out = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        item["arguments"] = fn["arguments"]
        out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=index, delta=fn["arguments"]))  # fmt: skip
        out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, name=fn["name"], arguments=fn["arguments"]))  # fmt: skip
        item["status"] = "completed"
        return out + [self._event("response.output_item.done", output_index=index, item=dict(item))]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item["content"]]}


def _echo_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice or "auto"
