timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/tiered_kv/cold/test_gpu.py tests/tiered_kv/cold/test_ranged.py 2>&1 | grep -v "^\s*$" | tail -3
