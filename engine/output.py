"""Model text out → OpenAI chat output: content, reasoning and tool calls, streamed or whole.

Transport-free and MLX-free: a :class:`ChatOutput` is made per request on the HTTP side and fed the
decoded text pieces the engine produces; each ``feed`` returns the :class:`Delta` that is safe to show
now, ``finish`` the rest and the OpenAI ``finish_reason``. Concatenating the deltas gives exactly what the
non-streamed response carries, because that one is built by the same object fed the whole text at once.

The markers come from the tokenizer (:mod:`engine.output_format`); a call block's text becomes calls
in :mod:`engine.tool_calls`. The splitting is mlx-lm's ``TextStateMachine`` (text-level, so a marker
split over tokens or merged with the next byte still matches). Ours on top: Llama 3.x's whole-output
calls held until they can no longer be one, whitespace next to markers kept out of ``content`` and
``reasoning`` (templates strip it when they re-render history), a call that does not parse shown as
text, ``parallel_tool_calls: false``, and which characters fed were shown as content
(:class:`Spans`).
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlx_lm.generate import TextStateMachine

from engine.output_format import (
    ANSWER,
    CALLS,
    END,
    NORMAL,
    REASONING,
    THINK_TOOL,
    TOOL,
    OutputFormat,
)
from engine.tool_calls import CALL_ID_PREFIX, PYTHON_TAG, CallParser

# What joins a channel's text across a break where the model wrote no whitespace: two think
# blocks back to back are two thoughts; content gets nothing the model did not write.
BREAK = {REASONING: "\n", NORMAL: ""}


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


class OutputCalls:
    """The calls one output makes, as its parser reads them: numbered in order (their stream
    ``index``), each with an id the conversation does not hold yet (a call id the model repeats —
    Kimi numbers its own — gets a fresh one), and only the first where ``parallel_tool_calls`` is
    false."""

    def __init__(self, reader: CallParser, parallel: bool, taken_ids: set[str] | None) -> None:
        self.reader, self.parallel = reader, parallel
        self.ids = set(taken_ids or ())
        self.n = 0

    def add(self, calls: list[dict[str, Any]], out: Delta) -> None:
        for call in calls:
            if self.n and not self.parallel:
                continue
            if call["id"] in self.ids:
                call["id"] = self.reader.fresh_id(call["function"]["name"], self.ids)
            self.ids.add(call["id"])
            out.call({"index": self.n, **call})
            self.n += 1


class OutputParser(Protocol):
    """What the responses need of a request's output parser: :class:`ChatOutput`, or
    :class:`engine.harmony.HarmonyOutput` for gpt-oss's harmony format."""

    fmt: OutputFormat
    fed: int
    shown: Spans
    result: Delta
    starts_in_reasoning: bool

    def feed(self, text: str) -> Delta: ...

    def finish(self, engine_reason: str | None, cut: bool = False) -> tuple[Delta, str | None]: ...

    @property
    def settled(self) -> int: ...


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
        call_id_prefix: str = CALL_ID_PREFIX,
    ) -> None:
        """``taken_ids``: call ids the conversation already holds (never given to a new call);
        ``call_id_prefix``: what the ids made for calls begin with (the API's own)."""
        self.fmt = fmt
        self._calls = CallParser(fmt.parse, fmt.parser_name, tools, call_id_prefix)
        self.calls = OutputCalls(self._calls, parallel_tool_calls, taken_ids)
        edges = fmt.edges(parse_tools)
        #: the output starts inside a think block the prompt opened
        self.starts_in_reasoning = start_in_reasoning
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
        # the output so far while it may be the end of an empty think block it opens with (MiniMax-M3
        # answers so when it does not think): never text
        self._opening: str | None = "" if fmt.think is not None and not start_in_reasoning else None
        self.result = Delta()

    # -- feeding ---------------------------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        out = Delta()
        self.fed += len(text)
        text = self._opened(text) if self._opening is not None else text
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

    def _opened(self, text: str) -> str:
        """The output less the end of an empty think block it opens with (after whitespace): held
        while it may be one; all of it once it cannot."""
        assert self._opening is not None and self.fmt.think is not None
        self._opening += text
        head, end = self._opening.lstrip(), self.fmt.think[1]
        if head.startswith(end):
            self._at += len(self._opening) - len(head) + len(end)  # (characters fed, never given back)
            self._opening, self._lstrip[NORMAL] = None, True  # nor is whitespace after it content
            return head[len(end) :]
        if end.startswith(head):
            return ""
        text, self._opening = self._opening, None
        return text

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
        if self._opening is not None:
            held, self._opening = self._opening, None
            self._feed(self._leading(held) if self._lead is not None else held, out)
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
        if not self.calls.n and self._state in (NORMAL, ANSWER):
            self._show_held(out, self._at)
        self._finished = True
        self.result.merge(out)
        return out, finish_reason(engine_reason, self.calls.n > 0)

    @property
    def settled(self) -> int:
        """Characters before this position are settled: shown as content, or never to be."""
        if self._finished:
            return sys.maxsize
        if self._lead is not None or self._opening is not None:  # all of it may yet be a call, or nothing
            return 0
        at = self._at - len(self._held[NORMAL])  # (whitespace held may yet be shown)
        if self._state == TOOL:  # the block may yet be text
            at = min(at, self._block_at - len(self._space))
        gap = self._gap_at[NORMAL]
        if gap is not None and self._said[NORMAL] and (self._state not in (NORMAL, ANSWER) or self._lstrip[NORMAL]):
            at = min(at, gap)  # the content's whitespace before a break, shown should it go on
        return at

    def _segment(self, state: str, piece: str, out: Delta) -> None:
        if state != self._state:
            self._transition(self._state, state, out)
        if state in CALLS:
            self._tool_text += piece
        elif state in (NORMAL, REASONING):
            self._show(state, piece, out)
        elif state == ANSWER:  # content, its markers left out
            self._show(NORMAL, piece, out)
        # (END: after the message's end marker, nothing is output)
        self._at += len(piece)

    def _show_held(self, out: Delta, at: int) -> None:
        """The content's trailing whitespace (ending at ``at``), at its end: plain text keeps it."""
        if not self._lstrip[NORMAL]:  # (a separator no text followed is nothing)
            held, self._held[NORMAL] = self._held[NORMAL], ""
            self._say(NORMAL, held, out, (at - len(held), at))

    def _transition(self, old: str, new: str, out: Delta) -> None:
        if (new == END or old == ANSWER) and not self.calls.n:  # the answer ended: its text did, as written
            self._show_held(out, self._at - len(self._marker[old, new]))
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
        are none (:meth:`CallParser.calls_of`); False (nothing added) when it holds no call. A call
        id the model gave that is already taken (Kimi numbers its own) gets a fresh one."""
        parts = self._calls.calls_of(text)
        if not any(calls for _, _, calls in parts):
            return False
        for start, end, calls in parts:
            if calls is None:  # a call of the block that is none: the text it is
                channel = REASONING if self._state == THINK_TOOL else NORMAL
                at = self._block_at + len(self.fmt.tool[0])
                self._say(channel, text[start:end], out, (at + start, at + end))
                self._said[channel] = True
                continue
            self.calls.add(calls, out)
        return True


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """Engine finish reason → OpenAI's ("cancelled" happens only when nobody listens)."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"
