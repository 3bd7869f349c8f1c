"""Structured output: a request's JSON mode or JSON Schema enforced while its tokens are sampled.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), the Responses API's ``text.format``
and Anthropic's ``output_config.format`` become one value at the API edge, :func:`schema_of`: the
JSON Schema as a compact JSON string (``json_object``: any object), checked there — a schema
that llguidance cannot compile is the client's 400, not a failure mid-generation. Nothing of it
is a per-request object until the batch loop takes the request: :meth:`Grammars.processor` then
gives it a logits processor over llguidance's matcher (``llguidance``, the constrained decoder of
llama.cpp, vLLM and SGLang), which masks every token that cannot continue the value; once the
value is complete only the end-of-sequence tokens are left, so the request ends with ``stop``
(``length`` when ``max_tokens`` cuts the value short, as OpenAI's).

A model with a think block may reason first: the grammar lets the output open with the block (or
start inside it, where the chat template opened it in the prompt) and requires the value after
its end marker; reasoning is not constrained. Tool calls cannot be made while a format is
enforced (the value is the whole answer); a call that ``tool_choice`` forces is the answer instead,
and the format is not enforced then (``respond.grammar_of``).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from engine.output_format import CALL_ID, GAP, ArgLayout

#: the schema of OpenAI's JSON mode (``json_object``): any JSON object
ANY_OBJECT = '{"type":"object"}'
#: how the value is written (llguidance's ``x-guidance`` options): one line, standard separators.
#: Flexible whitespace let a model write newlines between tokens without end (the tiny random
#: model: 60 lines of them where its value was 30 characters); a schema's own options win.
STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: added tokens a grammar names, each as (its text, its name in llguidance's lark: ``<think>``,
#: ``<[7]>``), longest first (:attr:`engine.output_format.OutputFormat.marker_tokens`)
Tokens = tuple[tuple[str, str], ...]


class FormatError(ValueError):
    """A ``response_format`` this server cannot enforce (its message names what is wrong)."""


def schema_of(fmt: Any, checked: bool = False) -> str:
    """The JSON Schema a request's output must match, as compact JSON ("" for plain text), from
    OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (the schema may
    also sit at the top level, as llama.cpp's server takes it). Raises :class:`FormatError`;
    ``checked``: the request's validation compiled it already (:func:`check` is not run again)."""
    if fmt is None:
        return ""
    if not isinstance(fmt, dict):
        raise FormatError("response_format must be an object with a 'type'")
    kind = fmt.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise FormatError(f"response_format type {kind!r} is not supported "
                          "('text', 'json_object' or 'json_schema')")  # fmt: skip
    wrapper = fmt.get("json_schema")
    schema = wrapper.get("schema") if isinstance(wrapper, dict) else fmt.get("schema")
    if schema is None and isinstance(wrapper, dict):
        schema = {}  # OpenAI's: a json_schema without a schema is any JSON value
    if not isinstance(schema, dict | bool):
        raise FormatError("response_format json_schema needs a 'schema' object")
    # compact, in the schema's own order: llguidance writes an object's properties in the order
    # they are declared (sorted keys made a name / age / city schema answer age, city, name)
    text = json.dumps(schema, separators=(",", ":"))
    if not checked:
        check(text)
    return text


def check(schema: str) -> None:
    """Raises :class:`FormatError` when llguidance cannot compile ``schema``'s grammar (as
    :func:`lark` writes it; no tokenizer needed)."""
    err = _compile_error(schema) if len(schema) <= KEEP_CHECKED_BYTES else _compile_error.__wrapped__(schema)
    if err:  # its first line: the rest lists the grammar's text
        raise FormatError(f"response_format schema: {err.splitlines()[0]}")


#: schemas :func:`check` keeps its answer for: up to 256 of up to 64 KiB each (16 MiB at most; a
#: request body may hold 16 MiB)
KEEP_CHECKED_BYTES = 64 * 1024


@functools.lru_cache(maxsize=256)
def _compile_error(schema: str) -> str:
    """llguidance's complaint about ``schema``'s grammar, "" for none: kept per schema text (an
    agent sends the same tools, each checked, with every request that forces a call)."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_lark(lark(schema))
    except (ValueError, RuntimeError) as e:
        return str(e) or type(e).__name__
    return LLMatcher.validate_grammar(grammar) or ""


def lark(schema: str, think: tuple[str, str] | None = None, opened: bool = False,
         harmony: bool = False, tokens: Tokens = ()) -> str:  # fmt: skip
    """The grammar of an output that is ``schema``'s JSON value, after an optional think block
    (``think``: its start and end markers; None: the model has none). ``opened``: the chat
    template opened the block in the prompt, so the output starts inside it and must close it
    first. (One grammar for both cases left a complete value unaccepted: it could still have been
    the start of a block whose opener the prompt held.) ``tokens``: the added tokens of the
    vocabulary the markers hold, which llguidance matches only by name (``<think>``), never by
    their text (a grammar with the text refused Qwen3's and GLM's own ``<think>`` token).
    ``harmony``: gpt-oss's messages
    (``engine/harmony.py``) — an optional analysis message, then the value as the final one; its
    markers are special tokens, which llguidance's grammars name as ``<|...|>``."""
    value = _styled(schema)
    if harmony:
        return (
            'start: (analysis <|start|> "assistant")? <|channel|> "final" <|message|> value\n'
            'analysis: <|channel|> "analysis" <|message|> reasoning <|end|>\n'
            "reasoning: /(?s:.*)/\n"  # (no special token is text: it ends at <|end|>)
            f"value: %json {value}\n"
        )
    if think is None:
        return f"start: value\nvalue: %json {value}\n"
    start, end = think
    if _ends_at_token(end, tokens):
        head = "reasoning closer gap?" if opened else "(opener reasoning closer gap?)?"
        marks = f"opener: {_marker(start, tokens)}\ncloser: {_marker(end, tokens)}\nreasoning: /(?s:.*)/\n"
    else:
        head = "reasoning gap?" if opened else "(opener reasoning gap?)?"
        marks = f"opener: {_marker(start, tokens)}\nreasoning[lazy]: /(?s:.*){_regex(end)}/\n"
    return f"start: {head} value\n{marks}" + "gap: /[ \\t\\r\\n]+/\n" + f"value: %json {value}\n"


def call_lark(calls: list[tuple[str, str]], close: str, tokens: Tokens = (), layout: ArgLayout | None = None,
              again: list[list[str]] | None = None) -> str:  # fmt: skip
    """The grammar of a forced call's rest: one of ``calls``, each the text that names its function
    (its head: "" where the prompt named it, ``tool_choice`` naming a function) then its arguments,
    the JSON value of its schema (the tool's ``parameters``); then ``close``, the format's end of
    the call (:meth:`OutputFormat.named_close`; ``tokens``: the added tokens these texts may hold,
    named as tokens). ``layout``: the arguments are written one by one (tags, Python keywords:
    :meth:`OutputFormat.arg_layout`, :func:`_arg_rules`), not as one JSON object.

    ``again`` (parallel calls): more calls may follow the first, each written as
    :meth:`OutputFormat.next_call` writes it — per level, the text before each of ``calls``'
    arguments; one level: any number of calls alike, else at most one call per level (Kimi-K2
    numbers its calls), and ``close`` ends the last."""
    tail = f" {_marker(close, tokens)}" if close else ""
    rules = "".join(f"value{i}: %json {_styled(schema)}\n" if layout is None else _arg_rules(i, schema, layout, tokens)
                    for i, (_, schema) in enumerate(calls))  # fmt: skip

    def choice(heads: list[str]) -> str:
        one = " | ".join(f"{_marker(head, tokens)} value{i}" if head else f"value{i}" for i, head in enumerate(heads))
        return one if len(heads) == 1 else f"({one})"

    call = choice([head for head, _ in calls])
    levels = again or []
    if len(levels) == 1:
        call += f" ({choice(levels[0])})*"
    elif levels:  # more1: a second call, and a third after it, ...
        call += " more1?"
        rules += "".join(f"more{k + 1}: {choice(heads)}" + (f" more{k + 2}?" if k + 1 < len(levels) else "") + "\n"
                         for k, heads in enumerate(levels))  # fmt: skip
    return f"start: {call}{tail}\n{rules}"


def check_args(schema: str, layout: ArgLayout | None) -> None:
    """:func:`check`, and where the arguments are written one by one (``layout``), that each of
    ``schema``'s properties can be named there (:meth:`ArgLayout.takes`). Raises :class:`FormatError`."""
    check(schema)
    if layout is None:
        return
    bad = [k for k in _properties(json.loads(schema)) if not layout.takes(k)]
    if bad:
        raise FormatError(f"argument {bad[0]!r} cannot be written in this model's call syntax")


def _properties(doc: Any) -> dict[str, Any]:
    props = doc.get("properties") if isinstance(doc, dict) else None
    return props if isinstance(props, dict) else {}


def _arg_rules(i: int, schema: str, layout: ArgLayout, tokens: Tokens) -> str:
    """Rule ``value{i}``: the arguments of ``schema`` (an object's JSON Schema) in ``layout``, one per
    property (in declared order, or sorted where the layout says), each optional unless
    ``required``, two apart by the layout's separator. A string (or untyped) value is its text in
    the layout's quotes (or up to the tag's end), a string enum one of its values, any other value
    its JSON (the parsers read a non-string value as JSON)."""
    doc = json.loads(schema)
    props = _properties(doc)
    required = set(doc.get("required") or ()) if isinstance(doc, dict) else set()
    quote = _marker(layout.quote, tokens) if layout.quote else ""
    end = _marker(layout.after, tokens) if layout.after else ""
    rules, args = [], []
    for j, key in enumerate(sorted(props, key=str.lower) if layout.sort else props):  # (as jinja's dictsort)
        sub = props[key] if isinstance(props[key], dict) else {}
        enum = sub.get("enum")

        def text_to(stop: str, name: str = f"text{i}_{j}") -> str:  # free text, then ``stop``
            if _ends_at_token(stop, tokens):
                return f"/(?s:.*)/ {_marker(stop, tokens)}"
            rules.append(f"{name}[lazy]: /(?s:.*){_regex(stop)}/")
            return name

        if layout.quote == '"' or sub.get("type") not in (None, "string"):  # (a JSON string is Python's too)
            rules.append(f"json{i}_{j}: %json {_styled(json.dumps(sub))}")
            value = " ".join(filter(None, [f"json{i}_{j}", end]))
        elif enum and all(isinstance(v, str) for v in enum):
            value = " ".join(filter(None, [quote, "(" + " | ".join(json.dumps(v) for v in enum) + ")", quote, end]))
        elif layout.quote:
            value = " ".join(filter(None, [quote, text_to(layout.quote), end]))
        else:  # a tag's text, up to its end
            value = text_to(layout.after)
        rules.append(f"arg{i}_{j}: {_marker(f'{layout.before}{key}{layout.between}', tokens)} {value}")
        args.append((f"arg{i}_{j}", key in required))
    seq = _args_seq(i, args, _marker(layout.sep, tokens) if layout.sep else "", rules)
    return f"value{i}: {seq}\n" + "".join(f"{r}\n" for r in rules)


def _args_seq(i: int, args: list[tuple[str, bool]], sep: str, rules: list[str]) -> str:
    """The arguments in order, each present or not (``args``: rule name, required), two apart by
    ``sep``. Without a separator each is optional in turn; with one, a chain of rules added to
    ``rules``: ``first{i}_{j}``, from ``j`` on, none written yet; ``rest{i}_{j}``, from ``j`` on,
    after one."""
    if not args:
        return '""'
    if not sep:
        return " ".join(rule if req else f"{rule}?" for rule, req in args)
    for j, (rule, req) in enumerate(args):
        rest = f" rest{i}_{j + 1}" if j + 1 < len(args) else ""
        skip = f"first{i}_{j + 1}" if j + 1 < len(args) else '""'
        if j:  # (a rest0 would follow nothing: no rule needs it)
            rules.append(f"rest{i}_{j}: " + (f"{sep} {rule}" if req else f"({sep} {rule})?") + rest)
        rules.append(f"first{i}_{j}: {rule}{rest}" + ("" if req else f" | {skip}"))
    return f"first{i}_0"


def _ends_at_token(end: str, tokens: Tokens) -> bool:
    """Whether the text ``end`` closes starts with one of ``tokens``: no token is text, so a free
    text before it can be ``/(?s:.*)/`` (else a lazy regex that ends with ``end``'s text)."""
    return any(end.startswith(t) for t, _ in tokens)


def _marker(text: str, tokens: Tokens) -> str:
    """``text`` as a lark sequence: each of ``tokens`` (longest first) in it named as a token,
    the text between them as string literals, a :data:`GAP` as an optional newline, a
    :data:`CALL_ID` as the nine letters or digits of a call's id."""
    parts, i, j = [], 0, 0
    while j < len(text):
        tok = next(((t, name) for t, name in tokens if text.startswith(t, j)), None)
        if tok is None and text[j] == GAP:
            tok = (GAP, '"\\n"?')
        if tok is None and text[j] == CALL_ID:
            tok = (CALL_ID, "/[A-Za-z0-9]{9}/")
        if tok is None:
            j += 1
            continue
        if j > i:
            parts.append(json.dumps(text[i:j]))
        parts.append(tok[1])
        i = j = j + len(tok[0])
    if j > i:
        parts.append(json.dumps(text[i:j]))
    return " ".join(parts)


def _styled(schema: str) -> str:
    """``schema`` with :data:`STYLE` (a boolean schema as its object form)."""
    doc = json.loads(schema)
    if doc is True:
        doc = {}
    if not isinstance(doc, dict):
        return schema
    own = doc.get("x-guidance")
    return json.dumps({**doc, "x-guidance": {**STYLE, **(own if isinstance(own, dict) else {})}})


#: what a literal escapes inside a lark ``/.../`` regex (Rust's regex syntax, plus the delimiter)
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def _regex(text: str) -> str:
    """``text`` as a literal inside a lark ``/.../`` regex (control characters escaped: a tag's
    newline)."""
    return "".join(_REGEX_ESCAPES.get(c) or ("\\" + c if c in _REGEX_META else c) for c in text)


_REGEX_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


class Grammars:
    """The model's side of structured output: llguidance's view of the tokenizer (built once, at
    the first request that needs it: about a second), the grammars compiled over it, and the
    processors made from them."""

    #: compiled grammars kept (by their text): a client sends the same schema turn after turn
    KEEP = 16

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self._ll: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar → its fresh matcher

    def prepare(self, grammar: str = "") -> None:
        """Build llguidance's view of the tokenizer now (once), and compile ``grammar`` (if
        given): any thread. The server does both off the engine thread, where a large schema's
        compile (~15 ms for 40 nested properties on a 2-core CPU) delays nobody's decode."""
        self._llg()
        if grammar:
            self._matcher(grammar)

    def _llg(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                eos = sorted(int(t) for t in self.tokenizer.eos_token_ids)
                hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
                self._ll = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                        eos_token=eos or None)  # fmt: skip
            return self._ll

    def _matcher(self, grammar: str) -> Any:
        """A matcher of ``grammar`` at its start, of the request's own: a copy (microseconds) of
        the one compiled for the text, compiled now if none is kept."""
        from llguidance import LLMatcher
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        with self._lock:
            kept = self._compiled.get(grammar)
            if kept is not None:
                self._compiled.move_to_end(grammar)
                return kept.deep_copy()
        kept = LLMatcher(self._llg(), LLMatcher.grammar_from_lark(grammar))
        if kept.is_error():  # checked at the edge: a defect here, not the client's
            raise RuntimeError(f"structured output: {kept.get_error()}")
        # its first mask, once: the lexer's tables it builds are shared by the copies
        fill_next_token_bitmask(kept, allocate_token_bitmask(1, self.vocab_size))
        with self._lock:
            self._compiled[grammar] = kept
            while len(self._compiled) > self.KEEP:
                self._compiled.popitem(last=False)
        return kept.deep_copy()

    def processor(self, grammar: str, prompt_len: int) -> Constrained:
        """The logits processor of one request (``grammar``: its :func:`lark` text) whose prompt
        has ``prompt_len`` ids."""
        return Constrained(self._matcher(grammar), prompt_len, self.vocab_size)


class Constrained:
    """A logits processor (mlx-lm's signature: ``(ids so far, logits (1, V)) -> logits``): the
    matcher consumes the ids sampled since its last call (the ids past the prompt), then every
    token it does not allow next gets ``-inf``. Runs on the engine thread; reading the sampled ids
    waits for the step that sampled them (a constrained request decodes without pipelining: on an
    H100, 8B shape, 0.84-0.90x of free decoding, ``bench.structured``). Setting the step's forward
    running before the mask was computed (``mx.async_eval`` of ``logits``) won nothing there
    (108 / 115 against 113 / 117 tok/s) and, called before the ids were read, lost a third."""

    def __init__(self, matcher: Any, prompt_len: int, vocab_size: int) -> None:
        from llguidance.numpy import allocate_token_bitmask

        self.matcher, self.prompt_len, self.vocab_size = matcher, prompt_len, vocab_size
        self.consumed = 0  # output ids the matcher has taken
        self._mask = allocate_token_bitmask(1, vocab_size)

    def __call__(self, ids: mx.array, logits: mx.array) -> mx.array:
        from llguidance.numpy import fill_next_token_bitmask

        out = int(ids.size) - self.prompt_len
        if out > self.consumed:
            new: list[int] = ids[self.prompt_len + self.consumed :].tolist()  # type: ignore[assignment]
            for t in new:
                # a whole value is followed by the end-of-sequence token, which the batch's next
                # step feeds here before the loop ends the request: nothing is left to check
                if self.matcher.is_stopped():
                    break
                if not self.matcher.consume_token(t):
                    raise RuntimeError(f"structured output: {self.matcher.get_error()}")
            self.consumed = out
        fill_next_token_bitmask(self.matcher, self._mask)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        width = int(logits.shape[-1])
        allowed = np.zeros(width, dtype=bool)
        n = min(width, self.vocab_size)
        allowed[:n] = bits[:n].astype(bool)
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))
