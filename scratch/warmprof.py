import os, sys, time, tempfile, shutil
from pathlib import Path
from dataclasses import replace
import numpy as np
import mlx.core as mx
from bench.sizes import SHAPES, make_caches, FINGERPRINT
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.cold import store, codec, scan
gb = float(sys.argv[1]); reps = int(sys.argv[2])
shape = SHAPES["bench"]; tokens = int(gb * 1e9 / shape.bytes_per_token)
root = Path(tempfile.mkdtemp(dir="/work"))
caches = make_caches(shape, tokens); ids = np.arange(tokens, dtype=np.int32) % 1000
cfg = replace(Config.from_env({}), cache_dir=root / "kv", disk_bytes=1 << 50, disk_free_floor=0)
tier = ColdTier(root / "kv", FINGERPRINT, cfg); tier.spill(ids, caches); tier.flush()
del caches; mx.clear_cache()
(path,) = tier.dir.glob("*.safetensors"); header = store.read_header(path, FINGERPRINT); size = path.stat().st_size
open(path, "rb").read()
for r in range(reps):
    T=[time.perf_counter()]
    arrays, order, ends = codec._open(path, header); T.append(time.perf_counter())
    mx.eval(list(arrays.values())); T.append(time.perf_counter())
    fs=[store.pool().submit(store.check_buffer, n, store.flat_bytes(x), header) for n,x in arrays.items()]
    for f in fs: f.result()
    T.append(time.perf_counter())
    out = codec._logical(arrays, header); T.append(time.perf_counter())
    print(" ".join(f"{b-a:.3f}" for a,b in zip(T,T[1:])), "total", f"{T[-1]-T[0]:.3f}")
    del arrays, out; mx.clear_cache()
    t=time.perf_counter(); a=mx.load(str(path)); mx.eval(list(a.values())); print("mx.load", f"{time.perf_counter()-t:.3f}"); del a; mx.clear_cache()
    t=time.perf_counter(); x=codec._load_checking_arrays(path, header); print("ours", f"{time.perf_counter()-t:.3f}"); del x; mx.clear_cache()
tier.close(); shutil.rmtree(root)
