"""CUDA: is landing memory managed, and does cudaMemPrefetchAsync of the tail beat the join's
on-demand migration? 8B 32k shape at m=22528 (tail 10240 tokens, 64 tensors)."""
import ctypes, ctypes.util, glob, os, subprocess, sys, threading, time
import numpy as np
import mlx.core as mx
from tiered_kv.restore import buffers

print("device", mx.default_device(), flush=True)
cands = sorted(set(glob.glob("/tmp/site/**/libcudart.so*", recursive=True)
                   + glob.glob("/usr/local/cuda*/lib*/libcudart.so*")
                   + glob.glob("/usr/lib/x86_64-linux-gnu/libcudart.so*")))
print("cudart candidates", cands, ctypes.util.find_library("cudart"), flush=True)
lib = glob.glob("/tmp/site/mlx/lib/*.so*")
print("mlx libs", lib)
for l in lib:
    out = subprocess.run(["ldd", l], capture_output=True, text=True).stdout
    print(l, [x.strip() for x in out.splitlines() if "cud" in x or "nv" in x])
rt = None
for c in cands + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
    try:
        rt = ctypes.CDLL(c)
        print("loaded", c)
        break
    except OSError:
        pass
if rt is None:
    print("NO CUDART")
    sys.exit(0)


class Attr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("dptr", ctypes.c_void_p), ("hptr", ctypes.c_void_p), ("pad", ctypes.c_char * 256)]


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def ptr(a):
    return np.frombuffer(a, dtype=np.uint8).ctypes.data


def kind(a):
    at = Attr()
    e = rt.cudaPointerGetAttributes(ctypes.byref(at), ctypes.c_void_p(ptr(a)))
    return e, at.type, at.device


ver = ctypes.c_int()
rt.cudaRuntimeGetVersion(ctypes.byref(ver))
print("runtime version", ver.value)
cu = ctypes.CDLL("libcuda.so.1")
cu.cuMemPrefetchAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, Loc, ctypes.c_uint, ctypes.c_void_p]
ctx = ctypes.c_void_p()
mx.eval(mx.ones((2,)) + 1)
print("ctx get", cu.cuCtxGetCurrent(ctypes.byref(ctx)), ctx.value)
stream = ctypes.c_void_p()
print("stream create", cu.cuStreamCreate(ctypes.byref(stream), 1), stream.value, flush=True)


def prefetch(a):
    return cu.cuMemPrefetchAsync_v2(ptr(a), a.nbytes, Loc(1, 0), 0, stream)


def sync():
    return cu.cuStreamSynchronize(stream)


L, H, D, M, N = 64, 8, 128, 22528, 32768
g = mx.ones((4,), mx.bfloat16) * 2
mx.eval(g)
try:
    print("gpu array kind (err, type, dev)", kind(g))
except Exception as e:
    print("gpu array ptr failed", e)
heads = [mx.random.normal((1, H, M, D)).astype(mx.bfloat16) for _ in range(L)]
mx.eval(heads)
lay = {f"t{i}": ("BF16", (1, N - M, H, D)) for i in range(L)}


def land():
    t = time.perf_counter()
    arr = buffers.allocate(lay)
    ta = time.perf_counter() - t
    t = time.perf_counter()
    for a in arr.values():
        np.frombuffer(a, dtype=np.uint8)[:] = 7
    return arr, ta, time.perf_counter() - t


def join(arr):
    t = time.perf_counter()
    out = [mx.concatenate([heads[i], mx.swapaxes(arr[f"t{i}"], 1, 2)], axis=2) for i in range(L)]
    mx.eval(out)
    return time.perf_counter() - t


work = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
mx.eval(work)


def busy(k):
    t = time.perf_counter()
    x = work
    for _ in range(k):
        x = (x @ work) * 1e-3
    mx.eval(x)
    return time.perf_counter() - t


print("busy 400:", busy(400), busy(400))
for rep in range(3):
    arr, ta, tf = land()
    print(f"[{rep}] landing kind", kind(arr["t0"]), f"alloc {ta:.3f} fill {tf:.3f}")
    print(f"[{rep}] join baseline {join(arr):.3f}")
    del arr; mx.clear_cache()
    print("cleared", flush=True)
    arr, ta, tf = land()
    print("landed", flush=True)
    cu.cuMemPrefetchAsync.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    print("old prefetch", cu.cuMemPrefetchAsync(ptr(arr["t1"]), arr["t1"].nbytes, 0, stream), flush=True)
    print("first prefetch", prefetch(arr["t0"]), flush=True)
    t = time.perf_counter()
    errs = {prefetch(a) for a in arr.values()}
    sync()
    tp = time.perf_counter() - t
    print(f"[{rep}] prefetch errs {errs} {tp:.3f} then join {join(arr):.3f}")
    del arr; mx.clear_cache()
    # overlapped: a thread fills + prefetches tensor by tensor while the GPU is busy
    arr, ta, _ = land()
    for a in arr.values():  # re-fill in the thread below: reset to host pages? (already host)
        pass
    done = {}

    def io():
        cu.cuCtxSetCurrent(ctx)
        t = time.perf_counter()
        for a in arr.values():
            np.frombuffer(a, dtype=np.uint8)[:] = 9
            prefetch(a)
        sync()
        done["io"] = time.perf_counter() - t
    th = threading.Thread(target=io)
    t = time.perf_counter()
    th.start()
    tb = busy(400)
    th.join()
    tw = time.perf_counter() - t
    print(f"[{rep}] overlapped: busy {tb:.3f} io {done['io']:.3f} both {tw:.3f} then join {join(arr):.3f}")
    del arr; mx.clear_cache()
for rep in range(3):
    arr = buffers.allocate(lay)
    t = time.perf_counter()
    errs = {cu.cuMemPrefetchAsync_v2(ptr(a), a.nbytes, Loc(2, 0), 0, stream) for a in arr.values()}
    sync()
    th = time.perf_counter() - t
    t = time.perf_counter()
    for a in arr.values():
        np.frombuffer(a, dtype=np.uint8)[:] = 5
    tf = time.perf_counter() - t
    t = time.perf_counter()
    {prefetch(a) for a in arr.values()}
    sync()
    tp = time.perf_counter() - t
    print(f"[{rep}] host prefetch {errs} {th:.3f} fill {tf:.3f} dev prefetch {tp:.3f} join {join(arr):.3f}")
    del arr; mx.clear_cache()
# a whole mx.load of a file on the GPU: where do its arrays live, and how fast is a warm load
import tempfile
d = tempfile.mkdtemp(dir="/tmp")
big = {f"t{i}": mx.zeros((1, H, 4096 * 8, D), mx.bfloat16) for i in range(L)}
mx.save_safetensors(f"{d}/x.safetensors", big)
del big; mx.clear_cache()
with open(f"{d}/x.safetensors", "rb") as f:
    while f.read(1 << 26):
        pass
for rep in range(3):
    t = time.perf_counter()
    x = mx.load(f"{d}/x.safetensors")
    mx.eval(list(x.values()))
    tl = time.perf_counter() - t
    t = time.perf_counter()
    y = [a * 2 for a in x.values()]
    mx.eval(y)
    tu = time.perf_counter() - t
    print(f"[{rep}] warm mx.load 4.3GB {tl:.3f} kind {kind(x['t0'])} first gpu use {tu:.3f}")
    del x, y; mx.clear_cache()
