set -x
timeout 560 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 8192,32768 --repeats 3 --dir /tmp/r8 2>&1 | grep --line-buffered -v "^INFO\|HTTP\|restore plan"
