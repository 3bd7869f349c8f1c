mkdir -p $OUT
python3 -m pip list 2>/dev/null | grep -i "^pytest "
timeout 100 python3 -m pytest -v -rfE -p no:cacheprovider -m "not slow" tests/engine/models tests/engine/test_api.py > $OUT/p1.txt 2>&1; echo rc=$?
grep -E "FAIL|ERROR|passed|failed" $OUT/p1.txt | tail -15
grep -B5 -A60 "^=* FAILURES" $OUT/p1.txt | head -120
timeout 250 python3 -m pytest -v -rfE -p no:cacheprovider -m "not slow" tests/reliability/test_memory_bomb.py tests/reliability/test_security.py tests/reliability/test_server_crash.py tests/reliability/test_shared_dir.py tests/reliability/test_shared_redis.py > $OUT/p2.txt 2>&1; echo rc=$?
grep -E "FAIL|ERROR|passed|failed|SKIP" $OUT/p2.txt | tail -30
