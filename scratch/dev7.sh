set -x
timeout 280 python3 -m bench.sizes --shape 8b --tokens 8192,32768,131072 --dir /tmp/sz --json $OUT/sizes8b.json 2>&1 | grep --line-buffered -v "INFO\|^\s*$"
rm -rf /tmp/sz
python3 -m engine.cli model tiny /tmp/models/1b --size 1b 2>&1 | tail -1
timeout 150 python3 -m engine.cli smoke /tmp/models/1b --prefix-words 6000 --max-tokens 64 2>&1 | grep --line-buffered -v '^\s*$' | tail -25
