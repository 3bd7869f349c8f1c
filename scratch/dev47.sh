python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
for m in tiny-8b tiny-1b; do for c in 8192 32768; do
timeout 170 python3 -m bench.decode_loop --model /tmp/models/$m --context $c --tokens 512 --rounds 3 2>&1 | grep -v Warn
done; done
timeout 150 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v httpx | tail -14
