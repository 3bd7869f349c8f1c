"""Engine: greedy output through the cache equals a cold run; sampling params; early stop stores."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generate import Engine, SamplingParams
from tests.fixtures import f32_tol, tokens
from tiered_kv.config import Config


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    cached = Engine(
        tiny_model_dir, Config(tiers=("hot",), min_continuation_tokens=16, prefill_chunk=16)
    )
    cold = Engine(tiny_model_dir, Config(tiers=()))
    return cached, cold


def ids_of(engine: Engine, text: str) -> list[int]:
    return engine.encode_text(text)


def run(engine: Engine, ids: list[int], **kw):
    chunks = list(engine.generate(ids, SamplingParams(**kw)))
    return (
        "".join(c.text for c in chunks),
        [c.token for c in chunks if c.token is not None],
        chunks[-1],
    )


TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 6


def test_greedy_equal_with_and_without_cache(engines):
    cached, cold = engines
    ids = ids_of(cold, TEXT)
    first = run(cached, ids, max_tokens=12)
    again = run(cached, ids, max_tokens=12)  # exact hit
    ref = run(cold, ids, max_tokens=12)
    assert first[1] == ref[1] == again[1]
    assert again[2].usage.cached_tokens == len(ids) - 1 and again[2].usage.cache_tier == "hot"
    longer = ids + ids_of(cold, " and then the story goes on")
    assert run(cached, longer, max_tokens=12)[1] == run(cold, longer, max_tokens=12)[1]


def test_logits_equal_for_prefix_divergence_and_continuation(engines):
    cached, cold = engines
    base = ids_of(cold, TEXT + " zebra")
    cases = [
        base,
        base[:40] + ids_of(cold, " something else entirely"),
        base + [5, 6, 7],
        base[:30],
    ]
    for ids in cases:
        got, hit = cached.logits(ids)
        want, _ = cold.logits(ids)
        np.testing.assert_allclose(got, want, rtol=f32_tol(1e-4), atol=f32_tol(1e-4))
    assert hit.tokens > 0


def test_cold_engine_reports_no_cache(engines):
    _, cold = engines
    ids = ids_of(cold, TEXT)
    run(cold, ids, max_tokens=2)
    assert run(cold, ids, max_tokens=2)[2].usage.cached_tokens == 0


def test_max_tokens_and_usage(engines):
    cached, _ = engines
    text, toks, last = run(cached, ids_of(cached, "hello world"), max_tokens=5)
    assert last.finish_reason in ("length", "stop")
    assert last.usage.completion_tokens == len(toks) <= 5
    assert last.usage.prompt_tokens == len(ids_of(cached, "hello world"))


def test_stop_string_cuts_text(engines):
    cached, _ = engines
    ids = ids_of(cached, "count: one two three")
    text, toks, last = run(cached, ids, max_tokens=30)
    assert len(text) > 4
    stop = text[2:4]
    cut, _, last = run(cached, ids, max_tokens=30, stop=(stop,))
    assert last.finish_reason == "stop"
    assert cut == text[: text.find(stop)]


def test_seeded_sampling_is_reproducible(engines):
    cached, _ = engines
    ids = ids_of(cached, "random words please")
    a = run(cached, ids, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)[1]
    b = run(cached, ids, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)[1]
    assert a == b


def test_early_close_stores_what_was_computed(engines):
    cached, cold = engines
    ids = ids_of(cold, "a fresh prompt that nobody has sent before " * 3)
    gen = cached.generate(ids, SamplingParams(max_tokens=50))
    got = [next(gen) for _ in range(4)]
    gen.close()  # the client went away
    assert all(c.finish_reason is None for c in got)
    hit = cached.cache.fetch(ids + [9])
    assert hit.hit.tokens >= len(ids)
    cached.cache.store(hit, (ids + [9])[: hit.hit.tokens])


def test_failure_after_fetch_gives_the_lease_back(engines):
    """Issue 12.5: a request failing after the lookup (here a seed mx.random.key refuses: a seed
    matters when sampling) must not lose the conversation's entry, which a continuation takes out of
    the hot tier."""
    cached, cold = engines
    ids = ids_of(cold, "a conversation that must survive a failed turn " * 3)
    run(cached, ids, max_tokens=4)
    turn = ids + ids_of(cold, " and the next question")
    with pytest.raises(TypeError):
        list(cached.generate(turn, SamplingParams(max_tokens=4, temperature=1.0, seed=-1)))
    assert run(cached, turn, max_tokens=4)[2].usage.cached_tokens >= len(ids)


@pytest.mark.parametrize("bad", ["past", "negative", "past 32 bits"])
def test_prompt_ids_outside_the_vocabulary_fail_the_request_not_the_process(engines, bad):
    """MLX's embedding gather reads past its table for an id outside the vocabulary: on the CPU
    the process died of a segfault (every request with it). The HTTP API takes text, so only a
    tokenizer with more ids than the model's embeddings (or a caller of ``generate``) sends one;
    the request fails with the id named, before any lookup or prefill, and the engine serves on."""
    cached, cold = engines
    ids = ids_of(cold, TEXT)
    wrong = {"past": cold.vocab_size + 30_000, "negative": -3, "past 32 bits": 1 << 40}[bad]
    for engine in engines:
        with pytest.raises(ValueError, match=f"token id {wrong} .*vocabulary of {cold.vocab_size}"):
            list(engine.generate(ids[:5] + [wrong] + ids[5:], SamplingParams(max_tokens=4)))
        assert run(engine, ids, max_tokens=4)[2].finish_reason == "length"


def test_should_stop_cancels_and_progress_reports(engines):
    cached, cold = engines
    ids = ids_of(cold, "progress " * 40)
    seen = []
    chunks = list(
        cached.generate(
            ids,
            SamplingParams(max_tokens=50),
            on_progress=lambda d, t: seen.append((d, t)),
            should_stop=lambda: len(seen) >= 2,
        )
    )
    assert chunks[-1].finish_reason == "cancelled"
    assert seen[0][1] == len(ids) and seen[-1][0] < len(ids)
    lease = cached.cache.fetch(ids)  # the partial prefill was stored
    assert lease.hit.tokens == seen[-1][0]
    cached.cache.store(lease, ids[: lease.hit.tokens])


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_hits_equal_cold(smollm2_dir, tmp_path):
    """The real model: logits and greedy text after hot and disk hits equal a cold prefill."""
    cfg = Config(cache_dir=tmp_path, block_tokens=16, min_continuation_tokens=32, prefill_chunk=64)
    cached = Engine(smollm2_dir, cfg)
    cold = Engine(smollm2_dir, Config(tiers=()))
    msgs = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name the capital of France in one word."},
    ]
    ids = cached.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    first = run(cached, ids, max_tokens=8)
    ref = run(cold, ids, max_tokens=8)
    assert first[1] == ref[1]
    assert run(cached, ids, max_tokens=8)[1] == ref[1]  # exact hit (hot)
    turn2 = (
        ids
        + first[1]
        + cached.encode_text(
            "<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
        )
    )
    for probe in (turn2, ids[:20] + cached.encode_text(" something different")):
        got, hit = cached.logits(probe)
        want, _ = cold.logits(probe)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        assert hit.tokens > 0
    cached.close()  # spills to disk
    restarted = Engine(smollm2_dir, cfg)
    text, toks, last = run(restarted, turn2, max_tokens=8)
    assert last.usage.cache_tier == "cold" and last.usage.cached_tokens >= len(ids)
    assert toks == run(cold, turn2, max_tokens=8)[1]
    restarted.close()


def _engine(model_dir, root, **kw):
    from engine.generate import Engine

    kw.setdefault(
        "cold_deadline", 30.0
    )  # (the deadline itself: tests/tiered_kv/cold/test_reader.py)
    # these tests ask whether entries reach the disk and serve: a disk hit is loaded (the planner,
    # free to recompute a short hit, has its own tests in tests/tiered_kv/restore/)
    kw.setdefault("restore", "load")
    return Engine(model_dir, Config(cache_dir=root, block_tokens=16, disk_free_floor=0, **kw))


def _answer(engine, ids: list[int]):
    from engine.generate import SamplingParams

    chunks = list(engine.generate(ids, SamplingParams(max_tokens=2)))
    return chunks[-1].usage


def test_spill_bigger_than_the_queue_bound_reaches_disk_and_serves_after_restart(
    tiny_bench_dir, tmp_path
):
    """Issue 11: an entry larger than TIERED_KV_SPILL_QUEUE_BYTES was dropped at once (no file)."""
    root = tmp_path / "kv"
    eng = _engine(tiny_bench_dir, root, spill_queue_bytes=1000, hot_bytes=1)
    ids = tokens(60, 80)
    _answer(eng, ids)
    _answer(eng, tokens(62, 40))  # evicts the first entry from memory: it spills
    eng.cache.cold.flush()
    st = eng.cache.stats()
    assert st["cold_spills"] == 1 and st["cold_drops"] == 0, st
    eng.close()
    eng = _engine(tiny_bench_dir, root, spill_queue_bytes=1000)
    usage = _answer(eng, ids + tokens(61, 3))
    assert usage.cache_tier == "cold" and usage.cached_tokens >= 64, usage
    eng.close()


def test_shutdown_writes_every_memory_only_entry_whatever_its_size(tiny_bench_dir, tmp_path):
    """Issue 11: close() dropped memory-only entries larger than the queue bound."""
    root = tmp_path / "kv"
    eng = _engine(tiny_bench_dir, root, spill_queue_bytes=1000)  # all stay in memory
    prompts = [tokens(70 + i, 48 + 16 * i) for i in range(3)]
    for p in prompts:
        _answer(eng, p)
    assert eng.cache.stats()["cold_spills"] == 0 and len(eng.cache.hot) == 3
    eng.close()
    assert len(list(root.glob("*/*.safetensors"))) == 3
    eng = _engine(tiny_bench_dir, root)
    st0 = eng.cache.stats()
    assert st0["cold_entries"] == 3 and st0["cold_drops"] == 0, st0
    for p in prompts:
        usage = _answer(eng, p + [5])
        assert usage.cache_tier == "cold" and usage.cached_tokens >= len(p) - 16, usage
    eng.close()
