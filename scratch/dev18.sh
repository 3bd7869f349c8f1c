set -x
nproc; free -g | head -2
W=4 timeout 200 python3 scratch/stage.py 1 2>&1 | grep -v INFO
W=8 timeout 150 python3 scratch/stage.py 1 2>&1 | grep -v INFO | grep staged
