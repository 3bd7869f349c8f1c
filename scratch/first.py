import time, sys
t0 = time.perf_counter()
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from engine.loading import load_model
from tiered_kv.cold import gpu
model, tok = load_model(sys.argv[1])
print("load model", round(time.perf_counter() - t0, 3))
def fwd(n, cache=None, label=""):
    cache = cache if cache is not None else make_prompt_cache(model)
    t = time.perf_counter()
    out = model(mx.array([[5] * n]), cache=cache); mx.eval(out)
    print(f"forward {n:5d} {label:10s} {time.perf_counter() - t:.3f}s", flush=True)
    return cache
t = time.perf_counter(); up = gpu.shared(); print("gpu.shared()", round(time.perf_counter() - t, 3), up is not None)
c = fwd(512, label="first"); fwd(1, c, "decode"); fwd(1, c, "decode2")
c = fwd(512, label="second"); fwd(37, c, "odd"); fwd(37, c, "odd again"); fwd(10, c, "ten"); fwd(1, c)
c = fwd(500, label="500"); fwd(500, c, "500 again")
