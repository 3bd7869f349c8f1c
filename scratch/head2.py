"""Why is a small `both` head slow on CUDA, and small cold ranged reads slow? (8B; warm 8k, cold 32k)"""
import os, sys, time, threading
from pathlib import Path
import numpy as np, mlx.core as mx, xxhash
from bench.restore import Bench, entry_files, set_pages
from tiered_kv.cold import ranged, store
from tiered_kv.restore import buffers

models = Path(sys.argv[1]); root = Path("/tmp/hd")
size = sys.argv[2] if len(sys.argv) > 2 else "8b"
mdir = models / f"tiny-{size}"
if not (mdir / "config.json").exists():
    from engine.models import tiny; tiny.build(mdir, size=size)
b = Bench(mdir, root, 0)
print("chunk", b.chunk, "device", b.device, flush=True)

def ev(c): mx.eval([x.state for x in c])

def head(ids):
    t = time.perf_counter(); c = b.compute(ids); ev(c); return time.perf_counter() - t

def beside(fn, ids):
    """head(ids) while fn() runs on a thread; (head s, fn s)"""
    out = {}
    def run():
        t = time.perf_counter(); fn(); out["fn"] = time.perf_counter() - t
    th = threading.Thread(target=run); th.start()
    h = head(ids); th.join()
    return h, out["fn"]

CASES = ((8192, 4255, "warm"), (32768, 22541, "cold")) if size == "8b" else ((512, 260, "warm"), (1024, 700, "cold"))
for T, m, state in CASES:
    rng = np.random.default_rng(T)
    ids = rng.integers(3, b.vocab, T).tolist()
    b.setup(T, ids)
    tc = b.open(T, "load"); fp = tc.cold.fingerprint; tc.cold.close(); tc.restorer.close()
    path = entry_files(root / f"t{T}")[0]
    lay = ranged.layout(path, fp, m, T)
    head_ids = ids[:m]
    print(f"\n## T={T} m={m} file {path.stat().st_size/1e9:.2f} GB", flush=True)
    for i in range(3):
        print(f"head alone run{i}: {head(head_ids):.3f}", flush=True)
    print(f"full prefill alone T: {head(ids):.3f}", flush=True)

    def landing():
        full = buffers.allocate(buffers.shapes(lay, m, T, "tail")); return full, buffers.byte_views(full, m, T)
    def rd_landing(workers=4):
        full, views = landing()
        def f(): ranged.read_range(path, fp, m, T, workers=workers, into=views)
        return f
    def rd_plain(workers=4):
        def f(): ranged.read_range(path, fp, m, T, workers=workers)
        return f
    def rd_nohash():
        hdr_fd = os.open(path, os.O_RDONLY)
        hdr = store.read_header_fd(hdr_fd, fp)
        spans = []
        for name, t in ranged.plan_tensors(hdr).items():
            base = hdr.data_start + int(t["data_offsets"][0]); size = int(t["data_offsets"][1]) - int(t["data_offsets"][0])
            per = size // T
            spans.append((base + m * per, size - m * per))
        bufs = [np.empty(s, np.uint8) for _, s in spans]
        def f():
            from concurrent.futures import ThreadPoolExecutor
            def one(k):
                off, s = spans[k]; v = memoryview(bufs[k]); got = 0
                while got < s:
                    got += os.preadv(hdr_fd, [v[got:got + (16 << 20)]], off + got)
            with ThreadPoolExecutor(4) as p: list(p.map(one, range(len(spans))))
        return f, spans, hdr_fd
    def rd_willneed():
        f0, spans, fd = rd_nohash()
        def f():
            for off, s in spans: os.posix_fadvise(fd, off, s, os.POSIX_FADV_WILLNEED)
            ranged.read_range(path, fp, m, T)
        return f
    def hash_only():
        buf = np.ones(sum(int(np.prod(s)) * 2 for _, s in lay.values()) * (T - m) // T, np.uint8)
        def f():
            for i in range(0, len(buf), 4 << 20): xxhash.xxh3_64(buf[i:i + (4 << 20)]).hexdigest()
        return f
    def touch_landing():
        full, views = landing()
        def f():
            for v in views.values(): v[...] = 7
        return f

    def prep():
        return set_pages(root / f"t{T}", state)
    # reads alone
    for name, mk in (("read landing w4", rd_landing), ("read plain w4", rd_plain),
                     ("read plain w8", lambda: rd_plain(8)), ("read plain w1", lambda: rd_plain(1)),
                     ("read nohash 16MiB w4", lambda: rd_nohash()[0]), ("read willneed", rd_willneed)):
        for i in range(2):
            f = mk(); sh = prep(); t = time.perf_counter(); f(); dt = time.perf_counter() - t
            print(f"{name} alone ({state} {sh}): {dt:.3f}", flush=True)
    # head beside things
    for name, mk in (("landing read", rd_landing), ("plain read", rd_plain), ("nohash read", lambda: rd_nohash()[0]),
                     ("hash only", hash_only), ("touch landing", touch_landing), ("landing read w1", lambda: rd_landing(1)),
                     ("willneed read", rd_willneed)):
        for i in range(2):
            f = mk(); prep(); h, r = beside(f, head_ids)
            print(f"head beside {name}: head {h:.3f}  other {r:.3f}", flush=True)
    sys.setswitchinterval(0.0005)
    f = rd_landing(); prep(); h, r = beside(f, head_ids)
    print(f"head beside landing read, switchinterval 0.5ms: head {h:.3f} other {r:.3f}", flush=True)
    sys.setswitchinterval(0.005)
    print(f"head alone again: {head(head_ids):.3f}", flush=True)
    mx.clear_cache()
