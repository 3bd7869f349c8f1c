mkdir -p $OUT
git log --oneline -1 2>/dev/null
timeout 400 python3 -m pytest -v -rfE -p no:cacheprovider -m "not slow" tests/tiered_kv --ignore=tests/tiered_kv/shared > $OUT/p3.txt 2>&1; echo rc=$?
grep -E "FAILED|ERROR|passed|failed" $OUT/p3.txt | tail -20
grep -c PASSED $OUT/p3.txt
