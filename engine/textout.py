"""Generated token ids → the text a client sees: incremental detokenisation, stop strings, limits.

Pure text logic (no MLX), one instance per request, driven by the engine thread. Text that might be
the start of a stop string is held back until it cannot be; a stop string ends the text before it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.detok import IncrementalDecoder
from engine.events import SamplingParams


class TextStream:
    """Feed sampled ids one at a time with :meth:`add`; :meth:`tail` gives the last text."""

    def __init__(self, tokenizer: Any, params: SamplingParams, eos: Iterable[int]) -> None:
        self.p = params
        self.detok = IncrementalDecoder(tokenizer, params.after)
        self.eos = set(eos)
        self.completion = 0  # tokens that became text (an end-of-sequence token does not)
        self.text = ""
        self.sent = 0  # chars of self.text already emitted
        self.stopped_by: str | None = None  # the stop string that ended the text
        self._hold = max((len(s) - 1 for s in params.stop), default=0)

    def add(self, tok: int) -> tuple[str, str | None]:
        """(text to emit now, finish reason or None) after the sampled id ``tok``."""
        if tok in self.eos:
            return "", "stop"
        self.completion += 1
        self.text += self.detok.add(tok)
        found = self._stop_at()
        if found is not None:
            cut, self.stopped_by = found
            out = self.text[self.sent : cut]
            self.sent = len(self.text)  # nothing after the stop string is ever sent
            return out, "stop"
        upto = max(self.sent, len(self.text) - self._hold)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out, ("length" if self.completion >= self.p.max_tokens else None)

    def tail(self) -> str:
        """Held-back text at the end (none after a stop string)."""
        if self.stopped_by is not None:
            return ""
        self.text += self.detok.flush()
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out

    def _stop_at(self) -> tuple[int, str] | None:
        """Where the first stop string in the text starts, and which one it is."""
        cuts = [(self.text.find(s, max(0, self.sent - len(s))), s) for s in self.p.stop if s]
        return min(((i, s) for i, s in cuts if i >= 0), default=None)
