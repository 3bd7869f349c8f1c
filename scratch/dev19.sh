set -x
git log --oneline -1 2>/dev/null
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/tiered_kv/cold/test_gpu.py tests/tiered_kv/cold/test_codec.py tests/tiered_kv/cold/test_ranged.py tests/tiered_kv/restore 2>&1 | grep -v "^\s*$" | tail -15
timeout 140 python3 -m bench.sizes --shape 8b --tokens 8192,32768 --dir /tmp/sz 2>&1 | grep --line-buffered -v "INFO\|^\s*$"
rm -rf /tmp/sz
timeout 170 python3 scratch/rb.py --size 1b --models-dir /tmp/models --tokens 8192,32768 --repeats 3 --dir /tmp/r1 2>&1 | grep --line-buffered -v "^INFO\|HTTP"
