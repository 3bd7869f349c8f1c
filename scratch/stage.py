"""H200: reading a file into MLX (managed) memory: CPU-written landing + prefetch vs pinned staging + DMA."""
import ctypes, os, sys, time, threading
from concurrent.futures import ThreadPoolExecutor
import numpy as np, xxhash
import mlx.core as mx
from tiered_kv.restore import buffers, prefetch
from bench.dd import drop_page_cache
from pathlib import Path

GB = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
N = int(GB * (1 << 30)) // (16 << 20) * (16 << 20)
P = 16 << 20
path = Path("/tmp/stage.bin")
if not path.exists() or path.stat().st_size != N:
    with open(path, "wb") as f:
        for i in range(N // P):
            f.write(np.random.randint(0, 255, P, dtype=np.uint8).tobytes())
mx.eval(mx.ones(4) + 1)  # make the context
dp = prefetch.open_device()
lib, ctx, dev = dp._lib, dp._context, dp._device
lib.cuMemAllocHost_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]

def chk(e, what):
    if e: raise RuntimeError(f"{what}: {e}")

W = int(os.environ.get("W", "4"))
pinned = []
for i in range(W * 2):
    p = ctypes.c_void_p(); chk(lib.cuMemAllocHost_v2(ctypes.byref(p), P), "hostalloc"); pinned.append(p.value)
streams, events = [], []
for i in range(W):
    s = ctypes.c_void_p(); chk(lib.cuStreamCreate(ctypes.byref(s), 1), "stream"); streams.append(s)
for i in range(W * 2):
    e = ctypes.c_void_p(); chk(lib.cuEventCreate(ctypes.byref(e), 2), "event"); events.append(e)

def hash16(v):
    for o in range(0, len(v), 4 << 20):
        xxhash.xxh3_64_hexdigest(v[o:o + (4 << 20)])

def landing():
    a = buffers.allocate({"whole": ("U8", (N,))})["whole"]
    return a, np.frombuffer(a, dtype=np.uint8)

def way_cpu(pf=True):
    a, v = landing()
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    def one(k):
        lib.cuCtxSetCurrent(ctx)
        for i in range(k, N // P, W):
            dst = v[i * P:(i + 1) * P]
            os.preadv(fd, [dst.data], i * P); hash16(dst.data)
            if pf: dp.to_device(dst)
    t = time.perf_counter()
    with ThreadPoolExecutor(W) as ex: list(ex.map(one, range(W)))
    t1 = time.perf_counter()
    dp.wait(); os.close(fd)
    t2 = time.perf_counter()
    s = mx.sum(a[:: 1 << 20].astype(mx.uint32)); mx.eval(s)
    return t1 - t, t2 - t, time.perf_counter() - t

def way_staged(pre=True):
    a, v = landing()
    base = v.ctypes.data
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    t = time.perf_counter()
    if pre: dp.to_device(v); dp.wait()
    tp = time.perf_counter() - t
    def one(k):
        lib.cuCtxSetCurrent(ctx)
        use = 0
        for i in range(k, N // P, W):
            slot = 2 * k + (use % 2); use += 1
            chk(lib.cuEventSynchronize(events[slot]), "evsync")
            buf = (ctypes.c_uint8 * P).from_address(pinned[slot])
            mv = memoryview(buf).cast("B")
            os.preadv(fd, [mv], i * P); hash16(mv)
            chk(lib.cuMemcpyHtoDAsync_v2(base + i * P, pinned[slot], P, streams[k]), "memcpy")
            chk(lib.cuEventRecord(events[slot], streams[k]), "record")
        chk(lib.cuStreamSynchronize(streams[k]), "ssync")
    with ThreadPoolExecutor(W) as ex: list(ex.map(one, range(W)))
    t1 = time.perf_counter(); os.close(fd)
    s = mx.sum(a[:: 1 << 20].astype(mx.uint32)); mx.eval(s)
    return tp, t1 - t, time.perf_counter() - t

def way_mxload():
    t = time.perf_counter()
    x = mx.load(str(path.with_suffix(".safetensors")))
    mx.eval(x)
    return 0, 0, time.perf_counter() - t

mx.save_safetensors(str(path.with_suffix(".safetensors")), {"x": mx.array(np.fromfile(path, dtype=np.uint8)[: N])})
mx.clear_cache()
ways = {"cpu+prefetch": way_cpu, "cpu nopf": lambda: way_cpu(False), "staged pre": way_staged,
        "staged nopre": lambda: way_staged(False), "mx.load": way_mxload}
for state in ("warm", "cold"):
    res = {k: [] for k in ways}
    for r in range(3):
        for k, f in ways.items():
            p = path.with_suffix(".safetensors") if k == "mx.load" else path
            if state == "cold": drop_page_cache(p)
            else: open(p, "rb").read()
            res[k].append(f()); mx.clear_cache()
    for k, v in res.items():
        m = sorted(v, key=lambda x: x[2])[1]
        print(f"{state} {k:14s} W={W} a={m[0]:.3f} b={m[1]:.3f} total={m[2]:.3f}s  {N/m[2]/1e9:.2f} GB/s", flush=True)
