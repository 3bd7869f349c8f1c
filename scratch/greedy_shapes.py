"""Same conversation, step shapes on vs off: greedy tokens per turn (GPU check)."""
import sys
from pathlib import Path
from bench.step_shapes import prompt as synthetic
from bench.hot_turns import NEW
from engine.events import SamplingParams
from engine.generate import Engine
from tiered_kv import Config

def convo(on, context, turns=10):
    engine = Engine(Path(sys.argv[1]), Config(tiers=("hot",), hot_bytes=64 * 1024**3))
    engine.tokenizer.eos_token_ids = []
    engine.step_shapes = on
    ids, answers, tiers = synthetic(context, 5), [], []
    try:
        for t in range(turns + 1):
            out, u = [], None
            for c in engine.generate(ids, SamplingParams(max_tokens=16)):
                u = c.usage or u
                if c.token is not None:
                    out.append(c.token)
            answers.append(out); tiers.append(u.cache_tier)
            ids = ids + out + synthetic(NEW[t % len(NEW)], 7 * t + 3)
    finally:
        engine.close()
    return answers, tiers

for context in (int(a) for a in sys.argv[2:]):
    a_on, t_on = convo(True, context)
    a_off, t_off = convo(False, context)
    same = [x == y for x, y in zip(a_on, a_off)]
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a_on, a_off)]
    print(f"context {context}: turns equal {sum(same)}/{len(same)}; first differing token per turn {first}; tiers on {t_on[1:3]} off {t_off[1:3]}", flush=True)
