"""Step cost by shape on the device: forward n tokens onto a context of c; then engine hot hit vs mlx-lm."""
import sys, time, cProfile, pstats
import mlx.core as mx
from pathlib import Path
from mlx_lm.models.cache import make_prompt_cache
from engine.loading import load_model
mdir = Path(sys.argv[1])
model, tok = load_model(mdir)
def ctx(c):
    cache = make_prompt_cache(model)
    for s in range(0, c, 2048):
        mx.eval(model(mx.array([[5] * min(2048, c - s)]), cache=cache))
    return cache
def step(cache, n):
    t = time.perf_counter(); mx.eval(model(mx.array([[7] * n]), cache=cache)); return time.perf_counter() - t
print("warm", step(ctx(0), 2048), step(ctx(0), 37), step(ctx(0), 1))
for c in (0, 2048, 8192):
    for n in (1, 2, 8, 10, 16, 31, 32, 33, 37, 63, 64, 65, 100, 128, 129, 256, 500, 512, 1000, 1024, 2047, 2048):
        ts = []
        for r in range(4):
            cache = ctx(c)
            ts.append(step(cache, n))
        print(f"ctx {c:5d} n {n:5d} first {ts[0]*1e3:7.1f} ms  min rest {min(ts[1:])*1e3:7.1f} ms", flush=True)
# components
D = model.args.hidden_size; I = model.args.intermediate_size
w = mx.random.normal((I, D)).astype(mx.bfloat16); mx.eval(w)
for n in (1, 10, 37, 64, 500, 512, 2048):
    x = mx.random.normal((n, D)).astype(mx.bfloat16); mx.eval(x)
    mx.eval(x @ w.T)
    t = time.perf_counter()
    for _ in range(20): y = x @ w.T; mx.eval(y)
    print(f"matmul {n}x{D} @ {D}x{I}: {(time.perf_counter()-t)/20*1e3:.3f} ms", flush=True)
H = model.args.num_attention_heads; KVH = model.args.num_key_value_heads; hd = D // H
for n, c in ((10, 8192), (37, 2048), (64, 8192), (500, 0), (512, 0), (2048, 0), (2048, 8192)):
    q = mx.random.normal((1, H, n, hd)).astype(mx.bfloat16); k = mx.random.normal((1, KVH, c + n, hd)).astype(mx.bfloat16); v = k
    mx.eval(q, k)
    f = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5, mask="causal" if n > 1 else None)
    mx.eval(f())
    t = time.perf_counter()
    for _ in range(20): mx.eval(f())
    print(f"sdpa q {n} kv {c+n}: {(time.perf_counter()-t)/20*1e3:.3f} ms", flush=True)
