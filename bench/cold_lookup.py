"""Cold-tier micro-benchmarks (print, never assert): lookup latency, reload GB/s vs ``dd`` (cold
and warm), and the write path's cost per entry beside N indexed entries.

    python -m bench.cold_lookup [--entries 10000] [--prompt 32768] [--reload-mib 256]
    python -m bench.cold_lookup --writes-at 1000,3000 [--writes 50]   # the write path only

The lookup index is filled directly (records + token ids, no entry files): lookup never reads
files. All entries share a 1024-token "system prompt" with the probe, the worst case for the
``blocks(hash)`` index; one 32k-token entry is the probe's real prefix.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench import dd
from tiered_kv import Config, keys
from tiered_kv.cold.index import Index  # measured alone: the lookup index
from tiered_kv.cold.rows import Record
from tiered_kv.cold.tier import ColdTier


def bench_lookup(root: Path, entries: int, prompt_tokens: int, entry_tokens: int = 2048) -> dict:
    cfg = Config(cache_dir=root, block_tokens=256)
    tier = ColdTier(root, "bench", cfg)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50_000, 1024, dtype=np.int32)
    probe = np.concatenate([system, rng.integers(0, 50_000, prompt_tokens, dtype=np.int32)])
    t0 = time.perf_counter()
    batch = []
    for i in range(entries):
        if i == entries // 2:
            toks = probe[:prompt_tokens]
        else:
            tail = rng.integers(0, 50_000, entry_tokens - len(system), dtype=np.int32)
            toks = np.concatenate([system, tail])
        blocks = tuple(keys.block_hashes(toks, cfg.block_tokens, tier.seed))
        batch.append(
            (Record(f"e{i}", f"e{i}.safetensors", len(toks), 0, i, i, blocks, trimmable=True),
             toks.tobytes())
        )
        if len(batch) == 1000:
            tier.index.add_many(batch)
            batch = []
    tier.index.add_many(batch)
    fill = time.perf_counter() - t0
    prompt = probe[: prompt_tokens + 100].tolist()
    times = []
    for _ in range(50):
        t = time.perf_counter()
        hit = tier.lookup(prompt)
        times.append(time.perf_counter() - t)
    assert hit is not None
    other = Index(tier.dir / "index")  # a second process's commits: seen by the next query
    after = []
    for i in range(20):
        toks = rng.integers(0, 50_000, entry_tokens, dtype=np.int32)
        blocks = tuple(keys.block_hashes(toks, cfg.block_tokens, tier.seed))
        other.add(
            Record(f"x{i}", f"x{i}.safetensors", len(toks), 0, 1e9, 1e9, blocks, trimmable=True),
            toks.tobytes(),
        )
        t = time.perf_counter()
        tier.lookup(prompt)
        after.append(time.perf_counter() - t)
    other.close()
    tier.close()
    t = time.perf_counter()  # opening the index (nothing is loaded into memory)
    Index(tier.dir / "index").close()  # (a ColdTier would also drop these file-less records)
    reopen = time.perf_counter() - t
    return {"entries": entries, "prompt_tokens": len(prompt), "hit_tokens": hit.tokens,
            "lookup_ms_median": 1e3 * statistics.median(times), "lookup_ms_max": 1e3 * max(times),
            "after_commit_ms_median": 1e3 * statistics.median(after),
            "after_commit_ms_max": 1e3 * max(after),
            "fill_s": fill, "index_open_s": reopen}  # fmt: skip


def bench_reload(root: Path, mib: int) -> dict:
    from mlx_lm.models import cache as C

    layers_n, tokens = 8, 4096
    per_layer = mib * 2**20 // layers_n // 2  # keys + values
    dim = max(1, per_layer // (tokens * 8 * 2))
    caches = []
    for _ in range(layers_n):
        c = C.KVCache()
        x = mx.random.normal((1, 8, tokens, dim)).astype(mx.bfloat16)
        c.update_and_fetch(x, x)
        caches.append(c)
    mx.eval([c.keys for c in caches])
    tier = ColdTier(root, "reload", Config(cache_dir=root, block_tokens=256))
    ids = np.arange(tokens)
    t = time.perf_counter()
    tier.persist(ids, caches)
    write_s = time.perf_counter() - t
    (path,) = tier.dir.glob("*.safetensors")
    size = path.stat().st_size
    hit = tier.lookup(ids.tolist())
    assert hit is not None
    loads: dict[bool, list[float]] = {True: [], False: []}  # cold (page cache dropped) / warm
    dds: dict[bool, list[float]] = {True: [], False: []}
    for cold in (True, False):
        for _ in range(3):
            if cold:
                dd.drop_page_cache(path)
            t = time.perf_counter()
            got = tier.load(hit)
            loads[cold].append(time.perf_counter() - t)
            assert got is not None
            dds[cold].append(dd.read(path, cold=cold))
    tier.close()
    gb = size / 1e9
    return {"file_bytes": size, "persist_GBps": gb / write_s,
            "load_cold_GBps": gb / min(loads[True]), "dd_cold_GBps": gb / min(dds[True]),
            "load_GBps": gb / min(loads[False]), "dd_GBps": gb / min(dds[False])}  # fmt: skip


def bench_writes(root: Path, entries: int, writes: int) -> dict:
    """ms per ``persist`` (write-through: the writer thread's whole write, budget check, file
    publish and index commit) of a small entry beside ``entries`` indexed entries, each with a
    (small) file of its own, as the budget check lists them; and the part of it spent on making
    room (``Remover.make_room``: before, it read every record and listed the directory)."""
    from mlx_lm.models import cache as C

    cfg = Config(cache_dir=root, block_tokens=16, disk_free_floor=0)
    tier = ColdTier(root, "writes", cfg)
    rng = np.random.default_rng(0)
    batch = []
    for i in range(entries):
        toks = rng.integers(0, 50_000, 64, dtype=np.int32)
        blocks = tuple(keys.block_hashes(toks, cfg.block_tokens, tier.seed))
        name = f"{i:032x}.safetensors"
        (tier.dir / name).write_bytes(b"\0" * 4096)
        batch.append((Record(f"{i:032x}", name, len(toks), 4096, i, i, blocks, trimmable=True),
                      toks.tobytes()))  # fmt: skip
    tier.index.add_many(batch)
    spent: list[float] = []
    real = tier.remover.make_room

    def timed(index: Index, n_tokens: int, data_bytes: int) -> bool:
        t = time.perf_counter()
        try:
            return real(index, n_tokens, data_bytes)
        finally:
            spent.append(time.perf_counter() - t)

    tier.remover.make_room = timed  # type: ignore[method-assign]
    caches = []
    for _ in range(writes):
        c = C.KVCache()
        x = mx.random.normal((1, 2, 64, 8)).astype(mx.bfloat16)
        c.update_and_fetch(x, x)
        caches.append(c)
    times = []
    for c in caches:
        t = time.perf_counter()
        tier.persist(rng.integers(0, 50_000, 64, dtype=np.int32), [c])
        times.append(time.perf_counter() - t)
    assert tier.stats()["spills"] == writes, tier.stats()
    tier.close()
    return {"entries": entries, "write_ms_median": 1e3 * statistics.median(times),
            "write_ms_mean": 1e3 * statistics.mean(times),
            "make_room_ms_median": 1e3 * statistics.median(spent),
            "make_room_ms_mean": 1e3 * statistics.mean(spent)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--prompt", type=int, default=32_768)
    ap.add_argument("--reload-mib", type=int, default=256)
    ap.add_argument("--writes-at", default="", help="entry counts (1000,3000): write path only")
    ap.add_argument("--writes", type=int, default=50, help="writes timed at each count")
    args = ap.parse_args()
    if args.writes_at:
        for n in (int(x) for x in args.writes_at.split(",")):
            with tempfile.TemporaryDirectory() as d:
                r = bench_writes(Path(d) / "writes", n, args.writes)
            print(f"writes  entries {r['entries']:6}  ms/write median {r['write_ms_median']:6.2f} "
                  f"mean {r['write_ms_mean']:6.2f}  make_room ms median "
                  f"{r['make_room_ms_median']:6.2f} mean {r['make_room_ms_mean']:6.2f}")
        return
    with tempfile.TemporaryDirectory() as d:
        for k, v in bench_lookup(Path(d) / "lookup", args.entries, args.prompt).items():
            print(f"lookup  {k:18} {v:.3f}" if isinstance(v, float) else f"lookup  {k:18} {v}")
        for k, v in bench_reload(Path(d) / "reload", args.reload_mib).items():
            print(f"reload  {k:18} {v:.3f}" if isinstance(v, float) else f"reload  {k:18} {v}")


if __name__ == "__main__":
    main()
