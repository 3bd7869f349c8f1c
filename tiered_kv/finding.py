"""Finding: a prompt's best candidate across the tiers — the hot tier's entry, a disk entry
restored the planned way (load / compute / both), or the shared tier's, fetched and adopted.

:class:`Finder` is what :meth:`tiered_kv.tiered.TieredCache.fetch_steps` asks; the
:class:`Candidate` it returns is turned into a lease there. A disk entry that fails to load gives
way to the next best (at most :data:`_DISK_TRIES` per fetch); the shared tier is asked once a
fetch, its entry fetched at most once.

Ownership: every method runs on the single thread that runs MLX (TieredCache's). With
``background`` a disk read or a shared fetch runs on an I/O thread and each step returns at once
meanwhile; the arrays are built on the owning thread, at the end. A loaded candidate's entry is
the caller's to lease out (or keep in the hot tier); a hot candidate's entry stays the hot tier's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tiered_kv import background as threads
from tiered_kv import layers, policy
from tiered_kv.config import Config
from tiered_kv.hot import Entry, HotTier, new_entry
from tiered_kv.prefix import TokenArray, common_prefix
from tiered_kv.steps import Steps

#: disk entries one fetch may try to restore: one that fails to load gives way to the next best
_DISK_TRIES = 3
_UNASKED = object()  # [shared tier] a fetch has not looked the prompt up there yet


class ColdHitLike(Protocol):
    entry_id: str
    tokens: int
    entry_tokens: int
    serves: int  # prompt tokens the entry can serve (policy.servable)


class ColdSource(Protocol):
    """What finding needs of ``tiered_kv.cold.tier.ColdTier``: its lookup and its loads."""

    def lookup(
        self, prompt_ids: Sequence[int] | np.ndarray, exclude: Collection[str] = ()
    ) -> Any: ...
    def load(self, hit: Any) -> Any: ...
    # [shared tier, issue 17] an entry fetched from the shared tier: decoded, and written locally
    def adopt(self, data: bytearray, tokens: np.ndarray) -> Any: ...


class SharedSource(Protocol):
    """[shared tier, issue 17] What finding needs of ``tiered_kv.shared.link.SharedLink``."""

    def lookup(self, prompt_ids: Sequence[int] | np.ndarray) -> Any: ...
    def fetch(self, hit: Any, stop: threading.Event | None = None) -> Any: ...


@dataclass
class Candidate:
    entry: Entry
    common: int
    tier: str
    load_seconds: float = 0.0
    load_bytes: int = 0
    restore: Any = None  # issue 15: the Decision that produced / passed over this candidate
    computed: int = 0  # of its tokens, those computed on the way (a `both`'s head)
    held: int = 0  # of its tokens, those memory held (a `both` computed onto a hot prefix)

    def serves(self, prompt_len: int) -> int:
        """Tokens of the prompt it can serve: any prefix of a trimmable entry, else its full
        length or the checkpoint at or before the common prefix (what the lease then holds)."""
        e = self.entry
        return policy.servable(self.common, prompt_len, len(e.tokens), e.trimmable, e.checkpoints)


class Finder:
    """The tiers' best candidate for a prompt (see the module docstring); reads the tiers it is
    given, owns none of them."""

    def __init__(
        self,
        config: Config,
        hot: HotTier,
        cold: ColdSource | None = None,
        shared: SharedSource | None = None,
    ) -> None:
        self.config = config
        self.hot = hot
        self.cold = cold
        self.shared = shared  # [shared tier] behind the disk

    def find(
        self, prompt: TokenArray, background: bool, restorer: Any = None
    ) -> Steps[Candidate | None]:
        """The best candidate of the tiers for ``prompt``. A disk hit that turns out corrupt or
        gone at load time left the index (quarantined / dropped by the cold tier), so the tiers
        are asked again: the next lookup names the next best entry (at most
        :data:`_DISK_TRIES` disk entries per fetch; one still indexed — unreadable, out of
        memory — is excluded from the next lookups, never read twice). The shared tier is asked
        once, its entry fetched at most once. ``restorer``: plans disk hits (issue 15; None =
        always load)."""
        cand = self.hot_candidate(prompt, count=True)
        tried: set[str] = set()
        shared_hit: Any = _UNASKED  # [shared tier] looked up once a fetch, fetched at most once
        while self.cold is not None and len(tried) < _DISK_TRIES:
            hot_n = cand.serves(len(prompt)) if cand else 0
            if policy.serves_all(hot_n, len(prompt)):
                break
            hit = self.cold.lookup(prompt, exclude=tried)
            cold_n = hit.serves if hit is not None else 0
            floor = max(hot_n, cold_n)
            if self.shared is not None and not policy.serves_all(floor, len(prompt)):
                if shared_hit is _UNASKED:
                    shared_hit = self.shared.lookup(prompt)
                n = shared_hit.serves if shared_hit else 0  # the lookup's (policy.servable)
                if n > floor:
                    shared = yield from self._load_shared(shared_hit, prompt, floor, background)
                    if shared is not None:
                        return shared
                    shared_hit = None  # it failed: the next disk try does not fetch it again
                    # the batch went on while it crossed the network: the hot candidate may
                    # have been taken or replaced, a disk entry removed; look again
                    cand = self.hot_candidate(prompt, count=False)
                    continue
            if hit is None or cold_n <= hot_n:
                break
            loaded = yield from self._restore(hit, prompt, cand, hot_n, background, restorer)
            if loaded is not None and loaded.entry is not None:
                return loaded
            # the batch went on while the disk was read: the hot candidate may have been
            # taken (and written into) by another request, or evicted; look again
            cand = self.hot_candidate(prompt, count=False)
            if loaded is not None:  # computing beats loading: the plan rides along
                cand = cand or loaded
                cand.restore = loaded.restore
                break
            tried.add(hit.entry_id)
        return cand

    def hot_candidate(self, prompt: TokenArray, count: bool) -> Candidate | None:
        """The hot tier's best entry for ``prompt`` (``count``: as a hit or a miss)."""
        best = self.hot.best(prompt, count=count) if self.config.hot_enabled else None
        return Candidate(best[0], best[1], "hot") if best else None

    # -- issue 15: load, compute or both ----------------------------------------------------
    def _restore(
        self, hit: ColdHitLike, prompt: TokenArray, hot: Candidate | None, hot_n: int,
        background: bool, restorer: Any,
    ) -> Steps[Candidate | None]:  # fmt: skip
        """The candidate of a disk hit restored the planned way; a candidate with no entry
        when the plan is to recompute; None on a miss (vanished / corrupt). ``hot``: the hot
        tier's candidate, which serves ``hot_n`` tokens (a `both` computes onto them)."""
        r = restorer
        if r is None:
            return (yield from self._load(hit, prompt, background))
        assert self.cold is not None
        d = r.plan(self.cold, hit, hit.serves, len(prompt), hot_n)
        if d.kind == "compute":
            return Candidate(None, 0, "none", restore=d)  # type: ignore[arg-type]
        if d.kind == "both":
            # views of the hot entry's first tokens, taken now (before any other request runs):
            # the head's first step writes past them into arrays of its own
            held = None
            if hot is not None and d.start:
                held = layers.view(hot.entry.caches, d.start, len(hot.entry.tokens))
            got = yield from r.both_steps(self.cold, hit, prompt, d, background, held)
            del held
            if got is not None:
                entry = new_entry(got.tokens, got.caches, {}, persisted=True)
                return Candidate(entry, len(got.tokens), "cold", got.seconds, got.nbytes, d,
                                 got.m - d.start, d.start)  # fmt: skip
        if d.kind == "both":  # it fell back: the load's time is no outcome of a both
            d = dataclasses.replace(d, kind="load", informed=False)
        cand = yield from self._load(hit, prompt, background)
        if cand is not None:
            r.observe_load(hit.entry_id, cand.load_bytes, cand.load_seconds)
            cand.restore = d
        return cand

    def _load(
        self, hit: ColdHitLike, prompt: TokenArray, background: bool
    ) -> Steps[Candidate | None]:
        assert self.cold is not None
        t0 = time.perf_counter()
        if background and hasattr(self.cold, "load_steps"):
            got = yield from self._load_beside(hit)
        else:
            got = self.cold.load(hit)
        if got is None:
            return None  # corrupt or vanished: the cold tier quarantined it and counted
        entry = loaded_entry(got)
        seconds = time.perf_counter() - t0
        common = common_prefix(entry.tokens, prompt)
        return Candidate(entry, common, "cold", seconds, entry.nbytes)

    def _load_beside(self, hit: ColdHitLike) -> Steps[Any]:
        """The cold tier's load step by step: a thread of the load reads and verifies the file
        into the arrays while the caller's other work goes on."""
        assert self.cold is not None
        cold: Any = self.cold
        return (yield from cold.load_steps(hit, beside=True))

    def _load_shared(
        self, hit: Any, prompt: TokenArray, floor: int, background: bool
    ) -> Steps[Candidate | None]:
        """[shared tier, issue 17] The shared tier's ``hit`` (its lookup's) when it serves more
        than ``floor`` tokens: fetched (verified bytes; with ``background`` on a thread of its
        own, so the batch's decode steps go on while a large entry crosses the network), then
        adopted by the local cold tier — decoded there and queued to be written locally, so the
        next restart finds it on the disk."""
        assert self.shared is not None and self.cold is not None
        shared = self.shared
        t0 = time.perf_counter()
        if background:
            stop = threading.Event()
            call = threads.Call(lambda: shared.fetch(hit, stop), "tkv-shared-fetch")
            try:
                while not call.done():
                    yield
            finally:  # closed while it runs (its request went away, shutdown): no more chunks
                stop.set()
            fetched = call.result()
        else:
            fetched = shared.fetch(hit)
        if fetched is None:
            return None  # evicted, corrupt, Redis down or slow: counted by the shared tier
        got = self.cold.adopt(fetched.data, fetched.tokens)
        if got is None:
            return None
        entry = loaded_entry(got)
        seconds = time.perf_counter() - t0
        cand = Candidate(entry, common_prefix(entry.tokens, prompt), "shared", seconds, entry.nbytes)
        # an entry published before what it serves was kept with it: one that cannot be cut back
        # may serve less than its common prefix (nothing, diverging before its end)
        return cand if cand.serves(len(prompt)) > floor else None


def loaded_entry(got: Any) -> Entry:
    """The entry of an entry loaded from the cold tier or adopted from the shared tier (a
    ``cold.loads.Loaded``): already on disk."""
    return new_entry(
        got.tokens, got.caches, got.checkpoints, persisted=True, prompt_tokens=got.prompt_tokens
    )
