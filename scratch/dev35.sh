set -x
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 150 python3 scratch/steps.py /tmp/models/tiny-1b 2>&1 | grep -v Warn
timeout 120 python3 scratch/hothit.py /tmp/models/tiny-1b 2>&1 | grep -v Warn | head -70
python3 -c "
from engine.generate import Engine; from tiered_kv import Config; from pathlib import Path
e = Engine(Path('/tmp/models/tiny-1b'), Config(tiers=('hot',))); print('warmup resolved', e.warmup, 'shared', e.share_prefill)"
timeout 200 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v httpx | tail -14
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/tiered_kv/cold/test_gpu.py tests/tiered_kv/restore 2>&1 | tail -2
