"""engine/decoding.py: which caches decode in the batched group; a seeded request samples the same
tokens whatever else decodes beside it.

Real tiny mlx-lm models (helpers: tests/engine/batching.py).
"""

from __future__ import annotations

from mlx_lm.models.cache import make_prompt_cache

from engine.batch import BatchLoop
from engine.decoding import batchable
from engine.events import SamplingParams
from tests.engine.batching import PROMPTS, ModelEngine, Sink, run_until
from tests.fixtures import QuantizedLlama, gemma, make_llama, qwen_next
from tiered_kv.config import Config


def test_which_caches_batch():
    assert batchable(make_prompt_cache(make_llama(seed=4)))
    assert batchable(make_prompt_cache(gemma())) and batchable(make_prompt_cache(qwen_next()))
    assert not batchable(QuantizedLlama().make_cache())


def test_seeded_sampling_same_in_a_batch():
    """A seed gives the same tokens whatever else runs in the batch (each seeded request has its
    own random key; mlx-lm's samplers share the global one)."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=()))
    params = SamplingParams(max_tokens=10, temperature=1.5, seed=1234)
    solo = Sink()
    loop = BatchLoop(engine)
    loop.add(solo, PROMPTS[0], params)
    run_until(loop, lambda: solo.done)
    sinks = [Sink() for _ in range(3)]
    loop.add(sinks[0], PROMPTS[1], SamplingParams(max_tokens=10, temperature=1.0))
    loop.add(sinks[1], PROMPTS[0], params)
    loop.add(sinks[2], PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.7, seed=9))
    run_until(loop, lambda: all(s.done for s in sinks))
    assert sinks[1].ids == solo.ids
