set -x
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/tiered_kv/cold/test_gpu.py tests/tiered_kv/cold/test_ranged.py tests/tiered_kv/cold/test_codec.py tests/tiered_kv/cold/test_landing.py tests/tiered_kv/restore 2>&1 | grep -v "^\s*$" | tail -8
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -2
timeout 200 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | tail -14
timeout 240 python3 -m bench.restore --size 1b --models-dir /tmp/models --tokens 8192,32768 --repeats 3 --dir /tmp/r1 2>&1 | grep "^|"
