"""A call block's text → OpenAI tool calls: our parsers, checks on every parser's calls, call ids.

Pure functions and one small per-request reader, no state machine (``engine/output.py`` finds the
blocks). mlx-lm ships a parser per model family (``mlx_lm/tool_parsers/``); ours are those it has
none for: Hermes, for templates that ignore ``tools`` (the server injects the Hermes instructions,
:mod:`engine.chat`), Llama 3.x's bare JSON calls, DeepSeek V3.1's markup and V3.2's / V4's DSML,
MiniMax-M3's namespaced tags, Hy3's, and JSON between the markers a template writes calls back in (Apriel,
Nemotron Nano v2, Cohere, …); and one around mlx-lm's Mistral parser, for
calls written with their ids (``name[CALL_ID]id[ARGS]{…}``). Whoever parsed a block, :class:`CallParser`
keeps only calls that name one of the request's tools with a JSON object for arguments, judges each
call of a multi-call block alone where the format marks each call (else a block with a call that is
none is text, as vLLM reads it), and gives every call an id the conversation does not hold yet.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from mlx_lm.tool_parsers import mistral

log = logging.getLogger(__name__)
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a call with it
#: what the ids the server makes for calls begin with: OpenAI's (Anthropic's API passes its own,
#: ``messages.CALL_ID_PREFIX``)
CALL_ID_PREFIX = "call_"
Parser = Callable[[str, Any], Any]


def parse_hermes(text: str, tools: Any = None) -> dict[str, Any]:
    """The JSON inside one ``<tool_call>`` block (``arguments`` or ``parameters``). Raises ValueError."""
    obj = json.loads(text.strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call object")
    return {"name": obj["name"], "arguments": obj.get("arguments", obj.get("parameters", {}))}


def parse_harmony(text: str, tools: Any = None) -> dict[str, Any]:
    """gpt-oss's call (``engine/harmony.py`` gives it as ``NAME<|message|>ARGUMENTS``: the
    recipient's function and the message body, JSON). Raises ValueError."""
    name, sep, body = text.partition("<|message|>")
    if not sep or not name.strip():
        raise ValueError("no function name or no arguments")
    return {"name": name.strip(), "arguments": json.loads(body) if body.strip() else {}}


def tool_names(tools: Any) -> set[str]:
    """The function names of a request's (chat-form) tools."""
    return {t["function"].get("name") for t in tools or ()
            if isinstance(t, dict) and isinstance(t.get("function"), dict)}  # fmt: skip


def _json_values(text: str) -> list[Any]:
    """The JSON values ``text`` holds one after another (whitespace, ``,`` or ``;`` between them),
    after an optional ``<|python_tag|>``. Raises ValueError (none, or one that is no JSON)."""
    body, at, values = text.strip().removeprefix(PYTHON_TAG), 0, []
    decoder = json.JSONDecoder()
    while True:
        while at < len(body) and (body[at].isspace() or body[at] in ";,"):
            at += 1
        if at == len(body):
            break
        value, at = decoder.raw_decode(body, at)
        values.append(value)
    if not values:
        raise ValueError("no call")
    return values


def parse_json_calls(text: str, tools: Any = None) -> list[dict[str, Any]]:
    """Llama 3.x calls: the whole output is one or more JSON objects ``{"name": …, "parameters":
    {…}}`` (after an optional ``<|python_tag|>``, separated by ``;`` or whitespace), each naming one
    of the request's tools (a JSON answer that names none is an answer). Raises ValueError."""
    names, calls = tool_names(tools), []
    for obj in _json_values(text):
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("not a tool call object")
        if names and obj["name"] not in names:
            raise ValueError(f"{obj['name']!r} is none of the request's tools")
        args = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(args, (dict, str)):
            raise ValueError("the call's parameters are not an object")
        calls.append({"name": obj["name"], "arguments": args})
    return calls


def parse_json_block(text: str, tools: Any = None) -> Any:
    """Calls written as JSON between a block's markers, in the templates mlx-lm has no parser for
    (the markers found by rendering a call, ``chat.template_call_block``): Apriel's and Nemotron
    Nano v2's list of ``{"name": …, "arguments": …}``, MiniMax-M1's such objects one a line, GigaChat
    3.1's one object, Cohere's (Command R7B, Cohere2 MoE) list of ``{"tool_name": …, "parameters": …}``,
    Apertus's list of ``{NAME: ARGUMENTS}``. A list or values one after another (:func:`_json_values`);
    an ``id`` the model wrote is kept (Apriel's template writes them back). Raises ValueError."""
    names, calls = tool_names(tools), []
    for value in _json_values(text):
        for obj in value if isinstance(value, list) else [value]:
            if not isinstance(obj, dict):
                raise ValueError("not a tool call object")
            if isinstance(obj.get("name"), str):
                call = {"name": obj["name"], "arguments": obj.get("arguments", obj.get("parameters", {}))}
            elif isinstance(obj.get("tool_name"), str):  # Cohere's
                call = {"name": obj["tool_name"], "arguments": obj.get("parameters", {})}
            elif len(obj) == 1 and next(iter(obj)) in names:  # Apertus's {NAME: ARGUMENTS}
                (name, args), = obj.items()
                call = {"name": name, "arguments": args}
            else:
                raise ValueError("not a tool call object")
            if isinstance(obj.get("id"), str):
                call["id"] = obj["id"]
            calls.append(call)
    if not calls:
        raise ValueError("no call")
    return calls[0] if len(calls) == 1 else calls


# Mistral Small 3.x's header of a call with its id, as its template writes calls back (and its
# model so writes them): ``name[CALL_ID]id[ARGS]{…}``
_MISTRAL_CALL_ID = re.compile(r"([\w-]+)\s*\[CALL_ID\]\s*(\w+)\s*(?=\[ARGS\])")


def parse_mistral(text: str, tools: Any = None) -> Any:
    """mlx-lm's Mistral calls, and those written ``name[CALL_ID]id[ARGS]{…}``, each with the id the
    model wrote: mlx-lm's parser reads such a header as a call of a function named by the id (a
    block shown as text). The id is kept, as the template renders it back where the model wrote it."""
    ids = [m.group(2) for m in _MISTRAL_CALL_ID.finditer(text)]
    if not ids:
        return mistral.parse_tool_call(text, tools)
    parsed = mistral.parse_tool_call(_MISTRAL_CALL_ID.sub(r"\1", text), tools)
    items = parsed if isinstance(parsed, list) else [parsed]
    if len(items) != len(ids):
        raise ValueError(f"{len(ids)} call ids for {len(items)} calls")
    for item, cid in zip(items, ids, strict=True):
        item["id"] = cid
    return parsed


#: DeepSeek V3.2's and V4's markup: ``<｜DSML｜function_calls>`` (V4: ``tool_calls``) holding one
#: ``<｜DSML｜invoke name="NAME">`` per call, each argument ``<｜DSML｜parameter name="K" string="true">V``
#: (``string="false"``: V is JSON)
DSML = "｜DSML｜"
_DSML_INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAMETER = re.compile(
    r'<｜DSML｜parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</｜DSML｜parameter>', re.DOTALL
)


def parse_dsml(text: str, tools: Any = None) -> Any:
    """DeepSeek V3.2's / V4's calls (mlx-lm has no parser for them): each ``invoke`` a call, each
    ``parameter`` an argument, its text as written where ``string="true"`` and JSON where
    ``string="false"`` (text that is no JSON stays text, as vLLM's deepseekv32 parser reads it).
    Raises ValueError."""
    calls = []
    for invoke in _DSML_INVOKE.finditer(text):
        args: dict[str, Any] = {}
        for key, string, value in _DSML_PARAMETER.findall(invoke.group(2)):
            if string == "false":
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            args[key] = value
        calls.append({"name": invoke.group(1), "arguments": args})
    if not calls or not all(c["name"] for c in calls):
        raise ValueError("no DSML invoke with a name")
    return calls[0] if len(calls) == 1 else calls


#: DeepSeek V3.1's call markup (its template writes calls back so; the server tells the model the
#: format, :func:`engine.chat.deepseek_messages`): ``<｜tool▁calls▁begin｜>`` holding one
#: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`` per call, ARGUMENTS JSON
DS_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_CALL = re.compile(re.escape(DS_CALL) + r"(.*?)" + re.escape(DS_SEP) + r"(.*?)" + re.escape(DS_CALL_END), re.DOTALL)


def parse_deepseek_v31(text: str, tools: Any = None) -> Any:
    """DeepSeek V3.1's calls (mlx-lm has no parser for them): each ``<｜tool▁call▁begin｜>`` a call,
    its name up to ``<｜tool▁sep｜>``, its arguments the JSON after it. Raises ValueError."""
    calls = [{"name": name.strip(), "arguments": json.loads(args)} for name, args in _DS_CALL.findall(text)]
    if not calls or not all(c["name"] for c in calls):
        raise ValueError("no DeepSeek call with a name")
    return calls[0] if len(calls) == 1 else calls


#: MiniMax-M3's markup: each tag after its namespace token, ``]<]minimax[>[<tool_call>`` holding one
#: ``<invoke name="NAME">`` per call, each argument ``<KEY>VALUE</KEY>``, a value an object's keys as
#: such tags, a list's items as ``<item>…</item>``, anything else its text (a boolean its JSON)
M3_NS = "]<]minimax[>["
_M3_INVOKE = re.compile(re.escape(M3_NS) + r'<invoke name="([^"]*)">(.*?)' + re.escape(M3_NS) + "</invoke>", re.DOTALL)
_M3_TAG = re.compile(r"<(/?)([^<>\s/]+)>")


def parse_minimax_m3(text: str, tools: Any = None) -> Any:
    """MiniMax-M3's calls (mlx-lm has no parser for them; it takes its template for a JSON one):
    each ``invoke`` a call, its elements the arguments, read as the call's tool declares them
    (:func:`_m3_value`). Raises ValueError."""
    calls = []
    for name, body in _M3_INVOKE.findall(text):
        parts = body.split(M3_NS)
        args, end = _m3_elements(parts, 1, _properties(tools, name))
        if end != len(parts) or parts[0].strip():
            raise ValueError(f"{name!r}'s arguments are not its elements alone")
        calls.append({"name": name, "arguments": args})
    if not calls or not all(c["name"] for c in calls):
        raise ValueError("no MiniMax-M3 invoke with a name")
    return calls[0] if len(calls) == 1 else calls


def _properties(tools: Any, name: str) -> dict[str, Any]:
    """The JSON Schema properties of the request's tool ``name`` ({} where it declares none)."""
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name and isinstance(fn.get("parameters"), dict):
            props = fn["parameters"].get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _m3_elements(parts: list[str], at: int, props: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The elements from ``parts[at]`` (each part an opening or closing tag and the text after it)
    to the first closing tag (not taken), as a mapping of their values; and where they end."""
    out: dict[str, Any] = {}
    while at < len(parts):
        tag = _M3_TAG.match(parts[at])
        if tag is None:
            raise ValueError(f"not a tag: {parts[at][:40]!r}")
        if tag[1]:  # a closing tag: the enclosing element's
            break
        out[tag[2]], at = _m3_value(parts, at, _schema(props, tag[2]))
    return out, at


def _schema(schema: dict[str, Any], key: str) -> dict[str, Any]:
    """``schema[key]`` where it is a schema (a mapping), else {}: nothing declared."""
    sub = schema.get(key)
    return sub if isinstance(sub, dict) else {}


def _m3_value(parts: list[str], at: int, schema: dict[str, Any]) -> tuple[Any, int]:
    """The value of the element opening at ``parts[at]`` (to its closing tag, taken), as ``schema``
    declares it: a string as written, a number, boolean or null as JSON, an array its ``<item>``
    elements, an object its elements; without a type, nested elements are an object (a list where
    they are all ``<item>``) and text is JSON where it parses as a number, boolean or null."""
    tag = _M3_TAG.match(parts[at])
    assert tag is not None
    text, at = parts[at][tag.end() :], at + 1
    close = f"</{tag[2]}>"
    if at < len(parts) and parts[at].startswith(close):  # a leaf: text
        if parts[at][len(close) :].strip():
            raise ValueError(f"text after {close}")
        return _typed(text, schema), at + 1
    if text.strip():
        raise ValueError(f"text before {tag[2]!r}'s elements")
    kind = schema.get("type")
    value: Any
    if kind == "array" or (kind is None and at < len(parts) and parts[at].startswith("<item>")):
        value = []
        while at < len(parts) and parts[at].startswith("<item>"):
            item, at = _m3_value(parts, at, _schema(schema, "items"))
            value.append(item)
    else:
        value, at = _m3_elements(parts, at, _schema(schema, "properties"))
    if at >= len(parts) or not parts[at].startswith(close) or parts[at][len(close) :].strip():
        raise ValueError(f"{tag[2]!r} not closed")
    return value, at + 1


def _typed(text: str, schema: dict[str, Any]) -> Any:
    """A value written as text (MiniMax-M3's and Hy3's) as ``schema`` declares it: a string as
    written, anything else its JSON (an empty object or array written as no text); without a type,
    JSON where the text is a number, boolean or null."""
    kind = schema.get("type")
    if not text and kind in ("object", "array"):
        return {} if kind == "object" else []
    if kind == "string" or (kind is None and "enum" in schema and text in schema["enum"]):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        if kind in ("integer", "number", "boolean", "null"):
            raise
        return text
    return value if kind is not None or isinstance(value, (int, float, bool)) or value is None else text


#: Tencent Hy3's markup (each tag ends ``:opensource``): ``<tool_calls:opensource>`` holding one
#: ``<tool_call:opensource>NAME<tool_sep:opensource>`` per call, each argument
#: ``<arg_key:opensource>K</arg_key:opensource><arg_value:opensource>V</arg_value:opensource>`` (V a
#: string as written, any other value its JSON)
HY3_CALLS = ("<tool_calls:opensource>", "</tool_calls:opensource>")
_HY3_CALL = re.compile(r"<tool_call:opensource>(.*?)<tool_sep:opensource>(.*?)</tool_call:opensource>", re.DOTALL)
_HY3_ARG = re.compile(
    r"<arg_key:opensource>(.*?)</arg_key:opensource>\s*<arg_value:opensource>(.*?)</arg_value:opensource>", re.DOTALL
)


def parse_hy3(text: str, tools: Any = None) -> Any:
    """Hy3's calls (mlx-lm has no parser for them): each ``tool_call`` a call, its arguments read as
    the call's tool declares them (:func:`_typed`). Raises ValueError."""
    calls = []
    for name, body in _HY3_CALL.findall(text):
        if _HY3_ARG.sub("", body).strip():
            raise ValueError(f"{name!r}'s arguments are not its key / value pairs alone")
        props = _properties(tools, name.strip())
        args = {k: _typed(v, _schema(props, k)) for k, v in _HY3_ARG.findall(body)}
        calls.append({"name": name.strip(), "arguments": args})
    if not calls or not all(c["name"] for c in calls):
        raise ValueError("no Hy3 call with a name")
    return calls[0] if len(calls) == 1 else calls


#: parsers of ours in place of mlx-lm's, by its parser module's name
OWN_PARSERS: dict[str, Parser] = {"mistral": parse_mistral}


# Formats whose call block holds several calls, each in markers of its own (Kimi's section of
# ``<|tool_call_begin|>…<|tool_call_end|>``, MiniMax's ``<invoke …>…</invoke>``): the one call text
# each parser reads alone.
_EACH_CALL = {
    "kimi_k2": re.compile(r"<\|tool_call_begin\|>.*?<\|tool_call_end\|>", re.DOTALL),
    "minimax_m2": re.compile(r"<invoke name=.*?</invoke>", re.DOTALL),
    "dsml": _DSML_INVOKE,
    "deepseek_v31": _DS_CALL,
    "minimax_m3": _M3_INVOKE,
    "hy3": _HY3_CALL,
}


def _pythonic_calls(text: str) -> int:
    """How many calls a pythonic block (LFM2's ``[a(x=1), b(y=2)]``) holds: its list's elements
    where it is Python, else the call openers after its ``[`` and each ``,``."""
    start, end = text.find("["), text.rfind("]")
    payload = text[start : end + 1] if 0 <= start < end else text
    try:
        tree = ast.parse(payload, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        tree = None
    if isinstance(tree, ast.List):
        return len(tree.elts)
    return len(re.findall(r"[\[,]\s*[\w.]+\(", payload))


# Formats whose parser may read fewer calls than the block holds: how many it holds. mlx-lm's
# pythonic parser falls back to a regex that reads one call, to the first ``)]``: on a block of
# several with one malformed, a first call with the others' text in its arguments (a call the model
# never wrote). Such a block is the text it is, as vLLM's lfm2 / pythonic parsers keep it.
_HOLDS = {"pythonic": _pythonic_calls}


class CallParser:
    """One request's reading of call blocks with ``parse`` (the format's parser, named
    ``parser_name``): a block's text → OpenAI calls naming the request's ``tools``, or None (the
    block is the text it is). Holds no state between blocks; the caller keeps the ids taken.
    ``id_prefix``: what the ids it makes begin with, the API's own (:func:`new_call_id`)."""

    def __init__(self, parse: Parser, parser_name: str, tools: Any = None,
                 id_prefix: str = CALL_ID_PREFIX) -> None:  # fmt: skip
        self.parse, self.parser_name, self.tools = parse, parser_name, tools
        self.id_prefix = id_prefix
        self.names = tool_names(tools)

    def calls_of(self, text: str) -> list[tuple[int, int, list[dict[str, Any]] | None]]:
        """A block's calls: ``[(0, len(text), calls)]``, or, where the whole does not parse and its
        format marks each call (:data:`_EACH_CALL`), each call judged alone: ``(where its text
        starts and ends, its calls or None)``, so one call naming no offered tool costs only itself."""
        calls = self.calls(text)
        each = _EACH_CALL.get(self.parser_name)
        if calls is not None or each is None:
            return [(0, len(text), calls)]
        return [(m.start(), m.end(), self.calls(m.group(0))) for m in each.finditer(text)]

    def fresh_id(self, name: str, taken: set[str]) -> str:
        """An id none of ``taken`` (the conversation's call ids) is, in the format's own form where
        it has one (Kimi's ``functions.NAME:N``, which its template writes back to the model)."""
        if self.parser_name != "kimi_k2":
            return new_call_id(self.parser_name, self.id_prefix)
        n = 0
        while f"functions.{name}:{n}" in taken:
            n += 1
        return f"functions.{name}:{n}"

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI calls of ``text`` as a whole; None where it is not all calls of the tools."""
        try:
            parsed = self.parse(text, self.tools)
        except Exception as e:  # third-party parsers raise ValueError, JSON, regex or key errors
            log.info("model output is not a %s tool call (%s)", self.parser_name, e)
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        count = _HOLDS.get(self.parser_name)
        held = count(text) if count is not None else len(items)
        if len(items) != held:
            log.info("model output holds %d %s calls, %d parsed", held, self.parser_name,
                     len(items))  # fmt: skip
            return None
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            if self.names and item["name"] not in self.names:
                # lenient parsers (GLM's) make a call of any text in a block: "unknown", "I"
                log.info("model output names %r, none of the request's tools", item["name"])
                return None
            call = _openai_call(item, self.parser_name, self.id_prefix)
            if call is None:
                return None
            calls.append(call)
        return calls or None


def new_call_id(parser_name: str, prefix: str = CALL_ID_PREFIX) -> str:
    """A fresh call id: ``prefix`` (the API's: OpenAI's ``call_``, Anthropic's ``toolu_``) and 24
    hex digits. Mistral templates refuse history whose ids are not 9 alphanumerics: theirs are."""
    if parser_name == "mistral":
        return uuid.uuid4().hex[:9]
    return prefix + uuid.uuid4().hex[:24]


def _openai_call(parsed: dict[str, Any], parser_name: str, id_prefix: str) -> dict[str, Any] | None:
    """A parsed call as OpenAI's, its arguments a JSON object's text (``arguments``, or
    ``parameters`` as some models write it); None where they are no object. An id the model wrote
    (Kimi's, Mistral's) is kept as it is: the template renders it back where the model wrote it."""
    args = parsed.get("arguments", parsed.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
    elif isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    else:
        return None
    cid = parsed.get("id")
    return {
        "id": cid if isinstance(cid, str) and cid else new_call_id(parser_name, id_prefix),
        "type": "function",
        "function": {"name": parsed["name"], "arguments": args},
    }
