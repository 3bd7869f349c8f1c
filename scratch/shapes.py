import sys, time
from pathlib import Path
import mlx.core as mx
from bench.restore import Bench
mdir = Path(sys.argv[1]) / "tiny-8b"
if not (mdir / "config.json").exists():
    from engine.models import tiny; tiny.build(mdir, size="8b")
b = Bench(mdir, Path("/tmp/hd2"), 0)
def head(m):
    ids = [(i * 7919) % 4000 + 3 for i in range(m)]
    t = time.perf_counter(); c = b.compute(ids); mx.eval([x.state for x in c]); return time.perf_counter() - t
print("warm 8", head(8), head(8))
print("4096 (calibration)", head(4096), head(4096))
for m in (6144, 8192, 10240, 4255, 4256, 4109, 12288, 2048 + 700, 2048 + 701, 64, 65, 22528, 22541):
    print(m, "first %.3f second %.3f" % (head(m), head(m)), flush=True)
# suffix: 32 tokens after a cache of n
