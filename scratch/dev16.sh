set -x
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/tiered_kv/restore tests/tiered_kv/cold/test_ranged.py 2>&1 | grep -v "^\s*$" | tail -12
timeout 300 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 8192,32768 --repeats 3 --dir /tmp/r8 2>&1 | grep --line-buffered "^|"
rm -rf /tmp/r8
timeout 150 python3 scratch/rb.py --size 1b --models-dir /tmp/models --tokens 8192 --repeats 5 --dir /tmp/r1 2>&1 | grep --line-buffered "^|"
rm -rf /tmp/r1
python3 -m engine.cli model tiny /tmp/models/1b --size 1b 2>&1 | tail -1
timeout 100 python3 -m engine.cli smoke /tmp/models/1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep --line-buffered -v '^\s*$\|httpx' | tail -16
