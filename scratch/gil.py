"""H200: both's tail read alone vs beside the head's compute (GIL contention?), and with a short switch interval."""
import sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import numpy as np, mlx.core as mx
from engine.loading import load_model
from mlx_lm.models.cache import make_prompt_cache
from tiered_kv.cold import ranged, codec, store, gpu
from tiered_kv.cold.backend import FileBackend
from tiered_kv.cold.landing import allocate
from tiered_kv.restore import buffers

model, _ = load_model(Path(sys.argv[1]))
n = int(sys.argv[2])
ids = mx.array(np.arange(n) % 1000)[None]
def fill(k):
    c = make_prompt_cache(model)
    for i in range(0, k, 2048):
        model(ids[:, i:i + 2048], cache=c); mx.eval([x.state for x in c])
    return c
caches = fill(n)
job = codec.prepare(np.arange(n, dtype=np.int32), caches, None, "fp")
Path("/tmp/gil").mkdir(exist_ok=True); b = FileBackend(Path("/tmp/gil")); b.put("e", store.encode(job.tokens, job.tensors, job.metadata)); path = b.path("e")
del caches, job
open(path, "rb").read()
m = n // 3
def read():
    lay = ranged.layout(path, "fp", m, n)
    tail = allocate(buffers.shapes(lay, m, n, "tail"), one_buffer=True)
    views = buffers.byte_views(tail, m, n)
    t = time.perf_counter(); rr = ranged.read_range(path, "fp", m, n, into=views, gpu=gpu.shared())
    return rr.nbytes / (time.perf_counter() - t) / 1e9
print("upload", gpu.shared() is not None, "file GB", path.stat().st_size / 1e9)
fill(m)
for label, sw in [("alone", 0.005), ("beside head", 0.005), ("beside head sw 0.2ms", 0.0002), ("alone sw 0.2ms", 0.0002)]:
    sys.setswitchinterval(sw)
    res = []
    for r in range(3):
        if label.startswith("alone"):
            res.append(read())
        else:
            with ThreadPoolExecutor(1) as ex:
                f = ex.submit(read); t = time.perf_counter(); fill(m); th = time.perf_counter() - t; res.append(f.result())
    print(f"{label:24s} " + " ".join(f"{g:.2f}" for g in res) + " GB/s" + (f"  head {th:.3f}s" if not label.startswith("alone") else ""), flush=True)
sys.setswitchinterval(0.005)
