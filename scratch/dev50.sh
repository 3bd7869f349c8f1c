python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 170 python3 -m bench.decode_loop --model /tmp/models/tiny-8b --context 32768 --tokens 512 --rounds 3 2>&1 | grep -v Warn
timeout 120 python3 -m bench.decode_loop --model /tmp/models/tiny-8b --context 8192 --tokens 512 --rounds 3 2>&1 | grep -v Warn
timeout 100 python3 -m bench.decode_loop --model /tmp/models/tiny-1b --context 32768 --tokens 512 --rounds 3 2>&1 | grep -v Warn
timeout 60 python3 scratch/misal.py /tmp/models/tiny-8b 32768 2>&1 | grep -v Warn
timeout 150 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v httpx | tail -14
