"""tiered-kv's prompt cache under plain mlx-lm: the few lines another MLX server (mlx_lm.server, exo) needs.

    python examples/mlx_lm_generate.py [MODEL_DIR]

Loads the model with ``mlx_lm.load``, opens the tiered cache (memory, then disk) through the one door
``tiered_kv``, and generates with mlx-lm's own ``generate_step``: each call fetches the longest cached
prefix of its prompt, prefills only the rest, and stores the result back. Call 2 continues call 1's
conversation and hits memory; after a restart (the cache closed and reopened) call 3 hits the disk.

With no MODEL_DIR it builds tiered-kv's tiny test model (random weights: the text is noise, the
cache hits are real) in a temp dir, as ``tiered-kv model tiny`` does. Everything runs on this one
thread, which owns MLX. The cache dir is a temp dir too, so every run starts cold. The disk keeps
entries of at least ``TIERED_KV_BLOCK_TOKENS`` (256) tokens, hence the long system prompt.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import tiered_kv


def complete(cache: tiered_kv.TieredCache, model, ids: list[int], max_tokens: int = 8):
    """Greedy completion of ``ids`` through the cache: (new ids, what the cache served)."""
    lease = cache.fetch(ids)  # lease.caches hold ids[:lease.hit.tokens]; lease.remaining is the rest
    out: list[int] = []
    steps = generate_step(mx.array(lease.remaining), model, prompt_cache=lease.caches,
                          max_tokens=max_tokens)  # fmt: skip
    for token, _ in steps:
        out.append(int(token))
    cache.store(lease, ids + out)  # the ids the caches now hold: generate_step fed each it yielded
    return out, lease.hit


def open_cache(model, model_dir: Path, cache_dir: Path) -> tiered_kv.TieredCache:
    config = tiered_kv.Config.from_env(cache_dir=cache_dir)  # TIERED_KV_* apply, then this dir
    identity = tiered_kv.model_identity(model_dir)  # config, weights and tokenizer: the cache key
    return tiered_kv.open_cache(config, identity, lambda: make_prompt_cache(model))


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="tiered-kv-example-") as tmp:
        if argv:
            model_dir = Path(argv[0])
        else:
            from engine.models import tiny  # the project's tiny test model, built offline

            model_dir = tiny.build(Path(tmp) / "tiny-test", size="test")
        model, tokenizer = load(str(model_dir))
        system = "You are a careful assistant. Answer in one short sentence. " * 40
        turn1 = tokenizer.encode(system + "What is a prompt cache?")

        cache = open_cache(model, model_dir, Path(tmp) / "kv")
        reply1, hit = complete(cache, model, turn1)
        print(f"call 1: cached {hit.tokens} of {len(turn1)} prompt tokens (tier {hit.tier})")
        turn2 = turn1 + reply1 + tokenizer.encode(" And why keep it on disk?")
        reply2, hit = complete(cache, model, turn2)
        print(f"call 2: cached {hit.tokens} of {len(turn2)} prompt tokens (tier {hit.tier})")
        cache.close()  # a restart: what memory held is written to disk

        cache = open_cache(model, model_dir, Path(tmp) / "kv")
        turn3 = turn2 + reply2 + tokenizer.encode(" Thanks.")
        _, hit = complete(cache, model, turn3)
        print(f"call 3 (after a restart): cached {hit.tokens} of {len(turn3)} prompt tokens "
              f"(tier {hit.tier})")  # fmt: skip
        cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
