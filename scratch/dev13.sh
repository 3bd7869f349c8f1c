set -x
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 300 python3 -X faulthandler scratch/mig.py 2>&1 | tail -40; echo rc=${PIPESTATUS[0]}
