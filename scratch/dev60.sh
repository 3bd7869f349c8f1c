export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 scratch/lp_probe.py 2>&1 | tail -3
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_decoding.py tests/engine/test_batch.py 2>&1 | tail -6
