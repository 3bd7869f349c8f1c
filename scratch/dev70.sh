mkdir -p /tmp/models $OUT
git log --oneline -1 2>/dev/null
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 120 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v httpx | tail -12
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider -m "not slow" tests/tiered_kv/test_cache_types.py tests/tiered_kv/test_tiered.py tests/tiered_kv/test_checkpoints.py tests/tiered_kv/test_layers.py tests/tiered_kv/cold/test_verify.py tests/tiered_kv/test_opening.py tests/tiered_kv/test_identity.py tests/engine/test_output.py tests/engine/test_detok.py tests/engine/test_messages.py tests/engine/test_api.py > $OUT/p4.txt 2>&1; echo rc=$?
grep -E "FAILED|ERROR|passed|failed" $OUT/p4.txt | tail -20
