export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 500 python3 -m bench.decode_loop --model /tmp/models/tiny-1b --context 8192 --tokens 256 --rounds 3 2>&1 | grep -v " INFO " | tail -15
