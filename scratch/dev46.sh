python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 250 python3 scratch/gbatch.py /tmp/models/tiny-8b 8000 600 2 2>&1 | grep -v Warn
timeout 200 python3 scratch/gbatch.py /tmp/models/tiny-1b 8000 600 2 2>&1 | grep -v Warn
