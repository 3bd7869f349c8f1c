import os, sys, time, tempfile, shutil
from pathlib import Path
from dataclasses import replace
import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from bench.sizes import SHAPES, make_caches, FINGERPRINT
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.cold import store, codec
gb = float(sys.argv[1]); reps = int(sys.argv[2])
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
def timed(f):
    t = time.perf_counter(); x = f()
    if isinstance(x, list): mx.eval([a for c in x for a in c.state])
    elif isinstance(x, dict): mx.eval(list(x.values()))
    dt = time.perf_counter() - t
    del x; mx.clear_cache(); return dt
def ours(g):
    def f():
        codec.GROUP_BYTES = g
        return codec.load_file(path, header)
    return f
def plain():
    a = mx.load(str(path)); mx.eval(list(a.values())); return a
def plain_hash():
    a = mx.load(str(path)); mx.eval(list(a.values()))
    for n, x in a.items(): store.check_buffer(n, store.flat_bytes(x), header)
    return a
def mlxlm_plain():
    a = mx.load(str(root / "m.safetensors")); mx.eval(list(a.values())); return a
from tiered_kv.cold import ranged
from tiered_kv.cold.landing import allocate
def filled(workers):
    def f():
        lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
        arrays = allocate(lay, one_buffer=False)
        dests = {n: np.frombuffer(a, dtype=np.uint8) for n, a in arrays.items()}
        ranged.read_tensors(path, header, dests, None, workers)
        return arrays
    return f
ways = {"fill2": filled(2), "fill3": filled(3), "fill4": filled(4), "mlx-lm": lambda: load_prompt_cache(str(root / "m.safetensors")), "ours256": ours(256 << 20), }
res = {k: [] for k in ways}
for r in range(reps):
    for k, f in ways.items():
        p = root / "m.safetensors" if k == "mlx-lm" else path
        open(p, "rb").read()
        res[k].append(timed(f))
for k, v in res.items():
    print(f"{k:10s} median {np.median(v):.3f}s {size/np.median(v)/1e9:.2f} GB/s  runs {' '.join(f'{x:.3f}' for x in v)}", flush=True)
tier.close(); shutil.rmtree(root)
