"""Hot hit through Engine.generate with max_tokens 64: first chunk, first text, usage ttft; + tokenize cost."""
import sys, time, os
from pathlib import Path
from engine.generate import Engine, SamplingParams
from engine.smoke import long_prefix
from tiered_kv import Config
eng = Engine(Path(sys.argv[1]), Config(tiers=("hot",)))
print("cudnn env", os.environ.get("MLX_CUDA_USE_CUDNN_SDPA"), "warm-up", round(eng.warm_up(), 3))
text = long_prefix(6000)
t = time.perf_counter(); ids = eng.encode_text(text); print("tokenize", len(ids), round((time.perf_counter() - t) * 1e3, 1), "ms")
def run(ids, label):
    t0 = time.perf_counter(); first = ftext = None; n = 0; usage = None
    for ch in eng.generate(ids, SamplingParams(max_tokens=64)):
        now = time.perf_counter() - t0
        if first is None: first = now
        if ftext is None and ch.text: ftext = now
        n += 1
        if ch.usage: usage = ch.usage
    tot = time.perf_counter() - t0
    print(f"{label}: first chunk {first*1e3:.0f} ms, first text {ftext*1e3 if ftext else -1:.0f} ms, usage ttft {usage.ttft_seconds*1e3:.0f} ms, "
          f"cached {usage.cached_tokens}, total {tot*1e3:.0f} ms, decode {usage.completion_tokens / max(usage.decode_seconds, 1e-9):.0f} tok/s", flush=True)
run(ids, "cold")
for k in range(4):
    ids = ids + eng.encode_text(f" more words {k} here")
    run(ids, f"hot {k}")
