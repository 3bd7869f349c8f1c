set -x
mkdir -p /tmp/models
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 150 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v httpx | tail -16
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_decoding.py tests/engine/test_batch.py tests/engine/test_shapes.py tests/engine/test_sampler.py tests/tiered_kv/cold/test_tier.py tests/tiered_kv/cold/test_site.py 2>&1 | tail -4
timeout 150 python3 scratch/greedy_shapes.py /tmp/models/tiny-1b 8192 30000
timeout 120 python3 -m bench.hot_turns --model /tmp/models/tiny-1b --context 8192 --rounds 2
