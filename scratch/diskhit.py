"""After-restart disk hits: first vs second in a process (process B), entries written by process A."""
import sys, time, os
from pathlib import Path
from engine.generate import Engine, SamplingParams
from engine.smoke import long_prefix
from tiered_kv import Config
mdir, d, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
cfg = Config(cache_dir=d, tiers=("hot", "cold"))
t = time.perf_counter(); eng = Engine(mdir, cfg); print(phase, "engine", round(time.perf_counter() - t, 2), "warm-up", round(eng.warm_up(), 3) if phase == "B" else "-")
prompts = [eng.encode_text(long_prefix(4500, seed=s)) for s in (1, 2, 3)]
def run(ids, label):
    t0 = time.perf_counter(); first = None; usage = None
    for ch in eng.generate(ids, SamplingParams(max_tokens=8)):
        if first is None: first = time.perf_counter() - t0
        if ch.usage: usage = ch.usage
    u = usage
    print(f"{label}: first {first*1e3:.0f} ms, ttft {u.ttft_seconds*1e3:.0f}, load {u.load_seconds*1e3:.0f}, prefill {u.prefill_seconds*1e3:.0f}, "
          f"cached {u.cached_tokens} tier {u.cache_tier}", flush=True)
if phase == "A":
    for i, p in enumerate(prompts): run(p, f"A write {i}")
else:
    for i, p in enumerate(prompts): run(p + eng.encode_text(" and then some more"), f"B disk hit {i}")
eng.close()
