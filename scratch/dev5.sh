set -x
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 420 python3 scratch/head2.py /tmp/models 8b 2>&1 | grep --line-buffered -v "^INFO\|HTTP"
