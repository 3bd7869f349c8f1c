set -x
git log --oneline -1 2>/dev/null
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/tiered_kv/restore tests/tiered_kv/cold/test_ranged.py 2>&1 | tail -8
timeout 330 python3 scratch/rb.py --size 8b --models-dir /tmp/models --tokens 8192,32768 --repeats 3 --dir /tmp/r8 2>&1 | grep --line-buffered "^|\|restore plan both"
rm -rf /tmp/r8
