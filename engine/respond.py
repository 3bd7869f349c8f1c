"""OpenAI requests in, OpenAI chunks and bodies out: everything between HTTP and the engine.

No transport and no MLX: ``engine/server.py`` reads the bytes and writes SSE / JSON, the engine
thread produces typed events (``engine/events.py``). Here a request becomes prompt ids (chat
template, forced tool prefix), and each engine :class:`Chunk` becomes the OpenAI objects of its
endpoint through an :class:`Output` (content / reasoning / tool calls parsed by ``engine/output.py``): the
same object serves streaming (``start`` + ``feed``) and
non-streaming (``feed`` every chunk, then ``body``), so tool calls, finish reasons and usage are
decided once for both.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from jinja2 import TemplateError

from engine import api, chat, openai_bodies, output, structured
from engine.api import ChatRequest, CompletionRequest
from engine.detok import TokenBytes, piece_text
from engine.errors import ApiError, error_body
from engine.events import Chunk, Hit, SamplingParams, TokenLogprob, Usage
from engine.harmony import HarmonyOutput
from engine.openai_bodies import LogprobEntry, Piece, TextOffsets
from engine.output_format import OutputFormat
from engine.tool_calls import CALL_ID_PREFIX

log = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]
CheckChars = Callable[[int, str], None]  # (characters, param): a 400 when they cannot fit


class Output(Protocol):
    """One request's API view of the engine's chunks (OpenAI's here, Anthropic's in
    ``engine/messages.py``): the streamed objects (``named_events``: each sent as an SSE event
    named by its ``type``, with no ``[DONE]`` after them), the whole body, a mid-stream error."""

    named_events: bool

    def start(self, hit: Hit | None = None) -> list[dict[str, Any]]: ...
    def feed(self, chunk: Chunk) -> list[dict[str, Any]]: ...
    def body(self) -> dict[str, Any]: ...
    def error(self, e: Exception) -> dict[str, Any]: ...


class _Logprobs:
    """A request's token log-probabilities as they come: every one listed (the body), and those
    not yet sent (the next streamed chunk). A token is listed once some of its text is shown, and
    never when none is (a ``stop`` string's tokens: the text ends before it). With a chat
    ``parser``, shown means as content (OpenAI's ``logprobs.content`` is the message content's
    tokens: reasoning, think markers and call markup are not), once the parser has settled its
    text (:meth:`settle`); for a completion, sent as its text (:meth:`release`)."""

    def __init__(self, token_bytes: TokenBytes, parser: output.OutputParser | None = None) -> None:
        self.token_bytes = token_bytes
        self.parser = parser
        self.all: list[LogprobEntry] = []
        self.pending: list[LogprobEntry] = []
        self.sent = TextOffsets()  # where the next token starts in the completion's text
        self.first = True
        # each token's characters in the text generated (for chat, in the text the parser was
        # fed, after a forced call's opener) until it is listed or known never to be
        self.base = parser.fed if parser is not None else 0
        self.offsets = TextOffsets()
        self.waiting: collections.deque[tuple[LogprobEntry, int, int]] = collections.deque()

    def add(self, lp: TokenLogprob | None) -> None:
        if lp is None:
            return
        first, self.first = self.first, False

        def piece(token: int) -> Piece:
            raw = self.token_bytes(token, first)
            return Piece(piece_text(raw), raw)

        entry = (piece(lp.token), lp.logprob, [(piece(t), v) for t, v in lp.top])
        start = self.offsets.advance(entry[0].raw)  # a part of a character: that character
        end = max(self.offsets.chars, start + 1)
        self.waiting.append((entry, self.base + start, self.base + end))

    def _list(self, entry: LogprobEntry) -> None:
        self.all.append(entry)
        self.pending.append(entry)

    def settle(self) -> None:
        """Chat: the tokens whose text the parser has settled: listed when shown as content."""
        assert self.parser is not None
        settled = self.parser.settled
        while self.waiting and self.waiting[0][2] <= settled:
            entry, start, end = self.waiting.popleft()
            if self.parser.shown.meets(start, end):
                self._list(entry)

    def release(self, chars: int, end: str | None = None, cut: bool = False) -> None:
        """A completion: the tokens of which some text is in the ``chars`` characters sent; at its
        ``end`` (a finish reason) the rest too, unless a stop string ``cut`` the text before them."""
        while self.waiting and (self.waiting[0][1] < chars or (end is not None and not cut)):
            self._list(self.waiting.popleft()[0])
        if end is not None:
            self.waiting.clear()

    def attach(self, chunks: list[dict[str, Any]], shape: Callable[..., dict[str, Any]]) -> None:
        """The pending entries onto the first of ``chunks`` that has a choice."""
        for c in chunks:
            if self.pending and c["choices"]:
                c["choices"][0]["logprobs"] = shape(self.pending)
                self.pending = []
                return


class _Base:
    obj = ""
    named_events = False

    def __init__(
        self, model: str, include_usage: bool, rid: str, token_bytes: TokenBytes | None
    ) -> None:
        self.rid, self.created, self.model = rid, openai_bodies.now(), model
        self.include_usage = include_usage
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.logprobs = None if token_bytes is None else _Logprobs(token_bytes)

    def start(self, hit: Hit | None = None) -> list[dict[str, Any]]:
        return []

    def error(self, e: Exception) -> dict[str, Any]:
        return error_chunk(e)

    def _usage_chunk(self) -> list[dict[str, Any]]:
        if self.usage is None or not self.include_usage:
            return []
        return [openai_bodies.usage_chunk(self.rid, self.created, self.model, self.obj, self.usage)]


class CompletionOutput(_Base):
    obj = "text_completion"

    def __init__(
        self, model: str, include_usage: bool = False, token_bytes: TokenBytes | None = None
    ) -> None:
        super().__init__(model, include_usage, openai_bodies.new_id("cmpl-"), token_bytes)
        self.chars = 0  # of the text sent

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        self.text.append(chunk.text)
        self.chars += len(chunk.text)
        finish = openai_bodies.openai_finish(chunk.finish_reason, False)
        out = []
        if chunk.text or finish:
            out.append(openai_bodies.completion_chunk(self.rid, self.created, self.model,
                                                      chunk.text, finish))  # fmt: skip
        if self.logprobs is not None:
            lp = self.logprobs
            lp.add(chunk.logprob)
            lp.release(self.chars, chunk.finish_reason, chunk.stop_sequence is not None)
            lp.attach(out, lambda entries: openai_bodies.completion_logprobs(entries, lp.sent))
        if chunk.finish_reason is not None:
            self.finish, self.usage = finish, chunk.usage
            out += self._usage_chunk()
        return out

    def body(self) -> dict[str, Any]:
        body = openai_bodies.completion_response(
            self.rid, self.model, "".join(self.text), self.finish, self.usage
        )
        if self.logprobs is not None:
            body["choices"][0]["logprobs"] = openai_bodies.completion_logprobs(
                self.logprobs.all, TextOffsets()
            )
        return body


class ChatOutput(_Base):
    """The chat view: content, reasoning and tool calls split by ``engine/output.py``'s parser for
    the model's format, the finish reason ("tool_calls" when the model called one) and usage."""

    obj = "chat.completion.chunk"

    def __init__(
        self,
        model: str,
        include_usage: bool,
        parser: output.OutputParser,
        token_bytes: TokenBytes | None = None,
    ) -> None:
        super().__init__(model, include_usage, openai_bodies.new_id("chatcmpl-"), None)
        self.parser = parser
        self.logprobs = None if token_bytes is None else _Logprobs(token_bytes, parser)

    def _delta(self, d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return openai_bodies.chat_chunk(self.rid, self.created, self.model, d, finish)

    def start(self, hit: Hit | None = None) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""})]

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        out = [self._delta(d) for d in self.parser.feed(chunk.text).sse_deltas()]
        if self.logprobs is not None:
            self.logprobs.add(chunk.logprob)
        if chunk.finish_reason is not None:
            tail, self.finish = self.parser.finish(
                chunk.finish_reason, chunk.stop_sequence is not None
            )
            out += [self._delta(d) for d in tail.sse_deltas()]
            self.usage = chunk.usage
            out.append(self._delta({}, self.finish))
        if self.logprobs is not None:  # with the next chunk sent (text may be held back)
            self.logprobs.settle()
            self.logprobs.attach(out, openai_bodies.chat_logprobs)
        return out + (self._usage_chunk() if chunk.finish_reason is not None else [])

    def body(self) -> dict[str, Any]:
        res = self.parser.result
        calls = [{k: v for k, v in c.items() if k != "index"} for c in res.tool_calls]
        body = openai_bodies.chat_response(
            self.rid, self.model, res.content, calls, self.finish, self.usage, res.reasoning
        )
        if self.logprobs is not None:
            body["choices"][0]["logprobs"] = openai_bodies.chat_logprobs(self.logprobs.all)
        return body


# --- requests → prompt ids ---------------------------------------------------------------------


def chat_prompt(
    tokenizer: Any,
    encode: Encode,
    req: ChatRequest,
    model: str,
    check_chars: CheckChars,
    template_defaults: dict[str, Any] | None = None,
    call_id_prefix: str = CALL_ID_PREFIX,
) -> tuple[list[int], ChatOutput]:
    """The chat template's prompt (plus a forced tool call's opener) as ids, and its Output (the
    output formats come from the model's tokenizer). ``template_defaults``: the server's extra
    template variables (a request's own override them); ``call_id_prefix``: what the ids made for
    the output's calls begin with (the API's own: ``messages.CALL_ID_PREFIX`` for Anthropic's)."""
    req.check_tool_choice()
    tools = req.tool_dicts()
    fmt = OutputFormat.of(tokenizer)
    parse = bool(tools) and req.tool_choice != "none"
    history = req.history_calls()
    prefix = fmt.forced_prefix(req.tool_choice, len(history)) if parse else ""
    extra = req.template_args(template_defaults or {})
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise ApiError(400, "continue_final_message continues the last message, which must be the "
                       "assistant's", param="continue_final_message")  # fmt: skip
    text = _render(tokenizer, req, tools, extra)
    continued = chat.content_text(req.messages[-1].content) if req.continue_final_message else ""
    reasoning = fmt.opens_reasoning(text, continued) and not prefix
    ids = {str(c["id"]) for c in history if c.get("id")}
    parser = output_parser(fmt, tools, parse, req.parallel_tool_calls, reasoning, ids, call_id_prefix)
    parser.feed(prefix)  # a forced call's opener is held until the model closes the call
    check_chars(len(text) + len(prefix), "messages")
    texts = TokenBytes(tokenizer, not continues(req)) if req.logprob_count() >= 0 else None
    return encode(text + prefix), ChatOutput(model, req.include_usage, parser, texts)


def output_parser(
    fmt: OutputFormat,
    tools: list[dict[str, Any]] | None = None,
    parse_tools: bool = True,
    parallel_tool_calls: bool = True,
    start_in_reasoning: bool = False,
    taken_ids: set[str] | None = None,
    call_id_prefix: str = CALL_ID_PREFIX,
) -> output.OutputParser:
    """The parser of an output in ``fmt``: gpt-oss's harmony messages, or markers and blocks."""
    if fmt.harmony:
        return HarmonyOutput(fmt, tools, parse_tools, parallel_tool_calls, taken_ids, call_id_prefix)
    return output.ChatOutput(fmt, tools, parse_tools, parallel_tool_calls, start_in_reasoning,
                             taken_ids, call_id_prefix)  # fmt: skip


def _render(
    tokenizer: Any, req: ChatRequest, tools: list[dict[str, Any]] | None, extra: dict[str, Any]
) -> str:
    """The chat template's text of ``req``; a 400 when the template refuses it: it raised ("roles
    must alternate": the messages), or failed on a value it cannot use (a tool schema's
    ``properties`` that is no mapping; a value of the request's own template arguments). What
    fails around the template (a model without one, a defect of ours) is no 400."""
    try:
        return chat.render_chat(tokenizer, req.message_dicts(), tools, extra,
                                req.continue_final_message)  # fmt: skip
    except TemplateError as e:
        raise ApiError(
            400, f"the model's chat template rejected the messages: {e}", param="messages"
        ) from None
    except chat.TemplateRefused as e:
        own = bool(req.chat_template_kwargs or req.reasoning_effort)
        param = "chat_template_kwargs" if own else "messages"
        what = "messages, tools or chat_template_kwargs" if own else "messages or tools"
        raise ApiError(400, f"the model's chat template cannot render these {what}: {e}",
                       param=param, code="invalid_value") from None  # fmt: skip


def completion_prompt(
    encode: Encode,
    req: CompletionRequest,
    model: str,
    check_chars: CheckChars,
    tokenizer: Any = None,
    vocab_size: int | None = None,
) -> tuple[list[int], CompletionOutput]:
    """The prompt's ids — encoded from its text, or as sent (each below ``vocab_size``, else a
    400) — and its Output (``tokenizer``: to name tokens in ``logprobs``)."""
    ids = req.prompt_ids()
    if ids is None:
        check_chars(len(req.prompt_text()), "prompt")
        ids = encode(req.prompt_text())
    elif vocab_size is not None and (top := max(ids)) >= vocab_size:
        raise ApiError(400, f"prompt: token id {top} is outside the model's vocabulary "
                       f"({vocab_size} ids)", param="prompt", code="invalid_value")  # fmt: skip
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
    texts = (TokenBytes(tokenizer, not continues(req))
             if tokenizer is not None and req.logprob_count() >= 0 else None)  # fmt: skip
    return ids, CompletionOutput(model, req.include_usage, texts)


def continues(req: Any) -> bool:
    """Whether the generated text continues the prompt's text (a completion, or a continued
    assistant message) rather than starting a turn of its own."""
    return isinstance(req, CompletionRequest) or bool(getattr(req, "continue_final_message", False))


def sampling(
    req: Any,
    ids: list[int],
    context_length: int,
    vocab_size: int,
    default_max: int = 0,
    xtc_keep: tuple[int, ...] = (),
    grammar: str = "",
) -> SamplingParams:
    """The engine's sampling parameters; ``max_tokens`` (the server's ``default_max`` where the
    request names none; 0: no bound of its own) clamped to what the context leaves; a ``top_k``
    of the whole vocabulary is off (it keeps every token); a penalty's context size is at most
    the context (mlx-lm slices the last tokens with a 32-bit index: 3e9 was a 500 of every
    request in its decode step); ``xtc_keep``: the model's tokens XTC never cuts."""
    max_tokens = api.check_length(len(ids), req.requested_max(), context_length, default_max,
                                  req.prompt_param)  # fmt: skip
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=req.stop_tuple(),
        # mlx-lm's top-k raises for k >= the vocabulary inside a function compiled over MLX's
        # global random state, which then failed every later sampled request of the server
        top_k=req.top_k if req.top_k < vocab_size else 0,
        min_p=req.min_p,
        xtc_probability=req.xtc_probability,
        xtc_threshold=req.xtc_threshold,
        xtc_keep=xtc_keep,
        repetition_penalty=req.repetition_penalty,
        repetition_context_size=min(req.repetition_context_size, context_length),
        presence_penalty=req.presence_penalty,
        presence_context_size=min(req.presence_context_size, context_length),
        frequency_penalty=req.frequency_penalty,
        frequency_context_size=min(req.frequency_context_size, context_length),
        logit_bias=req.bias(vocab_size),
        logprobs=req.logprob_count(),
        after=ids[-1] if continues(req) and ids else None,
        grammar=grammar,
    )


def grammar_of(req: Any, out: Any) -> str:
    """The grammar ``req``'s output must follow ("" for free text): its JSON Schema, after the
    model's think block where its format has one (``out.parser``: the chat output's parser, which
    knows the format and whether the prompt opened the block). A call that ``tool_choice`` forces
    is the whole answer: the format is not enforced then (the prompt already opened the call); the
    call is one of the tools' (``required``) or the named function's, its arguments the tool's
    ``parameters`` as a JSON Schema, where the format writes them as one JSON object or as tags
    (:func:`call_grammar`)."""
    if not isinstance(req, ChatRequest):
        return ""
    parser = getattr(out, "parser", None)
    if req.forces_call():
        return call_grammar(req, parser.fmt) if parser is not None else ""
    schema = req.output_schema()
    if not schema:
        return ""
    if parser is None:
        return structured.lark(schema)
    fmt = parser.fmt
    return structured.lark(schema, fmt.think, parser.starts_in_reasoning, fmt.harmony, fmt.marker_tokens)


def call_grammar(req: ChatRequest, fmt: OutputFormat) -> str:
    """The grammar of the call ``req``'s ``tool_choice`` forces: a call to the function it names,
    or, ``required``, to one of the tools (its name, in the format's syntax); its arguments the
    tool's ``parameters`` as a JSON Schema (one JSON object, or one by one where the format writes
    them so — tags, Python keywords: :meth:`OutputFormat.arg_layout`), then the format's end of the
    call. "" where the format's arguments are neither: the call is free then. A schema llguidance
    cannot compile, or with a name the format cannot write, leaves a named call's arguments free;
    ``required`` gives that tool any JSON object (where arguments are written one by one: none).
    ``required`` with ``parallel_tool_calls`` (OpenAI's default): one call or more, each to one of
    the tools, where the format writes several (:meth:`OutputFormat.next_call`; a named function
    is called once)."""
    close, forced = fmt.named_close(), req.forced_tool()
    if close is None or not req.forces_call():
        return ""
    calls_before = len(req.history_calls())
    calls, names = [], []
    for tool in req.tool_dicts() or ():
        name = str(tool.get("function", {}).get("name", ""))
        head = fmt.named_rest(name, calls_before) if forced is not None else fmt.call_head(name, calls_before)
        if (forced is not None and name != forced) or head is None:
            continue
        params = tool["function"].get("parameters")
        schema = json.dumps(params, separators=(",", ":")) if isinstance(params, dict) else structured.ANY_OBJECT
        try:
            structured.check_args(schema, fmt.arg_layout())
        except structured.FormatError as e:
            log.info("tool %r's parameters not enforced: %s", name, e)
            if forced is not None:
                return ""
            schema = structured.ANY_OBJECT
        calls.append((head, schema))
        names.append(name)
    if not calls:
        return ""
    again = None
    if forced is None and req.parallel_tool_calls and fmt.next_call(names[0], calls_before + 1) is not None:
        numbered = fmt.next_call(names[0], calls_before + 1) != fmt.next_call(names[0], calls_before + 2)
        again = [[str(fmt.next_call(name, calls_before + k)) for name in names]
                 for k in range(1, MAX_FORCED_CALLS if numbered else 2)]  # fmt: skip
    return structured.call_lark(calls, close, fmt.marker_tokens, fmt.arg_layout(), again)


#: calls a ``required`` turn may make where the format numbers them (Kimi-K2's ids: a grammar level
#: each); elsewhere any number
MAX_FORCED_CALLS = 16


#: the response headers naming a request's cache hit (:func:`hit_headers`)
HIT_HEADERS = ("x-tiered-kv-cache-tier", "x-tiered-kv-cached-tokens")


def hit_headers(first: Any) -> dict[str, str]:
    """Response headers naming the cache tier, when the lookup's result came first."""
    if not isinstance(first, Hit):
        return {}
    return dict(zip(HIT_HEADERS, (first.tier, str(first.tokens)), strict=True))


def error_chunk(e: Exception) -> dict[str, Any]:
    """A failure in the middle of a stream, as an OpenAI error object."""
    if isinstance(e, ApiError):
        return e.body()
    log.error("generation failed mid-stream: %s", e)
    return error_body(f"internal error: {e}", "server_error")
