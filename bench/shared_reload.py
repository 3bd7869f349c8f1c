"""Shared tier (Redis) vs the local disk vs ``dd``: reload GB/s per entry size, and the TTFT of a
session that moves from server A to server B (shared hit) against a cold prefill.

    python -m bench.shared_reload reload [--sizes 0.25,1,4] [--url redis://host:port/0]
    python -m bench.shared_reload ttft [--tokens 4096]

``reload``: one entry of each size (bench-shaped KV, float16) is written by a local cold tier and
published to Redis (a redis-server started on a free loopback port unless ``--url``, with
``maxmemory`` sized for the largest entry and ``allkeys-lru``, as the README advises). Then, each
from a cold page cache (``sync`` + ``posix_fadvise(DONTNEED)``) where it is a file:

* ``dd``: ``dd bs=16M`` of the entry file;
* ``disk``: ``ColdTier.load`` of the file (checksums verified, MLX arrays built);
* ``redis fetch``: ``SharedTier.fetch`` (every chunk over TCP + the entry format's checks);
* ``redis hit``: fetch + ``ColdTier.adopt`` (written to a second local dir, arrays built) — what a
  request on server B pays for a shared hit.

Memory: the entry is never held twice where once will do. Its KV is made layer by layer straight
into the cache objects (one copy, freed with MLX's buffer cache once the file is written); it is
published from a read-only map of the file (page cache, not process memory); every loaded copy
is dropped (and ``mx.clear_cache()``) before the next phase. The heaviest phase is the shared hit:
the fetched bytes and the arrays built from them (2x the entry). A second table gives each
phase's peak resident memory of this process (sampled every 10 ms; "anon" leaves out mapped
files) and Redis's own (``used_memory_peak``): a 4 GB entry needs ~8 GB here plus ~4 GB in Redis.

``ttft``: three ``tiered-kv serve`` processes on the bench model (8 layers, hidden 512, float32):
A computes a prompt of ``--tokens`` tokens and publishes it; B (its own empty dir) answers the
same conversation plus one turn from Redis; C (no Redis) answers it cold. Time = one request with
``max_tokens=1`` (queue + TTFT), client side.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from bench import dd
from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.shared.link import SharedLink

FP = "bench-shared"
LAYERS, KV_HEADS, HEAD_DIM = 8, 8, 64  # float16: 16 KiB of KV per token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path, maxmemory: int = 0) -> tuple[subprocess.Popen, str]:
    """A redis-server on a free loopback port; ``maxmemory`` bytes (0: unbounded) under
    ``allkeys-lru`` — the configuration the README gives for a shared tier."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             "--save", "", "--appendonly", "no", "--maxmemory", str(maxmemory),
                             "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    import redis

    for _ in range(200):
        try:
            if redis.Redis(port=port).ping():
                return proc, f"redis://127.0.0.1:{port}/0"
        except redis.RedisError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def caches_of(n_tokens: int) -> list:
    """Bench-shaped KV, made one layer at a time straight into the caches: the entry exists once
    (no ``update_and_fetch`` copy, no float32 intermediate)."""
    out = []
    for i in range(LAYERS):
        shape = (1, KV_HEADS, n_tokens, HEAD_DIM)
        c = C.KVCache()
        c.keys = mx.random.normal(shape, dtype=mx.float16, key=mx.random.key(i))
        c.values = mx.random.normal(shape, dtype=mx.float16, key=mx.random.key(LAYERS + i))
        c.offset = n_tokens
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def _status() -> tuple[int, int, int]:
    """(VmRSS, RssAnon, VmHWM) bytes of this process."""
    got = dict.fromkeys(("VmRSS", "RssAnon", "VmHWM"), 0)
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":")[0]
        if name in got:
            got[name] = int(line.split()[1]) * 1024
    return got["VmRSS"], got["RssAnon"], got["VmHWM"]


class Peaks:
    """Peak resident memory of this process per phase: VmHWM (reset through ``clear_refs``
    where the kernel allows) and anonymous memory sampled every 10 ms on a thread."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[float, float]] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        free_mlx()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        top = [_status()[1]]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.01):
                top[0] = max(top[0], _status()[1])

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            _, anon, hwm = _status()
            self.rows[name] = (max(hwm, _status()[0]) / 1e9, max(top[0], anon) / 1e9)


def map_file(path: Path) -> memoryview:
    """A read-only map of the entry file (what the publisher sends: pages, not a copy)."""
    with path.open("rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def free_mlx() -> None:
    """Give MLX's freed buffers back (its buffer cache would otherwise keep each phase's copy)."""
    import gc

    gc.collect()
    mx.clear_cache()


def redis_memory(url: str) -> tuple[float, float]:
    """Redis's (used_memory, used_memory_peak) in GB; the peak is since Redis started (the
    sweep runs sizes in the order given: smallest first keeps it per size)."""
    import redis

    info = redis.Redis.from_url(url).info("memory")
    return float(info["used_memory"]) / 1e9, float(info["used_memory_peak"]) / 1e9


def reload(sizes: list[float], url: str | None) -> None:
    work = Path(tempfile.mkdtemp(prefix="tkv-shared-bench-", dir=os.environ.get("TMPDIR")))
    proc = None
    if url is None:  # room for the largest entry (each size is flushed before the next)
        proc, url = start_redis(work, maxmemory=int(max(sizes) * 1e9 * 1.1) + (512 << 20))
    mem: list[str] = []
    try:
        print("| entry | tokens | dd GB/s | disk load GB/s | redis fetch GB/s | redis hit GB/s "
              "| publish GB/s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for gb in sizes:
            mem.append(_one(work, url, gb))
        print("\nPeak resident memory, GB (this process: RSS / anonymous; Redis: used_memory "
              "with the entry / used_memory_peak)\n")  # fmt: skip
        print("| entry | make + write | publish (mmap) | disk load | redis fetch | redis hit | "
              "(max RSS - start) / entry | redis |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for row in mem:
            print(row)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def _open(root: Path, url: str) -> tuple[ColdTier, SharedLink]:
    cfg = Config(cache_dir=root, shared_url=url, shared_timeout=30.0, disk_bytes=64 << 30,
                 disk_free_floor=0, spill_queue_bytes=16 << 30, shared_queue_bytes=16 << 30)  # fmt: skip
    cold = ColdTier(root, FP, cfg)
    link = SharedLink.open(cfg, cold.fingerprint)
    return cold, link


def _one(work: Path, url: str, gb: float) -> str:
    """One entry size: the speed row (printed) and the memory row (returned)."""
    n = int(gb * 1e9 / (LAYERS * 2 * KV_HEADS * HEAD_DIM * 2))
    n -= n % 256
    tokens = np.arange(n, dtype=np.int32) % 30000
    peaks = Peaks()
    free_mlx()
    base = _status()[0] / 1e9  # this process before the entry exists
    a, link_a = _open(work / f"a-{gb}", url)
    link_a.tier.client.config_resetstat()  # evicted_keys of this size only
    with peaks.phase("make"):
        caches = caches_of(n)
        a.persist(tokens, caches)
        del caches
    hit = a.lookup(tokens)
    assert hit is not None
    path = next((work / f"a-{gb}").rglob("*.safetensors"))
    size = path.stat().st_size
    with peaks.phase("publish"):
        data = map_file(path)  # page cache, not a copy in this process
        t0 = time.perf_counter()
        assert link_a.tier.publish(data, tokens)
        publish = time.perf_counter() - t0
        data.release()
        del data
    redis_used = redis_memory(url)[0]
    dd_s = dd.read(path, cold=True)
    dd.drop_page_cache(path)
    with peaks.phase("disk"):
        t0 = time.perf_counter()
        got = a.load(hit)
        disk = time.perf_counter() - t0
        assert got is not None
        del got
    b, link_b = _open(work / f"b-{gb}", url)
    sh = link_b.lookup(tokens)
    assert sh is not None
    with peaks.phase("fetch"):
        t0 = time.perf_counter()
        fetched = link_b.fetch(sh)
        fetch = time.perf_counter() - t0
        assert fetched is not None, f"shared fetch missed: {link_b.stats()}"
        del fetched
    with peaks.phase("hit"):
        t0 = time.perf_counter()
        fetched = link_b.fetch(sh)
        assert fetched is not None
        loaded = b.adopt(fetched.data, fetched.tokens)
        shared_hit = time.perf_counter() - t0
        assert loaded is not None
        del loaded, fetched
        assert b.flush(600)  # the local write holds the fetched bytes until it is done
    g = size / 1e9
    print(f"| {g:.2f} GB | {n} | {g / dd_s:.2f} | {g / disk:.2f} | {g / fetch:.2f} | "
          f"{g / shared_hit:.2f} | {g / publish:.2f} |", flush=True)  # fmt: skip
    evicted = int(link_a.tier.client.info("stats")["evicted_keys"])
    assert evicted == 0, f"Redis evicted {evicted} keys: raise its maxmemory"
    redis_peak = redis_memory(url)[1]
    for tier, link in ((a, link_a), (b, link_b)):
        tier.close()
        link.close(5)
    link_a.tier.client.flushall()
    free_mlx()
    cells = " | ".join(f"{rss:.2f} / {anon:.2f}" for rss, anon in peaks.rows.values())
    top = max(rss for rss, _ in peaks.rows.values()) - base
    return f"| {g:.2f} GB | {cells} | {top / g:.1f}x | {redis_used:.2f} / {redis_peak:.2f} |"


def ttft(n_tokens: int) -> None:
    from engine.models import tiny

    work = Path(tempfile.mkdtemp(prefix="tkv-shared-ttft-"))
    rproc, url = start_redis(work)
    servers: list[subprocess.Popen] = []
    try:
        model = tiny.build(work / "model", size="bench", seed=0)
        words = " ".join(f"w{i % 997}" for i in range(n_tokens))
        prompt = "system: remember these notes. " + words + " user: summarise. assistant:"

        def serve(name: str, **env: str) -> str:
            port = free_port()
            e = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
            e.update(TIERED_KV_DIR=str(work / f"kv-{name}"), TIERED_KV_MODELS_DIR=str(work / "m"),
                     **env)  # fmt: skip
            log = (work / f"{name}.log").open("wb")
            servers.append(subprocess.Popen(
                [sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--port",
                 str(port)], env=e, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
            base = f"http://127.0.0.1:{port}"
            import httpx

            for _ in range(1200):
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        return base
                except httpx.HTTPError:
                    time.sleep(0.1)
            raise SystemExit(f"server {name} did not start")

        def ask(base: str, text: str) -> tuple[float, str, int]:
            import httpx

            t0 = time.perf_counter()
            r = httpx.post(f"{base}/v1/completions", timeout=600, json={
                "model": "bench", "prompt": text, "max_tokens": 1, "temperature": 0})  # fmt: skip
            dt = time.perf_counter() - t0
            u = r.json()["usage"]
            return dt, u["cache_tier"], u["prompt_tokens"]

        a = serve("a", TIERED_KV_SHARED=url, TIERED_KV_WRITE_THROUGH="1")
        t_a, tier_a, n = ask(a, prompt)
        import httpx

        for _ in range(600):
            m = httpx.get(f"{a}/metrics").text
            if "tiered_kv_shared_publishes 1.0" in m:
                break
            time.sleep(0.1)
        b = serve("b", TIERED_KV_SHARED=url)
        c = serve("c")
        follow = prompt + " ok. user: and the first note? assistant:"
        t_b, tier_b, _ = ask(b, follow)
        t_c, tier_c, _ = ask(c, follow)
        print(f"| server | tier | request s (max_tokens=1) | prompt {n} tokens |")
        print("|---|---|---|---|")
        print(f"| A (first turn, cold) | {tier_a} | {t_a:.2f} | |")
        print(f"| B (moved session, Redis) | {tier_b} | {t_b:.2f} | |")
        print(f"| C (no shared tier, cold) | {tier_c} | {t_c:.2f} | |")
    finally:
        for p in servers:
            p.send_signal(signal.SIGKILL)
            p.wait(30)
        rproc.send_signal(signal.SIGTERM)
        rproc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reload")
    r.add_argument(
        "--sizes",
        default="0.25,1",
        help="entry sizes in GB (4 needs ~8 GB here + ~4.5 GB in Redis)",
    )
    r.add_argument("--url", default=None, help="an existing Redis (default: start one)")
    t = sub.add_parser("ttft")
    t.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    if args.cmd == "reload":
        reload([float(s) for s in args.sizes.split(",")], args.url)
    else:
        ttft(args.tokens)


if __name__ == "__main__":
    main()
