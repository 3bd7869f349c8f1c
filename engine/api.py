"""OpenAI-compatible request schemas, parsing and validation (no transport, no MLX).

A body becomes a validated request model or an :class:`engine.errors.ApiError` (400) naming the
offending field. Request models accept (and ignore) unknown fields, as agent clients send many
provider-specific extras. The response objects are built in ``engine/openai_bodies.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine import chat, structured
from engine.errors import ApiError, invalid

ROLES = ("system", "developer", "user", "assistant", "tool")
#: deepest JSON nesting a request may have (OpenAI bodies need < 20; tool schemas a few more)
MAX_JSON_DEPTH = 64
#: a seed is any 64-bit integer, signed (OpenAI's range: int64) or unsigned (what mx.random.key
#: takes); it is taken modulo 2**64, so -1 is 2**64 - 1
SEED_MIN, SEED_LIMIT = -(2**63), 2**64
#: JSON values (objects, arrays, strings, numbers, …: the entries of every object and array) a
#: request may hold. A 1M-token agent conversation of short turns is ~200k (test_api builds one);
#: 60k arrays nested 62 deep (7.5 MB) were 3.7M, walked and validated for 3.7 s to a 200
MAX_JSON_VALUES = 1_000_000
#: tools one request may list. OpenAI refuses more than 128 ("array too long ... maximum length
#: 128", code array_above_max_length); Claude Code with MCP servers sends more than that, so 4x
#: OpenAI's. 200k tools took 4 s to validate and render before the prompt's length refused them
MAX_TOOLS = 512
#: logit_bias entries one request may have. OpenAI documents none (ids to -100..100); a client
#: bans or favours a word list's tokens, tens to hundreds. 1M took 1.6 s to validate
MAX_LOGIT_BIAS = 1024
_SURROGATE = re.compile("[\ud800-\udfff]")  # "\ud800" in JSON: valid JSON, not valid text
# pydantic puts union member types into error locations ("content.str"); a param names fields only
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|function-.*|literal\[.*)$")


def function_tool(name: str, parameters: Any, description: Any) -> dict[str, Any]:
    """A chat request's function tool (the other APIs' tools are converted to it); a missing
    schema is an empty object's, a description that is no string is left out."""
    fn = {"name": name, "parameters": parameters or {"type": "object"}}
    if isinstance(description, str):
        fn["description"] = description
    return {"type": "function", "function": fn}


class RequestBody(BaseModel):
    """A request body of any endpoint (OpenAI's here; ``engine/messages.py``, ``engine/responses.py``):
    unknown fields are ignored, as agent clients send many provider-specific extras."""

    model_config = ConfigDict(extra="ignore", strict=False)
    #: the body field that holds the prompt (named by a context_length_exceeded error)
    prompt_param: ClassVar[str] = "messages"
    #: the most entries each top-level array or object field may have (:func:`check_sizes`)
    sizes: ClassVar[dict[str, int]] = {}

    @classmethod
    def turns(cls, data: dict[str, Any]) -> int:
        """How many chat messages and tool calls ``data`` (this model's JSON, not yet validated)
        renders at least: each takes a token, so :func:`check_turns` refuses more than the context has before
        validating any of them. 0: a body without turns to count."""
        return 0

    @classmethod
    def entries(cls, field: str, value: list[Any] | dict[str, Any]) -> int:
        """How many entries ``value`` (this model's JSON ``field``, not yet validated) counts
        against ``sizes`` (:func:`check_sizes`): its length, unless its entries hold more that the
        request makes entries of its own (a Responses ``namespace``'s tools)."""
        return len(value)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """A field sent as ``null`` is a field not sent: its default. OpenAI's fields are nullable
        (``"temperature": null``, ``"n": null``, ``"stream": null``), and clients built on typed
        SDKs or proxies send every unset field so; they were 400s."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class ToolFunction(RequestBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(RequestBody):
    type: Literal["function"] = "function"
    function: ToolFunction


class StreamOptions(RequestBody):
    include_usage: bool = False


class Message(RequestBody):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, as clients send it back
    reasoning: str | None = None  # the same, as mlx_lm.server names it

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: str | list[dict[str, Any]] | None) -> Any:
        """Parts of text only (an image, audio or file was dropped without a word: the model
        answered as if it had seen it); the other endpoints refuse them so too."""
        for part in v if isinstance(v, list) else ():
            kind = part.get("type")
            if kind not in chat.TEXT_PARTS:
                raise ValueError(f"content parts of type {str(kind)[:40]!r} are not supported: "
                                 "the model reads text")  # fmt: skip
            if not isinstance(part.get("refusal" if kind == "refusal" else "text"), str):
                raise ValueError("a text part needs its text as a string")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for call in v or ():
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError('each tool call needs "function": {"name": ..., "arguments": ...}')
            if not isinstance(fn.get("arguments", ""), (str, dict)):
                raise ValueError("tool call arguments must be a JSON string or an object")
        return v


def listed(data: dict[str, Any], field: str) -> list[Any]:
    """``data[field]`` where it is a list, else empty (pydantic names it if it is wrong)."""
    v = data.get(field)
    return v if isinstance(v, list) else []


class _Sampling(RequestBody):
    sizes: ClassVar[dict[str, int]] = {"logit_bias": MAX_LOGIT_BIAS}
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # mlx-lm's filters and logits processors, named and bounded as mlx_lm.server / OpenAI do
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=0.5)  # mlx-lm's apply_xtc's bound
    repetition_penalty: float = Field(default=0.0, ge=0.0)
    repetition_context_size: int = Field(default=20, ge=1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_context_size: int = Field(default=20, ge=1)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_context_size: int = Field(default=20, ge=1)
    logit_bias: dict[str, float] | None = None

    @field_validator("seed")
    @classmethod
    def _unsigned_seed(cls, v: int | None) -> int | None:
        """The seed as the unsigned 64-bit key MLX takes: a negative one (OpenAI's seeds are
        signed; they were a 400) wraps modulo 2**64, so the same seed still gives the same draw."""
        return None if v is None else v % SEED_LIMIT

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be a positive integer")
        return v

    @field_validator("stream_options")
    @classmethod
    def _streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        """As OpenAI's: a usage chunk asked of a response that is not streamed is a 400, not
        ignored (``stream`` is declared first, so it is validated by now)."""
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("n", "best_of", check_fields=False)  # best_of: the completions' field
    @classmethod
    def _one(cls, v: int, info: ValidationInfo) -> int:
        if v != 1:
            raise ValueError(f"only {info.field_name}=1 is supported")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, x in (v or {}).items():
            if not (k.isascii() and k.isdigit()):
                raise ValueError(f"logit_bias keys are token ids (got {k[:32]!r})")
            if not -100.0 <= x <= 100.0:
                raise ValueError("logit_bias values must be between -100 and 100")
        return v

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; a 400 naming an id the model does not have."""
        pairs = tuple((int(k), float(x)) for k, x in (self.logit_bias or {}).items())
        for tok, _ in pairs:
            if tok >= vocab_size:
                raise ApiError(400, f"logit_bias: token id {tok} is not below the model's "
                               f"vocabulary size {vocab_size}", param="logit_bias",
                               code="invalid_value")  # fmt: skip
        return pairs

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return tuple(s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    sizes: ClassVar[dict[str, int]] = {**_Sampling.sizes, "tools": MAX_TOOLS}
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    #: extra chat-template variables (mlx_lm.server's field): ``{"enable_thinking": false}``
    chat_template_kwargs: dict[str, Any] | None = None
    #: OpenAI's reasoning effort, handed to the template as ``reasoning_effort`` (gpt-oss reads it)
    reasoning_effort: str | None = Field(default=None, max_length=32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    #: continue the last message, the assistant's, rather than start a new turn (vLLM's field;
    #: Anthropic's Messages API does so whenever the last message is the assistant's)
    continue_final_message: bool = False
    #: OpenAI's structured output (``{"type": "json_object"}``, ``{"type": "json_schema", ...}``),
    #: enforced while sampling (``engine/structured.py``)
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        structured.schema_of(v)  # a FormatError (a ValueError): a 400 naming the field
        return v

    def output_schema(self) -> str:
        """The JSON Schema the output must match, as compact JSON; "" for free text."""
        return structured.schema_of(self.response_format, checked=True)  # by _format

    @classmethod
    def turns(cls, data: dict[str, Any]) -> int:
        """Messages and their tool calls: a call renders a token at least too (400k calls in one
        message took 4.9 s to validate and render before the prompt's length refused them)."""
        msgs = listed(data, "messages")
        return len(msgs) + sum(len(listed(m, "tool_calls")) for m in msgs if isinstance(m, dict))

    def logprob_count(self) -> int:
        """-1: no log-probabilities; else how many alternatives each token lists."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                               code="invalid_value")  # fmt: skip
            return -1
        return self.top_logprobs or 0

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_args(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else chat.template_args(v)

    def template_args(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The template's extra variables: the server's ``defaults``, then ``reasoning_effort``,
        then ``chat_template_kwargs``."""
        out = dict(defaults)
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        out.update(self.chat_template_kwargs or {})
        return out

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive2(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("max_completion_tokens must be a positive integer")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("auto", "none", "required"):
            raise ValueError('tool_choice must be "auto", "none", "required" or a named function')
        fn = v.get("function") if isinstance(v, dict) else None
        if isinstance(v, dict) and not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise ValueError(
                'a named tool_choice needs {"type": "function", "function": {"name": ...}}'
            )
        return v

    def requested_max(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def history_calls(self) -> list[dict[str, Any]]:
        """The calls the conversation's messages hold, in order (Kimi numbers a new call's id by
        their count: the forced prefix and the forced call's grammar count the same ones)."""
        return [c for m in self.messages for c in m.tool_calls or ()]

    def forces_call(self) -> bool:
        """Whether ``tool_choice`` forces a call: ``required``, or a named function."""
        return bool(self.tools) and self.tool_choice not in (None, "auto", "none")

    def forced_tool(self) -> str | None:
        """The function name of a named ``tool_choice``."""
        if isinstance(self.tool_choice, dict):
            return str(self.tool_choice["function"]["name"])
        return None

    def check_tool_choice(self) -> None:
        """A 400 naming ``tool_choice`` when no tool can answer it, as OpenAI's: ``required`` or
        a named function without ``tools``, or a name none of them has (it forced a call of a
        function the client does not have)."""
        if self.tool_choice in (None, "auto", "none"):
            return
        names = [t.function.name for t in self.tools or ()]
        forced = self.forced_tool()
        if not names:
            what = repr(self.tool_choice) if forced is None else f"a named function ({forced!r})"
            raise invalid(f"tool_choice {what} needs tools", "tool_choice")
        if forced is not None and forced not in names:
            raise invalid(f"tool_choice names the function {forced!r}, which is not among the "
                          f"tools ({', '.join(map(repr, names))})", "tool_choice")  # fmt: skip

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def content_chars(self) -> int:
        """Characters of message text: a lower bound of the rendered prompt's length."""
        n = 0
        for m in self.messages:
            if isinstance(m.content, str):
                n += len(m.content)
            elif m.content:
                n += sum(len(p["text"]) for p in m.content if isinstance(p.get("text"), str))
        return n


class CompletionRequest(_Sampling):
    prompt_param: ClassVar[str] = "prompt"
    #: text, or token ids as OpenAI's legacy API takes them (vLLM and llama.cpp too; lm-eval's
    #: ``local-completions`` sends ids by default): one prompt, alone or in a list of one
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    #: the prompt's text (and log-probabilities) before the completion: not served, a 400 (it was
    #: ignored: a client scoring prompts, lm-eval's loglikelihood, read a completion as the prompt's)
    echo: Literal[False] = False
    #: the legacy completions' form: the count of alternatives per token (0-5), absent: none
    logprobs: int | None = Field(default=None, ge=0, le=5)
    #: fill in the middle (the text after the completion) and the best of several samples: not
    #: served, a 400 (ignored, as echo was, they gave a completion blind to the text after it)
    suffix: str = ""
    best_of: int = 1

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str) -> str:
        if v:
            raise ValueError("suffix (fill in the middle) is not supported: the completion "
                             "continues the prompt alone")  # fmt: skip
        return v

    def logprob_count(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    @field_validator("prompt")
    @classmethod
    def _single(cls, v: Any) -> str | list[int]:
        """One prompt: a string, token ids, or a list of exactly one of either, kept as the string
        or the ids. Ids are ≥ 0 (the model's vocabulary bounds them once it is known:
        ``respond.completion_prompt``)."""
        if isinstance(v, list) and not (v and isinstance(v[0], int)):
            if len(v) != 1:
                raise ValueError(_ONE_PROMPT)
            v = v[0]
        if isinstance(v, list) and (not v or min(v) < 0):
            raise ValueError("token ids must be a non-empty list of integers >= 0")
        return v

    def requested_max(self) -> int | None:
        return self.max_tokens

    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids where it was sent as ids (None: text, :meth:`prompt_text`)."""
        return self.prompt if isinstance(self.prompt, list) else None  # type: ignore[return-value]

    def prompt_text(self) -> str:
        """The prompt's text ("" where it was sent as token ids)."""
        return self.prompt if isinstance(self.prompt, str) else ""


_ONE_PROMPT = ("prompt must be one prompt: a string or a list of token ids (or a list of exactly "
               "one of either)")  # fmt: skip


def parse_body(raw: bytes, model: type[RequestBody], context_length: int | None = None) -> Any:
    """JSON bytes → a validated request model, or ApiError(400) naming the offending field.
    A body of more values than the bound for certain is refused unparsed
    (:func:`surely_past_max_values`); the turns are counted first (:func:`check_turns`), then the
    whole body walked (:func:`check_json`)."""
    if surely_past_max_values(raw):
        raise ApiError(400, f"request JSON holds more than {MAX_JSON_VALUES} values",
                       code="invalid_json")  # fmt: skip
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5000-digit int
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return validate(data, model, context_length, walk=True)


def validate(
    data: dict[str, Any], model: type[RequestBody], context_length: int | None = None,
    walk: bool = False,
) -> Any:  # fmt: skip
    """A JSON object → a validated request model, or ApiError(400) naming the offending field
    (``context_length``: see :func:`check_turns`). The counts first (turns, then sizes), then,
    with ``walk`` (a body just parsed), the whole of it walked (:func:`check_json`)."""
    check_turns(data, model, context_length)
    check_sizes(data, model)
    if walk:
        check_json(data)
    return _validated(data, model)


def check_turns(
    data: dict[str, Any], model: type[RequestBody], context_length: int | None
) -> None:
    """With the model's ``context_length``, a body of more turns (``model.turns``) than it has
    tokens is a 400 (:func:`check_messages`) before anything walks or validates them: counting
    reads the top level alone. 400k empty messages (12 MB) took 3-4 s of a parse slot,
    validated one by one, only for the count to refuse them after."""
    if context_length is not None:
        check_messages(model.turns(data), context_length, model.prompt_param)


def check_sizes(data: dict[str, Any], model: type[RequestBody]) -> None:
    """A 400 naming the field, as OpenAI's, for a top-level array or object of more entries than
    ``model.sizes`` allows it (entries as ``model.entries`` counts them): counted before anything
    walks or validates them."""
    for field, most in model.sizes.items():
        v = data.get(field)
        if not isinstance(v, (list, dict)):
            continue
        n = model.entries(field, v)
        if n > most:
            what, code = ("array", "array_above_max_length") if isinstance(v, list) else (
                "object", "invalid_value")  # fmt: skip
            listed = f" ({len(v)} listed, {n} in all)" if n != len(v) else ""
            raise ApiError(400, f"Invalid '{field}': {what} too long. Expected an {what} with "
                           f"at most {most} entries, but got {n} instead{listed}.", param=field,
                           code=code)  # fmt: skip


def _validated(data: dict[str, Any], model: type[RequestBody]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()) if not _TYPE_TAG.match(str(p))) or None
        msg = str(err.get("msg", "invalid value"))
        msg = msg.removeprefix("Value error, ")
        raise ApiError(
            400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value"
        ) from None


#: where a value sits in the request JSON: None (the top), or (where its container sits, its key)
Where = tuple["Where", object] | None


def surely_past_max_values(raw: bytes) -> bool:
    """True when the JSON in ``raw`` holds more than MAX_JSON_VALUES values for certain, told
    before ``json.loads`` builds them: each value after a container's first follows a comma outside
    any string, so more such commas than the bound is more values (what :func:`check_json` refuses
    after the parse). A body of that many commas counts its strings' out (a few numpy passes); any
    other costs a ``count``. 16 MiB of ``[],`` took 1.0 s to parse (5.6M lists, the GIL held all
    along: every stream's decode waited), and 0.46 s as ``0,``."""
    if raw.count(b",") <= MAX_JSON_VALUES:
        return False
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")  # escapes out: each '"' left delimits
    a = np.frombuffer(plain, dtype=np.uint8)
    inside = np.cumsum(a == ord('"'), dtype=np.uint8) & 1  # odd: within a string
    return int(np.count_nonzero((a == ord(",")) & (inside == 0))) > MAX_JSON_VALUES


def check_json(data: Any) -> None:
    """Refuse what json.loads accepts but the engine cannot use: nesting deeper than
    MAX_JSON_DEPTH (templates and validators recurse), more than MAX_JSON_VALUES values (each
    costs its walk and validation) and lone surrogates (not encodable text: the tokenizer and the
    response encoder fail on them). Iterative: no recursion to exhaust; one open container per
    level (memory bounded by the depth, not by the body: pushing every container of a level with
    its path held 0.5 GB for 3.7M empty lists, in 2.9 s). Values are counted by the containers
    that hold them, as each is reached, so a body past the bound is refused before its rest."""
    values = _count(0, data, None)
    stack: list[tuple[Any, int, Where]] = [(_items(data), 1, None)]
    while stack:
        items, depth, where = stack[-1]
        for k, v in items:
            if isinstance(k, str) and _bad_text(k):
                _surrogate(_path((where, k)))
            if isinstance(v, str):
                if _bad_text(v):
                    _surrogate(_path((where, k)))
            elif isinstance(v, (dict, list)):
                if depth == MAX_JSON_DEPTH:
                    raise ApiError(400, f"request JSON is nested deeper than {MAX_JSON_DEPTH} levels",
                                   param=_path((where, k)), code="invalid_json")  # fmt: skip
                if v:  # an empty one holds nothing to check
                    values = _count(values, v, (where, k))
                    stack.append((_items(v), depth + 1, (where, k)))
                    break
        else:
            stack.pop()


def _count(values: int, container: dict[str, Any] | list[Any], where: Where) -> int:
    """``values`` with the container's entries added; past MAX_JSON_VALUES the 400 naming the
    top-level field it sits in."""
    values += len(container)
    if values > MAX_JSON_VALUES:
        field = _path(where).split(".", 1)[0] or None
        raise ApiError(400, f"request JSON holds more than {MAX_JSON_VALUES} values",
                       param=field, code="invalid_json")  # fmt: skip
    return values


def _items(value: dict[str, Any] | list[Any]) -> Iterator[tuple[object, Any]]:
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)


def _bad_text(s: str) -> bool:
    return not s.isascii() and _SURROGATE.search(s) is not None


def _path(where: Where) -> str:
    keys: list[str] = []
    while where is not None:
        where, key = where
        keys.append(str(key))
    return ".".join(reversed(keys))


def _surrogate(param: str) -> None:
    raise ApiError(400, f"{param}: a lone UTF-16 surrogate is not text", param=param,
                   code="invalid_value")  # fmt: skip


def check_chars(n_chars: int, context_length: int, max_token_chars: int, param: str) -> None:
    """Cheap bound before tokenising: no token is longer than ``max_token_chars`` characters, so
    a text longer than ``context_length * max_token_chars`` cannot fit the context. Tokenising it
    would cost memory and time proportional to the body (a 15 MB prompt: 3 GB and 26 s)."""
    limit = context_length * max(1, max_token_chars)
    if n_chars > limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {context_length} tokens; the prompt has "
            f"{n_chars} characters, more than {context_length} tokens can hold",
            param=param,
            code="context_length_exceeded",
        )


def check_messages(n_messages: int, context_length: int, param: str = "messages") -> None:
    """Cheap bound before rendering: every message a chat template renders takes at least one
    token (its role's marker), so a conversation of more messages than the context has tokens
    cannot fit. Its characters need not say so (400k empty messages are 13 MB of JSON and no
    text): rendering them cost 5.5 s of a parse slot before the length check refused them.
    ``param``: the body field that holds them."""
    if n_messages > context_length:
        raise ApiError(
            400,
            f"this model's maximum context length is {context_length} tokens; the conversation "
            f"has {n_messages} messages (tool calls included), each taking at least one",
            param=param,
            code="context_length_exceeded",
        )


def check_length(
    prompt_tokens: int, requested_max: int | None, context_length: int, default: int = 0,
    param: str = "messages",
) -> int:
    """Max new tokens for a prompt: the request's (else the server's ``default``; 0: no bound of
    its own), capped by what the context leaves.

    A prompt that fills the context is a 400 ``context_length_exceeded``.
    """
    room = context_length - prompt_tokens
    if room <= 0:
        raise ApiError(
            400,
            f"this model's maximum context length is {context_length} tokens; "
            f"the prompt has {prompt_tokens} tokens",
            param=param,
            code="context_length_exceeded",
        )
    return min(requested_max or default or room, room)

