# mypy: disable-error-code="arg-type,union-attr,operator,index,dict-item"
"""Restore plans end to end (issue 15), over real HTTP across restarts on one TIERED_KV_DIR: a disk
throttled to 0.1 MB/s makes the server recompute; a slow compute makes it load; the learned costs
survive the restart (the first request after it already knows); greedy output never changes."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from engine.generate import Engine, SamplingParams, default_prefill_chunk
from tests.fixtures import Steps
from tests.serving import serve
from tiered_kv import drain
from tiered_kv.config import Config
from tiered_kv.restore.costs import CostBook

WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex jolly boxers".split()
MESSAGES = [{"role": "user", "content": " ".join(WORDS[i * 7 % len(WORDS)] for i in range(120))}]


def config(tmp_path, **kw) -> Config:
    return Config(cache_dir=tmp_path, block_tokens=16, prefill_chunk=64, min_continuation_tokens=16,
                  **kw)  # fmt: skip


def ask(live) -> tuple[str, dict]:
    r = live.client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=6, temperature=0.0
    )
    return r.choices[0].message.content, r.usage.model_dump()


def metric(live, name: str) -> float:
    body = httpx.get(live.url + "/metrics", headers={"Authorization": "Bearer sekret"}).text
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def throttle(engine: Engine, bytes_per_s: float) -> None:
    """Injected fault: every read of the cold tier (load and ranged) runs at ``bytes_per_s``."""
    cold, restorer = engine.cache.cold, engine.restorer
    load, reader = cold.load, restorer.reader

    def slow_load(hit):
        got = load(hit)
        desc = cold.describe(hit)
        time.sleep((desc[1] if desc else 0) / bytes_per_s)
        return got

    def slow_reader(*args, **kw):
        rr = reader(*args, **kw)
        time.sleep(rr.nbytes / bytes_per_s)
        return rr

    cold.load, restorer.reader = slow_load, slow_reader  # type: ignore[method-assign]


class SlowModel:
    """Injected slow compute: the real model, 3 ms per token fed."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, x, cache=None):
        time.sleep(0.003 * x.shape[-1])
        return self._model(x, cache=cache)


def run_once(model_dir, cfg, inject=None):
    def make():  # on the server's engine thread, which owns MLX
        engine = Engine(model_dir, cfg)
        if inject:
            inject(engine)
        return engine

    with serve(make, cfg) as live:
        text, usage = ask(live)
        figures = {k: metric(live, f"tiered_kv_cache_{k}") for k in (
            "restore_load", "restore_compute", "restore_both", "learned_prefill_tok_s",
            "learned_load_cold_gb_s", "learned_load_warm_gb_s", "restore_not_admitted",
            "restore_predicted_seconds", "restore_actual_seconds")}  # fmt: skip
    return text, usage, figures


def test_throttled_disk_makes_the_server_recompute(tiny_model_dir, tmp_path):
    cfg = config(tmp_path)
    slow = lambda e: throttle(e, 1e5)  # noqa: E731
    text0, usage0, _ = run_once(tiny_model_dir, cfg)  # learns prefill; close spills the entry
    assert usage0["cache_tier"] == "none"
    # restart 1: reads not learned yet → load (the safe default), which teaches 0.1 MB/s
    text1, usage1, f1 = run_once(tiny_model_dir, cfg, slow)
    assert usage1["cache_tier"] == "cold" and f1["restore_load"] == 1
    assert text1 == text0
    # restart 2: the first request already knows: recomputing beats a 0.1 MB/s disk
    text2, usage2, f2 = run_once(tiny_model_dir, cfg, slow)
    # never the whole-file load; compute, or `both` (computing most of it while the tail is read) when a
    # loaded machine's learned prefill is slow enough that reading a few blocks at 0.1 MB/s pays off
    assert f2["restore_load"] == 0 and f2["restore_compute"] + f2["restore_both"] == 1, f2
    if f2["restore_compute"] == 1:
        assert usage2["cache_tier"] == "none"
        assert usage2["prompt_tokens_details"]["cached_tokens"] == 0
    assert text2 == text0
    assert (
        f2["learned_prefill_tok_s"] > 0
        and f2["learned_load_cold_gb_s"] + f2["learned_load_warm_gb_s"] > 0
    )
    assert f2["restore_predicted_seconds"] > 0 and f2["restore_actual_seconds"] > 0


def test_slow_compute_makes_the_server_load(tiny_model_dir, tmp_path):
    cfg = config(tmp_path)
    slow = lambda e: setattr(e, "model", SlowModel(e.model))  # noqa: E731
    text0, _, _ = run_once(tiny_model_dir, cfg, slow)
    _, usage1, f1 = run_once(tiny_model_dir, cfg, slow)  # load (not learned) teaches the read
    assert usage1["cache_tier"] == "cold"
    text2, usage2, f2 = run_once(tiny_model_dir, cfg, slow)
    assert f2["restore_load"] + f2["restore_both"] == 1 and f2["restore_compute"] == 0, f2
    assert usage2["cache_tier"] == "cold" and text2 == text0


@pytest.mark.parametrize("mode", ["load", "compute", "both"])
def test_forced_modes_give_identical_greedy_output(tiny_model_dir, tmp_path, mode):
    text0, _, _ = run_once(tiny_model_dir, config(tmp_path))
    text, usage, f = run_once(tiny_model_dir, config(tmp_path, restore=mode))
    assert text == text0 and f[f"restore_{mode}"] == 1
    assert usage["cache_tier"] == ("none" if mode == "compute" else "cold")


def test_cached_tokens_are_the_tokens_read_not_a_boths_computed_head(tiny_model_dir, tmp_path):
    run_once(tiny_model_dir, config(tmp_path))
    _, loaded, _ = run_once(tiny_model_dir, config(tmp_path, restore="load"))
    _, both, f = run_once(tiny_model_dir, config(tmp_path, restore="both"))
    assert f["restore_both"] == 1 and both["cache_tier"] == "cold"
    assert 0 < both["prompt_tokens_details"]["cached_tokens"]
    assert both["prompt_tokens_details"]["cached_tokens"] < loaded["prompt_tokens_details"]["cached_tokens"]


def test_admission_by_value_is_counted(tiny_model_dir, tmp_path):
    cfg = config(tmp_path)
    run_once(tiny_model_dir, cfg)  # learns prefill, spills the entry
    engine = Engine(tiny_model_dir, cfg)
    for warm in (0.0, 1.0):  # a disk (and page cache) of 1 kB/s, as learned before
        engine.restorer.costs.observe_load(10**6, 1000.0, warm)
    list(engine.generate(engine.encode_chat(MESSAGES), SamplingParams(max_tokens=2)))
    assert engine.cache.stats()["restore_compute"] == 1
    engine.close()  # the longer entry is not worth a file here: refused, counted
    assert engine.restorer.counters["restore_not_admitted"] == 1
    assert engine.cache.cold.stats()["spills"] == 0


def test_the_engine_plans_with_its_own_prefill_step(tiny_model_dir, tmp_path):
    """TIERED_KV_PREFILL_CHUNK=0 (auto) is resolved once, by the Engine, and the restore plans get
    the step its prefills run (a `both` computes whole steps)."""
    auto = Engine(tiny_model_dir, Config(cache_dir=tmp_path / "a"))
    assert auto.prefill_chunk == auto.config.prefill_chunk == default_prefill_chunk()
    assert auto.restorer.step == default_prefill_chunk()
    set_ = Engine(tiny_model_dir, Config(cache_dir=tmp_path / "b", prefill_chunk=96))
    assert set_.restorer.step == set_.prefill_chunk == 96
    auto.cache.close()
    set_.cache.close()


def test_the_engines_computed_prefix_is_whole_steps(tiny_model_dir, tmp_path):
    engine = Engine(tiny_model_dir, Config(cache_dir=tmp_path, prefill_chunk=16))
    engine.model = Steps(engine.model)  # type: ignore[assignment]
    caches = drain(engine.compute_prefix(list(range(3, 35))))
    assert engine.model.lengths == [16, 16] and caches[0].offset == 32
    engine.cache.close()


def test_a_restore_whose_request_never_reached_its_first_token_is_settled(tiny_model_dir, tmp_path):
    """The restore costs are fitted and saved at settle(), after a request's first token. A
    request cancelled after its disk load and before that token left the load observed but not
    fitted: /metrics said ``learned_load_*_gb_s 0`` and the file lacked it until another request
    came (or the shutdown). The loop settles them when it goes idle."""
    cfg = config(tmp_path, restore="load")
    run_once(tiny_model_dir, cfg)  # learns prefill; close spills the entry
    engine = Engine(tiny_model_dir, cfg)
    prompt = engine.encode_chat(MESSAGES)
    hits: list = []
    out = list(engine.generate(prompt + [5] * 300, SamplingParams(max_tokens=4),
                               should_stop=lambda: bool(hits), on_hit=hits.append))  # fmt: skip
    assert hits and hits[0].tier == "cold" and out[-1].finish_reason == "cancelled", (hits, out)
    assert engine.restorer.costs.obs["load"]  # the load was observed ...
    stats = engine.cache.stats()  # ... and is fitted, for /metrics and the file
    assert stats["learned_load_cold_gb_s"] + stats["learned_load_warm_gb_s"] > 0
    assert CostBook(engine.restorer.costs.path, engine.fingerprint).obs["load"]
    engine.close()
