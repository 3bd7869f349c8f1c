set -x
python3 -m engine.cli model tiny /tmp/models/1b --size 1b 2>&1 | tail -1
timeout 130 python3 -m engine.cli smoke /tmp/models/1b --prefix-words 6000 --max-tokens 64 2>&1 | grep --line-buffered "^ok\|^FAIL\|^fail\||" 
timeout 220 python3 -m engine.cli bench --model /tmp/models/1b --concurrency 1,2,4,8 --turns 2 --scale 0.5 --max-tokens 32 --decode-tokens 128 --repeats 3 --out $OUT/conc-1b 2>&1 | grep --line-buffered -v "INFO\|^\s*$\|Row(" | tail -24
timeout 150 python3 scratch/rb.py --size 1b --models-dir /tmp/models --tokens 8192,32768,65536 --dir /tmp/r1 2>&1 | grep --line-buffered "^|"
