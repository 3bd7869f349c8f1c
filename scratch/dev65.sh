set -x
mkdir -p /tmp/models
ls /tmp/models/tiny-1b >/dev/null 2>&1 || python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
timeout 200 python3 scratch/greedy_shapes.py /tmp/models/tiny-1b 8192 30000
timeout 150 python3 scratch/greedy_shapes.py /tmp/models/tiny-8b 8192
timeout 150 python3 -m bench.hot_turns --model /tmp/models/tiny-1b --context 8192 --rounds 3
