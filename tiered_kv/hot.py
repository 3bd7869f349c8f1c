"""Hot tier: model caches held in MLX memory, found by longest common token prefix.

Ownership: a HotTier is owned by the one thread that runs MLX (the request / generation thread).
A stored entry's tokens, caches and checkpoints are never mutated: lookups hand out *views* (new
cache objects sharing the stored arrays, see ``layers.view``) or *take* the entry out of the tier
(continuation: the caller then owns its buffers and writes into them in place), and thinning
replaces an entry by a copy with fewer checkpoints. Only its bookkeeping (``last_used``,
``persisted``) changes in place. Evicted entries are passed to ``on_evict`` (the cold
tier's spill hand-off) before the tier drops its reference, then MLX's buffer cache is released.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from tiered_kv import checkpoints, layers, policy
from tiered_kv.config import Config
from tiered_kv.memory import MemoryProbe
from tiered_kv.prefix import TokenArray, as_tokens, common_prefix, entry_prompt_len

log = logging.getLogger(__name__)
_ids = itertools.count(1)


def cache_bytes(caches: list[Any]) -> int:
    """Memory the caches' buffers occupy (capacity, not just the valid tokens)."""
    return int(sum(c.nbytes for c in caches))


@dataclass(eq=False)
class Entry:
    """Token ids whose KV the caches hold, and the per-layer caches. While stored, only the
    bookkeeping fields (``last_used``, ``persisted``) change; the rest is replaced, never mutated."""

    tokens: TokenArray
    caches: list[Any]
    nbytes: int  # caches + checkpoints
    trimmable: bool = True  # every layer can be cut back to any shorter length
    #: position → snapshot of the non-positional layers at exactly that many tokens
    checkpoints: dict[int, list[Any]] = field(default_factory=dict)
    checkpoint_bytes: int = 0
    persisted: bool = False  # an identical copy is (being) written to the cold tier
    #: the first ``prompt_tokens`` ids were its request's prompt, the rest that request generated
    #: (None: all of them, or not known — an entry loaded from disk, a running request's prefix)
    prompt_tokens: int | None = None
    id: int = field(default_factory=lambda: next(_ids))
    last_used: int = 0

    @property
    def prompt_len(self) -> int:
        """How many of the ids were the prompt (all of them where ``prompt_tokens`` is None)."""
        return entry_prompt_len(len(self.tokens), self.prompt_tokens)


def new_entry(
    ids: Sequence[int] | np.ndarray,
    caches: list[Any],
    ckpts: dict[int, list[Any]] | None = None,
    persisted: bool = False,
    prompt_tokens: int | None = None,
) -> Entry:
    """An Entry with its derived facts (byte size, trimmability) computed once;
    ``prompt_tokens``: how many of ``ids`` were the request's prompt (None: all)."""
    ckpts = ckpts or {}
    ck_bytes = checkpoints.total_bytes(ckpts)
    return Entry(
        as_tokens(ids),
        caches,
        cache_bytes(caches) + ck_bytes,
        trimmable=layers.can_trim(caches),
        checkpoints=ckpts,
        checkpoint_bytes=ck_bytes,
        persisted=persisted,
        prompt_tokens=None if prompt_tokens is None else min(prompt_tokens, len(ids)),
    )


@dataclass
class HotStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    replaced: int = 0


class HotTier:
    """LRU set of entries under a byte budget and a device-memory threshold."""

    def __init__(
        self,
        budget_bytes: int,
        memory_threshold: float,
        on_evict: Callable[[Entry], None],
        probe: MemoryProbe | None = None,
        checkpoint_share: float = Config.checkpoint_share,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.checkpoint_share = checkpoint_share
        self.memory_threshold = memory_threshold
        self.on_evict = on_evict
        self.probe = probe or MemoryProbe()
        self.entries: dict[int, Entry] = {}
        self.stats = HotStats()
        self._clock = itertools.count(1)

    # -- lookup ----------------------------------------------------------------------------
    def best(self, prompt: TokenArray, count: bool = True) -> tuple[Entry, int] | None:
        """(entry, common prefix) of the entry that can serve the most tokens of ``prompt``
        (ties: the longest common prefix, then the most recent). ``count=False``: a peek, not
        counted as a hit or a miss."""
        best: tuple[Entry, int] | None = None
        score = (0, 0, 0)
        for e in self.entries.values():
            common = common_prefix(e.tokens, prompt)
            n = policy.servable(common, len(prompt), len(e.tokens), e.trimmable, e.checkpoints)
            if n > 0 and (n, common, e.last_used) > score:
                best, score = (e, common), (n, common, e.last_used)
        if count and best is None:
            self.stats.misses += 1
        elif count:
            self.stats.hits += 1
        return best

    def touch(self, entry: Entry) -> None:
        entry.last_used = next(self._clock)

    # -- membership ------------------------------------------------------------------------
    def take(self, entry: Entry) -> Entry:
        """Remove ``entry`` without spilling: the caller now owns its caches."""
        del self.entries[entry.id]
        return entry

    def insert(self, entry: Entry) -> None:
        """Store ``entry`` as the most recent, then evict (superseded entries are dropped by the
        caller through :meth:`discard_where`)."""
        self.touch(entry)
        self.entries[entry.id] = entry
        self.enforce(keep=1)

    def discard(self, entry: Entry) -> None:
        """Drop a superseded entry (no spill: its tokens live on in a longer entry)."""
        if self.entries.pop(entry.id, None) is not None:
            self.stats.replaced += 1

    def discard_where(self, superseded: Callable[[Entry], bool]) -> None:
        """:meth:`discard` every stored entry for which ``superseded`` holds."""
        for e in [e for e in self.entries.values() if superseded(e)]:
            self.discard(e)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    # -- eviction --------------------------------------------------------------------------
    def enforce(self, keep: int = 0) -> None:
        """Evict LRU entries while over the byte budget or over the memory threshold."""
        self._thin_checkpoints()
        items = [policy.Item(e.id, e.nbytes, e.last_used) for e in self.entries.values()]
        over = self.probe.over_threshold(self.memory_threshold)
        victims = policy.lru_victims(items, self.budget_bytes, over, keep=keep)
        for key in victims:
            self._evict(self.entries[key])
        if victims:
            mx.clear_cache()

    def _thin_checkpoints(self) -> None:
        """Keep checkpoints within their share of the budget (``checkpoints.thin``); a thinned
        entry is replaced by a copy without the dropped checkpoints (same id, same recency)."""
        limit = int(self.checkpoint_share * self.budget_bytes)
        if sum(e.checkpoint_bytes for e in self.entries.values()) <= limit:
            return
        sizes = [(e.id, e.last_used, {p: checkpoints.snapshot_bytes(s)
                                       for p, s in e.checkpoints.items()})
                 for e in self.entries.values()]  # fmt: skip
        for key, drop in checkpoints.thin(sizes, limit).items():
            e = self.entries[key]
            kept = {p: s for p, s in e.checkpoints.items() if p not in drop}
            freed = e.checkpoint_bytes - checkpoints.total_bytes(kept)
            self.entries[key] = dataclasses.replace(
                e, checkpoints=kept, checkpoint_bytes=e.checkpoint_bytes - freed,
                nbytes=e.nbytes - freed,
            )  # fmt: skip

    def evict_all(self) -> None:
        """Hand every entry to ``on_evict`` (shutdown: spill what memory holds)."""
        for entry in sorted(self.entries.values(), key=lambda e: e.last_used):
            self._evict(entry)
        mx.clear_cache()

    def _evict(self, entry: Entry) -> None:
        del self.entries[entry.id]
        self.stats.evictions += 1
        self.stats.evicted_bytes += entry.nbytes
        self.on_evict(entry)  # the cold tier's spill never raises into the request path
