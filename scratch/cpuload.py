"""CPU reload A/B: mx.load (+ hashing) vs landing arrays filled by read_tensors, with/without THP madvise."""
import ctypes, os, sys, time, tempfile, shutil
from pathlib import Path
from dataclasses import replace
import numpy as np
import mlx.core as mx
from engine import blas  # noqa
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from bench.sizes import SHAPES, make_caches, FINGERPRINT
from bench import dd
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.cold import store, codec, ranged
from tiered_kv.cold.landing import allocate

gb = float(sys.argv[1]); reps = int(sys.argv[2]); state = sys.argv[3]
shape = SHAPES["bench"]
tokens = int(gb * 1e9 / shape.bytes_per_token)
root = Path(tempfile.mkdtemp(dir="/work"))
caches = make_caches(shape, tokens)
ids = np.arange(tokens, dtype=np.int32) % 1000
cfg = replace(Config.from_env({}), cache_dir=root / "kv", disk_bytes=1 << 50, disk_free_floor=0)
tier = ColdTier(root / "kv", FINGERPRINT, cfg)
tier.spill(ids, caches); tier.flush()
save_prompt_cache(str(root / "m.safetensors"), caches)
del caches; mx.clear_cache()
(path,) = tier.dir.glob("*.safetensors")
header = store.read_header(path, FINGERPRINT)
size = path.stat().st_size
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE = 14

def filled(workers=2, huge=False, one=True):
    def f():
        lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
        arrays = allocate(lay, one_buffer=one)
        dests = {n: np.frombuffer(a, dtype=np.uint8) for n, a in arrays.items()}
        if huge:
            for d in dests.values():
                a = d.ctypes.data; lo = -(-a // (2 << 20)) * (2 << 20); hi = (a + d.nbytes) // (2 << 20) * (2 << 20)
                if hi > lo: libc.madvise(lo, hi - lo, MADV_HUGEPAGE)
        ranged.read_tensors(path, header, dests, None, workers)
        return arrays
    return f

def timed(f):
    t = time.perf_counter(); x = f()
    if isinstance(x, list): mx.eval([a for c in x for a in c.state])
    elif isinstance(x, dict): mx.eval(list(x.values()))
    dt = time.perf_counter() - t
    del x; mx.clear_cache(); return dt

ways = {"dd": None, "mlx-lm": lambda: load_prompt_cache(str(root / "m.safetensors")),
        "ours": lambda: codec.load_file(path, header),
        "fill w2": filled(2), "fill w4": filled(4), "fill w2 thp": filled(2, True), "fill w4 thp": filled(4, True),
        "fill w2 thp sep": filled(2, True, False)}
res = {k: [] for k in ways}
for r in range(reps):
    for k, f in ways.items():
        p = root / "m.safetensors" if k == "mlx-lm" else path
        if k == "dd":
            res[k].append(dd.read(path, cold=state == "cold")); continue
        if state == "cold": dd.drop_page_cache(p)
        else: open(p, "rb").read()
        res[k].append(timed(f))
for k, v in res.items():
    print(f"{state} {k:16s} median {np.median(v):.3f}s {size/np.median(v)/1e9:.2f} GB/s  runs {' '.join(f'{x:.3f}' for x in v)}", flush=True)
tier.close(); shutil.rmtree(root)
