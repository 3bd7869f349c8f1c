import os, sys, time, tempfile, shutil
from pathlib import Path
from dataclasses import replace
import numpy as np
import mlx.core as mx
from bench.sizes import SHAPES, make_caches, FINGERPRINT
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.cold import store, codec
gb = float(sys.argv[1]); reps = int(sys.argv[2])
shape = SHAPES["bench"]; tokens = int(gb * 1e9 / shape.bytes_per_token)
root = Path(tempfile.mkdtemp(dir="/work"))
caches = make_caches(shape, tokens); ids = np.arange(tokens, dtype=np.int32) % 1000
cfg = replace(Config.from_env({}), cache_dir=root / "kv", disk_bytes=1 << 50, disk_free_floor=0)
tier = ColdTier(root / "kv", FINGERPRINT, cfg); tier.spill(ids, caches); tier.flush()
del caches; mx.clear_cache()
(path,) = tier.dir.glob("*.safetensors"); header = store.read_header(path, FINGERPRINT); size = path.stat().st_size
def mxload():
    a = mx.load(str(path)); mx.eval(list(a.values())); return a
def hashonly(a):
    fs=[store.pool().submit(store.check_buffer, n, store.flat_bytes(x), header) for n,x in a.items() if n in header.tensors]
    for f in fs: f.result()
def ours(g):
    codec.GROUP_BYTES = g
    return codec._load_checking_arrays(path, header)
ways = {"mx.load": mxload, "g256": lambda: ours(256<<20), "g64": lambda: ours(64<<20), "g16": lambda: ours(16<<20)}
res = {k: [] for k in ways}; hs=[]
open(path, "rb").read()
for r in range(reps):
    for k, f in ways.items():
        t = time.perf_counter(); x = f(); dt = time.perf_counter() - t
        res[k].append(dt)
        if k == "mx.load":
            t = time.perf_counter(); hashonly(x); hs.append(time.perf_counter()-t)
        del x; mx.clear_cache()
print("tensors", len(header.tensors), "size", size)
print("hash only", np.median(hs))
for k, xs in res.items():
    print(f"{k:8s} median {np.median(xs):.3f}  runs {' '.join(f'{x:.3f}' for x in xs)}", flush=True)
tier.close(); shutil.rmtree(root)
