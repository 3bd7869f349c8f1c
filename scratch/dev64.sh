set -x
mkdir -p /tmp/models
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 150 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | tail -25
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_shapes.py tests/engine/test_warmup.py 2>&1 | tail -4
timeout 150 python3 -m bench.restore --model /tmp/models/tiny-1b --tokens 8192 --pages warm --repeats 5 2>&1 | tail -14
