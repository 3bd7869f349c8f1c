"""The logprob test's scenario on this device: |engine - generate_step| per token."""
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from engine.batch import BatchLoop
from engine.events import SamplingParams
from tiered_kv import Config
from tests.fixtures import make_llama
from tests.engine.batching import PROMPTS, Sink, ModelEngine, run_until
model = make_llama(seed=4)
engine = ModelEngine(model, Config(tiers=()))
asks, other = Sink(), Sink()
loop = BatchLoop(engine)
loop.add(asks, PROMPTS[0], SamplingParams(max_tokens=8, logprobs=3))
loop.add(other, PROMPTS[1], SamplingParams(max_tokens=8))
run_until(loop, lambda: asks.done and other.done)
steps = list(generate_step(mx.array(PROMPTS[0]), model, max_tokens=8, prompt_cache=make_prompt_cache(model)))
got = [c.logprob for c in asks.chunks if c.token is not None]
print("tokens equal", [g.token for g in got] == [int(t) for t, _ in steps])
print("diffs", [f"{abs(g.logprob - lps[int(tok)].item()):.2e}" for g, (tok, lps) in zip(got, steps)])
