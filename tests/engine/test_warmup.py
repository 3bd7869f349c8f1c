"""engine/warmup.py and the Worker's use of it: the first request's shapes run once at start on a
fresh cache; nothing is stored or learned; TIERED_KV_WARMUP=off (and `auto` on the CPU) skips it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import mlx.core as mx
import pytest

from engine import shapes, warmup
from engine.generate import Engine, SamplingParams
from engine.loading import load_model
from engine.worker import Worker
from tests.engine.batching import Recorded, drain
from tiered_kv.config import Config


class Recording(Recorded):
    """:class:`Recorded`, with the cache each forward ran on and its length before it."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.caches: list[tuple[int, int, int]] = []  # (cache id, offset, buffer length)

    def __call__(self, inputs: Any, *a: Any, **kw: Any) -> Any:
        cache = kw["cache"]
        held = cache[0].keys.shape[2] if cache[0].keys is not None else 0
        self.caches.append((id(cache), cache[0].offset, held))
        return super().__call__(inputs, *a, **kw)


def test_run_forwards_a_step_an_odd_step_a_decode_step_and_a_suffix_on_one_fresh_cache(
    tiny_model_dir,
):
    """The last step continues the cache as a stored entry comes back: arrays of exactly its
    length (a fresh prefill's buffers are whole 256-token steps), as decode's extract and a disk
    load hand it over."""
    model, _ = load_model(tiny_model_dir)
    rec = Recording(model)
    seconds = warmup.run(rec, 16)
    assert seconds > 0
    odd = warmup.ODD_TOKENS
    assert rec.shapes == [(1, 16), (1, odd), (1, 1), (1, odd)]
    assert len({c[0] for c in rec.caches}) == 1  # one cache, grown step by step
    assert [c[1] for c in rec.caches] == [0, 16, 16 + odd, 17 + odd]
    assert rec.caches[2][2] == 256  # the fresh prefill's whole step
    assert rec.caches[3][2] == 17 + odd  # handed back at its length


def test_with_step_shapes_the_suffix_runs_as_the_engine_runs_it(tiny_model_dir):
    """TIERED_KV_STEP_SHAPES on (CUDA): the suffix step is padded to a power of two onto a
    buffer of whole grains, the shape a hot hit's suffix then has (engine/shapes.py)."""
    model, _ = load_model(tiny_model_dir)
    rec = Recording(model)
    warmup.run(rec, 16, step_shapes=True)
    odd = warmup.ODD_TOKENS
    assert rec.shapes[-1] == (1, shapes.query_rows(odd))
    assert rec.caches[-1][1:] == (17 + odd, 17 + odd)  # onto the entry handed back at its length


def _worker(tiny_model_dir, tmp_path, warmup: str) -> Worker:
    cfg = Config(cache_dir=tmp_path, tiers=("hot", "cold"), prefill_chunk=16, warmup=warmup)
    return Worker(lambda: Engine(tiny_model_dir, cfg))


def test_the_worker_warms_up_before_start_returns_and_stores_nothing(tiny_model_dir, tmp_path, caplog):
    worker = _worker(tiny_model_dir, tmp_path, "on")
    with caplog.at_level(logging.INFO, logger="engine.worker"):
        worker.start()
    try:
        assert any("warm-up" in r.message for r in caplog.records)
        engine = worker.engine
        assert not engine.cache.hot.entries  # nothing stored in memory
        assert engine.cache.cold is not None and engine.cache.cold.stats()["entries"] == 0
        assert sum(len(v) for v in engine.restorer.costs.obs.values()) == 0  # nothing learned
    finally:
        worker.close()
    assert not list(tmp_path.rglob("*.safetensors"))  # and nothing written at close


@pytest.mark.parametrize("setting", ["off", "auto"])
def test_warmup_off_and_auto_on_the_cpu_skip_it(tiny_model_dir, tmp_path, caplog, setting):
    """`auto` warms up on a GPU only: a CPU has no first-call kernel cost to move."""
    if setting == "auto" and mx.default_device() != mx.cpu:
        pytest.skip("auto warms up on a GPU")
    worker = _worker(tiny_model_dir, tmp_path, setting)
    with caplog.at_level(logging.INFO, logger="engine.worker"):
        worker.start()
    worker.close()
    assert not any("warm-up" in r.message for r in caplog.records)


def test_a_failed_warm_up_is_logged_and_the_worker_serves(tiny_model_dir, tmp_path, caplog, monkeypatch):
    """A warm-up only moves the first request's kernel loads: when it fails (here: the step
    raises, as an out-of-memory would) the server must still start and answer."""

    def no_memory(self):
        raise RuntimeError("[metal::malloc] Attempting to allocate more than the maximum")

    monkeypatch.setattr(Engine, "warm_up", no_memory)
    worker = _worker(tiny_model_dir, tmp_path, "on")
    with caplog.at_level(logging.WARNING, logger="engine.worker"):
        worker.start()
    try:
        assert any("warm-up failed" in r.message for r in caplog.records)
        ids = worker.engine.encode_text("still serving after a failed warm-up")

        async def main():
            return await drain(worker.submit(ids, SamplingParams(max_tokens=2)))

        events = asyncio.run(main())
        assert events[-1].finish_reason == "length"
    finally:
        worker.close()
