"""Cold tier at real-model scale: write and reload GB/s per entry size, next to ``dd`` and mlx-lm.

    python -m bench.sizes --shape 8b --tokens 8192,32768,131072      # on the device
    python -m bench.sizes --shape bench --gb 0.25,1,4                # the bench model, CPU

Builds random caches of the shape (no model is loaded), then per size, in one process that owns
MLX: spill through a real :class:`ColdTier` (write-behind, default queue bound; the entry must
reach disk whatever its size) and reload it with the page cache dropped for the file (``sync``
then ``posix_fadvise(DONTNEED)``) and warm; ``dd`` writing (``conv=fsync``) and reading the same
number of bytes; mlx-lm's ``save_prompt_cache`` (+ fsync) / ``load_prompt_cache`` of the same
caches. Reload times include evaluating every array (and, for ours, verifying every checksum).
Prints a table; ``--json`` writes the rows too. Files go under ``--dir`` (default: a temp dir
on the cache disk) and are deleted as soon as they are measured: peak disk ≈ 2 entries.
``--reps`` rounds (default 3) per size, each measure once per round, interleaved (a noisy machine,
e.g. a VM whose freed memory is handed back to its host and faulted in again, slows every measure
of that moment alike); the table shows medians and the goals are also given on the best runs.
Beside ``dd``, which reads into one reused block, the same single-threaded read into memory freshly
mapped for the file (:func:`dd.read_fresh`): a reload lands in new memory, and on a VM its page
faults can cost as much as the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from bench import dd
from tiered_kv import Config

FINGERPRINT = "bench-sizes"


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: Any

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.size


SHAPES = {
    "8b": KVShape(32, 8, 128, mx.bfloat16),  # Llama-3.1-8B: 128 KiB / token
    "bench": KVShape(8, 4, 64, mx.float32),  # engine/models/tiny.py "bench": 16 KiB / token
    "test": KVShape(2, 2, 16, mx.float32),
}


def make_caches(shape: KVShape, tokens: int, seed: int = 0) -> list[KVCache]:
    """Evaluated random KVCaches holding ``tokens`` positions (contiguous, as after a prefill)."""
    out = []
    key = mx.random.key(seed)
    for _ in range(shape.layers):
        key, k1, k2 = mx.random.split(key, 3)
        c = KVCache()
        dims = (1, shape.kv_heads, tokens, shape.head_dim)
        c.keys = mx.random.normal(dims, key=k1).astype(shape.dtype)
        c.values = mx.random.normal(dims, key=k2).astype(shape.dtype)
        c.offset = tokens
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def _eval_caches(caches: list) -> None:
    mx.eval([a for c in caches for a in c.state])


def _timed_load(load: Any) -> float:
    t = time.perf_counter()
    caches = load()
    assert caches is not None, "bench: reload failed"
    _eval_caches(caches)
    dt = time.perf_counter() - t
    del caches
    mx.clear_cache()  # every load starts from fresh memory, like the first reload after start
    return dt


def one_size(root: Path, shape: KVShape, tokens: int, config: Config, reps: int = 1) -> dict[str, Any]:
    """Write both files from the same caches, free the caches, then time every read; ``reps``
    rounds of each (writes, then reads), the measures of a round interleaved, so that a noisy
    machine slows ours and the yardsticks alike. The row holds each measure's median (and its
    runs, ``<key>_runs``)."""
    from tiered_kv.cold.tier import ColdTier

    runs: dict[str, list[float]] = {}

    def note(key: str, seconds: float) -> None:
        runs.setdefault(key, []).append(seconds)

    caches = make_caches(shape, tokens)
    ids = np.random.default_rng(tokens).integers(0, 100_000, tokens, dtype=np.int32)
    scratch = root / "dd.bin"  # writes measured back to back, each from a synced page cache
    mlx_file = root / "mlx-lm.safetensors"
    kv_dir = root / "kv"
    cfg = replace(config, cache_dir=kv_dir, disk_bytes=1 << 50, disk_free_floor=0)
    drops = spills = 0
    for r in range(reps):
        note("dd_write_s", dd.write(scratch, shape.bytes_per_token * tokens))
        scratch.unlink()
        mlx_file.unlink(missing_ok=True)
        os.sync()
        t = time.perf_counter()
        save_prompt_cache(str(mlx_file), caches)
        fd = os.open(mlx_file, os.O_RDONLY)
        os.fsync(fd)  # ours is durable when written: time mlx-lm's to the same point
        os.close(fd)
        note("mlx_save_s", time.perf_counter() - t)
        shutil.rmtree(kv_dir, ignore_errors=True)  # each round's entry is written afresh
        tier = ColdTier(kv_dir, FINGERPRINT, cfg)
        os.sync()
        t = time.perf_counter()
        tier.spill(ids, caches)  # write-behind, as the hot tier hands it over
        tier.flush()
        note("write_s", time.perf_counter() - t)
        st = tier.stats()
        drops, spills = drops + st["drops"], spills + st["spills"]
        if r < reps - 1:
            tier.close()
        mx.clear_cache()  # the copies each writer made (a 4 GB entry x 3 rounds filled 24 GB)
    del caches
    mx.clear_cache()
    (path,) = tier.dir.glob("*.safetensors")
    hit = tier.lookup(ids)
    assert hit is not None and hit.tokens == tokens, "bench: the entry did not reach the index"
    ways = [
        ("load", path, lambda: getattr(tier.load(hit), "caches", None)),
        ("mlx_load", mlx_file, lambda: load_prompt_cache(str(mlx_file))),
    ]
    for r in range(reps):
        for mode in ("cold", "warm"):
            # each goes first in every other round: the first read after the cold phase pays
            # for memory the page cache just took, whichever it is
            for name, file, load in ways if r % 2 == 0 else ways[::-1]:
                dd.drop_page_cache(file) if mode == "cold" else dd.read(file, cold=False)
                note(f"{name}_{mode}_s", _timed_load(load))
            note(f"dd_read_{mode}_s", dd.read(path, cold=mode == "cold"))
            if mode == "cold":  # the same read into fresh memory: what the disk AND the faults allow
                note("fresh_read_cold_s", dd.read_fresh(path))
    nbytes = path.stat().st_size
    tier.close()
    shutil.rmtree(kv_dir)
    mlx_file.unlink()
    per_file = nbytes / (shape.bytes_per_token * tokens)  # dd wrote the KV bytes: per file byte
    runs["dd_write_s"] = [x * per_file for x in runs["dd_write_s"]]
    row: dict[str, Any] = {"tokens": tokens, "bytes": nbytes, "reps": reps, "spills": spills,
                           "drops": drops}  # fmt: skip
    for key, values in runs.items():
        row[key] = float(np.median(values))
        row[f"{key}_runs"] = values
    return row


def gbps(row: dict[str, Any], key: str) -> float:
    return row["bytes"] / row[key] / 1e9


COLUMNS = [
    ("write", "write_s"), ("dd write", "dd_write_s"), ("mlx-lm save", "mlx_save_s"),
    ("reload cold", "load_cold_s"), ("dd read cold", "dd_read_cold_s"),
    ("read into fresh memory cold", "fresh_read_cold_s"),
    ("mlx-lm load cold", "mlx_load_cold_s"), ("reload warm", "load_warm_s"),
    ("dd read warm", "dd_read_warm_s"), ("mlx-lm load warm", "mlx_load_warm_s"),
]  # fmt: skip


def _goals(r: dict[str, Any], best: bool = False) -> str:
    """The three ratios of the goals, from the medians or (``best``) each measure's fastest run."""

    def s(key: str) -> float:
        return float(min(r[key + "_runs"])) if best else float(r[key])

    return (f"cold {100 * s('dd_read_cold_s') / s('load_cold_s'):.0f} % of dd "
            f"({100 * s('fresh_read_cold_s') / s('load_cold_s'):.0f} % of a read into fresh memory), "
            f"warm {100 * s('mlx_load_warm_s') / s('load_warm_s'):.0f} % of mlx-lm, "
            f"write {100 * s('dd_write_s') / s('write_s'):.0f} % of dd")  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    head = "| tokens | GB | " + " | ".join(c for c, _ in COLUMNS) + " | drops |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for r in rows:
        cells = [f"{gbps(r, k):.2f}" for _, k in COLUMNS]
        lines.append(f"| {r['tokens']} | {r['bytes'] / 1e9:.2f} | " + " | ".join(cells)
                     + f" | {r['drops']} |")  # fmt: skip
    lines.append("")
    lines.append("GB/s (file bytes / seconds). Goals: reload cold ≥ 90 % of dd read cold, "
                 "reload warm ≥ mlx-lm load warm, write ≥ 80 % of dd write, drops 0.")  # fmt: skip
    for r in rows:
        lines.append(f"{r['tokens']} tokens, median of {r.get('reps', 1)}: {_goals(r)}")
        if r.get("reps", 1) > 1:  # every measure's fastest run: what the machine does unhindered
            lines.append(f"{r['tokens']} tokens, best of {r['reps']}: "
                         f"{_goals(r, best=True)}")  # fmt: skip
    return "\n".join(lines)


def run(shape_name: str, token_counts: list[int], root: Path | None = None,
        config: Config | None = None, reps: int = 1) -> list[dict[str, Any]]:  # fmt: skip
    """One row per size (see the module docstring)."""
    shape = SHAPES[shape_name]
    config = config or Config()
    rows = []
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)  # `--dir /tmp/x` on a fresh machine
    with tempfile.TemporaryDirectory(prefix="tkv-sizes-", dir=root) as tmp:
        one_size(Path(tmp), shape, 1024, config)  # warm-up: first-call costs (CUDA, kernels) out
        for n in token_counts:
            need = 2 * n * shape.bytes_per_token + (1 << 30)
            free = shutil.disk_usage(tmp).free
            if free < need:
                print(f"skip {n} tokens: {need / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free",
                      file=sys.stderr)  # fmt: skip
                continue
            rows.append({"shape": shape_name, **one_size(Path(tmp), shape, n, config, reps)})
            print(f"done {n} tokens", file=sys.stderr, flush=True)
    return rows


def tokens_for_gb(shape: KVShape, gbs: list[float]) -> list[int]:
    return [max(256, int(g * 1e9 / shape.bytes_per_token) // 256 * 256) for g in gbs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--tokens", default="", help="comma-separated token counts")
    ap.add_argument("--gb", default="", help="comma-separated entry sizes in GB (instead)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch dir (on the disk to test)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--reps", type=int, default=3,
                    help="rounds per size, measures interleaved; the table shows medians")  # fmt: skip
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.tokens:
        counts = [int(x) for x in args.tokens.split(",")]
    else:
        counts = tokens_for_gb(shape, [float(x) for x in (args.gb or "0.25,1,4").split(",")])
    from tiered_kv import Config

    print(f"device: {mx.default_device()}, shape {args.shape} "
          f"({shape.bytes_per_token // 1024} KiB/token), sizes {counts}", flush=True)  # fmt: skip
    rows = run(args.shape, counts, args.dir, Config.from_env(), max(1, args.reps))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
