"""8B 8k warm: is a `both` head slower than the same prefill alone? (first-run shapes vs overlap)"""
import sys, time
from pathlib import Path
import mlx.core as mx
from bench.restore import Bench
from engine.generate import default_prefill_chunk
b = Bench(Path(sys.argv[1]), Path("/tmp/hd"), 0)
for m in (4255, 4096, 4255, 5597, 4096):
    ids = list(range(1, m + 1))
    t = time.perf_counter(); c = b.compute(ids); mx.eval([x.state for x in c]); dt = time.perf_counter() - t
    print(f"head alone m={m}: {dt:.3f} s", flush=True)
