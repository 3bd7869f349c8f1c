"""On the GPU: the decode batch's logits processors and log-probabilities against mlx-lm's generate_step."""
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from engine.batch import BatchLoop
from engine.events import SamplingParams
from tests.engine.batching import PROMPTS, ModelEngine, Sink, run_until
from tests.fixtures import make_llama
from tiered_kv.config import Config

print("device", mx.default_device())
model = make_llama(seed=4)
engine = ModelEngine(model, Config(tiers=()))
pen = SamplingParams(max_tokens=12, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.5, frequency_context_size=8, logprobs=3)
sinks = [Sink() for _ in range(3)]
loop = BatchLoop(engine)
loop.add(sinks[0], PROMPTS[0], pen)
loop.add(sinks[1], PROMPTS[1], SamplingParams(max_tokens=6, logit_bias=((7, 100.0),)))
loop.add(sinks[2], PROMPTS[2], SamplingParams(max_tokens=12))
run_until(loop, lambda: all(s.done for s in sinks))

def ref(prompt, n, **kw):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=make_prompt_cache(model),
                          logits_processors=make_logits_processors(**kw))
    return [(int(t), lp) for t, lp in steps]

want = ref(PROMPTS[0], 12, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.5, frequency_context_size=8)
got = [c.logprob for c in sinks[0].chunks if c.token is not None]
print("penalised same tokens:", sinks[0].ids == [t for t, _ in want])
print("max |logprob diff|:", max(abs(g.logprob - lp[t].item()) for g, (t, lp) in zip(got, want)))
print("biased all 7:", sinks[1].ids == [7] * 6)
print("plain row unchanged:", sinks[2].ids == [t for t, _ in ref(PROMPTS[2], 12)])
