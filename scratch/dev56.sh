export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
for i in 1 2; do
  echo "== new $i"; PYTHONPATH=/tmp/site:$PWD timeout 140 python3 -m bench.decode_loop --model /tmp/models/tiny-1b --context 8192 --tokens 1024 --rounds 3 2>&1 | grep "^|" | tail -3
  echo "== old33 $i"; (cd scratch/old33 && PYTHONPATH=/tmp/site:$PWD timeout 140 python3 -m bench.decode_loop --model /tmp/models/tiny-1b --context 8192 --tokens 1024 --rounds 3 2>&1 | grep "^|" | tail -3)
done
