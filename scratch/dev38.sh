set -x
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/tiered_kv/cold/test_gpu.py tests/tiered_kv/restore 2>&1 | tail -1
timeout 200 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v httpx | tail -6
timeout 250 python3 -m bench.restore --size 1b --models-dir /tmp/models --tokens 8192 --pages warm --repeats 5 --dir /tmp/r1 2>&1 | grep -v Warn | tail -8
