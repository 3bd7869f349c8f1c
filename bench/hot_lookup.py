"""Hot-tier lookup time: longest servable prefix over many long entries (no model needed).

Entries share a system prompt (as agent sessions do) and then diverge; the prompt extends one of them.

    python -m bench.hot_lookup
"""

from __future__ import annotations

import time

import numpy as np

from tiered_kv.hot import Entry, HotTier
from tiered_kv.memory import MemoryProbe
from tiered_kv.prefix import as_tokens


def main() -> None:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 50000, 3000)
    print("| entries | tokens each | lookup ms (median of 5) |")
    print("|---:|---:|---:|")
    for count in (10, 100, 300, 1000):
        tier = HotTier(1 << 62, 1.0, lambda e: None, MemoryProbe(1 << 62))
        for _ in range(count):
            ids = as_tokens(np.concatenate([shared, rng.integers(0, 50000, 29768)]))
            tier.insert(Entry(ids, [], 0))
        target = list(tier.entries.values())[count // 2].tokens
        prompt = as_tokens(np.concatenate([target, rng.integers(0, 50000, 500)]))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            best = tier.best(prompt)
            times.append(time.perf_counter() - t0)
        assert best is not None and best[1] == len(target)
        print(f"| {count} | 32768 | {1e3 * sorted(times)[2]:.2f} |")


if __name__ == "__main__":
    main()
