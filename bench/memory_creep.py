"""Memory creep of a serving process over many rounds of chat requests (issue 12.9).

The server runs in this process (uvicorn on a thread, the real app and worker), so every reading is
of the serving process itself. Each round sends ``--requests`` chat turns (fresh conversations of
three turns each, 4 clients at once), so the hot tier churns at its budget and spills to disk.
After each round (all requests done, the spill queue written, ``gc.collect()``) one row: the
process RSS and its anonymous part (RSS also counts mapped files, libraries and weights, which the
kernel drops under memory pressure), the hot tier, MLX's active and cache (freed-but-kept buffers)
memory, the Python objects, the arenas of CPython's small-object allocator, the cold entries,
index file and spill queue, and with ``--tracemalloc`` the bytes Python allocated.
``--clear-cache`` calls ``mx.clear_cache()`` after each round, ``--malloc-trim`` glibc's
``malloc_trim(0)``: if the creep disappears with one of them, that is its cause. Reading allocator
counters is no array operation, so it is done from this thread.

    python -m bench.memory_creep              # from the repo root: tiny model, 30 rounds x 60
    python -m bench.memory_creep --model ~/.cache/tiered-kv/models/smollm2-135m-instruct
    python -m bench.memory_creep --tiers hot --rounds 10 --clear-cache --malloc-trim
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import psutil
import uvicorn

from engine.generate import Engine
from engine.server import create_app
from tiered_kv import Config, parse_size

MB = 1e6
WORDS = "the of and to in file error def return class import value path line test".split()


def rss_bytes() -> tuple[int, int]:
    """(resident, resident anonymous) bytes of this process: the anonymous part is the heap and
    MLX's buffers; the rest is mapped files (libraries, weights), which the kernel may drop."""
    mem = psutil.Process().memory_info()
    # Linux: ``shared`` is statm's resident shared pages (RssFile + RssShmem), so rss - shared is
    # RssAnon; elsewhere there is no ``shared`` and the anonymous part is reported as the whole RSS
    return mem.rss, mem.rss - getattr(mem, "shared", 0)


def pymalloc_bytes() -> int:
    """Bytes of the arenas CPython's small-object allocator holds (live objects and the free
    room around them: an arena is returned only when every object in it is freed)."""
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)  # _debugmallocstats writes to the C stderr
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        for line in f.read().decode().splitlines():
            if "bytes/arena" in line:
                return int(line.split("=")[1].replace(",", ""))
    return 0


def index_bytes(root: Path) -> int:
    """Bytes of the cold index files (sqlite database and its WAL) under ``root``."""
    return sum(p.stat().st_size for p in root.glob("*/index/cache.db*") if p.is_file())


def malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def start(app: Any) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def conversation(client: httpx.Client, url: str, seed: int, words: int, max_tokens: int) -> None:
    """Three turns of one fresh conversation (each turn extends the previous one's entry)."""
    text = " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words)) + f" #{seed}"
    msgs: list[dict[str, Any]] = [{"role": "user", "content": text}]
    for turn in range(3):
        body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 0}
        r = client.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"and {turn}?"}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="model dir (default: tiny test model)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--requests", type=int, default=60, help="chat turns per round (3 per chat)")
    p.add_argument("--words", type=int, default=300, help="words in each chat's first message")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--hot-bytes", default="60MB")
    p.add_argument("--tiers", default="hot,cold", help='"hot,cold" (spills to disk) or "hot"')
    p.add_argument("--disk-bytes", default="20GiB", help="the disk tier's budget")
    p.add_argument("--write-through", action="store_true",
                   help="persist every turn (with a large hot budget: disk writes, no reloads)")  # fmt: skip
    p.add_argument("--clear-cache", action="store_true", help="mx.clear_cache() after each round")
    p.add_argument("--malloc-trim", action="store_true", help="malloc_trim(0) after each round")
    p.add_argument("--tracemalloc", action="store_true", help="trace Python allocations")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="memory-creep-"))
    model = args.model
    if model is None:
        from engine.models import tiny

        model = tiny.build(tmp / "tiny", size="test", seed=0)
    tiers = tuple(t for t in args.tiers.split(",") if t)
    config = Config(cache_dir=tmp / "kv", tiers=tiers, hot_bytes=parse_size(args.hot_bytes),
                    disk_bytes=parse_size(args.disk_bytes), disk_free_floor=0,
                    write_through=args.write_through)  # fmt: skip
    app = create_app(lambda: Engine(model, config), config)
    server, url = start(app)
    worker = app.state.server.worker
    if args.tracemalloc:
        tracemalloc.start(12)
    print(f"model {model.name}, tiers {args.tiers}, {args.rounds} rounds x {args.requests} "
          f"requests, hot budget {args.hot_bytes}, disk budget {args.disk_bytes}, "
          f"write_through={args.write_through}, clear_cache={args.clear_cache}, "
          f"malloc_trim={args.malloc_trim}\n")  # fmt: skip
    cols = ["round", "RSS MB", "anon MB", "hot MB", "hot entries", "mlx active MB", "mlx cache MB",
            "py objects", "pymalloc MB", "cold entries", "index file MB", "spill queue MB"]  # fmt: skip
    cols += ["traced MB"] if args.tracemalloc else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))
    first = snap = None
    chats = max(1, args.requests // 3)
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        for rnd in range(args.rounds):
            seeds = range(rnd * chats, (rnd + 1) * chats)
            list(
                pool.map(lambda s: conversation(client, url, s, args.words, args.max_tokens), seeds)
            )
            cold = worker.engine.cache.cold
            if cold is not None:  # a row never counts spills still waiting to be written
                cold.flush(120)
            gc.collect()
            if args.clear_cache:
                mx.clear_cache()  # between rounds: the engine thread is idle
            if args.malloc_trim:
                malloc_trim()
            st = worker.engine.cache.stats()
            rss, anon = rss_bytes()
            row = [rnd + 1, rss / MB, anon / MB, st["hot_bytes"] / MB, st["hot_entries"],
                   mx.get_active_memory() / MB, mx.get_cache_memory() / MB, len(gc.get_objects()),
                   pymalloc_bytes() / MB, st.get("cold_entries", 0), index_bytes(tmp / "kv") / MB,
                   st.get("cold_queue_bytes", 0) / MB]  # fmt: skip
            if args.tracemalloc:
                row.append(tracemalloc.get_traced_memory()[0] / MB)
                if rnd == 1:
                    first = tracemalloc.take_snapshot()
                snap = tracemalloc.take_snapshot()
            print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row)
                  + " |", flush=True)  # fmt: skip
    if first is not None and snap is not None:
        print("\nlargest Python allocation growth from round 2 to the last:")
        for stat in snap.compare_to(first, "lineno")[:10]:
            print(f"  {stat}")
    server.should_exit = True
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
