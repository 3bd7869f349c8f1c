set -x
python3 -c 'import mlx.core as mx; print(mx.default_device())'
mkdir -p /tmp/models
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
python3 -m engine.cli model tiny /tmp/models/gemma3-1b --size gemma3-1b 2>&1 | tail -1
timeout 150 python3 -m bench.greedy_match --model /tmp/models/gemma3-1b --context 600,3000 --tokens 48 2>&1 | tail -14
timeout 150 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | tail -16
timeout 90 python3 scratch/gpu_endpoints.py /tmp/models/tiny-1b 2>&1 | tail -22
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_decoding.py 2>&1 | tail -4
