"""generate_step against itself with other prefill steps: logprob diffs of the first tokens (chunking alone)."""
import sys
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm import load
from bench import step_shapes

model, tok = load(sys.argv[1])
ctx = int(sys.argv[2])
ids = step_shapes.prompt(ctx, 7)
runs = {}
for step in (2048, 1024, 512):
    cache = make_prompt_cache(model)
    runs[step] = [(int(t), lp) for t, lp in generate_step(mx.array(ids), model, max_tokens=4, prompt_cache=cache, prefill_step_size=step)]
    base = runs[2048]
    d = max(float(mx.max(mx.abs(a[1] - b[1]))) for a, b in zip(base, runs[step]))
    print(f"ctx {ctx} step {step}: tokens {[t for t, _ in runs[step]]} max |logprob diff| vs step 2048 over all vocab {d:.2e}", flush=True)
