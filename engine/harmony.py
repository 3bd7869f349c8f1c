"""gpt-oss's harmony output → OpenAI chat output: reasoning, content and tool calls, streamed or whole.

A harmony output is a run of messages, each a header and a body (the chat template's generation
prompt, ``<|start|>assistant``, opens the first)::

    [<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY<|end|>

``analysis`` is reasoning; ``final``, and ``commentary`` to nobody (a preamble the user sees), are
content; a message to ``functions.NAME`` is a call of NAME whose body is its JSON arguments. A call
ends with ``<|call|>`` and the answer with ``<|return|>``, both end-of-sequence tokens, so the
output usually stops before them (the engine does not show an end token's text). Text before any
header (a model that writes no channel) is content.

:class:`HarmonyOutput` is :class:`engine.output.ChatOutput`'s counterpart for this format (the same
``feed`` / ``finish`` / ``result`` / ``settled`` / ``shown``); :func:`engine.respond.chat_prompt`
picks it where :meth:`engine.output_format.OutputFormat.of` finds the harmony markers in the
vocabulary. Transport-free and MLX-free.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from engine.output import BREAK, Delta, OutputCalls, Spans, finish_reason
from engine.output_format import NORMAL, REASONING, OutputFormat
from engine.tool_calls import CALL_ID_PREFIX, CallParser, parse_harmony

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
#: what ends a message's body (``START`` / ``CHANNEL``: the next header, where a model left out the end)
ENDS = (END, CALL, RETURN)
NEXT = (START, CHANNEL)
MARKERS = (START, END, MESSAGE, CHANNEL, CALL, RETURN, CONSTRAIN)
_LONGEST = max(map(len, MARKERS))
#: how a header begins: a marker, or the recipient (written before the channel)
_HEADS = ("<|", "to=")
#: a header is no longer than this (a longer run of text without ``<|message|>`` is content)
HEADER_MAX = 256
#: the recipient of calls of the request's functions
FUNCTIONS = "functions."
_TO = re.compile(r"to=([^\s<]+)")
_WORD = re.compile(r"\s*([^\s<]+)")


def header_of(text: str) -> tuple[str, str]:
    """(channel, recipient) of a message header's text ("" where it names none): the word after
    ``<|channel|>``, and ``to=``'s (before or after the channel, as the template and the model
    write it)."""
    to = _TO.findall(text)
    at = text.find(CHANNEL)
    word = _WORD.match(text, at + len(CHANNEL)) if at >= 0 else None
    return (word.group(1) if word else ""), (to[-1] if to else "")


def _could_be_header(head: str) -> bool:
    """Whether ``head`` (the text since the last message, less its leading whitespace) may be a
    header the next text completes."""
    return any(head.startswith(h) or h.startswith(head) for h in _HEADS)


def _could_be_marker(tail: str) -> bool:
    """Whether ``tail`` may be the start of a marker the next text completes."""
    return any(m.startswith(tail) and len(tail) < len(m) for m in MARKERS)


class HarmonyOutput:
    """One request's harmony output parser: ``feed(text) -> Delta``; ``finish(engine_reason, cut) ->
    (Delta, finish_reason)``; ``result`` accumulates everything shown."""

    def __init__(
        self,
        fmt: OutputFormat,
        tools: list[dict[str, Any]] | None = None,
        parse_tools: bool = True,
        parallel_tool_calls: bool = True,
        taken_ids: set[str] | None = None,
        call_id_prefix: str = CALL_ID_PREFIX,
    ) -> None:
        self.fmt, self.parse_tools = fmt, parse_tools
        self._calls = CallParser(parse_harmony, "harmony", tools, call_id_prefix)
        self.calls = OutputCalls(self._calls, parallel_tool_calls, taken_ids)
        self.starts_in_reasoning = False  # a harmony prompt opens a message, never a channel
        self.fed = 0
        self.shown = Spans()
        self.result = Delta()
        self._buf = ""  # text fed and not yet placed: a header being read, or a marker's start
        self._at = 0  # where ``_buf`` starts in the text fed
        self._header = True  # reading a header (else a body)
        self._channel = self._recipient = ""
        self._call = ""  # the open call message's body
        self._call_at = 0  # where the open call message starts (it may yet be shown as text)
        self._call_head = ""  # its header's text
        self._said = {NORMAL: False, REASONING: False}
        self._new = {NORMAL: False, REASONING: False}  # a new message of the channel began
        self._finished = False

    # -- feeding ---------------------------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        out = Delta()
        self.fed += len(text)
        self._buf += text
        while self._step(out):
            pass
        self.result.merge(out)
        return out

    def _step(self, out: Delta) -> bool:
        """Place what of ``_buf`` can be placed now; True while there may be more."""
        buf = self._buf
        if not buf:
            return False
        if self._header:
            i = buf.find(MESSAGE)
            if i < 0:
                head = buf.lstrip()
                if len(buf) <= HEADER_MAX and _could_be_header(head):
                    return False  # still a header, perhaps
                self._open("", "")  # no header: content
                return True
            self._open(*header_of(buf[:i]), skip=i + len(MESSAGE))
            return True
        ends = [(j, m) for m in ENDS + NEXT if (j := buf.find(m)) >= 0]
        if ends:
            j, marker = min(ends)
            self._body(buf[:j], out)
            self._take(j)
            self._close(out)
            self._take(len(marker) if marker in ENDS else 0)
            self._header = True
            return True
        hold = next((k for k in range(max(0, len(buf) - _LONGEST), len(buf))
                     if buf[k] == "<" and _could_be_marker(buf[k:])), len(buf))  # fmt: skip
        self._body(buf[:hold], out)
        self._take(hold)
        return False

    def _take(self, n: int) -> None:
        self._buf, self._at = self._buf[n:], self._at + n

    def _open(self, channel: str, recipient: str, skip: int = 0) -> None:
        """A message begins (its header ``skip`` characters long)."""
        self._channel, self._recipient, self._header = channel, recipient, False
        if recipient:
            # (shown should it be no call: the header less the role the output repeats)
            self._call, self._call_at = "", self._at
            self._call_head = self._buf[:skip].removeprefix(START + "assistant")
        else:
            self._new[REASONING if channel == "analysis" else NORMAL] = True
        self._take(skip)

    def _body(self, text: str, out: Delta) -> None:
        if not text:
            return
        if self._recipient:
            self._call += text
            return
        channel = REASONING if self._channel == "analysis" else NORMAL
        if self._new[channel] and self._said[channel]:  # a channel resumed: one separator
            out.say(channel, "\n" if channel == REASONING else BREAK[NORMAL])
        self._new[channel] = False
        self._said[channel] = True
        out.say(channel, text)
        if channel == NORMAL:
            self.shown.add(self._at, self._at + len(text))

    def _close(self, out: Delta, cut: bool = False) -> None:
        """The open message ended; a call message becomes the request's call, or (naming none of
        its functions, or ``cut`` short) the text it was."""
        if not self._recipient:
            return
        recipient, self._recipient = self._recipient, ""
        calls = None
        if self.parse_tools and not cut and recipient.startswith(FUNCTIONS):
            calls = self._calls.calls(recipient[len(FUNCTIONS) :] + MESSAGE + self._call)
        if not calls:
            self._said[NORMAL] = True
            out.say(NORMAL, self._call_head + self._call)
            self.shown.add(self._call_at, self._at)
            return
        self.calls.add(calls, out)

    def finish(self, engine_reason: str | None, cut: bool = False) -> tuple[Delta, str | None]:
        """End of output: the text held (a header no body followed is dropped), an open call
        closed (by ``<|call|>``, the end token the output stopped at) or, cut short (``length``,
        a stop string), shown as text; the OpenAI finish reason."""
        out = Delta()
        if self._header:
            head = self._buf.lstrip()
            if head and not head.startswith(_HEADS):
                self._open("", "")
        if not self._header:
            self._body(self._buf, out)
            self._take(len(self._buf))
            self._close(out, cut or engine_reason == "length")
        self._finished = True
        self.result.merge(out)
        return out, finish_reason(engine_reason, self.calls.n > 0)

    @property
    def settled(self) -> int:
        """Characters before this position are settled: shown as content, or never to be."""
        if self._finished:
            return sys.maxsize
        return min(self._at, self._call_at) if self._recipient else self._at
