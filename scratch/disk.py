"""Cold strided tail reads (8B 32k both shape): buffered vs O_DIRECT, threads, request sizes."""
import mmap, os, sys, time, threading
import numpy as np

D = sys.argv[1] if len(sys.argv) > 1 else "/tmp/dk"
os.makedirs(D, exist_ok=True)
P = os.path.join(D, "f.bin")
T, TAIL, BASE = 64, 16 << 20, 9000  # 64 tensors, last 16 MiB of 64 MiB each, unaligned base
SZ = 64 << 20
if not os.path.exists(P) or os.path.getsize(P) != BASE + T * SZ:
    blk = np.random.default_rng(0).integers(0, 255, SZ, dtype=np.uint8)
    with open(P, "wb") as f:
        f.write(b"\0" * BASE)
        for i in range(T):
            blk[:8] = i
            f.write(blk.data)
        f.flush(); os.fsync(f.fileno())


def drop():
    os.sync()
    fd = os.open(P, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


spans = [(BASE + i * SZ + SZ - TAIL, TAIL) for i in range(T)]
dest = np.empty(T * TAIL, dtype=np.uint8)
dest[:] = 1


def run(jobs, threads, fn):
    it = iter(jobs); lock = threading.Lock()

    def w():
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                return
            fn(*j)
    ts = [threading.Thread(target=w) for _ in range(threads)]
    t = time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]
    return time.perf_counter() - t


def buffered(req, threads, fadv=None):
    fd = os.open(P, os.O_RDONLY)
    if fadv:
        os.posix_fadvise(fd, 0, 0, fadv)
    jobs = []
    for k, (off, n) in enumerate(spans):
        for p in range(0, n, req):
            jobs.append((off + p, k * TAIL + p, min(req, n - p)))
    dv = dest.data

    def f(off, at, n):
        got = 0
        while got < n:
            got += os.preadv(fd, [dv[at + got: at + n]], off + got)
    dt = run(jobs, threads, f)
    os.close(fd)
    return dt


def direct(req, threads):
    fd = os.open(P, os.O_RDONLY | os.O_DIRECT)
    jobs = []
    for k, (off, n) in enumerate(spans):
        a = off // 4096 * 4096
        e = -(-(off + n) // 4096) * 4096
        for p in range(a, e, req):
            jobs.append((p, min(req, e - p), off, n, k))
    dv = dest.data
    local = threading.local()

    def f(p, m, off, n, k):
        buf = getattr(local, "b", None)
        if buf is None:
            buf = local.b = mmap.mmap(-1, req)
        mv = memoryview(buf)[:m]
        got = os.preadv(fd, [mv], p)
        s, e = max(p, off), min(p + got, off + n)
        if s < e:
            dv[k * TAIL + s - off: k * TAIL + e - off] = mv[s - p: e - p]
    dt = run(jobs, threads, f)
    os.close(fd)
    return dt


def seq(nbytes, req=8 << 20):
    fd = os.open(P, os.O_RDONLY)
    buf = bytearray(req); mv = memoryview(buf)
    t = time.perf_counter(); off = BASE
    while off < BASE + nbytes:
        off += os.preadv(fd, [mv], off)
    dt = time.perf_counter() - t
    os.close(fd)
    return dt


tot = T * TAIL
ways = {
    "seq 1GiB (dd-like)": lambda: seq(tot),
    "buf 16M x4": lambda: buffered(16 << 20, 4),
    "buf 4M x4": lambda: buffered(4 << 20, 4),
    "buf 4M x8": lambda: buffered(4 << 20, 8),
    "buf 16M x4 SEQ": lambda: buffered(16 << 20, 4, os.POSIX_FADV_SEQUENTIAL),
    "buf 16M x4 RAND": lambda: buffered(16 << 20, 4, os.POSIX_FADV_RANDOM),
    "dio 4M x4": lambda: direct(4 << 20, 4),
    "dio 4M x8": lambda: direct(4 << 20, 8),
    "buf 4M x4 RAND": lambda: buffered(4 << 20, 4, os.POSIX_FADV_RANDOM),
    "buf 16M x8 RAND": lambda: buffered(16 << 20, 8, os.POSIX_FADV_RANDOM),
    "buf 16M x1 RAND": lambda: buffered(16 << 20, 1, os.POSIX_FADV_RANDOM),
    "buf 64M x4 RAND": lambda: buffered(64 << 20, 4, os.POSIX_FADV_RANDOM),
}
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
res = {k: [] for k in ways}
ref = None
for r in range(reps):
    for k, f in ways.items():
        drop()
        res[k].append(f())
        if k != "seq 1GiB (dd-like)":
            if ref is None:
                ref = dest.copy()
            else:
                assert np.array_equal(ref, dest), k
            dest[:] = 0
for k, v in res.items():
    print(f"{k:22s} {tot / 1e9 / np.median(v):.2f} GB/s  runs {' '.join(f'{x:.3f}' for x in v)}")
