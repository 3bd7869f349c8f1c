"""Benchmark: the `both` join alone — read tail ``[m, n)`` of an entry file + join with a computed head.

``old``: ``ranged.read_range`` into numpy buffers, then per layer ``mx.array`` of the bytes and
``mx.concatenate`` with the head (what ``Restorer.join`` did before: three copies of the tail).
``full``: the layer arrays of all n tokens allocated unwritten and token-major like the file
(``restore.buffers``), ``read_range(into=)`` straight into tokens [m, n) (one run per layer), the
head written in place (no copy of the tail after the read), the caches holding their ``swapaxes``
view. ``tail``: landing arrays of [m, n) only, joined by one ``mx.concatenate``.
``Restorer`` takes ``tail`` on CUDA, ``full`` elsewhere (``buffers.landing``).

Per tail size: an entry of an 8B-shaped layer stack (32 layers, 8 KV heads, head dim 128, bf16)
whose second half is the tail, written once with random bytes (cold format 3: token-major); the head is random arrays on the
default device. Columns: alloc (engine thread, before the compute), read (the I/O thread's work),
join (engine thread, after the read), use (a first reduction over every joined array: on CUDA
this is where host-resident memory migrates to the GPU), total = alloc + read + join + use.

    python -m bench.join --gib 1,4 --pages warm,cold --dir /tmp/jb

No network; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from bench.dd import drop_page_cache
from tiered_kv import layers
from tiered_kv.cold import encode, landing, ranged
from tiered_kv.cold.backend import FileBackend
from tiered_kv.restore import buffers
from tiered_kv.restore.costs import CostBook
from tiered_kv.restore.restorer import Restorer

LAYERS, HEADS, DIM = 32, 8, 128
ROW = DIM * 2  # bf16 bytes per token per head



def _no_compute(ids: list[int], held: Any = None) -> Any:
    """The Restorer's compute, never called here (only its join is measured)."""
    raise AssertionError("not called")
    yield

def tokens_for(gib: float) -> int:
    """Total tokens of an entry whose second half is ``gib`` GiB of KV."""
    per_token = LAYERS * 2 * HEADS * ROW
    return 2 * int(gib * (1 << 30) // per_token)


def write_entry(root: Path, n: int) -> Path:
    rng = np.random.default_rng(n)
    tensors, tree = [], []
    for i in range(LAYERS):
        for kv in ("keys", "values"):
            data = rng.integers(0, 1 << 14, (1, HEADS, n, DIM), dtype=np.uint16)  # finite bf16
            tensors.append(encode.Tensor(f"{i}.{kv}", "BF16", data.shape, data))
        tree.append({"cls": "KVCache", "meta": {"offset": n}})
    meta = {"layers": json.dumps(tree), "fingerprint": "fp", "layout": "bench", "created": "0"}
    enc = encode.encode(np.arange(n, dtype=np.int32), tensors, meta)
    root.mkdir(parents=True, exist_ok=True)
    b = FileBackend(root)
    b.put("e", enc)
    return b.path("e")


def head_caches(m: int) -> list[KVCache]:
    out = []
    for _ in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, HEADS, m, DIM)).astype(mx.bfloat16)
        c.update_and_fetch(k, -k)
        out.append(c)
    mx.eval([x for c in out for x in (c.keys, c.values)])
    return out


def old_join(computed: list[KVCache], rr: ranged.RangeRead, m: int, n: int) -> list[KVCache]:
    """The join before this benchmark's change, kept here as its reference."""
    mine, _ = layers.encode(computed)
    arrays = {}
    for name, (_, u8) in rr.tensors.items():  # (1, n - m, heads, row bytes): token-major
        part = np.ascontiguousarray(u8).view(np.uint16)
        read = mx.swapaxes(mx.array(part).view(mx.bfloat16), 1, 2)
        arrays[name] = mx.concatenate([mine[name][..., :m, :], read], axis=2)
    mx.eval(list(arrays.values()))
    return _decode(arrays, rr.metadata, n)


def _decode(arrays: dict[str, mx.array], metadata: dict[str, str], n: int) -> list[KVCache]:
    tree = json.loads(metadata["layers"])
    for node in tree:
        node["meta"]["offset"] = n
    return layers.decode(arrays, {"layers": json.dumps(tree)})


def use(caches: list[KVCache]) -> None:
    mx.eval([mx.sum(x[..., -1:, :]) + mx.max(x) for c in caches for x in (c.keys, c.values)])


def run(way: str, path: Path, computed: list[KVCache], m: int, n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    if way == "old":
        t1 = t0
        rr = ranged.read_range(path, "fp", m, n)
        t2 = time.perf_counter()
        caches = old_join(computed, rr, m, n)
    else:
        full = landing.allocate(buffers.shapes(ranged.layout(path, "fp", m, n), m, n, way))
        views = buffers.byte_views(full, m, n)
        t1 = time.perf_counter()
        rr = ranged.read_range(path, "fp", m, n, into=views)
        del views
        rr.tensors.clear()
        t2 = time.perf_counter()
        r = Restorer("both", CostBook(None), _no_compute, "", landing=way)
        caches = r.join(computed, full, rr.metadata, m, n)
    t3 = time.perf_counter()
    use(caches)
    t4 = time.perf_counter()
    del caches
    mx.clear_cache()
    return {"alloc": t1 - t0, "read": t2 - t1, "join": t3 - t2, "use": t4 - t3, "total": t4 - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", default="1,4", help="tail sizes in GiB")
    ap.add_argument("--pages", default="warm,cold")
    ap.add_argument("--ways", default="old,full,tail")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args(argv)
    root = a.dir or Path(tempfile.mkdtemp(prefix="tkv-join-"))
    print(f"# join benchmark on {mx.default_device()}, {root}")
    print("| tail GiB | pages | way | alloc s | read s | join s | use s | total s | GB/s |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for gib in (float(x) for x in a.gib.split(",")):
        n = tokens_for(gib)
        m = n // 2
        d = root / f"g{gib}"
        shutil.rmtree(d, ignore_errors=True)
        path = write_entry(d, n)
        computed = head_caches(m)
        tail = (n - m) * LAYERS * 2 * HEADS * ROW
        for pages in a.pages.split(","):
            for _ in range(a.repeat):
                for way in a.ways.split(","):
                    if pages == "cold":
                        drop_page_cache(path)
                    else:
                        ranged.read_range(path, "fp", m, n)  # every page resident
                    t = run(way, path, computed, m, n)
                    print(f"| {gib:g} | {pages} | {way} | {t['alloc']:.3f} | {t['read']:.3f} "
                          f"| {t['join']:.3f} | {t['use']:.3f} | {t['total']:.3f} "
                          f"| {tail / t['total'] / 1e9:.2f} |", flush=True)  # fmt: skip
        del computed
        shutil.rmtree(d, ignore_errors=True)
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
