set -x
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/tiered_kv/cold/test_gpu.py tests/tiered_kv/cold/test_codec.py tests/tiered_kv/cold/test_landing.py tests/tiered_kv/restore/test_restorer.py 2>&1 | grep -v "^\s*$" | tail -6
timeout 200 python3 -m bench.sizes --shape 8b --tokens 8192,32768 --dir /tmp/sz 2>&1 | grep --line-buffered -v "INFO\|^\s*$"
rm -rf /tmp/sz
python3 -m engine.cli model tiny /tmp/models/1b --size 1b 2>&1 | tail -1
timeout 150 python3 -m engine.cli smoke /tmp/models/1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep --line-buffered -v '^\s*$\|httpx' | tail -12
