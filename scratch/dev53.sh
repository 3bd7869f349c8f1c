export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 120 python3 scratch/gpu_check.py 2>&1 | tail -8
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/tiered_kv/cold/test_writes.py tests/tiered_kv/cold/test_index.py tests/tiered_kv/test_policy.py tests/tiered_kv/cold/test_tier.py 2>&1 | tail -4
timeout 240 python3 -m bench.decode_loop --model /tmp/models/tiny-1b --context 8192 --tokens 256 --rounds 3 2>&1 | grep -v " INFO " | tail -12
