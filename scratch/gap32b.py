import sys, time, cProfile, pstats, io
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
def prefill(n):
    cache = C.make_prompt_cache(model)
    for s in range(0, n, 2048):
        mx.eval(model(mx.array([base[s:min(n, s + 2048)]]), cache=cache))
    return cache
def run_gs(n):
    cache = prefill(n); ts = [time.perf_counter()]
    for _ in generate_step(mx.array([base[n]] if n < ctx else [5]), model, max_tokens=G, prompt_cache=cache): ts.append(time.perf_counter())
    return ts
def run_gb(n):
    cache = prefill(n); layers = [decoding.merge([c]) for c in cache]
    gen = GenerationBatch(model, [0], mx.array([5]), layers, [[]], [None], decoding.sampling.greedy, [()], [StopSequences()], [1 << 62])
    ts = [time.perf_counter()]
    for _ in range(G): gen.next(); ts.append(time.perf_counter())
    return ts
stamps = []; inside = []
orig_step = decoding.Decoding.step
def step(self):
    t = time.perf_counter(); orig_step(self); now = time.perf_counter(); stamps.append(now); inside.append(now - t)
def run_engine(prof=False):
    decoding.Decoding.step = step; stamps.clear(); inside.clear()
    ids = [int(time.time_ns() % 3000) + 5] + base[1:]
    pr = cProfile.Profile() if prof else None
    g = eng.generate(ids, SamplingParams(max_tokens=G))
    first = next(g)
    if pr: pr.enable()
    for ch in g: pass
    if pr:
        pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue()[-3500:])
    decoding.Decoding.step = orig_step
    print(f"  engine: in Decoding.step median {np.median(inside[3:])*1e3:.2f} ms", flush=True)
    return list(stamps)
ways = {"gs 32768": lambda: run_gs(ctx), "gs 32767": lambda: run_gs(ctx - 1), "gb 32768": lambda: run_gb(ctx), "gb 32767": lambda: run_gb(ctx - 1), "engine": run_engine}
res = {k: [] for k in ways}
for r in range(rounds):
    for k, f in ways.items():
        ts = f(); g = np.diff(ts[3:]); res[k].append((np.median(g), (ts[-1] - ts[3]) / (len(ts) - 4)))
        mx.clear_cache()
for k, v in res.items():
    print(f"{k:12s} median gap ms {' '.join(f'{a*1e3:.2f}' for a, _ in v)}; mean {' '.join(f'{b*1e3:.2f}' for _, b in v)}", flush=True)
run_engine(prof=True)
