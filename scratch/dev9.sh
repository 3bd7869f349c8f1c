set -x
git log --oneline -1 2>/dev/null
timeout 120 python3 scratch/rb.py --size 1b --models-dir /tmp/models --tokens 8192 --repeats 5 --dir /tmp/r1 2>&1 | grep --line-buffered "^|"
rm -rf /tmp/r1
timeout 230 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 8192,32768 --repeats 3 --dir /tmp/r8 2>&1 | grep --line-buffered "^|"
rm -rf /tmp/r8
python3 -m engine.cli model tiny /tmp/models/1b --size 1b 2>&1 | tail -1
timeout 150 python3 -m engine.cli smoke /tmp/models/1b --prefix-words 6000 --max-tokens 64 2>&1 | grep --line-buffered -v '^\s*$\|httpx' | tail -25
