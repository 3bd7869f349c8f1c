import cProfile, pstats, sys, time
from pathlib import Path
from bench import step_shapes
from engine.events import SamplingParams
from engine.generate import Engine
from tiered_kv import Config
engine = Engine(Path(sys.argv[1]), Config(tiers=()))
engine.tokenizer.eos_token_ids = []
n = int(sys.argv[2])
def run(salt):
    u = None
    for c in engine.generate(step_shapes.prompt(256, salt), SamplingParams(max_tokens=n)):
        u = c.usage or u
    return (u.completion_tokens - 1) / u.decode_seconds
print("warm", run(1))
pr = cProfile.Profile(); pr.enable(); r = run(2); pr.disable()
print("profiled tok/s", r)
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
