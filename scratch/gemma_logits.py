"""Engine vs generate_step on gemma3-1b bf16: first-token logits and greedy tokens."""
import sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from bench import step_shapes
from engine.events import SamplingParams
from engine.generate import Engine
from tiered_kv import Config

model_dir, ctx, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
engine = Engine(model_dir, Config(tiers=(), warmup="off"))
engine.tokenizer.eos_token_ids = []
ids = step_shapes.prompt(ctx, 7)
print("eos in prompt:", sum(1 for t in ids if t == 2), "prefill chunk", engine.config.prefill_chunk)
got = [c.token for c in engine.generate(ids, SamplingParams(max_tokens=n)) if c.token is not None]
cache = make_prompt_cache(engine.model)
want = [int(t) for t, _ in generate_step(mx.array(ids), engine.model, max_tokens=n, prompt_cache=cache)]
print("engine  ", got)
print("gen_step", want)
# logits of the whole prompt in one forward vs generate_step's chunks
full = engine.model(mx.array(ids)[None])[0, -1].astype(mx.float32)
top = mx.argsort(-full)[:3].tolist()
print("one-forward top3", top, [round(float(full[i]), 3) for i in top])
