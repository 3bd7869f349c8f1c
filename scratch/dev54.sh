export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 120 python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/test_decoding.py 2>&1 | tail -3
timeout 200 python3 scratch/gemma_decode.py /tmp/models/tiny-1b 1b 8192,32768 256 3 2>&1 | grep -v " INFO " | tail -12
timeout 240 python3 scratch/gemma_decode.py /tmp/models/tiny-1b 4b 8192,32768 256 3 2>&1 | grep -v " INFO " | tail -12
