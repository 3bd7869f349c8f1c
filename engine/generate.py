"""Engine: suffix-only prefill through the tiered cache, then sampling and streaming.

Ownership: an Engine is driven by one thread at a time (MLX is not thread-safe). ``generate`` is a
generator; the cache entry for the ids actually fed to the model is stored when it finishes, is
closed early (``close()`` / garbage collection) or ``should_stop()`` turns true.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from engine.detok import IncrementalDecoder
from engine.loading import context_length, fingerprint_parts, load_model
from engine.prefill import PrefillStopped, Progress, checkpoint_positions, prefill
from tiered_kv.config import Config
from tiered_kv.keys import fingerprint
from tiered_kv.tiered import HitInfo, Lease, TieredCache

log = logging.getLogger(__name__)


class CacheDirError(OSError):
    """The cold tier's directory cannot be opened or created at start."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_tier: str
    ttft_seconds: float
    prefill_seconds: float
    decode_seconds: float
    load_seconds: float


@dataclass(frozen=True)
class Chunk:
    text: str
    token: int | None
    finish_reason: str | None = None
    usage: Usage | None = None


def default_prefill_chunk() -> int:
    """Tokens per prefill step when TIERED_KV_PREFILL_CHUNK is 0 (auto): mlx-lm's 2048 on a GPU, where
    each step costs a synchronisation and 512-token steps made a 16k prefill ~4x slower than
    mlx_lm.server's on an H200; 512 on the CPU, where a step takes seconds and bounds how soon a
    cancelled request stops."""
    return 2048 if mx.default_device().type == mx.gpu else 512


class Engine:
    """A loaded model with its tiered prompt cache."""

    def __init__(self, model_dir: Path, config: Config) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.model, self.tokenizer = load_model(self.model_dir)
        self.context_length = context_length(self.model_dir, self.tokenizer)
        parts = fingerprint_parts(self.model_dir, self.model, config.kv_bits, config.cache_salt)
        self.fingerprint = fingerprint(parts)
        cold = None
        if config.cold_enabled:
            from tiered_kv.cold.tier import ColdTier

            try:
                cold = ColdTier(config.cache_dir, self.fingerprint, config)
            except OSError as e:  # misconfiguration at start: say which setting, not a traceback
                raise CacheDirError(f"TIERED_KV_DIR={config.cache_dir}: {e.strerror or e}") from e
        shared = None
        if cold is not None and config.shared_enabled:  # [shared tier, issue 17]
            from tiered_kv.shared.link import SharedLink

            shared = SharedLink.open(config, cold.fingerprint)
            cold.publish_to(shared.published)  # every entry written locally is published too
        self.cache = TieredCache(
            config, lambda: make_prompt_cache(self.model), cold, shared=shared
        )
        self.prefill_chunk = config.prefill_chunk or default_prefill_chunk()
        self.restorer = self._restorer(cold)  # issue 15

    # -- issue 15: restore plans (load / compute / both) ------------------------------------
    def _restorer(self, cold: Any) -> Any:
        """The disk-hit planner with this model's learned costs (None without a cold tier)."""
        if cold is None:
            return None
        from tiered_kv.restore.costs import CostBook
        from tiered_kv.restore.restorer import Restorer, blocker_of, calibrate

        device = str(mx.default_device())
        costs = CostBook(CostBook.file_for(cold.dir, device), cold.fingerprint, device)
        mode: Any = self.config.restore  # validated by config: auto | load | compute | both
        r = Restorer(mode, costs, self.compute_prefix,
                     blocker_of(make_prompt_cache(self.model)), self.config.kv_bits,
                     self.config.kv_group_size)  # fmt: skip
        self.cache.restorer = r
        unknown = costs.learned.prefill is None and self.config.restore == "auto"
        if unknown and cold.stats()["entries"]:
            calibrate(self.compute_prefix, costs)  # the first disk hit must not plan blind
        return r

    def compute_prefix(self, ids: list[int]) -> list[Any]:
        """Fresh caches holding exactly ``ids`` (prefilled here, on the engine thread)."""
        lease = Lease(make_prompt_cache(self.model), list(ids), HitInfo())
        prefill(self.model, lease, [], self.prefill_chunk)
        return lease.caches

    # -- prompts ---------------------------------------------------------------------------
    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None
    ) -> list[int]:
        from engine.chat import render_chat  # the server's module owns template quirks

        return self.encode_text(render_chat(self.tokenizer, messages, tools))

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- prefill ---------------------------------------------------------------------------
    def _prefill(
        self,
        lease: Lease,
        fed: list[int],
        on_progress: Progress | None,
        should_stop: Callable[[], bool],
    ) -> mx.array:
        cuts: list[int] = []
        if lease.needs_checkpoints:
            eos = set(self.tokenizer.eos_token_ids)
            cuts = checkpoint_positions(
                len(fed), lease.remaining, eos, self.config.checkpoint_tokens
            )
        t0, start, new = time.perf_counter(), len(fed), len(lease.remaining)
        out = prefill(
            self.model, lease, fed, self.prefill_chunk, cuts, on_progress, should_stop
        )
        if self.restorer is not None:  # issue 15: every prefill teaches the cost model
            dt = time.perf_counter() - t0
            self.restorer.costs.observe_prefill(new, start, dt)
            if lease.hit.restore is not None:
                self.restorer.outcome(lease.hit.restore, lease.hit.load_seconds + dt)
        return out

    def logits(self, prompt_ids: Sequence[int]) -> tuple[np.ndarray, HitInfo]:
        """Next-token logits after ``prompt_ids`` through the cache (stores the entry)."""
        lease = self.cache.fetch(prompt_ids)
        fed = list(prompt_ids[: lease.hit.tokens])
        try:
            out = self._prefill(lease, fed, None, lambda: False)
            return np.array(out.astype(mx.float32)), lease.hit
        finally:
            self.cache.store(lease, fed)

    # -- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_progress: Progress | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_hit: Callable[[HitInfo], None] | None = None,
    ) -> Iterator[Chunk]:
        """Stream the completion of ``prompt_ids``; the last chunk has finish_reason + usage.

        ``on_hit`` hears the cache lookup's result before the prefill starts (response headers)."""
        stop_check = should_stop or (lambda: False)
        t0 = time.perf_counter()
        lease = self.cache.fetch(prompt_ids)
        fed = list(prompt_ids[: lease.hit.tokens])
        try:  # from here on the lease goes back to the cache whatever fails (the entry may be taken)
            if on_hit is not None:
                on_hit(lease.hit)
            out = _Decode(self, params, len(prompt_ids), lease.hit)
            try:
                logits = self._prefill(lease, fed, on_progress, stop_check)
            except PrefillStopped:
                yield out.finish("cancelled", t0)
                return
            out.prefill_done(t0)
            yield from out.run(logits, lease, fed, stop_check, t0)
        finally:
            self.cache.store(lease, fed)

    def close(self) -> None:
        self.cache.close()
        if self.restorer is not None:
            self.restorer.close()


class _Decode:
    """Sampling loop state: stop strings, detokenisation, timings."""

    def __init__(self, engine: Engine, params: SamplingParams, prompt_len: int, hit: HitInfo):
        self.e, self.p, self.hit, self.prompt_len = engine, params, hit, prompt_len
        self.sampler = make_sampler(temp=params.temperature, top_p=params.top_p)
        self.detok = IncrementalDecoder(engine.tokenizer)
        self.eos = set(engine.tokenizer.eos_token_ids)
        self.completion = 0
        self.text = ""  # text decoded so far
        self.sent = 0  # chars of self.text already emitted
        self.t_prefill = self.t_first = 0.0
        if params.seed is not None:
            mx.random.seed(params.seed)

    def prefill_done(self, t0: float) -> None:
        self.t_prefill = time.perf_counter() - t0

    def _sample(self, logits: mx.array) -> int:
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return int(self.sampler(logprobs[None])[0].item())

    def run(
        self, logits: mx.array, lease: Lease, fed: list[int], stop: Callable[[], bool], t0: float
    ) -> Iterator[Chunk]:
        model, caches = self.e.model, lease.caches
        while True:
            tok = self._sample(logits)
            if not self.t_first:
                self.t_first = time.perf_counter() - t0
            if tok in self.eos:
                yield self.finish("stop", t0)
                return
            self.completion += 1
            self.text += self.detok.add(tok)
            cut = self._stop_at()
            if cut is not None:
                yield Chunk(self.text[self.sent : cut], tok)
                yield self.finish("stop", t0, flush=False)  # nothing after the stop string
                return
            hold = max((len(s) - 1 for s in self.p.stop), default=0)
            upto = max(self.sent, len(self.text) - hold)
            yield Chunk(self.text[self.sent : upto], tok)
            self.sent = upto
            if self.completion >= self.p.max_tokens:
                yield self.finish("length", t0)
                return
            if stop():
                yield self.finish("cancelled", t0)
                return
            logits = model(mx.array([[tok]]), cache=caches)[0, -1, :]
            mx.eval(logits)
            fed.append(tok)

    def _stop_at(self) -> int | None:
        cuts = [
            i
            for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.p.stop if s)
            if i >= 0
        ]
        return min(cuts) if cuts else None

    def finish(self, reason: str, t0: float, flush: bool = True) -> Chunk:
        """The last chunk: held-back text (unless a stop string ended it) and usage."""
        tail = ""
        if flush:
            self.text += self.detok.flush()
            tail = self.text[self.sent :]
        now = time.perf_counter() - t0
        usage = Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=self.completion,
            cached_tokens=self.hit.tokens,
            cache_tier=self.hit.tier,
            ttft_seconds=self.t_first or now,
            prefill_seconds=self.t_prefill,
            decode_seconds=max(0.0, now - (self.t_first or now)),
            load_seconds=self.hit.load_seconds,
        )
        return Chunk(tail, None, reason, usage)
