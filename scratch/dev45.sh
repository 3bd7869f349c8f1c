set -x
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
timeout 150 python3 scratch/dtrace.py /tmp/models/tiny-1b 8000 1100 256,1024,4096 2>&1 | grep -v Warn
timeout 200 python3 scratch/dtrace.py /tmp/models/tiny-8b 8000 1100 256,1024,4096 2>&1 | grep -v Warn
