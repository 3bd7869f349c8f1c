"""Eviction policy as pure functions over metadata (values in, values out: no arrays, no I/O).

Rules (one place each):
* :func:`is_continuation` — when a hit makes the request a continuation of the stored entry.
* :func:`prompt_resent` — when a new entry makes a stored one that diverges from it redundant.
* :func:`servable_tokens` — a full hit still recomputes the last prompt token (its logits are needed).
* :func:`servable` — what a stored entry can serve (the checkpoint rules are :mod:`checkpoints`').
* :func:`lru_victims` — least recently used first until the byte budget and the memory threshold hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiered_kv import checkpoints
from tiered_kv.checkpoints import within as checkpoints_within  # noqa: F401  (its old home)
from tiered_kv.prefix import entry_prompt_len


def servable_tokens(common_prefix: int, prompt_len: int) -> int:
    """Tokens a cache hit may serve: the common prefix, but never the last prompt token.

    The last prompt token is always recomputed because its logits start the generation.
    """
    return max(0, min(common_prefix, prompt_len - 1))


def serves_all(tokens: int, prompt_len: int) -> bool:
    """Whether a hit serving ``tokens`` serves all that any hit may (:func:`servable_tokens`):
    no other tier can do better."""
    return tokens >= servable_tokens(prompt_len, prompt_len)


def servable(
    common_prefix: int, prompt_len: int, entry_len: int, trimmable: bool, positions=()
) -> int:
    """Tokens a stored entry can serve: trimmable entries any prefix, others their full length
    or the nearest checkpoint at or before the common prefix (0: it cannot serve this prompt)."""
    n = servable_tokens(common_prefix, prompt_len)
    if trimmable or n == entry_len:
        return n
    return checkpoints.nearest(positions, n)


def is_continuation(
    hit_tokens: int, prompt_len: int, min_tokens: int, entry_len: int, entry_prompt: int | None = None
) -> bool:
    """A hit that covers the whole stored entry — or at least the whole prompt that made it
    (``entry_prompt``, of its ``entry_len`` ids; the rest its request generated) — at least
    ``min_tokens`` long and at least half of the prompt.

    Then the request continues the stored entry: the entry is handed over (no copy; cut back to
    the hit when the hit ends inside its generated ids) and the longer result replaces it instead
    of duplicating it. The generated ids it loses serve only a prompt that resends them verbatim,
    and this one did not: agent clients send the answer back re-rendered (reasoning dropped, tool
    calls as their JSON). Other hits (a shared system prompt of another conversation, a title
    request, a branch inside the prompt, the same prompt again) share the entry read-only and
    store a new one: handing such an entry over would cut it back and take it away from the
    requests that run beside this one or come after it.
    """
    covered = min(entry_prompt_len(entry_len, entry_prompt), entry_len)
    return (
        hit_tokens > 0
        and covered <= hit_tokens <= entry_len
        and hit_tokens >= min_tokens
        and 2 * hit_tokens >= prompt_len
    )


def prompt_resent(common_prefix: int, entry_prompt: int, trimmable: bool) -> bool:
    """A stored entry whose whole prompt (``entry_prompt`` ids) a new entry's request resent
    (``common_prefix`` ids in common) is redundant, where both can be cut back to any length
    (``trimmable``): the new entry serves every prefix of that prompt, and the ids the old one
    generated past it serve only a prompt that resends them verbatim — which the next turn did
    not (:func:`is_continuation`). The hot tier drops such an entry, the cold tier its file."""
    return trimmable and common_prefix >= entry_prompt


@dataclass(frozen=True)
class Item:
    key: int  # entry id
    nbytes: int
    last_used: int  # monotonically increasing use stamp


def lru_victims(
    items: Sequence[Item], budget_bytes: int, over_memory_bytes: int = 0, keep: int = 0
) -> list[int]:
    """Entry ids to evict, least recently used first.

    Evicts until the items' total fits ``budget_bytes`` and at least ``over_memory_bytes`` were
    freed (the amount by which device memory exceeds its threshold). ``keep`` most recent items
    are never chosen (e.g. 1 to keep the entry just stored).
    """
    order = sorted(items, key=lambda it: it.last_used)
    candidates = order[: max(0, len(order) - keep)]
    total = sum(it.nbytes for it in items)
    freed = 0
    victims: list[int] = []
    for it in candidates:
        if total <= budget_bytes and freed >= over_memory_bytes:
            break
        victims.append(it.key)
        total -= it.nbytes
        freed += it.nbytes
    return victims

