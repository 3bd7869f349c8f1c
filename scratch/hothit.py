"""Engine hot hit (8k prefix + 10 new tokens) vs mlx-lm's generate_step with its own prompt cache."""
import sys, time, cProfile, pstats, copy
import mlx.core as mx
from pathlib import Path
from engine.generate import Engine, SamplingParams
from tiered_kv import Config
mdir = Path(sys.argv[1])
eng = Engine(mdir, Config(tiers=("hot",)))
eng.warm_up()
base = [(i * 7919) % 4000 + 3 for i in range(8000)]
def first_token(ids):
    t = time.perf_counter()
    for ch in eng.generate(ids, SamplingParams(max_tokens=1)):
        pass
    return time.perf_counter() - t
print("cold 8000", first_token(base))
for k in range(5):
    base = base + [11 + k] * 10
    print("hot +10", round(first_token(base) * 1e3, 1), "ms")
base = base + [99] * 10
pr = cProfile.Profile(); pr.enable(); first_token(base); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
# mlx-lm's own: prefill 8000 into a prompt cache, then 10 new tokens and first token
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
cache = make_prompt_cache(eng.model)
ids = base[:8000]
for _ in generate_step(mx.array(ids), eng.model, max_tokens=1, prompt_cache=cache): break
for k in range(5):
    t = time.perf_counter()
    for _ in generate_step(mx.array([21 + k] * 10), eng.model, max_tokens=1, prompt_cache=cache): break
    print("mlx-lm +10", round((time.perf_counter() - t) * 1e3, 1), "ms")
