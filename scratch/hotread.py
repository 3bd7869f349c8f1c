import os, sys, time, tempfile, shutil
from pathlib import Path
from dataclasses import replace
import numpy as np, xxhash
import mlx.core as mx
from concurrent.futures import ThreadPoolExecutor
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
open(path, "rb").read()
H=16
def span(fd, base, size, d, digests, chunk, P):
    for c in range(-(-size // chunk)):
        a, b = c*chunk, min(size, (c+1)*chunk)
        h = xxhash.xxh3_64()
        for s in range(a, b, P):
            e = min(b, s+P); v = d[s:e]
            ranged._preadv_all(fd, [v], base+s); h.update(v)
        if h.hexdigest() != digests[c*H:(c+1)*H]: raise store.CorruptEntry("x")
def fill(P, w):
    lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
    arrays = allocate(lay, one_buffer=True)
    dests = {n: np.frombuffer(a, dtype=np.uint8) for n, a in arrays.items()}
    fd = ranged._open(path)
    def one(n):
        s0, s1 = header.tensors[n]["data_offsets"]
        span(fd, header.data_start+s0, s1-s0, dests[n].data.cast("B"), header.digests(n), header.chunk_bytes, P)
    order = sorted(header.tensors, key=lambda k: header.tensors[k]["data_offsets"][0])
    with ThreadPoolExecutor(w) as pool: list(pool.map(one, order))
    os.close(fd)
    return arrays
def cur(w):
    lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
    arrays = allocate(lay, one_buffer=True)
    dests = {n: np.frombuffer(a, dtype=np.uint8) for n, a in arrays.items()}
    ranged.read_tensors(path, header, dests, None, w); return arrays
def mxload():
    a = mx.load(str(path)); mx.eval(list(a.values())); return a
ways = {"mx.load": mxload, "ours": lambda: codec._load_checking_arrays(path, header), "rt4": lambda: cur(4), "rt2": lambda: cur(2)}
for P in (256<<10, 1<<20, 4<<20):
    for w in (2, 3):
        ways[f"p{P>>10}k w{w}"] = (lambda P=P, w=w: fill(P, w))
res = {k: [] for k in ways}
for r in range(reps):
    for k, f in ways.items():
        t = time.perf_counter(); x = f(); dt = time.perf_counter() - t
        res[k].append(dt); del x; mx.clear_cache()
for k, xs in res.items():
    print(f"{k:12s} median {np.median(xs):.3f}  runs {' '.join(f'{x:.3f}' for x in xs)}", flush=True)
tier.close(); shutil.rmtree(root)
