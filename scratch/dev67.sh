set -x
mkdir -p /tmp/models $OUT
git log --oneline -1 2>/dev/null
python3 -c 'import mlx.core as mx, openai, anthropic, httpx; print(mx.default_device(), openai.__version__, anthropic.__version__)'
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 120 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v httpx | tail -16
timeout 350 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine tests/reliability > $OUT/pytest_engine.txt 2>&1; echo rc=$?
tail -40 $OUT/pytest_engine.txt
