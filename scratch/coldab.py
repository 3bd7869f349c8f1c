"""CPU cold reload A/B: which part of ours costs against mlx-lm's load."""
import os, sys, time, tempfile, shutil
from pathlib import Path
from dataclasses import replace
import numpy as np
import mlx.core as mx
from engine import blas  # noqa
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from bench.sizes import SHAPES, make_caches, FINGERPRINT
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.cold import store, scan, codec

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
hit = tier.lookup(ids)
header = store.read_header(path, FINGERPRINT)


def drop(p):
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)


class NoPrefetch:
    def __init__(self, *a, **k): pass
    def advance(self, o): pass
    def close(self): pass


real_pf, real_check = scan.Prefetch, store.check_buffer


import functools


def variant(pf=True, check=True, ahead=None, group=None):
    def f():
        g0 = codec.GROUP_BYTES
        if group:
            codec.GROUP_BYTES = group
        scan.Prefetch = (functools.partial(real_pf, ahead=ahead) if ahead else real_pf) if pf else NoPrefetch
        store.check_buffer = real_check if check else (lambda *a: None)
        try:
            return codec.load_file(path, header)
        finally:
            scan.Prefetch, store.check_buffer = real_pf, real_check
            codec.GROUP_BYTES = g0
    return f


def timed(f):
    t = time.perf_counter(); x = f()
    if isinstance(x, list):
        mx.eval([a for c in x for a in c.state])
    elif isinstance(x, dict):
        mx.eval(list(x.values()))
    dt = time.perf_counter() - t
    del x; mx.clear_cache(); return dt


ways = {"mlx-lm": lambda: load_prompt_cache(str(root / "m.safetensors")),
        "mx.load ours": lambda: mx.load(str(path)),
        "ours": variant(), "ahead 1G": variant(ahead=1 << 30),
        "group 64M": variant(group=64 << 20), "group 1G": variant(group=1 << 30),
        "group 1G ahead 1G": variant(group=1 << 30, ahead=1 << 30),
        "ours neither": variant(False, False)}
res = {k: [] for k in ways}
for r in range(reps):
    for k, f in ways.items():
        drop(path); drop(root / "m.safetensors")
        res[k].append(timed(f))
for k, v in res.items():
    print(f"{k:20s} median {np.median(v):.3f}  runs {' '.join(f'{x:.3f}' for x in v)}")
tier.close(); shutil.rmtree(root)
