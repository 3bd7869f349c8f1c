timeout 200 python3 scratch/tailw.py 8192 6144,4096 2>&1 | grep -v INFO
timeout 150 python3 scratch/tailw.py 32768 22528 2>&1 | grep -v INFO
