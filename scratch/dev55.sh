export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 280 python3 -m bench.decode_loop --model /tmp/models/tiny-1b --context 8192 --tokens 256 --rounds 5 2>&1 | grep -v " INFO " | tail -8
timeout 280 python3 scratch/gemma_decode.py /tmp/models/tiny-1b 1b 8192,32768 256 5 2>&1 | grep -v " INFO " | tail -12
