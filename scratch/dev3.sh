set -x
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
git log --oneline -1 2>/dev/null
timeout 280 python3 -m bench.sizes --shape 8b --tokens 8192,32768,131072 --dir /tmp/sz --json $OUT/sizes8b.json 2>&1 | grep --line-buffered -v "INFO\|^\s*$"
rm -rf /tmp/sz
timeout 80 python3 -m bench.write_pass --gb 1,4 --reps 2 --dir /tmp/wp 2>&1 | grep --line-buffered -v "INFO\|^\s*$"
rm -rf /tmp/wp
