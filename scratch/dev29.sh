timeout 200 python3 scratch/prof.py 8192 8b /tmp/models 2>&1 | grep -v "^\s*$" | head -60
timeout 100 python3 scratch/prof.py 32768 8b /tmp/models 2>&1 | grep -v "^\s*$" | head -5
timeout 280 python3 -m bench.restore --size 8b --models-dir /tmp/models --tokens 8192,32768 --repeats 3 --dir /tmp/r3 2>&1 | grep "^|"
