"""A request's output deltas as typed items: Anthropic's content blocks, Responses output items.

Pure bookkeeping over :class:`engine.output.Delta` (no transport, no MLX), one per request on the
HTTP side, streamed or whole: :mod:`engine.messages` and :mod:`engine.responses` name and shape the
items, this says where each one opens and closes.
"""

from __future__ import annotations

from typing import Any

from engine.output import Delta


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
