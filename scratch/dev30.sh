timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/tiered_kv/cold/test_gpu.py tests/tiered_kv/cold/test_ranged.py tests/tiered_kv/restore 2>&1 | grep -v "^\s*$" | tail -3
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 200 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v httpx | tail -22
