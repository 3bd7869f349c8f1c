"""CPU cold reload A/B: mx.load path vs the ranged reader for the whole entry vs dd."""
import os, sys, time, tempfile, shutil, functools
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
from tiered_kv.cold import store, scan, codec, ranged
from tiered_kv.restore import buffers

gb = float(sys.argv[1]); reps = int(sys.argv[2]); cold = sys.argv[3] == "cold" if len(sys.argv) > 3 else True
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

def ranged_all(workers=4, ra=False):
    def f():
        lay = ranged.layout(path, FINGERPRINT, 0, tokens)
        arrs = buffers.allocate(lay)
        views = buffers.byte_views(arrs, 0, tokens)
        old = ranged.no_readahead
        if ra:
            ranged.no_readahead = lambda fd: None
        try:
            ranged.read_range(path, FINGERPRINT, 0, tokens, workers=workers, into=views)
        finally:
            ranged.no_readahead = old
        del views
        return {k: mx.swapaxes(a, 1, 2) for k, a in arrs.items()}
    return f

def timed(f):
    t = time.perf_counter(); x = f()
    if isinstance(x, list):
        mx.eval([a for c in x for a in c.state])
    elif isinstance(x, dict):
        mx.eval(list(x.values()))
    dt = time.perf_counter() - t
    del x; mx.clear_cache(); return dt

ways = {"dd": None,
        "mlx-lm": lambda: load_prompt_cache(str(root / "m.safetensors")),
        "mx.load": lambda: mx.load(str(path)),
        "ours": lambda: codec.load_file(path, header),
        "ranged w2": ranged_all(2), "ranged w4": ranged_all(4), "ranged w8": ranged_all(8),
        "ranged w4 ra": ranged_all(4, True)}
res = {k: [] for k in ways}
for r in range(reps):
    for k, f in ways.items():
        p = root / "m.safetensors" if k == "mlx-lm" else path
        if k == "dd":
            res[k].append(dd.read(path, cold=cold)); continue
        if cold:
            dd.drop_page_cache(p)
        else:
            timed(f)
        res[k].append(timed(f))
for k, v in res.items():
    print(f"{k:14s} median {np.median(v):.3f}s {size/np.median(v)/1e9:.2f} GB/s  runs {' '.join(f'{x:.3f}' for x in v)}")
tier.close(); shutil.rmtree(root)
