set -x
timeout 260 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 8192,32768 --dir /tmp/r8 2>&1 | grep --line-buffered "^|"
rm -rf /tmp/r8
timeout 100 python3 scratch/rb.py --size 1b --models-dir /tmp/models --tokens 8192,32768 --dir /tmp/r1 2>&1 | grep --line-buffered "^|"
rm -rf /tmp/r1
