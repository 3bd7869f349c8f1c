import cProfile, pstats, sys, time
from pathlib import Path
import numpy as np
from bench.restore import Bench, set_pages, SUFFIX
from engine.models import tiny
t = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
size = sys.argv[2] if len(sys.argv) > 2 else "bench"
md = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/tkv-models") / f"tiny-{size}"
if not (md / "config.json").exists():
    tiny.build(md, size=size)
b = Bench(md, Path("/tmp/prof-root"), 0)
rng = np.random.default_rng(t)
ids = rng.integers(3, b.vocab, t).tolist()
prompt = ids + rng.integers(3, b.vocab, SUFFIX).tolist()
if not (Path("/tmp/prof-root") / f"t{t}").exists():
    b.setup(t, ids)
import gc, mlx.core as mx
for i in range(4):
    gc.collect(); mx.clear_cache()
    set_pages(Path("/tmp/prof-root") / f"t{t}", "warm")
    tc = b.open(t, "load")
    t0 = time.perf_counter(); lease = tc.fetch(prompt); t1 = time.perf_counter()
    ph = tc.restorer.last_phases
    print("fetch", round(t1 - t0, 4), "hit", lease.hit.tokens, "load_s", round(lease.hit.load_seconds, 4), "bytes", lease.hit.load_bytes)
    tc.hot.entries.clear(); tc.cold.close(); tc.restorer.close()
set_pages(Path("/tmp/prof-root") / f"t{t}", "warm")
tc = b.open(t, "load")
pr = cProfile.Profile(); pr.enable(); lease = tc.fetch(prompt); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
