"""Per-step decode spikes (cuDNN graph per KV buffer size?) and SDPA first-call cost by shape."""
import sys, time, os
import mlx.core as mx
import numpy as np
from pathlib import Path
from mlx_lm.models.cache import make_prompt_cache
from engine.loading import load_model
print("MLX_CUDA_USE_CUDNN_SDPA", os.environ.get("MLX_CUDA_USE_CUDNN_SDPA"))
model, tok = load_model(Path(sys.argv[1]))
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
def prefill(n):
    cache = make_prompt_cache(model)
    ids = [(i * 7919) % 4000 + 3 for i in range(n)]
    for s in range(0, n, 2048):
        out = model(mx.array([ids[s:s + 2048]]), cache=cache); mx.eval(out)
    return cache, out
t = time.perf_counter(); cache, out = prefill(ctx); print("prefill", ctx, round(time.perf_counter() - t, 3))
# hot-hit-like steps: new n at this context
for n in (10, 10, 37, 37, 200, 200):
    t = time.perf_counter(); mx.eval(model(mx.array([[9] * n]), cache=cache)); print(f"step n {n} at {cache[0].offset - n}: {(time.perf_counter()-t)*1e3:.1f} ms")
y = mx.array([[5]])
times = []
for i in range(1100):
    t = time.perf_counter()
    logits = model(y, cache=cache); y = mx.argmax(logits[:, -1:], axis=-1); mx.eval(y)
    times.append((time.perf_counter() - t, cache[0].offset, cache[0].keys.shape[2]))
med = float(np.median([x[0] for x in times]))
print(f"decode median {med*1e3:.2f} ms, total {sum(x[0] for x in times):.2f} s for {len(times)}")
for i, (dt, off, buf) in enumerate(times):
    if dt > 3 * med:
        print(f"  spike step {i}: {dt*1e3:.1f} ms offset {off} buffer {buf}")
# mlx-lm's own generate_step, same start, timing per yielded token
from mlx_lm.generate import generate_step
cache, _ = prefill(ctx)
ts = [time.perf_counter()]
for i, _ in enumerate(generate_step(mx.array([5]), model, max_tokens=1100, prompt_cache=cache)):
    ts.append(time.perf_counter())
gaps = np.diff(ts)
print(f"mlx-lm generate_step: {len(gaps)} tokens in {ts[-1]-ts[0]:.2f} s, median gap {np.median(gaps)*1e3:.2f} ms; gaps > 3x median:",
      [(i, round(g * 1e3, 1)) for i, g in enumerate(gaps) if g > 3 * np.median(gaps)][:20])
