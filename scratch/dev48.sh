python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
timeout 300 python3 scratch/gap32.py /tmp/models/tiny-8b 32768 300 3 2>&1 | grep -v Warn
