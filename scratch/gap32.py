import sys, time
from pathlib import Path
import numpy as np
import mlx.core as mx
from mlx_lm.models import cache as C
from mlx_lm.generate import generate_step, GenerationBatch, StopSequences
from engine.generate import Engine, SamplingParams
from engine import decoding
from tiered_kv import Config
model_dir = Path(sys.argv[1]); ctx = int(sys.argv[2]); G = int(sys.argv[3]); rounds = int(sys.argv[4])
eng = Engine(model_dir, Config(tiers=()))
eng.tokenizer.eos_token_ids = []
eng.warm_up()
model = eng.model
base = [(i * 7919) % 4000 + 3 for i in range(ctx)]
def prefill():
    cache = C.make_prompt_cache(model)
    for s in range(0, ctx, 2048):
        mx.eval(model(mx.array([base[s:s + 2048]]), cache=cache))
    return cache
def run_gs():
    cache = prefill(); ts = [time.perf_counter()]
    for _ in generate_step(mx.array([5]), model, max_tokens=G, prompt_cache=cache): ts.append(time.perf_counter())
    return ts
def run_gb():
    cache = prefill(); layers = [decoding.merge([c]) for c in cache]
    gen = GenerationBatch(model, [0], mx.array([5]), layers, [[]], [None], decoding.sampling.greedy, [()], [StopSequences()], [1 << 62])
    ts = [time.perf_counter()]
    for _ in range(G): gen.next(); ts.append(time.perf_counter())
    return ts
stamps = []
orig_step = decoding.Decoding.step
def step(self):
    orig_step(self); stamps.append(time.perf_counter())
def run_engine():
    decoding.Decoding.step = step; stamps.clear()
    ids = [int(time.time_ns() % 3000) + 5] + base[1:]
    for ch in eng.generate(ids, SamplingParams(max_tokens=G)): pass
    decoding.Decoding.step = orig_step
    return list(stamps)
ways = {"generate_step": run_gs, "GenerationBatch DecodeKV": run_gb, "Engine": run_engine}
res = {k: [] for k in ways}
for r in range(rounds):
    for k, f in ways.items():
        ts = f(); g = np.diff(ts[3:]); res[k].append((np.median(g), (ts[-1] - ts[3]) / (len(ts) - 4)))
        mx.clear_cache()
for k, v in res.items():
    print(f"{k:26s} median gap ms {' '.join(f'{a*1e3:.2f}' for a, _ in v)}; mean {' '.join(f'{b*1e3:.2f}' for _, b in v)}", flush=True)
for r in range(2):
  for label, wrap in (("KVCache", lambda c: c), ("DecodeKVCache", lambda c: [decoding.merge([x]) for x in c])):
    cache = wrap(prefill()); y = mx.array([[5]]); mx.eval(model(y, cache=cache))
    t = time.perf_counter()
    for _ in range(100): mx.eval(model(y, cache=cache))
    print(f"sync forward {label}: {(time.perf_counter()-t)/100*1e3:.2f} ms", flush=True)
    del cache; mx.clear_cache()
