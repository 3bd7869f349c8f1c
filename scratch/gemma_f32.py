"""Engine vs generate_step on a gemma3-shaped model: first-token log-probs and greedy tokens, per context."""
import sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from bench import step_shapes
from engine.events import SamplingParams
from engine.generate import Engine
from tiered_kv import Config

model_dir, n = Path(sys.argv[1]), int(sys.argv[2])
ctxs = [int(x) for x in sys.argv[3].split(",")]
engine = Engine(model_dir, Config(tiers=(), warmup="off"))
engine.tokenizer.eos_token_ids = []
for ctx in ctxs:
    ids = step_shapes.prompt(ctx, 7)
    chunks = [c for c in engine.generate(ids, SamplingParams(max_tokens=n, logprobs=5)) if c.token is not None]
    got = [c.token for c in chunks]
    cache = make_prompt_cache(engine.model)
    want, lps = [], []
    for t, lp in generate_step(mx.array(ids), engine.model, max_tokens=n, prompt_cache=cache):
        want.append(int(t)); lps.append(lp)
    diffs = []
    for c, lp in zip(chunks, lps):
        for tok, v in c.logprob.top:
            diffs.append(abs(v - float(lp[tok])))
    gap = sorted(lps[0].tolist(), reverse=True)
    print(f"ctx {ctx}: equal {sum(a == b for a, b in zip(got, want))}/{n}, first diverge "
          f"{next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)}, "
          f"max |logprob diff| over top-5 while equal {max(diffs[:5*next((i for i,(a,b) in enumerate(zip(got,want)) if a!=b), n)] or [0]):.2e}, "
          f"first-token top-2 gap {gap[0]-gap[1]:.4f}", flush=True)
