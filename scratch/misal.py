"""Prefill/decode steps onto a plain KVCache whose buffer is of whole steps vs exact length (as a hit hands it over)."""
import sys, time
from pathlib import Path
import mlx.core as mx
from mlx_lm.models import cache as C
from engine.loading import load_model
model, _ = load_model(Path(sys.argv[1])); ctx = int(sys.argv[2])
base = [(i * 7919) % 4000 + 3 for i in range(ctx)]
def prefill():
    cache = C.make_prompt_cache(model)
    for s in range(0, ctx, 2048):
        mx.eval(model(mx.array([base[s:s + 2048]]), cache=cache))
    return cache
def exact(cache):
    for c in cache:
        c.keys, c.values = mx.contiguous(c.keys[..., :c.offset, :]), mx.contiguous(c.values[..., :c.offset, :])
    mx.eval([c.keys for c in cache]); return cache
def t_step(cache, n):
    t = time.perf_counter(); mx.eval(model(mx.array([[7] * n]), cache=cache)); return time.perf_counter() - t
for rnd in range(2):
    for label, make in (("whole steps", lambda: C.trim_prompt_cache(c := prefill(), 1) and c), ("exact length", lambda: exact(C.trim_prompt_cache(c := prefill(), 1) and c))):
        cache = make(); L = cache[0].offset
        out = []
        for n in (37, 1000):
            t_step(cache, n); C.trim_prompt_cache(cache, n); out.append(t_step(cache, n)); C.trim_prompt_cache(cache, n)
        cache = make()
        t_step(cache, 1); ds = [t_step(cache, 1) for _ in range(20)]
        print(f"round {rnd} {label} ({L} rows, buffer {cache[0].keys.shape[2]}): 37-step {out[0]*1e3:.1f} ms, 1000-step {out[1]*1e3:.1f} ms, decode step median {sorted(ds)[10]*1e3:.2f} ms", flush=True)
        del cache; mx.clear_cache()
