"""TieredCache: hot tier first, then the cold tier (then the shared tier) behind ``fetch`` / ``store``.

Built by :func:`tiered_kv.opening.open_cache` (which decides the tiers and wires them). Finding a
prompt's best candidate across the tiers (and restoring a disk or shared one) is
:mod:`tiered_kv.finding`'s; this module turns the candidate into a :class:`Lease`, stores what a
lease gives back, and runs the tiers' lifecycle.

Ownership: every method runs on the single thread that runs MLX (the generation worker). A
:class:`Lease` from :meth:`TieredCache.fetch` is owned by the caller until it is given back with
:meth:`TieredCache.store`; the caches in it are either views sharing a stored entry's arrays (the
entry stays unchanged: MLX writes make new buffers) or a whole entry taken out of the tier
(continuation: written in place, and the longer result replaces it on ``store``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from tiered_kv import checkpoints, layers, policy
from tiered_kv.config import Config
from tiered_kv.finding import Candidate, ColdSource, Finder, SharedSource, loaded_entry
from tiered_kv.hot import Entry, HotTier, new_entry
from tiered_kv.memory import MemoryProbe
from tiered_kv.prefix import TokenArray, as_tokens, common_prefix
from tiered_kv.steps import Steps, drain

log = logging.getLogger(__name__)
#: [shared tier] at shutdown, how long queued publishes may take before they are dropped (counted)
_SHARED_CLOSE_SECONDS = 30.0


class ColdStore(ColdSource, Protocol):
    """What TieredCache needs of ``tiered_kv.cold.tier.ColdTier``: finding's lookup and loads,
    the writes, and the lifecycle."""

    def spill(
        self, token_ids: np.ndarray, caches: list[Any], checkpoints: Any = None,
        prompt_tokens: int | None = None,
    ) -> None: ...
    def persist(
        self, token_ids: np.ndarray, caches: list[Any], checkpoints: Any = None,
        prompt_tokens: int | None = None,
    ) -> None: ...
    def recent(self, limit_entries: int, limit_bytes: int) -> list[Any]: ...
    def flush(self, timeout: float | None = None) -> Any: ...
    def begin_close(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> Any: ...


class SharedStore(SharedSource, Protocol):
    """[shared tier, issue 17] What TieredCache needs of ``tiered_kv.shared.link.SharedLink``:
    finding's lookup and fetch, and the lifecycle."""

    def stats(self) -> dict[str, Any]: ...
    def close(self, timeout: float | None = None) -> Any: ...


@dataclass(frozen=True)
class HitInfo:
    tokens: int = 0  # prompt tokens the lease's caches hold (the prefill starts after them)
    tier: str = "none"  # "hot" | "cold" | "shared" | "none"
    load_seconds: float = 0.0
    load_bytes: int = 0
    #: issue 15: the restore plan taken for a disk hit (a ``restore.restorer.Decision``)
    restore: Any = None
    #: of ``tokens``, those the restore computed rather than read (a `both`'s head)
    computed: int = 0
    #: of ``tokens``, those memory held when a disk restore computed onto them (a `both` from a
    #: shorter hot hit): served by the hot tier, though ``tier`` says the disk's
    held: int = 0

    @property
    def cached(self) -> int:
        """Prompt tokens whose KV came from a tier, not from a computation: what a response's
        ``cached_tokens`` counts."""
        return self.tokens - self.computed


@dataclass
class Lease:
    """Caches holding ``hit.tokens`` tokens of the prompt, and the ids still to prefill."""

    caches: list[Any]
    remaining: list[int]
    hit: HitInfo
    taken: Entry | None = field(default=None, repr=False)  # entry moved out of the hot tier
    #: position → snapshot of the non-positional layers (recurrent / sliding window); the engine
    #: adds one at each checkpoint position it prefills past, store() keeps them with the entry.
    checkpoints: dict[int, list[Any]] = field(default_factory=dict, repr=False)
    needs_checkpoints: bool = False
    #: the prompt's length (``fetch``'s): ids past it in ``store`` are the request's generated ones
    prompt_tokens: int | None = None


class TieredCache:
    """Hot tier + optional cold tier behind ``fetch`` / ``store``."""

    def __init__(
        self,
        config: Config,
        make_cache: Callable[[], list[Any]],
        cold: ColdStore | None = None,
        probe: MemoryProbe | None = None,
        shared: SharedStore | None = None,
    ) -> None:
        self.config = config
        self.make_cache = make_cache
        # which tiers are on is decided once, by tiered_kv.opening.open_cache: what is given is used
        assert shared is None or cold is not None, "the shared tier sits behind the cold tier"
        self.cold = cold
        self.shared = shared  # [shared tier] behind the disk
        #: the key this model's entries are filed under (set by open_cache; "" when built directly)
        self.fingerprint = ""
        self.hot = HotTier(
            config.hot_bytes, config.memory_threshold, self._spill, probe, config.checkpoint_share
        )
        self.finder = Finder(config, self.hot, cold, shared)
        self.needs_checkpoints = layers.needs_checkpoints(make_cache())
        self._unsupported_logged = False
        #: issue 15: plans disk hits (load / compute / both); set by the engine, None = always load
        self.restorer: Any = None
        self.counters = {"fetches": 0, "hit_tokens_hot": 0, "hit_tokens_cold": 0,
                         "hit_tokens_shared": 0, "stores": 0}  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.config.hot_enabled or self.cold is not None

    # -- fetch -----------------------------------------------------------------------------
    def fetch(self, prompt_ids: Sequence[int]) -> Lease:
        """Caches for the longest cached prefix of ``prompt_ids`` (never the last token)."""
        return drain(self.fetch_steps(prompt_ids, background=False))

    def fetch_steps(
        self, prompt_ids: Sequence[int], background: bool = True
    ) -> Steps[Lease]:
        """:meth:`fetch`, for a thread with other work to keep going (the batch loop's decode
        steps): with ``background``, a disk entry's file is read on an I/O thread and each
        ``next()`` while it is read returns at once; the arrays are built here, at the end."""
        prompt = as_tokens(prompt_ids)
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        self.counters["fetches"] += 1
        cand = (
            (yield from self.finder.find(prompt, background, self.restorer)) if self.enabled else None
        )
        decision = cand.restore if cand is not None else None
        if cand is not None and cand.entry is not None:
            lease = self._lease_from(cand, prompt)
            if lease is not None:
                self.counters[f"hit_tokens_{lease.hit.tier}"] += lease.hit.cached - lease.hit.held
                self.counters["hit_tokens_hot"] += lease.hit.held
                return lease
        hit = HitInfo(restore=decision)
        return Lease(
            self.make_cache(), prompt.tolist(), hit, None, {}, self.needs_checkpoints, len(prompt)
        )

    def peek(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens the hot tier could serve now: a scheduling estimate (no lease, no copy,
        no disk, not counted as a hit)."""
        prompt = as_tokens(prompt_ids)
        cand = self.finder.hot_candidate(prompt, count=False)
        return cand.serves(len(prompt)) if cand else 0

    def _lease_from(self, cand: Candidate, prompt: TokenArray) -> Lease | None:
        entry, total = cand.entry, len(cand.entry.tokens)
        n = cand.serves(len(prompt))
        stored = self.hot.entries.get(entry.id) is entry
        if cand.tier == "hot" and not stored:
            return None  # taken by another request, evicted or replaced: never serve it twice
        taken: Entry | None = None
        caches: list[Any] | None = None
        if n == 0:
            return None
        direct = entry.trimmable or n == total  # no checkpoint needed to serve n
        if direct and (
            policy.is_continuation(
                n, len(prompt), self.config.min_continuation_tokens, total, entry.prompt_len
            )
            or not self.config.hot_enabled
        ):
            # Hand the entry over: the caller writes into its buffers; the result replaces it.
            caches = layers.cut(entry.caches, n, total)
            if caches is not None:
                if stored:
                    self.hot.take(entry)
                taken = entry
        if caches is None:
            ckpt = None if direct else entry.checkpoints[n]
            caches = checkpoints.restore(entry.caches, n, total, ckpt)
            if caches is None:
                return None  # e.g. recurrent state that only exists at the entry's full length
            if stored:
                self.hot.touch(entry)
            elif self.config.hot_enabled:
                self.hot.insert(entry)  # a reloaded cold entry stays in memory for the next turn
        hit = HitInfo(n, cand.tier, cand.load_seconds, cand.load_bytes, cand.restore,
                      min(cand.computed, n), min(cand.held, n))
        inherited = checkpoints.inherit(entry.checkpoints, n, caches, self.needs_checkpoints)
        return Lease(
            caches, prompt[n:].tolist(), hit, taken, inherited, self.needs_checkpoints, len(prompt)
        )

    # -- store -----------------------------------------------------------------------------
    def store(self, lease: Lease, token_ids: Sequence[int]) -> None:
        """Keep ``lease.caches`` as the entry for ``token_ids`` (the ids whose KV they hold).

        Inconsistent caches (a failure in the middle of a forward pass) are cut back to
        ``token_ids`` when possible and dropped otherwise — never stored at a wrong length.
        """
        ids = as_tokens(token_ids)
        if not self.enabled or len(ids) == 0:
            return
        try:
            layers.check_supported(lease.caches)
        except layers.UnsupportedCache as e:
            if not self._unsupported_logged:
                log.warning("not caching: %s", e)
                self._unsupported_logged = True
            return
        caches = layers.cut(lease.caches, len(ids))  # after a failure mid-forward some hold more
        if caches is None:
            log.warning("dropping a cache whose layers disagree on its length")
            return
        old = layers.leaves(lease.caches)
        if any(a is not b for a, b in zip(layers.leaves(caches), old, strict=True)):
            mx.eval(list(layers.encode(caches)[0].values()))
        lease.caches = caches  # the cut consumed the old objects
        self.counters["stores"] += 1
        if self.config.kv_bits:
            caches = layers.quantize(caches, self.config.kv_bits, self.config.kv_group_size)
        entry = new_entry(
            ids, caches, checkpoints.upto(lease.checkpoints, len(ids)), prompt_tokens=lease.prompt_tokens
        )
        if not self.config.hot_enabled:
            self._persist(entry)
            return
        self.hot.discard_where(lambda other: _supersedes(entry, other))
        if self.config.write_through and self.cold is not None:
            self._persist(entry)
        self.hot.insert(entry)

    def share(self, lease: Lease, token_ids: Sequence[int]) -> None:
        """Publish a running request's prompt cache in the hot tier (new cache objects sharing its
        arrays: no copy), so that requests running beside it hit its prefix. The request keeps
        its lease; its final :meth:`store` supersedes this entry. Memory only, never persisted."""
        ids = as_tokens(token_ids)
        if not self.config.hot_enabled or len(ids) == 0:
            return
        try:
            caches = layers.view(lease.caches, len(ids), len(ids))
        except layers.UnsupportedCache:
            return
        if caches is None:
            return
        if self.config.kv_bits:
            caches = layers.quantize(caches, self.config.kv_bits, self.config.kv_group_size)
        ckpts = checkpoints.upto(lease.checkpoints, len(ids))
        # persisted=True: never spilled (the final store is); the entries it would supersede stay
        # until that store, so a crash in between loses nothing that was there before
        self.hot.insert(new_entry(ids, caches, ckpts, persisted=True))

    def _persist(self, entry: Entry) -> None:
        if self.cold is not None:
            self.cold.persist(
                entry.tokens, entry.caches, self._disk_checkpoints(entry), entry.prompt_tokens
            )
            entry.persisted = True

    def _spill(self, entry: Entry) -> None:
        """Hot-tier eviction hand-off: write-behind to the cold tier unless already there."""
        if self.cold is not None and not entry.persisted:
            r = self.restorer  # issue 15: admission by value (counted by the restorer)
            if r is not None and not r.admit(len(entry.tokens), entry.nbytes):
                return
            self.cold.spill(
                entry.tokens, entry.caches, self._disk_checkpoints(entry), entry.prompt_tokens
            )
            entry.persisted = True

    def _disk_checkpoints(self, entry: Entry) -> dict[int, list[Any]]:
        """The checkpoints written with an entry (see checkpoints.for_disk)."""
        return checkpoints.for_disk(entry.checkpoints, self.config.checkpoint_share, entry.nbytes)

    # -- lifecycle -------------------------------------------------------------------------
    def prefetch(self) -> int:
        """Warm start: load the most recently used cold entries into the hot tier."""
        if self.cold is None or not self.config.hot_enabled:
            return 0
        c = self.config
        if c.prefetch_entries <= 0 and c.prefetch_bytes <= 0:
            return 0
        limit_entries = c.prefetch_entries if c.prefetch_entries > 0 else 1 << 30
        limit_bytes = c.prefetch_bytes if c.prefetch_bytes > 0 else 1 << 62
        loaded = 0
        for hit in reversed(self.cold.recent(limit_entries, limit_bytes)):
            got = self.cold.load(hit)
            if got is not None:
                self.hot.insert(loaded_entry(got))
                loaded += 1
        return loaded

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.counters)
        h = self.hot.stats
        s.update(
            hot_entries=len(self.hot),
            hot_bytes=self.hot.nbytes,
            hot_hits=h.hits,
            hot_misses=h.misses,
            evictions=h.evictions,
            evicted_bytes=h.evicted_bytes,
            replaced=h.replaced,
        )
        if self.cold is not None:
            s.update({f"cold_{k}": v for k, v in self.cold.stats().items()})
        if self.shared is not None:
            s.update({f"shared_{k}": v for k, v in self.shared.stats().items()})
        if self.restorer is not None:
            s.update(self.restorer.stats())  # issue 15: restore_* and learned_* figures
        return s

    def close(self) -> None:
        """Spill everything memory holds that the cold tier lacks — none dropped, whatever its
        size — and write it all within the cold tier's shutdown limit."""
        if self.cold is not None:
            self.cold.begin_close()
            self.hot.evict_all()
            self.cold.close()
        if self.shared is not None:  # [shared tier] after the cold tier queued its last writes
            self.shared.close(_SHARED_CLOSE_SECONDS)
        if self.restorer is not None:  # saves the learned restore costs
            self.restorer.close()


def _supersedes(new: Entry, other: Entry) -> bool:
    """A stored entry whose ids are a prefix of the new entry's is redundant when the new entry
    serves every request it served (checkpoints.serves_all). So is one whose whole prompt the
    new entry's request resent, where both can be cut back to any length: the new entry serves
    every prefix of that prompt, and the ids the old one generated past it serve only a prompt
    that resends them verbatim — which the next turn did not (``policy.is_continuation``)."""
    n = len(other.tokens)
    common = common_prefix(other.tokens, new.tokens)
    if common == n:
        return checkpoints.serves_all(
            len(new.tokens), new.checkpoints, new.trimmable, n, other.checkpoints
        )
    return policy.prompt_resent(common, other.prompt_len, other.trimmable and new.trimmable)
