import os, sys, time, tempfile, shutil, ctypes
from pathlib import Path
from dataclasses import replace
import numpy as np
import mlx.core as mx
from bench.sizes import SHAPES, make_caches, FINGERPRINT
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.cold import store, codec, ranged
from tiered_kv.cold.landing import allocate
libc = ctypes.CDLL(None, use_errno=True); libc.madvise.argtypes=[ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
gb = float(sys.argv[1]); reps = int(sys.argv[2])
shape = SHAPES["bench"]; tokens = int(gb * 1e9 / shape.bytes_per_token)
root = Path(tempfile.mkdtemp(dir="/work"))
caches = make_caches(shape, tokens); ids = np.arange(tokens, dtype=np.int32) % 1000
cfg = replace(Config.from_env({}), cache_dir=root / "kv", disk_bytes=1 << 50, disk_free_floor=0)
tier = ColdTier(root / "kv", FINGERPRINT, cfg); tier.spill(ids, caches); tier.flush()
del caches; mx.clear_cache()
(path,) = tier.dir.glob("*.safetensors"); header = store.read_header(path, FINGERPRINT); size = path.stat().st_size
open(path, "rb").read()
def huge(d):
    a = d.ctypes.data; e = a + d.nbytes; A = 2<<20
    a2 = -(-a//A)*A; e2 = e//A*A
    if e2 > a2:
        r = libc.madvise(a2, e2-a2, 14)
        if r: print("madvise", ctypes.get_errno())
def fill(w, hp):
    lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
    arrays = allocate(lay, one_buffer=True)
    dests = {n: np.frombuffer(a, dtype=np.uint8) for n, a in arrays.items()}
    if hp:
        for d in dests.values(): huge(d)
    ranged.read_tensors(path, header, dests, None, w); return arrays
def fill1(w, hp):
    lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
    arrays = allocate(lay, one_buffer=False)
    dests = {n: np.frombuffer(a, dtype=np.uint8) for n, a in arrays.items()}
    if hp:
        for d in dests.values(): huge(d)
    ranged.read_tensors(path, header, dests, None, w); return arrays
def mxload():
    a = mx.load(str(path)); mx.eval(list(a.values())); return a
ways = {"mx.load": mxload, "ours": lambda: codec._load_checking_arrays(path, header),
        "rt4": lambda: fill(4, False), "rt4 thp": lambda: fill(4, True),
        "sep4 thp": lambda: fill1(4, True), "rt2 thp": lambda: fill(2, True)}
res = {k: [] for k in ways}
for r in range(reps):
    for k, f in ways.items():
        t = time.perf_counter(); x = f(); dt = time.perf_counter() - t
        res[k].append(dt); del x; mx.clear_cache()
for k, xs in res.items():
    print(f"{k:12s} median {np.median(xs):.3f}  runs {' '.join(f'{x:.3f}' for x in xs)}", flush=True)
tier.close(); shutil.rmtree(root)
