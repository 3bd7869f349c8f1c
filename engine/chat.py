"""Chat prompts: template rendering, OpenCode message normalisation, Hermes injection.

Pure text functions (no MLX); safe to call from any thread. Rendering goes through the model's own chat
template (``tokenizer.apply_chat_template``). A template that ignores ``tools`` (SmolLM2's plain ChatML)
gets them injected into the system message in Hermes format, and assistant tool calls / tool results are
written as ``<tool_call>`` / ``<tool_response>`` text, so the model sees the same format it is asked to emit.
What the model writes back is split by ``engine/output.py``.
"""

from __future__ import annotations

import functools
import json
import re
import string
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import xxhash
from jinja2 import TemplateError

from engine.tool_calls import DS_CALL, DS_CALL_END, DS_CALLS, DS_SEP, DSML, M3_NS, parse_json_block

Probes = weakref.WeakKeyDictionary[Any, bool]
#: what a template's own code raises at run time on request data it cannot use: its filters and
#: calls meet a string where they iterate a mapping (``dictsort``, ``items``), an int where they
#: loop over a list (a tool schema's ``required``, a call's arguments)
TEMPLATE_DATA_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError)


class TemplateRefused(Exception):
    """The chat template failed on the request's messages, tools or template arguments (one of
    :data:`TEMPLATE_DATA_ERRORS` inside it, named in the message): the request's mistake, a 400,
    like the ``TemplateError`` a template raises itself ("roles must alternate")."""


OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes markers the injected instructions name
# (with a description: gpt-oss's template writes ``"// " + tool.description`` and raises without one)
_PROBE_TOOL = {"type": "function", "function": {"name": "tiered_kv_probe_fn", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
# per tokenizer (held weakly: an id of a freed one may come back as another's), the probes' answers
_tool_support: Probes = weakref.WeakKeyDictionary()  # does its template render ``tools``?
_PROBE_NOTE = "tiered_kv_probe_note"
_midway_system: Probes = weakref.WeakKeyDictionary()  # a system turn mid-conversation?
_system: Probes = weakref.WeakKeyDictionary()  # a system turn at all?
_text_beside_reasoning: Probes = weakref.WeakKeyDictionary()  # a call with text and reasoning?
_bare_tools: Probes = weakref.WeakKeyDictionary()  # tools without a description?
_call_markups: dict[str, Probes] = {}  # per markup, is an assistant's call written back in it?
_any_ids: Probes = weakref.WeakKeyDictionary()  # call ids other than 9 alphanumerics rendered?
_short_ids: Probes = weakref.WeakKeyDictionary()  # call ids of 9 alphanumerics rendered?

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


# --- messages -------------------------------------------------------------------------------------


#: the chat content parts read, as text (a ``refusal`` part's text is its ``refusal``); the request
#: model refuses any other (``engine.api.Message``)
TEXT_PARTS = ("text", "input_text", "refusal")


def content_text(content: Any) -> str:
    """OpenAI content (None, a string, or a list of parts) → plain text; non-text parts are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and (kind := part.get("type")) in TEXT_PARTS:
            parts.append(str(part.get("refusal" if kind == "refusal" else "text", "")))
        elif isinstance(part, str):
            parts.append(part)
    return "".join(parts)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as a dict when they are a JSON object string (templates ``tojson`` them);
    an empty string is a call without arguments (``{}``, as the Responses API's are read): kept as
    "", Qwen3-Coder's template failed on it and the JSON templates wrote ``"arguments": }``."""
    if isinstance(raw, str) and not raw.strip():
        return {}
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        return value if isinstance(value, dict) else raw
    return raw if raw is not None else {}


def _tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    fn = tc.get("function") or {}
    return {
        "id": tc.get("id", ""),
        "type": "function",
        "function": {"name": str(fn.get("name", "")), "arguments": _arguments(fn.get("arguments"))},
    }


def normalise_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenCode's messages → what chat templates expect.

    Content lists become text; null content becomes ""; ``developer`` becomes ``system``; assistant
    ``tool_calls`` keep their ids with arguments decoded to dicts; ``tool`` messages keep ``tool_call_id``;
    an assistant's reasoning (``reasoning_content`` or ``reasoning``) is passed on as ``reasoning_content``
    only when there is some (a template given an empty one renders an empty think block;
    transformers passes it on as ``thinking`` too, gpt-oss's key).
    """
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": content_text(m.get("content"))}
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if role == "assistant" and reasoning:  # templates that keep reasoning read this key
            msg["reasoning_content"] = str(reasoning)
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(tc) for tc in m["tool_calls"]]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or ""
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


# --- rendering ------------------------------------------------------------------------------------


#: ``apply_chat_template``'s own parameters and the template's ``messages`` / ``tools``: template
#: arguments (a request's ``chat_template_kwargs``, the server's ``TIERED_KV_CHAT_TEMPLATE_ARGS``)
#: may not take these names
RESERVED_TEMPLATE_ARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})  # fmt: skip


#: template arguments one request or the server may pass: templates read a handful (a body of
#: 1M names took 4 s to render, and a 200)
MAX_TEMPLATE_ARGS = 64


def template_args(args: Any) -> dict[str, Any]:
    """Extra variables for the chat template (``enable_thinking``, ``reasoning_effort``, …), as
    mlx_lm.server takes them: a JSON object of at most :data:`MAX_TEMPLATE_ARGS` names, each an
    identifier that is not in :data:`RESERVED_TEMPLATE_ARGS`. ValueError saying what is refused."""
    if not isinstance(args, dict):
        raise ValueError("template arguments must be a JSON object")
    if len(args) > MAX_TEMPLATE_ARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_ARGS} template arguments (got {len(args)})")
    for name in args:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"template argument names are identifiers (got {str(name)[:40]!r})")
        if name in RESERVED_TEMPLATE_ARGS:
            raise ValueError(f"{name!r} is the template's own parameter, not an argument")
    return dict(args)


def _apply(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    extra: dict[str, Any] | None = None,
    continue_final: bool = False,
    generation_prompt: bool = True,
) -> str:
    kwargs: dict[str, Any] = {**(extra or {}), "tokenize": False,
                              "add_generation_prompt": generation_prompt and not continue_final}  # fmt: skip
    if continue_final:  # the last message, the assistant's, left open for the model to go on
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    own = _template_of(tokenizer, tools)
    if own and (fixed := immutable_template(own)) != own:
        kwargs["chat_template"] = fixed
    try:
        return str(tokenizer.apply_chat_template(messages, **kwargs))
    except TemplateError:
        raise
    except TEMPLATE_DATA_ERRORS as e:
        if not _raised_in_template(e):  # transformers' own checks, ours: no request's mistake
            raise
        raise TemplateRefused(f"{type(e).__name__}: {e}") from e


def _template_of(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """The template text ``apply_chat_template`` would render (the tool-use one of a set, given
    tools); None where the tokenizer names none (rendering then fails as it would)."""
    get = getattr(tokenizer, "get_chat_template", None)
    try:
        text = get(None, tools) if get is not None else None
    except (ValueError, TypeError, KeyError):
        return None
    return text if isinstance(text, str) else None


# A list kept in a namespace and changed in place: ``{% set _ = ns.ids.append(x) %}``, ``{% set v =
# ns.ids.pop(0) %}`` (Kimi-K2-Thinking queues its call ids so). transformers renders templates in
# jinja's immutable sandbox, which refuses any list's ``append`` ("access to attribute 'append' of
# 'list' object is unsafe": every request whose history holds a call failed, in mlx_lm.server too);
# :func:`immutable_template` writes them as assignments to the namespace's attribute.
_APPEND = re.compile(r"\{%(-?)\s*set\s+\w+\s*=\s*(\w+\.\w+)\.append\((.*?)\)\s*(-?)%\}")
_POP = re.compile(r"\{%(-?)\s*set\s+(\w+)\s*=\s*(\w+\.\w+)\.pop\(\s*(0?)\s*\)\s*(-?)%\}")


@functools.lru_cache(maxsize=16)
def immutable_template(text: str) -> str:
    """``text`` with its in-place changes of a namespace's list (:data:`_APPEND`, :data:`_POP`)
    written as assignments that build a new list (the same rendering, in the immutable sandbox);
    any other template is returned as it is."""

    def pop(m: re.Match[str]) -> str:
        item, rest = ("[0]", "[1:]") if m[4] else ("[-1]", "[:-1]")
        return f"{{%{m[1]} set {m[2]} = {m[3]}{item} %}}{{% set {m[3]} = {m[3]}{rest} {m[5]}%}}"

    return _POP.sub(pop, _APPEND.sub(r"{%\1 set \2 = \2 + [\3] \4%}", text))


def _raised_in_template(e: BaseException) -> bool:
    """Whether ``e`` came out of the template's own code (a frame of the compiled template, which
    jinja names ``<template>``, is on its way), not out of the code around it — a tokenizer with no
    template at all, a message shape transformers refuses, a defect of ours."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


_T = TypeVar("_T")


def _once(seen: weakref.WeakKeyDictionary[Any, _T], tokenizer: Any, probe: Callable[[], _T]) -> _T:
    """``probe()``'s answer for ``tokenizer``, asked once and kept in ``seen`` (held weakly: an id
    of a freed tokenizer may come back as another's; one that cannot be held weakly is asked
    every time)."""
    try:
        return seen[tokenizer]
    except (KeyError, TypeError):  # not probed yet (TypeError: it cannot be held weakly)
        pass
    found = probe()
    try:
        seen[tokenizer] = found
    except TypeError:
        pass
    return found


def _probed(
    seen: Probes, tokenizer: Any, messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None, marker: str,
    refusals: type[Exception] | tuple[type[Exception], ...] = Exception,
) -> bool:  # fmt: skip
    """Whether the template renders ``marker`` from ``messages`` (+ ``tools``), probed once per
    tokenizer (``seen``); a template that raises one of ``refusals`` on them does not (any other
    error: it does, the probe's question is not what failed)."""

    def probe() -> bool:
        try:
            return marker in _apply(tokenizer, messages, tools)
        except refusals:  # a template may raise on what it does not understand
            return False
        except Exception:
            return True

    return _once(seen, tokenizer, probe)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders ``tools`` (probed once per tokenizer)."""
    probe = [{"role": "user", "content": "hi"}]
    return _probed(_tool_support, tokenizer, probe, [_PROBE_TOOL], "tiered_kv_probe_fn")


#: a conversation holding an assistant's call: how does the template write the call back?
_CALL_PROBE: list[dict[str, Any]] = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "tiered_kv_probe_fn", "arguments": {"a": 1}}}]},
]  # fmt: skip


def template_writes_json_calls(tokenizer: Any) -> bool:
    """Whether the chat template writes an assistant's tool call back as a bare JSON object
    ``{"name": …, "parameters": …}`` with no markers around it (Llama 3.1–3.3, whose models answer
    with the call's JSON alone); probed once per tokenizer."""
    return _writes_call_as(tokenizer, '{"name": "tiered_kv_probe_fn", "parameters": {"a": 1}}')


def _writes_call_as(tokenizer: Any, written: str, tools: bool = True) -> bool:
    """Whether the chat template writes the probe's call (:data:`_CALL_PROBE`) back holding
    ``written``, probed once per tokenizer and markup (``tools``: rendered with the probe's tool)."""
    seen = _call_markups.setdefault(written, weakref.WeakKeyDictionary())
    return _probed(seen, tokenizer, _CALL_PROBE, [_PROBE_TOOL] if tools else None, written)


_single_quotes: Probes = weakref.WeakKeyDictionary()


def template_quotes_python_strings(tokenizer: Any) -> bool:
    """Whether the chat template writes a Python call's string argument between single quotes
    (LFM2.5-8B-A1B's ``[f(city='Oslo')]``; LFM2-8B-A1B's writes JSON's double quotes); probed once
    per tokenizer."""
    call = {"id": "c", "type": "function", "function": {"name": "tiered_kv_probe_fn", "arguments": {"a": "x"}}}
    probe = [_CALL_PROBE[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
    return _probed(_single_quotes, tokenizer, probe, [_PROBE_TOOL], "tiered_kv_probe_fn(a='x')")


_mistral_ids: Probes = weakref.WeakKeyDictionary()
_mistral_json: weakref.WeakKeyDictionary[Any, CallJson | None] = weakref.WeakKeyDictionary()


def template_mistral_json_calls(tokenizer: Any) -> CallJson | None:
    """How the chat template spells Mistral's calls where it writes them as a JSON list after
    ``[TOOL_CALLS]`` (Mistral Nemo's ``[{"name": …, "arguments": …, "id": …}]``, each id the
    model's: :data:`CALL_ID`), else None; probed once per tokenizer."""
    return _once(_mistral_json, tokenizer, lambda: _mistral_json_calls(tokenizer))


def _mistral_json_calls(tokenizer: Any) -> CallJson | None:
    """:func:`template_mistral_json_calls`' probe."""
    try:
        one, two = (_apply(tokenizer, _calls_turn(n), [_PROBE_TOOL]) for n in (1, 2))
    except Exception:  # a template that cannot render the probe writes no list we can find
        return None
    json_list = f'[TOOL_CALLS][{{"name": "{NAME_SLOT}"' in one
    return call_json(one, two, "[TOOL_CALLS]", ids=_CALL_IDS) if json_list else None


#: the ids of :func:`_calls_turn`'s calls: nine letters or digits, as Mistral's templates demand
_CALL_IDS = ("tkvprobe1", "tkvprobe2")


def _calls_turn(n: int) -> list[dict[str, Any]]:
    """A user's "hi", then an assistant turn of ``n`` (1 or 2) calls — to the probe's function with
    ``{"a": 1}``, then to ``tiered_kv_probe_gn`` with ``{"a": 2}``, ids :data:`_CALL_IDS` — and each
    call's result: the probes of how a template writes calls back, for templates that need ids of
    Mistral's shape and a result after each call."""
    calls = [{"id": _CALL_IDS[i], "type": "function", "function": {"name": name, "arguments": {"a": i + 1}}}
             for i, name in enumerate((NAME_SLOT, "tiered_kv_probe_gn")[:n])]  # fmt: skip
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": "r"} for c in calls)]  # fmt: skip


def template_writes_mistral_call_ids(tokenizer: Any) -> bool:
    """Whether the chat template writes an assistant's call back as ``NAME[CALL_ID]ID[ARGS]{…}``
    (Mistral Small 3.2's; Devstral's writes ``NAME[ARGS]{…}``); probed once per tokenizer, with an
    id of the nine letters or digits Mistral's templates demand."""
    written = f"{NAME_SLOT}[CALL_ID]{_CALL_IDS[0]}[ARGS]"
    return _probed(_mistral_ids, tokenizer, _calls_turn(1), [_PROBE_TOOL], written)


def template_writes_deepseek_calls(tokenizer: Any) -> bool:
    """Whether the chat template writes an assistant's calls back in DeepSeek V3.1's markup
    (``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>``) — V3.1's renders no ``tools`` (the server writes them
    into the system turn as DeepSeek documents, :func:`deepseek_messages`); probed once per
    tokenizer. R1's and V3's older ``function<｜tool▁sep｜>NAME`` markup is not it."""
    return _writes_call_as(tokenizer, f"{DS_CALL}tiered_kv_probe_fn{DS_SEP}", tools=False)


def template_writes_minimax_m3_calls(tokenizer: Any) -> bool:
    """Whether the chat template writes an assistant's calls back in MiniMax-M3's markup (each tag
    after its namespace token, ``]<]minimax[>[<invoke name="NAME">``); probed once per tokenizer."""
    return _writes_call_as(tokenizer, f'{M3_NS}<invoke name="tiered_kv_probe_fn">')


def template_writes_hy3_calls(tokenizer: Any) -> bool:
    """Whether the chat template writes an assistant's calls back in Tencent Hy3's markup
    (``<tool_call:opensource>NAME<tool_sep:opensource>``); probed once per tokenizer."""
    return _writes_call_as(tokenizer, "<tool_call:opensource>tiered_kv_probe_fn<tool_sep:opensource>")


def template_dsml_block(tokenizer: Any) -> str:
    """The block DeepSeek V3.2's / V4's template writes an assistant's calls back in, after
    ``<｜DSML｜`` (``function_calls``, V4's ``tool_calls``); "" for any other template. Probed once per
    tokenizer: the name is built from pieces in the template's code, so only its rendering shows it."""
    return next((b for b in ("function_calls", "tool_calls") if _writes_call_as(tokenizer, f"<{DSML}{b}>")), "")


#: a tag as templates write call markers: ``<tool_calls>``, ``<|START_ACTION|>``, ``</TOOLCALL>``
_TAG = r"<[^<>\s]{1,40}>"
_TAG_BEFORE, _TAG_AFTER = re.compile(_TAG + r"\s*$"), re.compile(r"^\s*(" + _TAG + ")")
#: the probe call as Qwen3-Coder's XML writes it (Seed-OSS's too, in its own block)
_FUNCTION_CALL = re.compile(r"<function=tiered_kv_probe_fn>\s*<parameter=a>\s*1\s*</parameter>\s*</function>")


@dataclass(frozen=True)
class CallJson:
    """How one call is spelled as JSON in its block (:func:`call_json`): ``head``, from the block's
    opener up to the call's arguments, with :data:`NAME_SLOT` where its function's name goes;
    ``tail``, from the arguments to the JSON's end (its closing brackets); ``between``, from one
    call's arguments to the next call's (None where the template writes no second call so, or
    numbers its calls: Cohere's ``"tool_call_id": "1"``)."""

    head: str
    tail: str
    between: str | None = None


#: where a :class:`CallJson` holds the function's name
NAME_SLOT = "tiered_kv_probe_fn"
#: in a call's spelling, the call's id, the model's to write: nine letters or digits, as Mistral's
#: (a grammar reads it so; the prompt's forced opening stops before it)
CALL_ID = "\x1e"


@dataclass(frozen=True)
class CallBlock:
    """Where a template writes an assistant's calls back (:func:`template_call_block`): between
    ``start`` and ``end`` ("": to the turn's end), as JSON (``body`` "json") or as Qwen3-Coder's
    ``<function=NAME><parameter=K>V</parameter></function>`` ("function"); ``json``: how the JSON
    spells one call, where it holds nothing but the name and the arguments (Apriel's also writes
    the call's id after them: None)."""

    start: str
    end: str
    body: str
    json: CallJson | None = None


_call_blocks: weakref.WeakKeyDictionary[Any, CallBlock | None] = weakref.WeakKeyDictionary()


def template_call_block(tokenizer: Any) -> CallBlock | None:
    """The markers between which the chat template writes an assistant's calls back, as JSON
    (Apriel's ``<tool_calls>[…]</tool_calls>``, Nemotron Nano v2's ``<TOOLCALL>``, Cohere's
    ``<|START_ACTION|>``; end "" where the call runs to the turn's end, GigaChat 3.1's
    ``<|function_call|>{…}``) or as ``<function=…>`` XML (Seed-OSS's ``<seed:tool_call>``); None
    where the call is neither or is no tag's. Probed once per tokenizer by rendering a call, and
    the same turn as text: the start marker is the tag before the call that the call's rendering
    adds and a text turn's text does not follow (a role's header), the end marker the tag after it
    where a text turn does not end so."""
    return _once(_call_blocks, tokenizer, lambda: _template_call_block(tokenizer))


def _template_call_block(tokenizer: Any) -> CallBlock | None:
    """:func:`template_call_block`'s probe."""
    hi = {"role": "user", "content": "hi"}
    result = {"role": "tool", "tool_call_id": "c", "content": "r"}
    try:  # (a turn after the call: a template may render a last assistant turn as the prompt's)
        with_call = _apply(tokenizer, [*_CALL_PROBE, result, hi], [_PROBE_TOOL])
        as_text = _apply(tokenizer, [hi, {"role": "assistant", "content": _PROBE_NOTE}, hi], [_PROBE_TOOL])
    except Exception:  # a template that cannot render the probe writes no block we can find
        block = None
    else:
        block = _call_block(with_call, as_text)
    if block is not None and block.body == "json":
        try:
            with_two = _apply(tokenizer, [*_TWO_CALLS_PROBE, result, hi], [_PROBE_TOOL])
        except Exception:  # (a template that refuses two calls writes no second one)
            with_two = ""
        block = replace(block, json=call_json(with_call, with_two, block.start, block.end))
    return block


#: the probe's call and a second one (:func:`call_json`'s ``between``)
_TWO_CALLS_PROBE: list[dict[str, Any]] = [
    _CALL_PROBE[0],
    {"role": "assistant", "content": "", "tool_calls": [
        *_CALL_PROBE[1]["tool_calls"],
        {"id": "d", "type": "function", "function": {"name": "tiered_kv_probe_gn", "arguments": {"a": 2}}}]},
]  # fmt: skip


def call_json(with_call: str, with_two: str, opener: str, closer: str = "", ids: Sequence[str] = ()) -> CallJson | None:
    """How ``with_call`` (a rendering of :data:`_CALL_PROBE`'s call between ``opener`` and ``closer``,
    "": none) spells the call as JSON, and ``with_two`` (of :data:`_TWO_CALLS_PROBE`'s two calls; ""
    for none) a second one; None where the JSON holds more than the name and the arguments — and
    the call's id, where the probe's calls had ``ids`` (each then the model's: :data:`CALL_ID`)."""
    where = _probe_json_call(with_call)
    args = _json_at(with_call, {"a": 1}, with_call.rfind(f'"{NAME_SLOT}"'))
    at = with_call.rfind(opener, 0, where[0]) if where else -1
    if where is None or args is None or at < 0:
        return None
    rest = with_call[where[1] :]
    gap = rest[: len(rest) - len(rest.lstrip())] if closer and rest.lstrip().startswith(closer) else ""
    head, tail = with_call[at + len(opener) : args[0]], with_call[args[1] : where[1]] + gap
    for i in ids:
        tail = tail.replace(i, CALL_ID)
    if head.count(NAME_SLOT) != 1 or _MODEL_ID.sub("", tail).strip(" \n]}"):
        return None
    first, second = _json_at(with_two, {"a": 1}, with_two.rfind(f'"{NAME_SLOT}"')), None
    if first is not None:
        second = _json_at(with_two, {"a": 2}, with_two.find('"tiered_kv_probe_gn"', first[1]))
    between = with_two[first[1] : second[0]].replace("tiered_kv_probe_gn", NAME_SLOT) if first and second else None
    for i in ids:
        between = between.replace(i, CALL_ID) if between is not None else None
    if between is not None and (any(c.isdigit() for c in between) or between.count(NAME_SLOT) != 1):
        between = None
    return CallJson(head, tail, between)


#: a call's id in its JSON where the model writes it (:data:`CALL_ID`: Mistral Nemo's), the one
#: thing a call's JSON may hold beside its name and arguments
_MODEL_ID = re.compile(r',\s*"id":\s*"' + CALL_ID + '"')


def _json_at(text: str, value: Any, after: int) -> tuple[int, int] | None:
    """Where the JSON ``value`` is first written in ``text`` past ``after`` (None: not there)."""
    if after < 0:
        return None
    for start in (i for i in range(after, len(text)) if text[i] == "{"):
        try:
            got, end = json.JSONDecoder().raw_decode(text, start)
        except ValueError:
            continue
        if got == value:
            return start, end
    return None


def _probe_json_call(text: str) -> tuple[int, int] | None:
    """Where the outermost JSON value holding the probe's call (and only it) is in ``text``."""
    at = text.rfind('"tiered_kv_probe_fn"')  # the call's (after any tool list in a system turn)
    outermost = None
    for start in range(at - 1, max(text.rfind(">", 0, at), -1), -1) if at >= 0 else ():
        if text[start] not in "[{":
            continue
        try:
            _, end = json.JSONDecoder().raw_decode(text, start)
            call = parse_json_block(text[start:end], [_PROBE_TOOL])
            args = call["arguments"]
            args = json.loads(args) if isinstance(args, str) else args
        except (ValueError, TypeError):  # no JSON, no call, several calls (a list)
            continue
        if end > at and call["name"] == "tiered_kv_probe_fn" and args == {"a": 1}:
            outermost = start, end
    return outermost


def _call_block(with_call: str, as_text: str) -> CallBlock | None:
    """:func:`template_call_block`'s reading of the two renderings."""
    where, body = _probe_json_call(with_call), "json"
    if where is None:
        found = list(_FUNCTION_CALL.finditer(with_call))
        if not found:
            return None
        where, body = found[-1].span(), "function"
    note = as_text.find(_PROBE_NOTE)
    text_before, text_after = _TAG_BEFORE.search(as_text, 0, note), _TAG_AFTER.match(as_text[note + len(_PROBE_NOTE) :])
    before, after = _TAG_BEFORE.search(with_call, 0, where[0]), _TAG_AFTER.match(with_call[where[1] :])
    opener = before.group(0).rstrip() if before else ""
    if not opener or with_call.count(opener) <= as_text.count(opener):
        return None
    if text_before and text_before.group(0).rstrip() == opener:
        return None  # what opens every turn's text (a role's header): no call block of its own
    closer = after.group(1) if after else ""
    if text_after and text_after.group(1) == closer:
        closer = ""  # the turn's own end (a text turn's too): the call runs to it
    return CallBlock(opener, closer, body)


def template_holds(tokenizer: Any, texts: Sequence[str]) -> bool:
    """Whether the chat template's text holds each of ``texts`` (mlx-lm finds tool parsers so)."""
    template = _template_of(tokenizer, None)
    return template is not None and all(t in template for t in texts)


#: call openers a template names but writes no call back after (Granite 3.3's instructions: "respond
#: only with <|tool_call|> followed by a JSON list of tools used"; its template renders each message's
#: content alone): the assistant's calls go back into its content as its model writes them
CALL_TEXTS = ("<|tool_call|>",)
_writes_calls: Probes = weakref.WeakKeyDictionary()  # does its template write an assistant's calls back?
CallWriter = Callable[[list[dict[str, Any]]], str]  # an assistant's calls → their text, as its model writes them


def template_writes_calls(tokenizer: Any) -> bool:
    """Whether the chat template writes an assistant's calls back at all (probed once per tokenizer):
    Granite 3.3's and LFM2-8B-A1B's render each message's content alone."""
    # (the call, its result and turns after it, as Nemotron's renders no call of a last assistant turn;
    # its id 9 alphanumerics and the roles alternating, as Mistral's takes them)
    probe = _call_and_result("a1b2c3d4e")
    probe[1]["tool_calls"][0]["function"]["arguments"] = {"tiered_kv_probe_arg": 1}
    return _probed(_writes_calls, tokenizer, probe, [_PROBE_TOOL], "tiered_kv_probe_arg")


def template_call_text(tokenizer: Any) -> str:
    """The opener of :data:`CALL_TEXTS` the chat template names where it writes no assistant's call
    back, else ""."""
    if template_writes_calls(tokenizer):
        return ""
    return next((t for t in CALL_TEXTS if template_holds(tokenizer, (t,))), "")


def call_writer(tokenizer: Any) -> CallWriter | None:
    """How an assistant's calls go back into its content where the chat template writes none back:
    Granite 3.3's opener and their JSON list; LFM2's Python calls between its markers (mlx-lm's
    pythonic format: ``<|tool_call_start|>[name(k="v")]<|tool_call_end|>``, each value its JSON, as
    its model card writes them); None where the template writes them, or their format is neither."""
    if template_writes_calls(tokenizer):
        return None
    if opener := next((t for t in CALL_TEXTS if template_holds(tokenizer, (t,))), ""):
        return lambda calls: opener + json.dumps(calls, ensure_ascii=False)
    parser = getattr(tokenizer, "tool_parser", None)
    start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
    if parser is None or not parser.__module__.endswith(".pythonic") or not start:
        return None

    def python(calls: list[dict[str, Any]]) -> str:
        def one(c: dict[str, Any]) -> str:
            args = c["arguments"] if isinstance(c["arguments"], dict) else {}
            return f"{c['name']}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items()) + ")"

        return f"{start}[{', '.join(one(c) for c in calls)}]{end or ''}"

    return python


def written_call_json(tokenizer: Any) -> CallJson | None:
    """How :func:`call_writer` spells one call as JSON, and a second (Granite's list), where the
    chat template writes none back itself: :func:`call_json` of its writing; None where the writer
    writes no JSON (LFM2's Python calls) or there is none."""
    write, opener = call_writer(tokenizer), template_call_text(tokenizer)
    if write is None or not opener:
        return None
    calls = [{"name": NAME_SLOT, "arguments": {"a": 1}}, {"name": "tiered_kv_probe_gn", "arguments": {"a": 2}}]
    return call_json(write(calls[:1]), write(calls), opener)


def calls_as_text(messages: list[dict[str, Any]], write: CallWriter) -> list[dict[str, Any]]:
    """Each assistant's calls written after its content as ``write`` spells them (:func:`call_writer`),
    for a template that renders content alone."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]} for tc in m["tool_calls"]]
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": (m["content"] or "") + write(calls)}
        out.append(m)
    return out


_frames: dict[tuple[str, str], Probes] = {}  # per answer-marker pair, as the probes above


def template_frames_text(tokenizer: Any, frame: tuple[str, str]) -> bool:
    """Whether the chat template writes an assistant's text right between ``frame``'s two markers
    (Command R7B's ``<|START_RESPONSE|>…<|END_RESPONSE|>``, which its model writes); probed once
    per tokenizer and pair."""
    seen = _frames.setdefault(frame, weakref.WeakKeyDictionary())
    hi = {"role": "user", "content": "hi"}
    probe = [hi, {"role": "assistant", "content": _PROBE_NOTE}, hi]
    return _probed(seen, tokenizer, probe, None, frame[0] + _PROBE_NOTE + frame[1])


def _call_and_result(call_id: str) -> list[dict[str, Any]]:
    call = {"name": "tiered_kv_probe_fn", "arguments": {}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": call_id, "content": _PROBE_NOTE},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"},
    ]  # fmt: skip


def template_wants_short_call_ids(tokenizer: Any) -> bool:
    """Whether the chat template renders tool-call ids of 9 alphanumerics and refuses others
    (Mistral Small 3.2's: "Tool call IDs should be alphanumeric strings with length 9!"); probed
    once per tokenizer."""
    if _probed(
        _any_ids, tokenizer, _call_and_result("tiered_kv_probe_id"), [_PROBE_TOOL], _PROBE_NOTE
    ):
        return False
    return _probed(_short_ids, tokenizer, _call_and_result("a1b2c3d4e"), [_PROBE_TOOL], _PROBE_NOTE)


_SHORT_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = string.digits + string.ascii_letters


def short_call_id(call_id: str) -> str:
    """``call_id`` as 9 alphanumerics: itself when it is so already, else digits of its xxh3 hash
    (the same id always the same: a call and its result still pair, and a conversation renders
    the same prompt turn after turn, the cache's prefix)."""
    if _SHORT_ID.fullmatch(call_id):
        return call_id
    h = xxhash.xxh3_64_intdigest(call_id.encode("utf-8", "surrogatepass"))
    return "".join(_ALNUM[(h // 62**i) % 62] for i in range(9))


def shorten_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised messages with every tool-call id (an assistant's calls, a tool result's
    ``tool_call_id``) as :func:`short_call_id` makes it."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**tc, "id": short_call_id(str(tc.get("id", "")))}
                                     for tc in m["tool_calls"]]}  # fmt: skip
        if m["role"] == "tool":
            m = {**m, "tool_call_id": short_call_id(str(m.get("tool_call_id", "")))}
        out.append(m)
    return out


def template_takes_text_beside_reasoning(tokenizer: Any) -> bool:
    """Whether the chat template renders an assistant's call with both text and reasoning beside
    it; probed once per tokenizer. gpt-oss's raises ("Cannot pass both content and thinking"): it
    has one analysis message before a call, where it writes either."""
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "tiered_kv_probe_fn", "arguments": {}},
    }
    probe: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": _PROBE_NOTE, "reasoning_content": "r", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}, {"role": "user", "content": "hi"},
    ]  # fmt: skip
    return _probed(_text_beside_reasoning, tokenizer, probe, [_PROBE_TOOL], _PROBE_NOTE)


def template_takes_bare_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders a tool that has no description and no declared properties
    (``parameters: {}``, as a tool without arguments may come); probed once per tokenizer. gpt-oss's
    and Apertus's raise without a description (gpt-oss writes ``"// " + tool.description``),
    Seed-OSS's without properties (it loops over ``parameters.properties``)."""
    bare = {"type": "function", "function": {"name": "tiered_kv_probe_fn", "parameters": {}}}
    return _probed(
        _bare_tools, tokenizer, [{"role": "user", "content": "hi"}], [bare], "tiered_kv_probe_fn"
    )


def described(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool with a description ("" where it had none) and its parameters' ``properties``
    (``{}`` where it declared none, or no parameters: the same schema), for a template that needs
    them."""
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict):
            params = fn.get("parameters")
            if fn.get("description") is None:
                fn = {**fn, "description": ""}
            if params is None or (isinstance(params, dict) and "properties" not in params):
                fn = {**fn, "parameters": {"type": "object", **(params or {}), "properties": {}}}
            t = {**t, "function": fn}
        out.append(t)
    return out


def reasoning_for_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each assistant call's reasoning alone where it had text beside it too (for a template that
    takes one of them: the reasoning is what the model wrote first, so the prompt's prefix stays
    the tokens it wrote)."""
    return [{k: v for k, v in m.items() if k != "content"} | {"content": ""}
            if m["role"] == "assistant" and m.get("tool_calls") and m.get("reasoning_content") and m["content"]
            else m for m in messages]  # fmt: skip


def template_keeps_midway_system(tokenizer: Any) -> bool:
    """Whether the chat template renders a system turn that comes after the conversation began,
    followed by an assistant turn (Claude Code sends its environment so, after the first user
    turn); probed once per tokenizer. Mistral Small 3.2's refuses it (roles must alternate) and
    MiniMax-M2's drops it."""
    probe = [
        {"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
        {"role": "system", "content": _PROBE_NOTE}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "hi"},
    ]  # fmt: skip
    return _probed(_midway_system, tokenizer, probe, None, _PROBE_NOTE)


def template_takes_system(tokenizer: Any) -> bool:
    """Whether the chat template renders a system turn's text at all (probed once per tokenizer):
    Gemma 2's raises "System role not supported" (every request of a client that sends a system
    prompt — every agent's — was a 400), and a template may drop the turn."""
    probe = [{"role": "system", "content": _PROBE_NOTE}, {"role": "user", "content": "hi"}]
    # refused: by the template's own raise_exception (a TemplateError), not by a failure elsewhere
    # (a tool-use template that needs tools)
    return _probed(_system, tokenizer, probe, None, _PROBE_NOTE, TemplateError)


_calls_after_first: Probes = weakref.WeakKeyDictionary()


def template_renders_calls_after_first(tokenizer: Any) -> bool:
    """Whether the chat template renders every call of an assistant turn that holds several;
    probed once per tokenizer. gpt-oss's and GigaChat 3.1's render the first alone (the rest, and
    where their results belong, vanished from the prompt); Llama 3.x's raises "This model only
    supports single tool-calls at once!" (a 400 on every later turn)."""
    return _probed(_calls_after_first, tokenizer, _calls_turn(2), [_PROBE_TOOL], "tiered_kv_probe_gn", TemplateError)


def one_call_a_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each assistant turn of several calls as one turn per call, each followed by its call's
    result (the first keeps the turn's text and reasoning; results no call claims follow the
    last), for a template that renders one call a turn (:func:`template_renders_calls_after_first`),
    as harmony writes calls: one message each."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if not calls or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        results = messages[i + 1 : j]
        for k, call in enumerate(calls):
            out.append(dict(m, tool_calls=[call]) if k == 0 else {"role": "assistant", "content": "", "tool_calls": [call]})
            out.extend(r for r in results if r.get("tool_call_id") == call.get("id"))
        claimed = {c.get("id") for c in calls}
        out.extend(r for r in results if r.get("tool_call_id") not in claimed)
        i = j
    return out


_system_after_calls: Probes = weakref.WeakKeyDictionary()


def template_keeps_system_after_calls(tokenizer: Any) -> bool:
    """Whether the chat template still renders the system turn once the conversation goes on past
    its last user turn (a call and its result); probed once per tokenizer. Mistral Nemo's writes it
    into the last message only where that is a user's: an agent's every turn after a call lost its
    system prompt, and its prompt parted from the turn before's at the first user turn. A template
    that cannot render the probe keeps it (the probe's question is not what failed)."""
    probe = [{"role": "system", "content": _PROBE_NOTE}, *_calls_turn(1)]
    return _probed(_system_after_calls, tokenizer, probe, [_PROBE_TOOL], _PROBE_NOTE, ())


def system_to_last_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system turns a conversation opens with joined, as paragraphs, to the start of its last
    user turn — where a template that renders the system turn only into a last user message
    (:func:`template_keeps_system_after_calls`) writes it — so it stays there after the turn's
    calls and their results. Without a user turn, unchanged."""
    n = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    if n == 0 or last < n:
        return messages
    head = "\n\n".join(m["content"] for m in messages[:n])  # contents are text (normalise_messages)
    out = [dict(m) for m in messages[n:]]
    out[last - n]["content"] = head + "\n\n" + out[last - n]["content"]
    return out


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system turns a conversation opens with joined, as paragraphs, to the start of the first
    user turn (none after them: they become one), for templates that take no system turn
    (:func:`template_takes_system`; llama.cpp's minja polyfills it so). A system turn later on is
    :func:`fold_midway_system`'s."""
    n = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if n == 0:
        return messages
    head = "\n\n".join(m["content"] for m in messages[:n])  # contents are text (normalise_messages)
    rest = [dict(m) for m in messages[n:]]
    if rest and rest[0]["role"] == "user":
        rest[0]["content"] = head + "\n\n" + rest[0]["content"]
        return rest
    return [{"role": "user", "content": head}, *rest]


def fold_midway_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each system turn after the first message joined to the user turn beside it, as a paragraph:
    at the end of the user turn just before it, else at the start of the one just after it (one
    with neither beside it stays). For templates that refuse or drop such turns
    (:func:`template_keeps_midway_system`); the text keeps its place, so a conversation's earlier
    turns render the same every time (its prompt's prefix is stable)."""
    out = [dict(m) for m in messages]
    i = 1
    while i < len(out):
        m = out[i]
        if m["role"] != "system":
            i += 1
            continue
        before, after = out[i - 1], out[i + 1] if i + 1 < len(out) else None
        if before["role"] == "user":  # contents are text (normalise_messages)
            before["content"] = before["content"] + "\n\n" + m["content"]
        elif after is not None and after["role"] == "user":
            after["content"] = m["content"] + "\n\n" + after["content"]
        else:
            i += 1
            continue
        del out[i]
    return out


def format_tool_call(name: str, arguments: Any) -> str:
    """The Hermes text of one call, as the model is told to write it."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{CLOSE}'


#: DeepSeek V3.1's tool instructions around the tool list, as its model card writes them (its template
#: renders no tools)
DEEPSEEK_TOOLS = "## Tools\nYou have access to the following tools:\n"
DEEPSEEK_TOOL_USE = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    + DS_CALLS[0] + DS_CALL + "tool_call_name" + DS_SEP + "tool_call_arguments" + DS_CALL_END + "{{additional_tool_calls}}"
    + DS_CALLS[1] + "\n\nWhere:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces"
)


def deepseek_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """For DeepSeek V3.1's template (it writes calls and results back in its own markup, and no
    tool list): the tools into the system turn as its model card describes them."""
    if not tools:
        return messages
    listing = ""
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict):
            params = json.dumps(fn.get("parameters") or {}, ensure_ascii=False)
            listing += f"\n### {fn.get('name', '')}\nDescription: {fn.get('description') or ''}\n\nParameters: {params}\n"
    return _with_system(messages, DEEPSEEK_TOOLS + listing + DEEPSEEK_TOOL_USE)


def _with_system(messages: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    """``messages`` with ``block`` at the end of their opening system turn (one made for it where
    they open with none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """For templates without tool support: tools into the system turn, calls/results into text."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        messages = _with_system(messages, HERMES_SYSTEM.format(tools=listing))
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                format_tool_call(tc["function"]["name"], tc["function"]["arguments"])
                for tc in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{k: v for k, v in m.items() if not k.startswith("_")} for m in out]


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    continue_final: bool = False,
    generation_prompt: bool = True,
) -> str:
    """Messages (+ tools) → the prompt text, ending with the assistant generation prompt (or,
    ``continue_final``, inside the last message, the assistant's, for the model to continue; or,
    without ``generation_prompt``, after the last message: a whole conversation as history).
    ``extra``: template arguments (:func:`template_args`)."""
    msgs = normalise_messages(messages)
    if not template_keeps_midway_system(tokenizer):
        msgs = fold_midway_system(msgs)
    if template_supports_tools(tokenizer):
        if template_wants_short_call_ids(tokenizer):
            msgs = shorten_call_ids(msgs)
        if not template_takes_text_beside_reasoning(tokenizer):
            msgs = reasoning_for_text(msgs)
        if tools and not template_takes_bare_tools(tokenizer):
            tools = described(tools)
        if write := call_writer(tokenizer):
            msgs = calls_as_text(msgs, write)
        elif not template_renders_calls_after_first(tokenizer):
            msgs = one_call_a_turn(msgs)
    elif template_writes_deepseek_calls(tokenizer):
        msgs, tools = deepseek_messages(msgs, tools), None
    else:
        msgs, tools = hermes_messages(msgs, tools), None
    if not template_takes_system(tokenizer):
        msgs = fold_system(msgs)
    elif not template_keeps_system_after_calls(tokenizer):
        msgs = system_to_last_user(msgs)
    return _apply(tokenizer, msgs, tools or None, extra, continue_final, generation_prompt)
