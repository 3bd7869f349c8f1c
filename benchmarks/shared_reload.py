"""Shared tier (Redis) vs the local disk vs ``dd``: reload GB/s per entry size, and the TTFT of a
session that moves from server A to server B (shared hit) against a cold prefill.

    python -m benchmarks.shared_reload reload [--sizes 0.25,1,4] [--url redis://host:port/0]
    python -m benchmarks.shared_reload ttft [--tokens 4096]

``reload``: one entry of each size (bench-shaped KV, float16) is written by a local cold tier and
published to Redis (a redis-server started on a free loopback port unless ``--url``). Then, each
from a cold page cache (``sync`` + ``posix_fadvise(DONTNEED)``) where it is a file:

* ``dd``: ``dd bs=16M`` of the entry file;
* ``disk``: ``ColdTier.load`` of the file (checksums verified, MLX arrays built);
* ``redis fetch``: ``SharedTier.fetch`` (every chunk over TCP + the entry format's checks);
* ``redis hit``: fetch + ``ColdTier.adopt`` (written to a second local dir, arrays built) — what a
  request on server B pays for a shared hit.

``ttft``: three ``tiered-kv serve`` processes on the bench model (8 layers, hidden 512, float32):
A computes a prompt of ``--tokens`` tokens and publishes it; B (its own empty dir) answers the
same conversation plus one turn from Redis; C (no Redis) answers it cold. Time = one request with
``max_tokens=1`` (queue + TTFT), client side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from tiered_kv import Config
from tiered_kv.cold.tier import ColdTier
from tiered_kv.shared.link import SharedLink

FP = "bench-shared"
LAYERS, KV_HEADS, HEAD_DIM = 8, 8, 64  # float16: 16 KiB of KV per token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             "--save", "", "--appendonly", "no"],
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
    out = []
    for i in range(LAYERS):
        c = C.KVCache()
        k = mx.random.normal((1, KV_HEADS, n_tokens, HEAD_DIM), key=mx.random.key(i)).astype(mx.float16)
        c.update_and_fetch(k, k + 1)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def drop_cache(path: Path) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_seconds(path: Path) -> float:
    drop_cache(path)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - t0


def reload(sizes: list[float], url: str | None) -> None:
    work = Path(tempfile.mkdtemp(prefix="tkv-shared-bench-", dir=os.environ.get("TMPDIR")))
    proc = None
    if url is None:
        proc, url = start_redis(work)
    try:
        print("| entry | tokens | dd GB/s | disk load GB/s | redis fetch GB/s | redis hit GB/s "
              "| publish GB/s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for gb in sizes:
            _one(work, url, gb)
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


def _one(work: Path, url: str, gb: float) -> None:
    n = int(gb * 1e9 / (LAYERS * 2 * KV_HEADS * HEAD_DIM * 2))
    n -= n % 256
    tokens = np.arange(n, dtype=np.int32) % 30000
    a, link_a = _open(work / f"a-{gb}", url)
    t0 = time.perf_counter()
    caches = caches_of(n)
    a.persist(tokens, caches)
    del caches
    hit = a.lookup(tokens)
    assert hit is not None
    path = next((work / f"a-{gb}").rglob("*.safetensors"))
    size = path.stat().st_size
    t0 = time.perf_counter()
    data = path.read_bytes()
    link_a.tier.publish(data, tokens)
    publish = time.perf_counter() - t0
    del data
    dd = dd_seconds(path)
    drop_cache(path)
    t0 = time.perf_counter()
    got = a.load(hit)
    disk = time.perf_counter() - t0
    assert got is not None
    del got
    b, link_b = _open(work / f"b-{gb}", url)
    sh = link_b.lookup(tokens)
    assert sh is not None
    t0 = time.perf_counter()
    fetched = link_b.fetch(sh)
    fetch = time.perf_counter() - t0
    assert fetched is not None
    del fetched
    t0 = time.perf_counter()
    fetched = link_b.fetch(sh)
    assert fetched is not None
    loaded = b.adopt(fetched.data, fetched.tokens)
    shared_hit = time.perf_counter() - t0
    assert loaded is not None
    del loaded, fetched
    g = size / 1e9
    print(f"| {g:.2f} GB | {n} | {g / dd:.2f} | {g / disk:.2f} | {g / fetch:.2f} | "
          f"{g / shared_hit:.2f} | {g / publish:.2f} |", flush=True)  # fmt: skip
    for tier, link in ((a, link_a), (b, link_b)):
        tier.close()
        link.close(5)
    link_a.tier.client.flushall()


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
    r.add_argument("--sizes", default="0.25,1", help="entry sizes in GB (4 needs ~20 GB of RAM)")
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
