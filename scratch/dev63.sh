mkdir -p /tmp/models
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 100 python3 -m bench.hot_turns --model /tmp/models/tiny-1b --context 8192
