"""Engine: a loaded model, its tiered prompt cache, and suffix-only prefill through it.

Ownership: an Engine is driven by one thread, the one that owns MLX (the server's batch loop, see
``engine/batch.py``). ``generate`` runs one request alone through the same loop on the calling
thread; the cache entry for the ids actually fed to the model is stored when it finishes, is closed
early (``close()`` / garbage collection) or ``should_stop()`` turns true.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import tiered_kv
from engine import shapes, structured, warmup
from engine.batch import BatchLoop
from engine.events import Chunk, Event, Failed, Hit, SamplingParams, Usage
from engine.loading import context_length, load_model, vocab_size, xtc_keep
from engine.prefill import Progress, checkpoint_positions, fill, prefill, prefill_steps
from engine.textout import TextStream
from tiered_kv import CacheDirError, Config, HitInfo, Lease, Steps, model_identity

__all__ = ["CacheDirError", "Chunk", "Engine", "SamplingParams", "Usage"]

log = logging.getLogger(__name__)


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
        # the prefill step, resolved here once (0 is auto): the cache's restore plans need it too
        config = replace(config, prefill_chunk=config.prefill_chunk or default_prefill_chunk())
        self.config = config
        self.model, self.tokenizer = load_model(self.model_dir)
        self.context_length = context_length(self.model_dir, self.tokenizer)
        self.vocab_size = vocab_size(self.model_dir, self.tokenizer)
        self.xtc_keep = xtc_keep(self.tokenizer)
        # structured output's view of the tokenizer (built at the first request with a format)
        self.grammars = structured.Grammars(self.tokenizer, self.vocab_size)
        # several requests' prompt chunks in one forward (engine/prefilling.py), when switched on
        # (TIERED_KV_SHARED_PREFILL; `auto`: on a GPU)
        gpu = mx.default_device().type == mx.gpu
        self.share_prefill = {"on": True, "off": False}.get(config.shared_prefill, gpu)
        # the first request's kernels loaded at start (TIERED_KV_WARMUP; `auto`: on a GPU)
        self.warmup = {"on": True, "off": False}.get(config.warmup, gpu)
        # prefill steps in few attention shapes (TIERED_KV_STEP_SHAPES; `auto`: on CUDA)
        # (and only where the model takes them: checked once, engine/shapes.works)
        cuda = gpu and mx.cuda.is_available()
        self.step_shapes = {"on": True, "off": False}.get(config.step_shapes, cuda)
        if self.step_shapes and not shapes.works(self.model, config.prefill_chunk):
            log.info("TIERED_KV_STEP_SHAPES: off for this model (a padded step did not match)")
            self.step_shapes = False
        self.cache = tiered_kv.open_cache(
            config, model_identity(self.model_dir), lambda: make_prompt_cache(self.model),
            self.compute_prefix,
        )  # fmt: skip
        self.fingerprint = self.cache.fingerprint
        self.restorer = self.cache.restorer  # issue 15: None without a cold tier

    def warm_up(self) -> float:
        """The first request's kernels loaded before serving (engine/warmup.py; engine thread)."""
        return warmup.run(self.model, self.prefill_chunk, step_shapes=self.step_shapes)

    @property
    def prefill_chunk(self) -> int:
        """Tokens per prefill step (``config.prefill_chunk``, resolved at start)."""
        return self.config.prefill_chunk

    def compute_prefix(self, ids: list[int], held: list[Any] | None = None) -> Steps[list[Any]]:
        """Caches holding ``held``'s tokens (fresh ones when None) and then ``ids`` (whole
        prefill steps, no logits: a restore's computed head, the calibration), computed here, on
        the engine thread, step by step (:func:`engine.prefill.fill`; ``tiered_kv.drain`` runs it
        through). ``tiered_kv.restore.restorer.Compute``."""
        caches = held if held is not None else make_prompt_cache(self.model)
        lease = Lease(caches, list(ids), HitInfo())
        yield from fill(self.model, lease, self.prefill_chunk)
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
    def _cuts(self, lease: Lease, fed: list[int]) -> list[int]:
        if not lease.needs_checkpoints:
            return []
        eos = set(self.tokenizer.eos_token_ids)
        return checkpoint_positions(len(fed), lease.remaining, eos, self.config.checkpoint_tokens)

    def prefill_done(self, lease: Lease, start: int, new: int, seconds: float) -> None:
        """A request's suffix prefill finished: ``new`` tokens onto ``start`` cached ones in
        ``seconds`` of prefill work (the batch loop's decode steps in between not counted). Issue 15:
        every prefill teaches the restore cost model, and a planned disk restore learns its outcome."""
        if self.restorer is None:
            return
        try:  # advice: a failure to learn costs a calibration, never the request or the worker
            self.restorer.costs.observe_prefill(new, start, seconds)
            if lease.hit.restore is not None:
                self.restorer.outcome(lease.hit.restore, lease.hit.load_seconds + seconds)
            self.settle_costs()  # after the first token: fit and save what was observed
        except Exception:
            log.exception("restore costs not learned from this prefill")

    def settle_costs(self) -> None:
        """Fit and save what the restore costs observed: after a request's first token
        (:meth:`prefill_done`), and when the batch goes idle (a request cancelled or failed after
        its restore and before its first token settles nothing; its load would stay unfitted on
        /metrics and unsaved)."""
        if self.restorer is None:
            return
        try:
            self.restorer.costs.settle()
        except Exception:
            log.exception("restore costs not settled")

    def logits(self, prompt_ids: Sequence[int]) -> tuple[np.ndarray, HitInfo]:
        """Next-token logits after ``prompt_ids`` through the cache (stores the entry)."""
        lease = self.cache.fetch(prompt_ids)
        fed = list(prompt_ids[: lease.hit.tokens])
        try:
            out = prefill(self.model, lease, fed, self.prefill_chunk, self._cuts(lease, fed))
            return np.array(out.astype(mx.float32)), lease.hit
        finally:
            self.cache.store(lease, fed)

    def prefill_steps(
        self, lease: Lease, fed: list[int], on_progress: Progress | None = None
    ) -> Generator[None, None, mx.array]:
        """The lease's suffix prefill, one evaluated chunk per ``next()`` (see prefill_steps)."""
        return prefill_steps(
            self.model, lease, fed, self.prefill_chunk, self._cuts(lease, fed), on_progress
        )

    # -- generation ------------------------------------------------------------------------
    def text_stream(self, params: SamplingParams) -> TextStream:
        """How one request's sampled ids become its text (stop strings, limits)."""
        return TextStream(self.tokenizer, params, self.tokenizer.eos_token_ids)

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_progress: Progress | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_hit: Callable[[Hit], None] | None = None,
    ) -> Iterator[Chunk]:
        """Stream the completion of ``prompt_ids`` alone, on the calling thread; the last chunk
        has finish_reason + usage. The same batch loop as the server's, with one request in it.

        ``on_hit`` hears the cache lookup's result before the prefill starts. The cache entry is
        stored when the generation finishes, is closed early or ``should_stop()`` turns true."""
        loop = BatchLoop(self, max_batch=1)
        sink = _ListSink(should_stop or (lambda: False))
        loop.add(sink, prompt_ids, params, on_progress)
        try:
            while True:  # what add() said first (a refused prompt), then each step's events
                for ev in sink.take():
                    if isinstance(ev, Hit):
                        if on_hit is not None:
                            on_hit(ev)
                    elif isinstance(ev, Failed):
                        raise ev.error
                    elif isinstance(ev, Chunk):
                        yield ev
                if not loop.active:
                    break
                loop.step()
        finally:
            loop.close()

    def close(self) -> None:
        self.cache.close()


class _ListSink:
    """Events of the one request of :meth:`Engine.generate`, collected on the calling thread."""

    def __init__(self, should_stop: Callable[[], bool]) -> None:
        self.events: list[Event] = []
        self.should_stop = should_stop

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def cancelled(self) -> bool:
        return self.should_stop()

    def take(self) -> list[Event]:
        out, self.events = self.events, []
        return out
