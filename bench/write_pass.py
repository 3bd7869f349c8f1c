"""Benchmark: the cold writer alone — ``encode.encode`` + ``FileBackend.put`` of one entry.

An 8B-shaped layer stack (32 layers, 8 KV heads, head dim 128, bf16 as uint16; strided views of
longer buffers, as a KVCache holds them) of random bytes, written ``--reps`` times to ``--dir``
next to a plain ``write`` + ``fsync`` of as many bytes (what ``dd conv=fsync`` does). Per size:
seconds (best of the reps), GB/s, the process's CPU seconds, and ours as a share of the plain
write. ``--disk-gbps R`` makes every ``write()`` of both last at least bytes / R (a sleep after
it): a disk of known speed on a machine whose own disk is noisy or a tmpfs, so what is measured
is how much of the disk's time the writer leaves idle (the two-pass writer: ~75 %).

    python -m bench.write_pass --gb 1,4 --dir /tmp/wp
    python -m bench.write_pass --gb 1 --dir /dev/shm/wp --disk-gbps 1.2

numpy and bytes only (no MLX); the table goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tiered_kv.cold import backend, encode

LAYERS, HEADS, DIM, STEP = 32, 8, 128, 256
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 2


def make_entry(tokens: int, seed: int = 0) -> list[encode.Tensor]:
    rng = np.random.default_rng(seed)
    alloc = -(-tokens // STEP) * STEP + STEP  # a cache buffer longer than its tokens
    out = []
    for layer in range(LAYERS):
        for kv in ("keys", "values"):
            big = rng.integers(0, 1 << 16, size=(1, HEADS, alloc, DIM), dtype=np.uint16)
            view = big[:, :, :tokens, :]
            out.append(encode.Tensor(f"{layer}.{kv}", "BF16", view.shape, view))
    return out


def paced(rate: float | None) -> Callable[[int, memoryview], int]:
    """``os.write`` that lasts at least ``len / rate`` seconds (``rate`` bytes/s; None: plain)."""
    real = os.write
    if rate is None:
        return real

    def write(fd: int, view: memoryview) -> int:
        t0 = time.perf_counter()
        n = real(fd, view)
        left = n / rate - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return n

    return write


def plain_write(path: Path, data: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = encode.flat_bytes(data)
        for off in range(0, len(view), encode.BLOCK_BYTES):
            piece = view[off : off + encode.BLOCK_BYTES]
            done = 0
            while done < len(piece):
                done += os.write(fd, piece[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    path.unlink()


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return wall, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime


def one_size(root: Path, tokens: int, reps: int, rate: float | None) -> dict[str, float]:
    tensors = make_entry(tokens)
    ids = np.arange(tokens, dtype="<i4")
    b = backend.FileBackend(root)
    plain = np.full(tokens * BYTES_PER_TOKEN, 7, dtype=np.uint8)
    ours, dd = [], []
    for _ in range(reps):
        os.sync()
        ours.append(timed(lambda: b.put("e", encode.encode(ids, tensors, {"fingerprint": "wp"}))))
        nbytes = b.path("e").stat().st_size
        b.delete("e")
        os.sync()
        dd.append(timed(lambda: plain_write(root / "plain", plain)))
    wall, cpu = min(ours)
    dd_wall, _ = min(dd)
    return {"tokens": tokens, "gb": nbytes / 1e9, "s": wall, "cpu": cpu, "dd_s": dd_wall}


def table(rows: list[dict[str, float]], rate: float | None) -> str:
    disk = f"disk paced at {rate / 1e9:.2f} GB/s" if rate else "disk as it is"
    out = [f"encode + FileBackend.put, best of the reps ({disk})", "",
           "| tokens | GB | ours s | ours GB/s | ours CPU s | write+fsync s | write+fsync GB/s | ours / write |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['tokens']} | {r['gb']:.2f} | {r['s']:.2f} | {r['gb'] / r['s']:.2f} | "
                   f"{r['cpu']:.2f} | {r['dd_s']:.2f} | {r['gb'] / r['dd_s']:.2f} | "
                   f"{r['dd_s'] / r['s'] * 100:.0f} % |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", default="1", help="entry sizes, comma separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/tkv-write-pass"))
    ap.add_argument("--disk-gbps", type=float, default=None)
    args = ap.parse_args(argv)
    rate = args.disk_gbps * 1e9 if args.disk_gbps else None
    root: Path = args.dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    real = os.write
    os.write = paced(rate)  # type: ignore[assignment]  # this process's writes: ours and plain
    try:
        sizes = [max(1, int(float(g) * 1e9 / BYTES_PER_TOKEN)) for g in args.gb.split(",")]
        rows = [one_size(root, t, args.reps, rate) for t in sizes]
    finally:
        os.write = real
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows, rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
