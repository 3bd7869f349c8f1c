"""CUDA: landing allocation cost, 64 arrays vs one buffer sliced into views."""
import time
import mlx.core as mx
from tiered_kv.restore import buffers

L, H, D = 64, 8, 128
mx.eval(mx.ones((4,)) + 1)
for toks in (2048, 2048, 10240, 10240, 4096):
    lay = {f"t{i}": ("BF16", (1, toks, H, D)) for i in range(L)}
    mx.clear_cache()
    t = time.perf_counter()
    a = buffers.allocate(lay)
    t_many = time.perf_counter() - t
    del a
    mx.clear_cache()
    total = sum(toks * H * D * 2 for _ in range(L))
    t = time.perf_counter()
    big = buffers.allocate({"all": ("U8", (total,))})["all"]
    per = toks * H * D * 2
    views = [big[i * per:(i + 1) * per].view(mx.bfloat16).reshape(1, toks, H, D) for i in range(L)]
    mx.eval(views)
    t_one = time.perf_counter() - t
    import numpy as np
    ok = all(np.frombuffer(v, dtype=np.uint8).nbytes == per for v in views)
    del views, big
    mx.clear_cache()
    # cached: allocate again without clear_cache
    a = buffers.allocate(lay); del a
    t = time.perf_counter()
    a = buffers.allocate(lay)
    t_cached = time.perf_counter() - t
    del a
    print(f"{toks} tokens x {L}: {L} arrays {t_many:.4f} s, one buffer + views {t_one:.4f} s (views ok {ok}), {L} arrays from MLX's cache {t_cached:.4f} s")
