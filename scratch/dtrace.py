"""Per-token decode intervals of Engine.generate (one request) vs mlx-lm generate_step, KV step sizes."""
import sys, time, os
from pathlib import Path
import numpy as np
import mlx.core as mx
from mlx_lm.models import cache as C
from engine.generate import Engine, SamplingParams
from engine import decoding
from tiered_kv import Config
model_dir = Path(sys.argv[1]); ctx = int(sys.argv[2]); G = int(sys.argv[3]); steps = [int(x) for x in sys.argv[4].split(",")]
eng = Engine(model_dir, Config(tiers=("hot",)))
eng.tokenizer.eos_token_ids = []
print("warm-up", round(eng.warm_up(), 3), flush=True)
stamps = []
orig = decoding.Decoding.step
def step(self):
    orig(self); stamps.append(time.perf_counter())
decoding.Decoding.step = step
def report(label, gaps, total_tokens, total_s):
    med = float(np.median(gaps)); sp = [(i, round(g * 1e3, 1)) for i, g in enumerate(gaps) if g > 3 * med]
    excess = sum(g - med for g in gaps if g > 3 * med)
    print(f"{label}: {total_tokens} tok {total_s:.2f} s = {total_tokens/total_s:.0f} tok/s, median gap {med*1e3:.2f} ms, "
          f"{len(sp)} spikes, excess {excess*1e3:.0f} ms; {sp[:12]}", flush=True)
base = [(i * 7919) % 4000 + 3 for i in range(ctx)]
for k, st in enumerate(steps):
    C.BatchKVCache.step = st
    ids = [k + 5] + base[1:]  # a miss each time: no hot hit
    stamps.clear(); t0 = time.perf_counter(); n = 0
    for ch in eng.generate(ids, SamplingParams(max_tokens=G)):
        if ch.usage: u = ch.usage
    tot = time.perf_counter() - t0
    gaps = np.diff(stamps[2:])
    report(f"engine step {st} (ttft {u.ttft_seconds:.2f}, decode {u.decode_seconds:.2f} s)", gaps, u.completion_tokens, u.decode_seconds)
C.BatchKVCache.step = 256
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
for st in (256, steps[-1]):
    C.KVCache.step = st
    cache = make_prompt_cache(eng.model)
    ts = [time.perf_counter()]
    for i, _ in enumerate(generate_step(mx.array(base), eng.model, max_tokens=G, prompt_cache=cache)):
        ts.append(time.perf_counter())
    gaps = np.diff(ts[2:])
    report(f"mlx-lm generate_step KVCache.step {st}", gaps, len(gaps), ts[-1] - ts[2])
C.KVCache.step = 256
