set -x
git log --oneline -1 2>/dev/null
timeout 150 python3 scratch/disk.py /tmp/dk 2 2>&1
rm -rf /tmp/dk
python3 -m engine.cli model tiny /tmp/models/1b --size 1b 2>&1 | tail -1
timeout 150 python3 -m engine.cli smoke /tmp/models/1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep --line-buffered -v '^\s*$\|httpx' | tail -16
