import os, sys, time, tempfile, shutil
from pathlib import Path
from dataclasses import replace
import numpy as np
import mlx.core as mx
from bench.sizes import SHAPES, make_caches, FINGERPRINT
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.cold import store, codec, ranged
from tiered_kv.cold.landing import allocate
gb = float(sys.argv[1]); reps = int(sys.argv[2])
shape = SHAPES["bench"]; tokens = int(gb * 1e9 / shape.bytes_per_token)
root = Path(tempfile.mkdtemp(dir="/work"))
caches = make_caches(shape, tokens); ids = np.arange(tokens, dtype=np.int32) % 1000
cfg = replace(Config.from_env({}), cache_dir=root / "kv", disk_bytes=1 << 50, disk_free_floor=0)
tier = ColdTier(root / "kv", FINGERPRINT, cfg); tier.spill(ids, caches); tier.flush()
del caches; mx.clear_cache()
(path,) = tier.dir.glob("*.safetensors"); header = store.read_header(path, FINGERPRINT); size = path.stat().st_size
def drop():
    os.sync(); fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def current(): return codec._load_checking_arrays(path, header)
def fill(w=4):
    lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
    arrays = allocate(lay, one_buffer=True)
    dests = {n: np.frombuffer(a, dtype=np.uint8) for n, a in arrays.items()}
    ranged.read_tensors(path, header, dests, None, w); return arrays
def dd():
    fd = os.open(path, os.O_RDONLY); buf = bytearray(8 << 20)
    while os.readv(fd, [buf]): pass
    os.close(fd)
ways = {"dd": dd, "current": current, "fill4": fill}
res = {k: {"cold": [], "warm": []} for k in ways}
for r in range(reps):
    for k, f in ways.items():
        for pages in ("cold", "warm"):
            if pages == "cold": drop()
            else: open(path, "rb").read()
            t = time.perf_counter(); x = f(); dt = time.perf_counter() - t
            del x; mx.clear_cache(); res[k][pages].append(dt)
for k, v in res.items():
    for p, xs in v.items():
        print(f"{k:8s} {p}: median {size/np.median(xs)/1e9:.2f} GB/s  runs {' '.join(f'{x:.3f}' for x in xs)}", flush=True)
tier.close(); shutil.rmtree(root)
