"""Where a hot-hit TTFT goes on CPU: render + tokenize, cache fetch, suffix prefill.

Tiny-bench model (`tiered-kv model tiny --size bench`), an ~8.4k-token chat, then the same chat plus
~940 new tokens.

    python -m bench.ttft_breakdown
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from engine.generate import Engine, SamplingParams
from tiered_kv import Config

WORDS = "the of and to in file error def return class import value path line test".split()


def main() -> None:
    engine = Engine(Path.home() / ".cache/tiered-kv/models/tiny-bench", Config(tiers=("hot",)))
    rng = np.random.default_rng(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS, n))

    msgs = [{"role": "system", "content": text(2500)}, {"role": "user", "content": text(3000)}]
    t0 = time.perf_counter()
    ids = engine.encode_chat(msgs)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    list(engine.generate(ids, SamplingParams(max_tokens=1)))
    t_cold = time.perf_counter() - t0
    msgs += [{"role": "assistant", "content": text(20)}, {"role": "user", "content": text(600)}]
    t0 = time.perf_counter()
    ids2 = engine.encode_chat(msgs)
    t_tok2 = time.perf_counter() - t0
    t0 = time.perf_counter()
    lease = engine.cache.fetch(ids2)
    t_fetch = time.perf_counter() - t0
    fed = list(ids2[: lease.hit.tokens])
    t0 = time.perf_counter()
    for _ in engine.prefill_steps(lease, fed):  # one evaluated chunk per step
        pass
    t_pre = time.perf_counter() - t0
    engine.cache.store(lease, fed)
    new = len(ids2) - lease.hit.tokens
    print(f"prompt 1: {len(ids)} tokens, render+tokenize {t_tok * 1e3:.0f} ms, "
          f"cold prefill {t_cold:.1f} s ({len(ids) / t_cold:.0f} tok/s)")  # fmt: skip
    print(f"prompt 2: {len(ids2)} tokens, render+tokenize {t_tok2 * 1e3:.0f} ms, fetch "
          f"{t_fetch * 1e3:.1f} ms (hit {lease.hit.tokens}), suffix prefill {new} tokens "
          f"{t_pre:.2f} s ({new / t_pre:.0f} tok/s)")  # fmt: skip


if __name__ == "__main__":
    main()
