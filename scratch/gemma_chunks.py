"""gemma3-1b bf16 on this device: does the prefill's chunking alone change greedy tokens?"""
import sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm import load
from bench import step_shapes

model, tok = load(sys.argv[1])
for ctx in (600, 3000):
    ids = step_shapes.prompt(ctx, 7)
    runs = {}
    for step in (2048, 1024, 512):
        cache = make_prompt_cache(model)
        out = []
        for t, lp in generate_step(mx.array(ids), model, max_tokens=16, prompt_cache=cache, prefill_step_size=step):
            if not out:
                top = mx.argsort(-lp)[:2].tolist()
                gap = float(lp[top[0]] - lp[top[1]])
            out.append(int(t))
        runs[step] = out
        print(f"ctx {ctx} prefill step {step}: first-token top-2 gap {gap:.4f}; tokens {out}", flush=True)
