git log --oneline -1 2>/dev/null
timeout 400 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 8192,32768 --repeats 5 --dir /tmp/r8 2>&1 | grep --line-buffered -v "^INFO\|HTTP\|restore plan"
