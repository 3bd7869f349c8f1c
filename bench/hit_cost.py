"""Cost of serving a hot hit: deepcopy (what exo and mlx-lm do) vs a shared view vs a take.

Shape of the bench model's KV: 8 layers × 4 KV heads × head_dim 64, float32 (16 KiB per token).
For each prompt length we hand out a cache for the whole entry and run one decode step on it, and
report the bytes MLX allocated for the hand-out + first write (active memory delta) and the time.

    python -m bench.hit_cost [--tokens 2048,8192,32768]
"""

from __future__ import annotations

import argparse
import copy
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tiered_kv import layers

L, H, D = 8, 4, 64


def make_entry(n: int) -> list[KVCache]:
    caches = []
    for _ in range(L):
        c = KVCache()
        k = mx.random.normal((1, H, n, D))
        c.update_and_fetch(k, k + 1)
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def first_step(caches: list[KVCache]) -> None:
    x = mx.ones((1, H, 1, D))
    mx.eval([c.update_and_fetch(x, x) for c in caches])


def measure(n: int, hit: int, how: str) -> tuple[float, int]:
    """Hand out ``hit`` tokens of an ``n``-token entry, then run one decode step on it."""
    entry: list[KVCache] | None = make_entry(n)
    assert entry is not None
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    if how == "deepcopy":  # exo / mlx-lm: copy the whole entry, then trim the copy
        handed: list[KVCache] = copy.deepcopy(entry)
        for c in handed:
            c.trim(n - hit)
        mx.eval([c.state for c in handed])
    elif how == "view":  # ours, short hit: new cache objects sharing the stored arrays
        view = layers.view(entry, hit, n)
        assert view is not None  # KVCache layers always serve a prefix
        handed = view
    else:  # ours, continuation: the entry itself is handed over (it is replaced afterwards)
        handed = entry
        entry = None
        for c in handed:
            c.trim(n - hit)
    first_step(handed)
    dt = time.perf_counter() - t0
    grown = mx.get_active_memory() - base
    del handed, entry
    mx.clear_cache()
    return dt, grown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192,32768")
    ns = [int(x) for x in ap.parse_args().tokens.split(",")]
    print("| entry tokens | entry MB | hit | way | ms (hand-out + 1st step) | MB allocated |")
    print("|---:|---:|---|---|---:|---:|")
    measure(512, 400, "deepcopy")  # warm-up
    for n in ns:
        n -= 100  # entries usually have buffer headroom (KVCache grows in 256-token steps)
        mb = n * L * H * D * 4 * 2 / 1e6
        for label, hit, ways in (
            ("continuation (all)", n, ("deepcopy", "take")),
            ("branch (10 %)", n // 10, ("deepcopy", "view")),
        ):
            for how in ways:
                dt, grown = measure(n, hit, how)
                print(f"| {n} | {mb:.0f} | {label} | {how} | {dt * 1e3:.1f} | {grown / 1e6:.1f} |")


if __name__ == "__main__":
    main()
