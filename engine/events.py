"""What a generation tells its listener, as typed values (no MLX, no transport).

The engine thread emits, for each request, in order: one :class:`Hit` (the cache lookup, so the
transport can name the tier in headers), then :class:`Chunk` values (the last one has
``finish_reason`` and ``usage``), or a :class:`Failed` at any point, and finally :data:`END`.
``None`` is never an event: a transport's idle tick is its own business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    #: XTC ("exclude top choices"): with this probability per token, every token likelier than
    #: the least likely one above the threshold is cut; ``xtc_keep`` are never cut (0: off)
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_keep: tuple[int, ...] = ()
    #: logits processors (mlx-lm's ``make_logits_processors``): 0 / None is off
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    #: -1: no log-probabilities; n >= 0: each token's, with the n likeliest tokens' at its place
    logprobs: int = -1
    #: the prompt's last id where the text continues the prompt (completions, a continued assistant
    #: message): the text is decoded after it, so a SentencePiece first token keeps its space
    after: int | None = None
    #: the output's grammar (``engine.structured.lark``: a request's JSON Schema); "" is free text
    grammar: str = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_tier: str
    ttft_seconds: float | None  # None: it ended before its first token (cancelled, failed)
    queue_seconds: float = 0.0
    #: of ``cached_tokens``, those memory held for a disk restore (``cache_tier`` "cold")
    held_tokens: int = 0


@dataclass(frozen=True)
class Hit:
    """The cache lookup's result: prompt tokens served from the cache (not those a restore
    computed on the way), and from which tier."""

    tokens: int = 0
    tier: str = "none"  # "hot" | "cold" | "none"
    held: int = 0  # of ``tokens``, those memory held for a disk restore (counted as the hot tier's)


@dataclass(frozen=True)
class Chunk:
    text: str
    token: int | None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" on the last chunk
    usage: Usage | None = None
    logprob: TokenLogprob | None = None  # when the request asked for log-probabilities
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended the text


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability (after the request's logits processors) and the
    likeliest tokens' at its place, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Failed:
    """The generation raised (or the server is stopping it); ``error`` is turned into an error
    body at the HTTP edge. ``usage``: what it had computed when it ended (None: it never ran)."""

    error: Exception
    usage: Usage | None = None


class _End:
    def __repr__(self) -> str:
        return "END"


END: Final = _End()
Event = Hit | Chunk | Failed | _End
