set -x
timeout 280 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 8192,32768 --repeats 3 --dir /tmp/r8 2>&1 | grep --line-buffered "^|\|restore plan both"
rm -rf /tmp/r8
