"""H200: cold tail read of an 8B-shaped 8k entry (64 tensors) by read_range with 4 / 8 / 16 workers, through the upload."""
import sys, time
from pathlib import Path
import numpy as np, mlx.core as mx
from mlx_lm.models.cache import KVCache
from bench.dd import drop_page_cache
from tiered_kv.cold import codec, store, ranged, gpu
from tiered_kv.cold.backend import FileBackend
from tiered_kv.cold.landing import allocate
from tiered_kv.restore import buffers

n = int(sys.argv[1]); ms = [int(x) for x in sys.argv[2].split(",")]
caches = []
for _ in range(32):
    c = KVCache(); x = mx.random.normal((1, 8, n, 128)).astype(mx.bfloat16); c.update_and_fetch(x, -x); caches.append(c)
mx.eval([a for c in caches for a in (c.keys, c.values)])
job = codec.prepare(np.arange(n, dtype=np.int32), caches, None, "fp")
Path("/tmp/tw").mkdir(exist_ok=True)
b = FileBackend(Path("/tmp/tw")); b.put("e", store.encode(job.tokens, job.tensors, job.metadata)); path = b.path("e")
del caches, job
up = gpu.shared()
for m in ms:
    for w in (4, 8, 16):
        res = []
        for r in range(3):
            drop_page_cache(path)
            lay = ranged.layout(path, "fp", m, n)
            tail = allocate(buffers.shapes(lay, m, n, "tail"), one_buffer=True)
            views = buffers.byte_views(tail, m, n)
            t = time.perf_counter(); rr = ranged.read_range(path, "fp", m, n, workers=w, into=views, gpu=up); dt = time.perf_counter() - t
            res.append((dt, rr.nbytes / dt / 1e9))
            del views, tail
        res.sort()
        print(f"n={n} m={m} workers={w:2d} cold: " + " ".join(f"{d:.3f}s/{g:.2f}GB/s" for d, g in res), flush=True)
