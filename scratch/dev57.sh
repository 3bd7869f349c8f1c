export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 120 python3 -m engine.cli model tiny /tmp/models/gemma3-1b --size gemma3-1b 2>&1 | tail -1
timeout 100 python3 scratch/gemma_decode.py check /tmp/models/tiny-1b 1b 2>&1 | grep -v " INFO " | tail -3
for v in new old33 new old33; do
  d=.; [ $v = old33 ] && d=scratch/old33
  echo "== $v"; (cd $d && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m bench.decode_loop --model /tmp/models/tiny-1b --context 8192 --tokens 512 --rounds 3 2>&1 | grep "^| [ge]" | head -2)
done
timeout 150 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v " INFO " | tail -14
