"""Where a hot-hit TTFT goes on CPU: render + tokenize, cache fetch, suffix prefill.

Tiny-bench model (build it with `tiered-kv model tiny --size bench`), an ~8.4k-token chat, then the same chat
plus ~940 new tokens.  python benchmarks/ttft_breakdown.py
"""

import time
from pathlib import Path

import numpy as np

from engine.generate import Engine, SamplingParams
from tiered_kv.config import Config

d = Path.home() / ".cache/tiered-kv/models/tiny-bench"
e = Engine(d, Config(tiers=("hot",)))
rng = np.random.default_rng(0)
words = "the of and to in file error def return class import value path line test".split()
text = lambda n: " ".join(rng.choice(words, n))
msgs = [{"role": "system", "content": text(2500)}, {"role": "user", "content": text(3000)}]
t = time.perf_counter()
ids = e.encode_chat(msgs)
t_tok = time.perf_counter() - t
t = time.perf_counter()
list(e.generate(ids, SamplingParams(max_tokens=1)))
t_cold = time.perf_counter() - t
msgs2 = msgs + [{"role": "assistant", "content": text(20)}, {"role": "user", "content": text(600)}]
t = time.perf_counter()
ids2 = e.encode_chat(msgs2)
t_tok2 = time.perf_counter() - t
t = time.perf_counter()
lease = e.cache.fetch(ids2)
t_fetch = time.perf_counter() - t
fed = list(ids2[: lease.hit.tokens])
t = time.perf_counter()
e._prefill(lease, fed, None, lambda: False)
t_pre = time.perf_counter() - t
e.cache.store(lease, fed)
n_new = len(ids2) - lease.hit.tokens
print(
    f"prompt 1: {len(ids)} tokens, render+tokenize {t_tok * 1e3:.0f} ms, cold prefill {t_cold:.1f} s ({len(ids) / t_cold:.0f} tok/s)"
)
print(
    f"prompt 2: {len(ids2)} tokens, render+tokenize {t_tok2 * 1e3:.0f} ms, fetch {t_fetch * 1e3:.1f} ms (hit {lease.hit.tokens}), "
    f"suffix prefill {n_new} tokens {t_pre:.2f} s ({n_new / t_pre:.0f} tok/s)"
)
