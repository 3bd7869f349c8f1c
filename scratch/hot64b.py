import sys, time, os
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, KVCache, BatchKVCache
from pathlib import Path
sys.argv.append("x")
exec(open("scratch/hot64.py").read().split("text = long_prefix")[0])
variant = os.environ.get("V", "none")
m = eng.model
def extra():
    cache = make_prompt_cache(m)
    for n in (2048, 37, 1):
        mx.eval(m(mx.array([[0] * n]), cache=cache))
    if variant in ("extract", "both"):
        # what a stored entry looks like: exact-length contiguous arrays (BatchKVCache.extract)
        for c in cache:
            c.keys = mx.contiguous(c.keys[..., : c.offset, :]); c.values = mx.contiguous(c.values[..., : c.offset, :])
        mx.eval(m(mx.array([[0] * 8]), cache=cache))
    if variant in ("batch", "both"):
        b = [c.merge([c]) for c in cache]
        mx.eval(m(mx.array([[0]]), cache=b)); mx.eval(m(mx.array([[0]]), cache=b))
    mx.clear_cache()
t = time.perf_counter(); extra(); print("variant", variant, "extra warm-up", round(time.perf_counter() - t, 3))
exec("text = long_prefix" + open("scratch/hot64.py").read().split("text = long_prefix")[1])
