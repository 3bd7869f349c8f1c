set -x
timeout 300 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 131072 --dir /tmp/r8 2>&1 | grep --line-buffered -v "^INFO\|HTTP"
mkdir -p $OUT/costs128 && find /tmp/r8 -name 'costs-*.json' -exec cp {} $OUT/costs128/ \;
rm -rf /tmp/r8
timeout 250 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 8192,32768 --dir /tmp/r8 2>&1 | grep --line-buffered -v "^INFO\|HTTP"
mkdir -p $OUT/costs32 && find /tmp/r8 -name 'costs-*.json' -exec cp {} $OUT/costs32/ \;
rm -rf /tmp/r8
