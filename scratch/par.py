import os, time, threading, sys
import numpy as np, mlx.core as mx, xxhash
from tiered_kv.cold.landing import allocate
p = "/tmp/big.bin"; size = 1 << 30
open(p,"rb").read()
def fresh():
    a = allocate({"x": ("U8", (size,))}, one_buffer=False)
    return a, np.frombuffer(a["x"], dtype=np.uint8)
def run(threads, hash_=False, piece=4<<20):
    arrs, d = fresh()
    fd = os.open(p, os.O_RDONLY)
    n = size // threads
    def work(i):
        lo = i * n
        for off in range(lo, lo + n, piece):
            v = memoryview(d[off:off+piece])
            os.preadv(fd, [v], off)
            if hash_: xxhash.xxh3_64_hexdigest(v)
    t = time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    [x.start() for x in ts]; [x.join() for x in ts]
    dt = time.perf_counter() - t
    os.close(fd); del d, arrs; mx.clear_cache()
    return dt
for _ in range(2):
    for th in (1, 2, 4):
        for h in (False, True):
            print(th, "hash" if h else "    ", round(size/1e9/run(th, h), 2), "GB/s")
def mxload():
    t=time.perf_counter(); a = mx.load("/tmp/x.safetensors"); mx.eval(list(a.values())); dt=time.perf_counter()-t; del a; mx.clear_cache(); return dt
