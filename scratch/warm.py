"""CPU warm reload: mlx-lm load vs ours vs piecewise pread+hash-hot into landing arrays."""
import os, sys, time, threading, tempfile, shutil
from pathlib import Path
from dataclasses import replace
import numpy as np
import mlx.core as mx
import xxhash
from engine import blas  # noqa
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from bench.sizes import SHAPES, make_caches, FINGERPRINT
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.cold import store
from tiered_kv.restore import buffers

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
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
order = sorted(header.tensors, key=lambda n: header.tensors[n]["data_offsets"][0])


def piecewise(piece, threads, hashing=True):
    lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
    arrays = buffers.allocate(lay)
    chunk = header.chunk_bytes
    jobs = []  # (fd offset, dest view, expected digest)
    for n in order:
        t = header.tensors[n]
        a, b = t["data_offsets"]
        d = np.frombuffer(arrays[n], dtype=np.uint8)
        sums = header.digests(n)
        for i, off in enumerate(range(0, b - a, chunk)):
            jobs.append((header.data_start + a + off, d[off: off + chunk], sums[16 * i: 16 * i + 16]))
    fd = os.open(path, os.O_RDONLY)
    it = iter(jobs)
    lock = threading.Lock()
    bad = []

    def work():
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                return
            off, dst, want = j
            h = xxhash.xxh3_64()
            for p in range(0, len(dst), piece):
                v = dst[p: p + piece]
                os.preadv(fd, [v], off + p)
                if hashing:
                    h.update(v)
            if hashing and h.hexdigest() != want:
                bad.append(off)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    os.close(fd)
    assert not bad
    return arrays


COLD = len(sys.argv) > 3 and sys.argv[3] == "cold"


def cat(p):
    if COLD:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        return
    with open(p, "rb") as f:
        while f.read(64 << 20):
            pass


def timed(f):
    t = time.perf_counter()
    x = f()
    if isinstance(x, list):
        mx.eval([a for c in x for a in c.state])
    elif isinstance(x, dict):
        mx.eval(list(x.values()))
    elif x is not None:
        mx.eval([a for c in x.caches for a in c.state])
    dt = time.perf_counter() - t
    del x
    mx.clear_cache()
    return dt


ways = {
    "mlx-lm": lambda: load_prompt_cache(str(root / "m.safetensors")),
    "ours": lambda: tier.load(hit),
}
for piece, th in ((2 << 20, 2),):
    ways[f"pw{piece >> 10}k/{th}"] = (lambda p=piece, t=th: piecewise(p, t))
from tiered_kv.cold import ranged
from concurrent.futures import ThreadPoolExecutor


def rs(threads, group):
    ranged._GROUP_CHUNKS = group
    lay = {n: (t["dtype"], tuple(t["shape"])) for n, t in header.tensors.items()}
    arrays = buffers.allocate(lay)
    fd = os.open(path, os.O_RDONLY)
    if RANDOM:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    def one(n):
        t = header.tensors[n]
        a, b = t["data_offsets"]
        d = np.frombuffer(arrays[n], dtype=np.uint8)
        ranged.read_span(fd, header.data_start + a, b - a, 0, d, header.digests(n), header.chunk_bytes, n)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, order))
    os.close(fd)
    return arrays


del ways["pw2048k/2"]
RANDOM = False
for th, g in ((2, 4), (4, 4), (4, 1)):
    ways[f"rs{th}/g{g}"] = (lambda t=th, g=g: rs(t, g))


def rsr(t, g):
    global RANDOM
    RANDOM = True
    try:
        return rs(t, g)
    finally:
        RANDOM = False


for th, g in ((2, 4), (4, 4)):
    ways[f"rsR{th}/g{g}"] = (lambda t=th, g=g: rsr(t, g))
res = {k: [] for k in ways}
for r in range(reps):
    for k, f in ways.items():
        cat(path); cat(root / "m.safetensors")
        res[k].append(timed(f))
for k, v in res.items():
    print(f"{k:20s} median {np.median(v):.3f}  runs {' '.join(f'{x:.3f}' for x in v)}")
tier.close()
shutil.rmtree(root)
