"""Cold ranged reads of an entry's last tokens (a `both`'s tail): GB/s served, by chunk size and readers.

    python -m bench.tails --shape 8b --tokens 8192 --reps 5          # the figures in the README
    python -m bench.tails --shape 8b --tokens 32768 --chunks 4,1 --readers 4,8

Writes one entry per checksum chunk size (``--chunks``, MiB: the same caches, the file format's
``chunk_bytes`` set at write time) with the cold tier's own encoder and file backend, then per round
reads tokens ``[m, n)`` of every layer tensor by :func:`tiered_kv.cold.ranged.read_range` for each
tail length (``--tails``, shares of ``n``), chunk size and reader count, the page cache dropped for
the file before each read (``sync`` + ``posix_fadvise(DONTNEED)``), next to ``dd`` reading the
whole file cold. GB/s are bytes *served* (what a `both` gets) per second: a read in whole chunks
reads more than it serves, which is the point of the sweep. Prints medians per cell; ``--json``
writes every run. Files go under ``--dir`` (default: a temp dir on the cache disk), removed after.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench import dd
from bench.sizes import SHAPES, make_caches
from tiered_kv.cold import codec, encode, ranged
from tiered_kv.cold.backend import FileBackend

FINGERPRINT = "bench-tails"


def write(root: Path, shape_name: str, tokens: int, chunks_mib: list[float]) -> dict[float, Path]:
    """One entry file of ``tokens`` random tokens of ``shape_name`` per chunk size (MiB)."""
    caches = make_caches(SHAPES[shape_name], tokens)
    ids = np.arange(tokens, dtype=np.int32) % 1000
    job = codec.prepare(ids, caches, None, FINGERPRINT)
    out = {}
    for mib in chunks_mib:
        (root / f"chunk{mib:g}").mkdir()
        backend = FileBackend(root / f"chunk{mib:g}")
        key = f"{int(mib * 1024):032x}"
        backend.put(key, encode.encode(job.tokens, job.tensors, job.metadata, int(mib * (1 << 20))))
        out[mib] = backend.path(key)
    del caches, job
    mx.clear_cache()
    return out


def run(shape_name: str, tokens: int, chunks_mib: list[float], readers: list[int],
        tails: list[float], reps: int, root: Path | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (tail, chunk size, readers), with every run's GB/s served and their median;
    and a ``dd`` row (the whole file, cold)."""
    runs: dict[tuple[float, float, int], list[float]] = {}
    dd_runs: list[float] = []
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tkv-tails-", dir=root) as tmp:
        paths = write(Path(tmp), shape_name, tokens, chunks_mib)
        for _ in range(reps):
            for tail in tails:
                m = tokens - max(1, int(tokens * tail))
                for mib, path in paths.items():
                    for w in readers:
                        dd.drop_page_cache(path)
                        t = time.perf_counter()
                        rr = ranged.read_range(path, FINGERPRINT, m, tokens, workers=w)
                        seconds = time.perf_counter() - t
                        served = sum(a.nbytes for _, a in rr.tensors.values())
                        runs.setdefault((tail, mib, w), []).append(served / seconds / 1e9)
            any_path = next(iter(paths.values()))
            dd_runs.append(any_path.stat().st_size / dd.read(any_path, cold=True) / 1e9)
    rows: list[dict[str, Any]] = [
        {"tail": tail, "chunk_mib": mib, "readers": w, "gb_s": float(np.median(v)), "runs": v}
        for (tail, mib, w), v in sorted(runs.items())
    ]
    rows.append({"tail": 1.0, "chunk_mib": 0, "readers": 0, "gb_s": float(np.median(dd_runs)),
                 "runs": dd_runs, "dd": True})  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]], tokens: int) -> str:
    lines = ["| tail (tokens) | chunk | readers | GB/s served (median) | runs |", "|---|---|---|---|---|"]
    for r in rows:
        runs = " ".join(f"{x:.2f}" for x in r["runs"])
        if r.get("dd"):
            lines.append(f"| whole file, `dd` | - | - | {r['gb_s']:.2f} | {runs} |")
            continue
        n = max(1, int(tokens * r["tail"]))
        lines.append(f"| {r['tail']:g} ({n}) | {r['chunk_mib']:g} MiB | {r['readers']} | "
                     f"{r['gb_s']:.2f} | {runs} |")  # fmt: skip
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunks", default="4,1", help="checksum chunk sizes, MiB (comma-separated)")
    ap.add_argument("--readers", default="4,8", help="reader threads (comma-separated)")
    ap.add_argument("--tails", default="0.125,0.25,0.5", help="tail lengths, shares of --tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch dir (on the disk to test)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = run(args.shape, args.tokens, _floats(args.chunks), [int(x) for x in _floats(args.readers)],
               _floats(args.tails), max(1, args.reps), args.dir)  # fmt: skip
    print(f"device: {mx.default_device()}, shape {args.shape}, {args.tokens} tokens, "
          f"page cache dropped before every read")  # fmt: skip
    print(table(rows, args.tokens))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
