"""In-process: our Engine's hot-hit TTFT per bench turn vs mlx-lm's prompt cache + generate_step."""
import time, sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache, can_trim_prompt_cache
from engine.generate import Engine, SamplingParams
from tiered_kv import Config
from bench.session import build_session

chunk = int(sys.argv[1]) if len(sys.argv) > 1 else 0
engine = Engine(Path.home() / ".cache/tiered-kv/models/tiny-bench", Config(tiers=("hot",), prefill_chunk=chunk))
model = engine.model
sess = build_session(6, 0, 1, 0.25)
reqs = [r for r in sess.requests() if r.turn >= 1]
prompts = [engine.encode_chat(r.body["messages"], r.body["tools"]) for r in reqs]
pc, prev = None, []
for i, ids in enumerate(prompts):
    t0 = time.perf_counter()
    list(engine.generate(ids, SamplingParams(max_tokens=1)))
    ours = time.perf_counter() - t0
    # mlx-lm: common prefix with the cached prompt
    t0 = time.perf_counter()
    if pc is None:
        pc = make_prompt_cache(model); n = 0
    else:
        n = 0
        while n < min(len(prev), len(ids)) - 1 and prev[n] == ids[n]:
            n += 1
        trim_prompt_cache(pc, len(prev) - n)
    rest = ids[n:]
    for tok, _ in generate_step(mx.array(rest), model, max_tokens=1, prompt_cache=pc, prefill_step_size=2048):
        break
    peer = time.perf_counter() - t0
    prev = list(ids[:n]) + list(rest) + [int(tok)]
    hot = engine.cache.hot if hasattr(engine.cache, 'hot') else None
    info = ""
    if hot is not None:
        info = f"hot entries {len(hot.entries)} bytes {sum(e.nbytes for e in hot.entries.values())/2**20:.0f} MiB"
    print(f"turn {i+1}: {len(ids)} tok, suffix {len(rest)}: ours {ours*1e3:.0f} ms, mlx-lm {peer*1e3:.0f} ms  {info}", flush=True)
