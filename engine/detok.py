"""Incremental detokenisation that keeps exactly the text ``tokenizer.decode(ids)`` would give.

mlx-lm's BPE streaming detokenizer drops the leading space of the first generated token; a client
that resends that text then re-tokenises it differently and the next turn's prompt stops matching
the cached ids one token early. Here each step decodes a short window of ids and emits the diff
(the approach of HF's TextStreamer): the concatenated deltas equal ``decode(all ids)``.

Why not mlx-lm's (mlx-lm 0.32.2, checked): its BPE detokenizer loses that space (a test below pins it) and
its ``NaiveStreamingDetokenizer``, exact, re-decodes the whole line per token (a 5k-token line: 13 s vs 0.16 s).
"""

from __future__ import annotations

from typing import Any

from mlx_lm import tokenizer_utils as tu


class IncrementalDecoder:
    """Feed ids one at a time; get the new text each brings (held back while a UTF-8 sequence
    is incomplete)."""

    def __init__(self, tokenizer: Any, after: int | None = None) -> None:
        """``after``: an id the text continues (the prompt's last), decoded as context only."""
        self.tokenizer = tokenizer
        self.ids: list[int] = [] if after is None else [after]
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # ids whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence at the end)."""
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]


class TokenBytes:
    """The bytes a generated token adds to the text (OpenAI's logprobs ``token`` and ``bytes``).

    ``tokenizer.decode([id])`` alone loses what a token means in context: a SentencePiece piece
    (``▁world``) decodes without its space, and a token holding part of a UTF-8 character (byte
    fallback ``<0xE2>``, or a byte-level BPE token that splits an emoji) decodes to U+FFFD. The
    bytes come from the token map of the tokenizer's mlx-lm streaming detokenizer (SentencePiece:
    ``▁`` is a space and ``<0xNN>`` a byte; byte-level BPE: GPT-2's byte alphabet); a tokenizer
    with neither falls back to decoding the id alone. As ``decode`` strips one leading space from
    a SentencePiece sequence (and so the completion's text), the first token of a completion
    loses it here too: its tokens concatenate to its text (``trim_first`` False: a text that
    continues the prompt keeps it)."""

    def __init__(self, tokenizer: Any, trim_first: bool = True) -> None:
        self._tokenizer = tokenizer
        detok: Any = getattr(tokenizer, "detokenizer", None)
        self._spm = isinstance(detok, tu.SPMStreamingDetokenizer)
        self._bpe = isinstance(detok, tu.BPEStreamingDetokenizer)
        self._map = detok.tokenmap if self._spm or self._bpe else []
        self._trim = trim_first and self._spm and bool(getattr(detok, "trim_space", False))

    def __call__(self, token: int, first: bool = False) -> bytes:
        if not (self._spm or self._bpe):
            return str(self._tokenizer.decode([token])).encode("utf-8")
        piece = self._map[token] if 0 <= token < len(self._map) else None
        if piece is None:  # a padded vocabulary's id, or one the tokenizer does not name
            return b""
        if self._spm:
            raw = piece.replace(_SPM_SPACE, b" ")
            return raw[1:] if first and self._trim and raw.startswith(b" ") else raw
        table = tu._byte_decoder()  # GPT-2's byte alphabet (mlx-lm's own table)
        return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)


_SPM_SPACE = "\u2581".encode()


def piece_text(raw: bytes) -> str:
    """A token's text for OpenAI's logprobs: its bytes as UTF-8, or, for a part of a character,
    ``bytes:`` and the bytes escaped (``bytes:\\xe2\\x9c``), as OpenAI writes such tokens."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
