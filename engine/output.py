"""Model text out → OpenAI chat output: content, reasoning and tool calls, streamed or whole.

Transport-free and MLX-free: a :class:`ChatOutput` is made per request on the HTTP side and fed the
decoded text pieces the engine produces; each ``feed`` returns the :class:`Delta` that is safe to show
now, ``finish`` the rest and the OpenAI ``finish_reason``. Concatenating the deltas gives exactly what the
non-streamed response carries, because that one is built by the same object fed the whole text at once.

What the markers are comes from mlx-lm, which picks them from the model's chat template and vocabulary
(``TokenizerWrapper.tool_parser`` / ``tool_call_start`` / ``tool_call_end``, ``think_start`` /
``think_end``; ``mlx_lm/tool_parsers/`` holds one parser per family). The splitting is mlx-lm's
``TextStateMachine`` (text-level, so a marker split over tokens or merged with the next byte still
matches). Ours on top: the Hermes fallback for templates that ignore ``tools`` (the server injects the
Hermes instructions, so it parses Hermes), Llama 3.x's calls (no markers: the whole answer is the call's
JSON, as its template writes calls back; mlx-lm has no parser for them), whitespace next to markers kept
out of ``content`` and ``reasoning`` (templates strip it when they re-render history), a call that does
not parse shown as text, and ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine

from engine import chat

log = logging.getLogger(__name__)
NORMAL, REASONING, TOOL = "normal", "reasoning", "tool"
THINK_TOOL = "think_tool"  # a call block opened inside a think block: it closes back into reasoning
CALLS = (TOOL, THINK_TOOL)
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a call with it
# What joins a channel's text across a break where the model wrote no whitespace: two think
# blocks back to back are two thoughts; content gets nothing the model did not write.
BREAK = {REASONING: "\n", NORMAL: ""}
Parser = Callable[[str, Any], Any]


def parse_hermes(text: str, tools: Any = None) -> dict[str, Any]:
    """The JSON inside one ``<tool_call>`` block (``arguments`` or ``parameters``). Raises ValueError."""
    obj = json.loads(text.strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call object")
    return {"name": obj["name"], "arguments": obj.get("arguments", obj.get("parameters", {}))}


def tool_names(tools: Any) -> set[str]:
    """The function names of a request's (chat-form) tools."""
    return {t["function"].get("name") for t in tools or ()
            if isinstance(t, dict) and isinstance(t.get("function"), dict)}  # fmt: skip


def parse_json_calls(text: str, tools: Any = None) -> list[dict[str, Any]]:
    """Llama 3.x calls: the whole output is one or more JSON objects ``{"name": …, "parameters":
    {…}}`` (after an optional ``<|python_tag|>``, separated by ``;`` or whitespace), each naming one
    of the request's tools (a JSON answer that names none is an answer). Raises ValueError."""
    body, at, calls = text.strip().removeprefix(PYTHON_TAG), 0, []
    names = tool_names(tools)
    decoder = json.JSONDecoder()
    while True:
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
        if at == len(body):
            break
        obj, at = decoder.raw_decode(body, at)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("not a tool call object")
        if names and obj["name"] not in names:
            raise ValueError(f"{obj['name']!r} is none of the request's tools")
        args = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(args, (dict, str)):
            raise ValueError("the call's parameters are not an object")
        calls.append({"name": obj["name"], "arguments": args})
    if not calls:
        raise ValueError("no call")
    return calls


@dataclass(frozen=True)
class OutputFormat:
    """The markers of one tokenizer: think block, tool-call block (end "" = to the end of the output)
    and the parser of a block's text; ``parser_name`` names the mlx-lm parser module ("hermes",
    "llama3_json": ours). ``whole``: calls have no markers; an output that starts as a call (``{``
    or ``<|python_tag|>``) is held to its end and parsed whole (Llama 3.x)."""

    think: tuple[str, str] | None = None
    tool: tuple[str, str] = (HERMES_START, HERMES_END)
    parse: Parser = parse_hermes
    parser_name: str = "hermes"
    whole: bool = False

    @classmethod
    def of(cls, tokenizer: Any) -> OutputFormat:
        """What ``tokenizer`` (an mlx-lm TokenizerWrapper, or any HF tokenizer) and its chat template
        say: Hermes where the template ignores ``tools`` (the server injects Hermes instructions,
        :mod:`engine.chat`), so calls come back as Hermes whatever mlx-lm infers; Llama 3.x's bare
        JSON where the template writes calls back so and mlx-lm has no parser; else mlx-lm's."""
        think = None
        if getattr(tokenizer, "has_thinking", False):
            think = (str(tokenizer.think_start), str(tokenizer.think_end))
        if not chat.template_supports_tools(tokenizer):
            return cls(think)
        parser = getattr(tokenizer, "tool_parser", None)
        if parser is None and chat.template_writes_json_calls(tokenizer):
            return cls(think, ("", ""), parse_json_calls, "llama3_json", whole=True)
        if parser is None or not getattr(tokenizer, "tool_call_start", None):
            return cls(think)
        tool = (str(tokenizer.tool_call_start), str(tokenizer.tool_call_end or ""))
        return cls(think, tool, parser, parser.__module__.rsplit(".", 1)[-1])

    def opens_reasoning(self, prompt_text: str, continued: str = "") -> bool:
        """Whether the model starts inside a think block: the generation prompt opens one (the
        prompt ends with the opener: GLM-4.7, MiniMax-M2, DeepSeek-R1), or the assistant message
        it continues (``continued``: its text) left one open. A marker in the conversation's own
        text — a user message or a tool result quoting ``<think>`` — opens nothing."""
        if self.think is None:
            return False
        start, end = self.think
        head = prompt_text
        if continued:
            s, e = continued.rfind(start), continued.rfind(end)
            if s != e:  # the continued text has a marker: its last one decides
                return s > e
            cut = prompt_text.rfind(continued.strip())
            head = prompt_text[:cut] if cut >= 0 else ""
        return head.rstrip().endswith(start)

    def forced_prefix(self, tool_choice: Any, calls_before: int = 0) -> str:
        """Text after the generation prompt that makes the model call (``required``) or call one
        named function; formats we cannot name a function in get the call opener only.
        ``calls_before``: the calls in the conversation so far (Kimi numbers its call ids by it)."""
        if tool_choice == "required":
            if self.whole:
                return '{"name": "'
            return self.tool[0] + ("\n" if self.tool[0] == HERMES_START else "")
        if not isinstance(tool_choice, dict):
            return ""
        name = str(tool_choice["function"]["name"])
        named = _NAMED.get(self.parser_name)
        return named.format(start=self.tool[0], name=name, index=calls_before) if named else self.tool[0]

    def machine(self, tools: bool) -> TextStateMachine:
        """mlx-lm's text state machine over our markers (the tool edges only when calls are parsed)."""
        return TextStateMachine(self.edges(tools))

    def edges(self, tools: bool) -> dict[str, list[tuple[str, str]]]:
        """State → ``[(marker, next state)]``; no two edges of a state lead to one state."""
        edges: dict[str, list[tuple[str, str]]] = {NORMAL: []}
        if self.think is not None:
            edges[NORMAL].append((self.think[0], REASONING))
            edges[REASONING] = [(self.think[1], NORMAL)]
        if tools and not self.whole:
            edges[NORMAL].append((self.tool[0], TOOL))
            edges[TOOL] = [(self.tool[1], NORMAL)] if self.tool[1] else []
            if self.think is not None:  # GLM and Qwen3 call from inside a think block
                edges[REASONING].append((self.tool[0], THINK_TOOL))
                edges[THINK_TOOL] = [(self.think[1], NORMAL)]  # the block did not close
                if self.tool[1]:
                    edges[THINK_TOOL].append((self.tool[1], REASONING))
        return edges


# Forced named calls: the opening of a call to {name}, in each family's own syntax.
_NAMED = {
    "hermes": '{start}\n{{"name": "{name}", "arguments": ',
    "json_tools": '{start}\n{{"name": "{name}", "arguments": ',
    "qwen3_coder": "{start}\n<function={name}>\n",
    "glm47": "{start}{name}",
    "kimi_k2": "{start}<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>",
    "minimax_m2": '{start}\n<invoke name="{name}">\n',
    "mistral": "{start}{name}[ARGS]",
    "gemma4": "{start}call:{name}{{",
    "pythonic": "{start}[{name}(",
    "llama3_json": '{{"name": "{name}", "parameters": ',
}


# Formats whose call block holds several calls, each in markers of its own (Kimi's section of
# ``<|tool_call_begin|>…<|tool_call_end|>``, MiniMax's ``<invoke …>…</invoke>``): the one call text
# each parser reads alone.
_EACH_CALL = {
    "kimi_k2": re.compile(r"<\|tool_call_begin\|>.*?<\|tool_call_end\|>", re.DOTALL),
    "minimax_m2": re.compile(r"<invoke name=.*?</invoke>", re.DOTALL),
}


@dataclass
class Delta:
    """What to show now; ``tool_calls`` are complete OpenAI calls carrying their stream ``index``.
    ``parts``: the same in the order it came (``("reasoning" | "content", text)``, ``("tool",
    call)``), for APIs whose items keep it (a text after a call is after it)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parts: list[tuple[str, Any]] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.parts:  # made of its fields: reasoning, content, then the calls
            kinds = [("reasoning", self.reasoning), ("content", self.content)]
            self.parts = [(k, x) for k, x in kinds if x] + [("tool", c) for c in self.tool_calls]

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def say(self, channel: str, text: str) -> None:
        """Text of ``channel`` (NORMAL / REASONING)."""
        if not text:
            return
        kind = "content" if channel == NORMAL else "reasoning"
        setattr(self, kind, getattr(self, kind) + text)
        if self.parts and self.parts[-1][0] == kind:
            self.parts[-1] = (kind, self.parts[-1][1] + text)
        else:
            self.parts.append((kind, text))

    def call(self, call: dict[str, Any]) -> None:
        self.tool_calls.append(call)
        self.parts.append(("tool", call))

    def merge(self, other: Delta) -> None:
        for kind, x in other.parts:
            if kind == "tool":
                self.call(x)
            else:
                self.say(NORMAL if kind == "content" else REASONING, x)

    def sse_deltas(self) -> list[dict[str, Any]]:
        """OpenAI ``delta`` objects in the order they came: reasoning (as ``reasoning_content``, the
        field OpenAI-compatible clients read, and ``reasoning``, mlx_lm.server's), content, calls."""
        out: list[dict[str, Any]] = []
        for kind, x in self.parts:
            if kind == "reasoning":
                out.append({"reasoning_content": x, "reasoning": x})
            elif kind == "content":
                out.append({"content": x})
            else:
                out.append({"tool_calls": [x]})
        return out


class Spans:
    """Sorted, disjoint ``[start, end)`` spans of positions (of the characters fed a ChatOutput)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self.starts, start)
        if i and self.ends[i - 1] == start:  # joins the one before (the usual case: the last)
            self.ends[i - 1] = end
            return
        self.starts.insert(i, start)
        self.ends.insert(i, end)

    def meets(self, start: int, end: int) -> bool:
        """Whether a span holds a position of ``[start, end)``."""
        i = bisect.bisect_left(self.starts, end)  # the spans before i start before ``end``
        return i > 0 and self.ends[i - 1] > start


class Items:
    """A request's deltas as the items of APIs that stream typed output items (Anthropic's content
    blocks, OpenAI's Responses output items): a run of reasoning or of content is one item, open
    while the same channel goes on; each tool call is an item of its own, whole. :meth:`steps`
    gives ``("open", channel, None)``, ``("text", channel, text)``, ``("close", channel, None)`` and
    ``("call", "tool", call)`` in order; :meth:`close` ends the open item at the finish."""

    def __init__(self) -> None:
        self.open: str | None = None  # "reasoning" / "content"
        self.seen: set[str] = set()  # the channels an item was opened for

    def steps(self, d: Delta) -> list[tuple[str, str, Any]]:
        out: list[tuple[str, str, Any]] = []
        for kind, x in d.parts:
            if kind == "tool":
                out += self.close()
                out.append(("call", "tool", x))
                continue
            if self.open != kind:
                if kind in self.seen:  # a channel resumed: its separator joins text, not items
                    x = x.lstrip()
                    if not x:
                        continue
                out += self.close()
                out.append(("open", kind, None))
                self.open = kind
                self.seen.add(kind)
            out.append(("text", kind, x))
        return out

    def close(self) -> list[tuple[str, str, Any]]:
        if self.open is None:
            return []
        channel, self.open = self.open, None
        return [("close", channel, None)]


class ChatOutput:
    """One request's output parser. ``feed(text) -> Delta``; ``finish(engine_reason) -> (Delta,
    finish_reason)``; ``result`` accumulates everything shown (the non-streamed message)."""

    def __init__(
        self,
        fmt: OutputFormat,
        tools: list[dict[str, Any]] | None = None,
        parse_tools: bool = True,
        parallel_tool_calls: bool = True,
        start_in_reasoning: bool = False,
        taken_ids: set[str] | None = None,
    ) -> None:
        """``taken_ids``: call ids the conversation already holds (never given to a new call)."""
        self.fmt, self.tools, self.parallel = fmt, tools, parallel_tool_calls
        self.ids = set(taken_ids or ())
        self._names = tool_names(tools)
        edges = fmt.edges(parse_tools)
        self._sm = TextStateMachine(edges).make_state(REASONING if start_in_reasoning else NORMAL)
        self._marker = {(src, dst): m for src, out in edges.items() for m, dst in out}
        self._state = self._sm[0]
        # Where the text is: positions count characters fed (``fed``); ``shown`` holds the spans
        # of them shown as content (engine/respond.py lists the log-probabilities of their tokens)
        self.fed = 0
        self.shown = Spans()
        self._at = 0  # the first character the state machine has not given back (it may be a marker's)
        self._block_at = 0  # where the open call block's opener starts
        self._finished = False
        self._tool_text = ""
        self._space = ""  # the whitespace before the open call block
        # trailing whitespace per channel, shown once more text follows (it might precede a
        # marker); with no marker to parse, nothing is held: a first "\n" token streams at once
        self._held = {NORMAL: "", REASONING: ""}
        self._markers = fmt.think is not None or parse_tools
        self._lstrip = {NORMAL: False, REASONING: start_in_reasoning}
        self._said = {NORMAL: False, REASONING: False}  # whether a channel has shown text
        # per channel, what joins its text when it resumes after a break with no whitespace of
        # its own: the whitespace written before the break, else BREAK's
        self._gap = {NORMAL: "", REASONING: ""}
        self._gap_at: dict[str, int | None] = {NORMAL: None, REASONING: None}  # (None: BREAK's)
        # formats whose calls are the whole output: the output so far while it may be one
        self._lead: str | None = "" if fmt.whole and parse_tools and not start_in_reasoning else None
        self.n_calls = 0
        self.result = Delta()

    # -- feeding ---------------------------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        out = Delta()
        self.fed += len(text)
        self._feed(self._leading(text) if self._lead is not None else text, out)
        self.result.merge(out)
        return out

    def _feed(self, text: str, out: Delta) -> None:
        if text:
            self._sm, segments = TextStateMachine.split(self._sm, text)
            for state, piece in segments:
                if state != self._state:  # past the marker between them
                    self._at += len(self._marker[self._state, state])
                self._segment(state, piece, out)

    def _leading(self, text: str) -> str:
        """Held while the output may still be a whole-output call (it starts with ``{`` or the
        python tag, after whitespace); all of it once it cannot."""
        assert self._lead is not None
        self._lead += text
        head = self._lead.lstrip()
        if not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
            return ""
        text, self._lead = self._lead, None
        return text

    def finish(self, engine_reason: str | None, cut: bool = False) -> tuple[Delta, str | None]:
        """End of output: pending text, an open call block parsed (formats without an end marker run
        to the end; whole-output calls parsed, or shown as text; one whose end never came —
        ``length``, or ``cut`` by a stop string — shown as text), and the OpenAI finish reason
        (``tool_calls`` when a call ended the output)."""
        out = Delta()
        if self._lead is not None:
            held, self._lead = self._lead, None
            if not (held.strip() and self._add_calls(held, out)):
                self._feed(held, out)
        self._sm, rest, _ = TextStateMachine.flush(self._sm)
        if rest:
            self._segment(self._state, rest, out)
        if self._state in CALLS:
            if self.fmt.tool[1] and (cut or engine_reason == "length"):
                self._cut_call(out)  # its end never came: lenient parsers made calls of halves
            else:
                self._close_call(out, closed=not self.fmt.tool[1])
            self._state = NORMAL
        if not self.n_calls and self._state == NORMAL:
            if not self._lstrip[NORMAL]:  # (a separator no text followed is nothing)
                held = self._held[NORMAL]  # plain text keeps its trailing whitespace
                self._say(NORMAL, held, out, (self._at - len(held), self._at))
        self._finished = True
        self.result.merge(out)
        return out, _finish_reason(engine_reason, self.n_calls > 0)

    @property
    def settled(self) -> int:
        """Characters before this position are settled: shown as content, or never to be."""
        if self._finished:
            return sys.maxsize
        if self._lead is not None:  # all of it may yet be a call
            return 0
        at = self._at - len(self._held[NORMAL])  # (whitespace held may yet be shown)
        if self._state == TOOL:  # the block may yet be text
            at = min(at, self._block_at - len(self._space))
        gap = self._gap_at[NORMAL]
        if gap is not None and self._said[NORMAL] and (self._state != NORMAL or self._lstrip[NORMAL]):
            at = min(at, gap)  # the content's whitespace before a break, shown should it go on
        return at

    def _segment(self, state: str, piece: str, out: Delta) -> None:
        if state != self._state:
            self._transition(self._state, state, out)
        if state in CALLS:
            self._tool_text += piece
        elif state in (NORMAL, REASONING):
            self._show(state, piece, out)
        self._at += len(piece)

    def _transition(self, old: str, new: str, out: Delta) -> None:
        if (old, new) == (THINK_TOOL, NORMAL):
            self._cut_call(out)  # the think block ended inside it: a mention, never parsed
            self._gap[REASONING] = BREAK[REASONING]
        elif old in CALLS:
            self._close_call(out, closed=True)
        elif old in self._held:
            # whitespace before a marker is not text, unless the block turns out to be text
            held, at = self._held[old], self._at - len(self._marker[old, new]) - len(self._held[old])
            self._gap[old], self._gap_at[old] = (held, at) if held else (BREAK[old], None)
            self._space, self._held[old] = held, ""
        if new in CALLS:
            self._tool_text = ""
            self._block_at = self._at - len(self._marker[old, new])
        elif old in (REASONING, THINK_TOOL) or new == REASONING:
            self._lstrip[new] = True  # nor is whitespace just inside or after a think block
        self._state = new

    def _show(self, channel: str, text: str, out: Delta) -> None:
        at = self._at  # where ``text`` is; the whitespace held ends there
        held_at: int | None = at - len(self._held[channel])
        if self._lstrip[channel]:
            stripped = text.lstrip()
            if self._said[channel]:  # a channel resumed (interleaved thinking): one separator
                self._held[channel] += text[: len(text) - len(stripped)]
            at += len(text) - len(stripped)
            text = stripped
            if not text:
                return
            self._lstrip[channel] = False
            if self._said[channel] and not self._held[channel]:  # none written after the break
                self._held[channel], held_at = self._gap[channel], self._gap_at[channel]
            self._gap[channel], self._gap_at[channel] = "", None
        body = text.rstrip() if self._markers else text
        if body:
            held = self._held[channel]
            self._held[channel] = text[len(body) :]
            self._said[channel] = True
            spans = [(at, at + len(body))]
            if held_at is not None:
                spans.append((held_at, held_at + len(held)))
            self._say(channel, held + body, out, *spans)
        else:
            self._held[channel] += text

    def _say(self, channel: str, text: str, out: Delta, *spans: tuple[int, int]) -> None:
        """``text`` shown in ``channel``; ``spans``: where it is in the text fed (content's kept)."""
        out.say(channel, text)
        if channel == NORMAL:
            for start, end in spans:
                self.shown.add(start, end)

    # -- calls -----------------------------------------------------------------------------------
    def _close_call(self, out: Delta, closed: bool) -> None:
        """Parse the block just ended: its calls, or (not a call after all) text."""
        if self._add_calls(self._tool_text, out):
            self._tool_text = self._space = ""
        else:
            self._cut_call(out, self.fmt.tool[1] if closed else "")

    def _cut_call(self, out: Delta, end: str = "") -> None:
        """The block shown as the text it is (a block cut short is never parsed)."""
        text, self._tool_text = self._tool_text, ""
        channel = REASONING if self._state == THINK_TOOL else NORMAL
        if channel == REASONING and not end:
            text = text.rstrip()  # before the think block's end: not text
        shown = self._held[channel] + self._space + self.fmt.tool[0] + text + end
        self._say(channel, shown, out, (self._block_at - len(self._space), self._at))
        self._held[channel] = self._space = self._gap[channel] = ""  # its text goes on from here
        self._gap_at[channel] = None
        self._said[channel] = True

    def _add_calls(self, text: str, out: Delta) -> bool:
        """The calls ``text`` holds into ``out``, in order with the text of those of its calls that
        are none (:meth:`_calls_of`); False (nothing added) when it holds no call. A call id the
        model gave that is already taken (Kimi numbers its own) gets a fresh one."""
        parts = self._calls_of(text)
        if not any(calls for _, _, calls in parts):
            return False
        for start, end, calls in parts:
            if calls is None:  # a call of the block that is none: the text it is
                channel = REASONING if self._state == THINK_TOOL else NORMAL
                at = self._block_at + len(self.fmt.tool[0])
                self._say(channel, text[start:end], out, (at + start, at + end))
                self._said[channel] = True
                continue
            for call in calls:
                if self.n_calls and not self.parallel:
                    continue
                if call["id"] in self.ids:
                    call["id"] = self._fresh_id(call["function"]["name"])
                self.ids.add(call["id"])
                out.call({"index": self.n_calls, **call})
                self.n_calls += 1
        return True

    def _calls_of(self, text: str) -> list[tuple[int, int, list[dict[str, Any]] | None]]:
        """A block's calls: ``[(0, len(text), calls)]``, or, where the whole does not parse and its
        format marks each call (:data:`_EACH_CALL`), each call judged alone: ``(where its text
        starts and ends, its calls or None)``, so one call naming no offered tool costs only itself."""
        calls = self._parse(text)
        each = _EACH_CALL.get(self.fmt.parser_name)
        if calls is not None or each is None:
            return [(0, len(text), calls)]
        return [(m.start(), m.end(), self._parse(m.group(0))) for m in each.finditer(text)]

    def _fresh_id(self, name: str) -> str:
        """An id no call of the conversation has, in the format's own form where it has one
        (Kimi's ``functions.NAME:N``, which its template writes back to the model)."""
        if self.fmt.parser_name != "kimi_k2":
            return new_call_id(self.fmt.parser_name)
        n = 0
        while f"functions.{name}:{n}" in self.ids:
            n += 1
        return f"functions.{name}:{n}"

    def _parse(self, text: str) -> list[dict[str, Any]] | None:
        try:
            parsed = self.fmt.parse(text, self.tools)
        except Exception as e:  # third-party parsers raise ValueError, JSON, regex or key errors
            log.info("model output is not a %s tool call (%s)", self.fmt.parser_name, e)
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            if self._names and item["name"] not in self._names:
                # lenient parsers (GLM's) make a call of any text in a block: "unknown", "I"
                log.info("model output names %r, none of the request's tools", item["name"])
                return None
            call = _openai_call(item, self.fmt.parser_name)
            if call is None:
                return None
            calls.append(call)
        return calls or None


def new_call_id(parser_name: str) -> str:
    """A fresh call id. Mistral templates refuse history whose ids are not 9 alphanumerics."""
    if parser_name == "mistral":
        return uuid.uuid4().hex[:9]
    return "call_" + uuid.uuid4().hex[:24]


def _openai_call(parsed: dict[str, Any], parser_name: str) -> dict[str, Any] | None:
    """A parsed call as OpenAI's, its arguments a JSON object's text (``arguments``, or
    ``parameters`` as some models write it); None where they are no object."""
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
        "id": cid if isinstance(cid, str) and cid else new_call_id(parser_name),
        "type": "function",
        "function": {"name": parsed["name"], "arguments": args},
    }


def _finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """Engine finish reason → OpenAI's ("cancelled" happens only when nobody listens)."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"
