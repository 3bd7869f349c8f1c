"""Hit hand-out cost as a share of a long prefill, on whatever device MLX runs (CPU, Metal, CUDA).

A bench-shaped llama (8 layers, hidden 512, 8 heads / 4 KV heads, head_dim 64, float32, random weights,
built in memory) prefills N tokens in chunks; then one hit on the resulting entry is handed out three
ways (deepcopy as exo / mlx-lm do, our view for a short hit, our take for a continuation) and one
decode step runs on it.

    python -m bench.hit_vs_prefill [--tokens 8192,32768] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import cast

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from tiered_kv import layers


def bench_model() -> llama.Model:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=4096,
        max_position_embeddings=65536,
    )  # fmt: skip
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def sync() -> None:
    if hasattr(mx, "synchronize"):
        mx.synchronize()


def prefill(model, n: int, chunk: int):
    caches = make_prompt_cache(model)
    ids = cast(list[int], mx.random.randint(0, 4096, (n,)).tolist())
    t0 = time.perf_counter()
    for i in range(0, n, chunk):
        out = model(mx.array([ids[i : i + chunk]]), cache=caches)
        mx.eval(out[:, -1], [c.state for c in caches])
    sync()
    return caches, time.perf_counter() - t0


def hand_out(model, caches, how: str, hit: int, total: int) -> float:
    t0 = time.perf_counter()
    if how == "deepcopy":
        got = copy.deepcopy(caches)
        for c in got:
            c.trim(total - hit)
    elif how == "view":
        got = layers.view(caches, hit, total)
    else:
        got = caches
        for c in got:
            c.trim(total - hit)
    out = model(mx.array([[1]]), cache=got)
    mx.eval(out, [c.state for c in got])
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--chunk", type=int, default=2048)
    a = ap.parse_args()
    model = bench_model()
    prefill(model, 1024, a.chunk)  # warm-up
    print(f"device: {mx.default_device()}")
    print("| tokens | prefill s | hit | way | hand-out + 1 step ms | % of prefill |")
    print("|---:|---:|---|---|---:|---:|")
    for n in (int(x) for x in a.tokens.split(",")):
        for label, frac, ways in (("continuation", 1.0, ("deepcopy", "take")), ("branch 10 %", 0.1, ("deepcopy", "view"))):
            for how in ways:
                caches, pre = prefill(model, n, a.chunk)
                hand_out(model, layers.view(caches, 256, n), "view", 256, 256)  # warm the step kernels
                dt = hand_out(model, caches, how, int(n * frac) - 1, n)
                print(f"| {n} | {pre:.2f} | {label} | {how} | {dt * 1e3:.1f} | {100 * dt / pre:.1f} |")
                del caches
                mx.clear_cache()


if __name__ == "__main__":
    main()
