"""Micro-benchmarks of the cold tier, run in the bench process (which owns MLX here).

- ``reload``: ColdTier.load throughput against ``dd`` reading the same entry files, both after
  ``posix_fadvise(DONTNEED)`` so neither is served from the page cache (best effort: dirty pages are
  fsync-ed first; a filesystem that ignores the advice makes both numbers page-cache numbers).
- ``lookup``: mean ColdTier.lookup time with 100 / 1k / 10k entries in the index.
- ``suffix``: measured time to prefill only each turn's new tokens (the bound for the hot-tier goal).
- ``sizes`` (``--sizes 0.25,1,4``): write / reload GB/s of one entry per size vs ``dd`` and mlx-lm's
  ``save_prompt_cache`` / ``load_prompt_cache`` (``bench/sizes.py``, also runnable alone).
- ``spill``: prefill (TTFT) and decode tok/s of the model with the cold writer thread busy writing a large
  spill vs idle, alternated to cancel drift.

Each function returns a plain dict for results.json; a missing ``tiered_kv.cold`` becomes an ``*_error`` key.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from bench import dd
from tiered_kv import Config

FINGERPRINT = "bench-micro"


def _cold_tier_class() -> Any:
    from tiered_kv.cold.tier import ColdTier  # imported late: the cold tier may not exist yet

    return ColdTier


def make_caches(layers: int, heads: int, tokens: int, head_dim: int, seed: int) -> list[KVCache]:
    """Evaluated float16 KVCache objects holding ``tokens`` positions (what the engine would spill)."""
    caches = []
    for i in range(layers):
        k1, k2 = mx.random.split(mx.random.key(seed * 1000 + i))
        c = KVCache()
        shape = (1, heads, tokens, head_dim)
        c.update_and_fetch(
            mx.random.normal(shape, key=k1).astype(mx.float16),
            mx.random.normal(shape, key=k2).astype(mx.float16),
        )
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def _arrays(caches: list) -> list[mx.array]:
    return [a for c in caches for a in c.state if isinstance(a, mx.array)]


def _data_files(root: Path, min_bytes: int) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_size >= min_bytes]


def reload(config: Config, entries: int = 4, tokens: int = 4096, repeats: int = 3) -> dict:
    """GB/s of ColdTier.load (lookup excluded, arrays evaluated) vs dd over the same files."""
    ColdTier = _cold_tier_class()
    with tempfile.TemporaryDirectory(prefix="tkv-reload-") as tmp:
        root = Path(tmp)
        tier = ColdTier(root, FINGERPRINT, replace(config, cache_dir=root))
        rng = np.random.default_rng(0)
        prompts = []
        for i in range(entries):
            ids = rng.integers(0, 30000, size=tokens, dtype=np.int64)
            # 8 layers × 2 × (1, 8, tokens, 64) fp16 = 16 MiB per 1k tokens
            tier.persist(ids, make_caches(8, 8, tokens, 64, seed=i))
            prompts.append([int(x) for x in ids])
        tier.flush()
        files = _data_files(root, 1 << 20)
        file_bytes = sum(p.stat().st_size for p in files)
        load_s, dd_s, loaded_bytes = [], [], 0
        for _ in range(repeats):
            hits = [tier.lookup(p) for p in prompts]
            dd.drop_page_cache(*files)
            t0 = time.perf_counter()
            loaded_bytes = 0
            for h in hits:
                got = tier.load(h) if h is not None else None
                assert got is not None, "reload: persisted entry did not load"
                caches = got[0]  # Loaded(caches, tokens, ...) or (caches, tokens)
                arrays = _arrays(caches)
                mx.eval(arrays)
                loaded_bytes += sum(a.nbytes for a in arrays)
            load_s.append(time.perf_counter() - t0)
            dd_s.append(dd.read(*files, cold=True))
        tier.close()
    load, dd_med = statistics.median(load_s), statistics.median(dd_s)
    return {
        "entries": entries,
        "tokens_per_entry": tokens,
        "file_bytes": file_bytes,
        "loaded_bytes": loaded_bytes,
        "load_s": load,
        "dd_s": dd_med,
        "load_gbps": file_bytes / load / 1e9,
        "dd_gbps": file_bytes / dd_med / 1e9,
    }


def lookup(config: Config, counts: tuple[int, ...] = (100, 1000, 10000), probes: int = 200) -> dict:
    """Mean lookup seconds (half hits that extend an entry, half misses) per index size."""
    ColdTier = _cold_tier_class()
    out: dict[str, Any] = {}
    block = config.block_tokens
    for n in counts:
        with tempfile.TemporaryDirectory(prefix="tkv-lookup-") as tmp:
            root = Path(tmp)
            tier = ColdTier(root, FINGERPRINT, replace(config, cache_dir=root))
            rng = np.random.default_rng(n)
            caches = make_caches(1, 1, block, 8, seed=n)
            stored = []
            t0 = time.perf_counter()
            for _ in range(n):
                ids = rng.integers(0, 30000, size=block, dtype=np.int64)
                tier.spill(ids, caches)
                stored.append(ids)
            tier.flush()
            build_s = time.perf_counter() - t0
            times, hits = [], 0
            for i in range(probes):
                base = stored[int(rng.integers(0, n))]
                tail = rng.integers(0, 30000, size=32, dtype=np.int64)
                prompt = (
                    np.concatenate([base, tail])
                    if i % 2 == 0
                    else rng.integers(0, 30000, block + 32)
                )
                probe = [int(x) for x in prompt]
                t1 = time.perf_counter()
                hit = tier.lookup(probe)
                times.append(time.perf_counter() - t1)
                hits += hit is not None
            entries = tier.stats().get("entries", n)
            tier.close()
        out[str(n)] = {
            "entries": entries,
            "build_s": build_s,
            "lookup_mean_s": statistics.fmean(times),
            "lookup_p95_s": sorted(times)[int(0.95 * len(times)) - 1],
            "hits": hits,
            "probes": probes,
        }
    return out


def _timed_generate(model: Any, prompt: mx.array, decode_tokens: int) -> tuple[float, float]:
    """(TTFT seconds, decode tok/s) of greedy generation with a fresh cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = model(prompt[None], cache=cache)
    tok = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(tok)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        logits = model(tok[:, None], cache=cache)
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(tok)
    return ttft, decode_tokens / (time.perf_counter() - t1)


def spill(
    config: Config,
    model_dir: Path,
    prompt_tokens: int = 1024,
    decode_tokens: int = 32,
    rounds: int = 4,
    spill_tokens: int = 8192,
) -> dict:
    """Model TTFT / decode tok/s while the writer thread writes a ~``spill_tokens`` entry, vs idle."""
    from engine.loading import load_model

    ColdTier = _cold_tier_class()
    model, _ = load_model(model_dir)
    prompt = mx.array(
        np.random.default_rng(1).integers(0, 1000, size=prompt_tokens), dtype=mx.int32
    )
    big = make_caches(8, 8, spill_tokens, 64, seed=7)  # 128 MiB
    _timed_generate(model, prompt, 4)  # warm-up
    res: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory(prefix="tkv-spill-") as tmp:
        root = Path(tmp)
        tier = ColdTier(root, FINGERPRINT, replace(config, cache_dir=root))
        rng = np.random.default_rng(2)
        for _ in range(rounds):
            res["without"].append(_timed_generate(model, prompt, decode_tokens))
            tier.spill(rng.integers(0, 30000, size=spill_tokens, dtype=np.int64), big)
            res["with"].append(_timed_generate(model, prompt, decode_tokens))
            tier.flush()
        writes = tier.stats()
        tier.close()
    med = {
        k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
        for k, v in res.items()
    }
    return {
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "rounds": rounds,
        "spill_bytes": sum(a.nbytes for a in _arrays(big)),
        "ttft_with_s": med["with"][0],
        "ttft_without_s": med["without"][0],
        "tps_with": med["with"][1],
        "tps_without": med["without"][1],
        "cold_stats": {k: v for k, v in writes.items() if isinstance(v, (int, float, str))},
    }


def suffix_prefill(model_dir: Path, turns: dict[int, tuple[int, int]], chunk: int = 512) -> dict:
    """Measured "prefill only the new suffix": per turn, seconds to prefill ``cur - prev`` tokens on top
    of an (untimed) ``prev``-token cache and pick the first token, in process (no HTTP, no template).

    ``turns`` maps turn → (previous prompt tokens, this prompt tokens). Token ids are random; the cost
    of a dense model does not depend on them.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from engine.loading import load_model

    model, _ = load_model(model_dir)
    rng = np.random.default_rng(3)
    out: dict[str, float] = {}
    for t, (prev, cur) in sorted(turns.items()):
        ids = mx.array(rng.integers(0, 1000, size=cur), dtype=mx.int32)[None]
        cache = make_prompt_cache(model)
        for i in range(0, prev, chunk):
            mx.eval(model(ids[:, i : min(i + chunk, prev)], cache=cache))
        t0 = time.perf_counter()
        for i in range(prev, cur, chunk):
            logits = model(ids[:, i : min(i + chunk, cur)], cache=cache)
            mx.eval(logits)
        mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
        out[str(t)] = time.perf_counter() - t0
    return {"chunk": chunk, "seconds": out, "mean_s": statistics.fmean(out.values())}


def sizes(config: Config, gbs: tuple[float, ...]) -> list[dict]:
    """The entry size sweep on the bench model's KV shape (see ``bench/sizes.py``)."""
    from bench import sizes as sweep

    shape = sweep.SHAPES["bench"]
    return sweep.run("bench", sweep.tokens_for_gb(shape, list(gbs)), None, config)


def run_all(
    config: Config,
    model_dir: Path,
    turns: dict[int, tuple[int, int]] | None = None,
    size_gbs: tuple[float, ...] = (),
) -> dict:
    """Every micro-benchmark; a failure of one is recorded as ``<name>_error`` and the rest still run."""
    out: dict[str, Any] = {}
    for name, fn in (
        ("sizes", lambda: sizes(config, size_gbs)),
        ("suffix", lambda: suffix_prefill(model_dir, turns or {}, config.prefill_chunk or 512)),
        ("reload", lambda: reload(config)),
        ("lookup", lambda: lookup(config)),
        ("spill", lambda: spill(config, model_dir)),
    ):
        if name == "suffix" and not turns or name == "sizes" and not size_gbs:
            continue
        try:
            out[name] = fn()
        except ImportError as e:
            out[f"{name}_error"] = f"tiered_kv.cold not available ({e})"
        except Exception as e:  # noqa: BLE001 - a benchmark edge: record and go on
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"
    return out
