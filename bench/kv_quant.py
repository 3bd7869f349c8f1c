"""Stored-KV quantisation (TIERED_KV_KV_BITS): bytes saved and the logit difference it causes.

Bench-shaped llama (random weights, float32). A prompt of N tokens is stored with kv_bits 0/8/4; then
the prompt plus a new suffix is served from the cache and compared with a cold prefill: max |Δlogit|,
relative to the logits' spread, and agreement of 16 greedy tokens.

    python -m bench.kv_quant [--tokens 2048]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from bench.hit_vs_prefill import bench_model
from engine.prefill import prefill
from tiered_kv import Config, TieredCache


def greedy(model, tc: TieredCache | None, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    if tc is None:
        caches = make_prompt_cache(model)
        logits = model(mx.array([ids]), cache=caches)[0, -1]
    else:
        lease = tc.fetch(ids)
        caches = lease.caches
        logits = prefill(model, lease, list(ids[: lease.hit.tokens]), 512)
    first = np.array(logits)
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits).item())  # type: ignore[arg-type]
        out.append(t)
        logits = model(mx.array([[t]]), cache=caches)[0, -1]
    return first, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    n = ap.parse_args().tokens
    model = bench_model()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 4096, n).tolist()
    query = prompt + rng.integers(0, 4096, 32).tolist()
    ref_logits, ref_toks = greedy(model, None, query, 16)
    spread = float(ref_logits.max() - ref_logits.min())
    print("| kv_bits | stored MB | saved | max abs Δlogit | Δ / logit range | greedy tokens equal (of 16) |")
    print("|---:|---:|---:|---:|---:|---:|")
    base = None
    for bits in (0, 8, 4):
        tc = TieredCache(Config(tiers=("hot",), kv_bits=bits), lambda: make_prompt_cache(model))
        lease = tc.fetch(prompt)
        fed = list(prompt[: lease.hit.tokens])
        prefill(model, lease, fed, 512)
        tc.store(lease, fed)
        stored = tc.hot.nbytes
        base = base or stored
        logits, toks = greedy(model, tc, query, 16)
        d = float(np.abs(logits - ref_logits).max())
        same = sum(a == b for a, b in zip(toks, ref_toks, strict=True))
        print(f"| {bits or 'off'} | {stored / 1e6:.1f} | {100 * (1 - stored / base):.0f} % | {d:.4f} | {d / spread:.4f} | {same} |")


if __name__ == "__main__":
    main()
