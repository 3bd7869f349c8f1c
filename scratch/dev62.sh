mkdir -p /tmp/models
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 120 python3 -m bench.hot_turns --model /tmp/models/tiny-1b --context 8192
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/engine/test_shapes.py tests/engine/test_warmup.py 2>&1 | tail -3
timeout 120 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | tail -12
python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
timeout 150 python3 -m bench.hot_turns --model /tmp/models/tiny-8b --context 8192
