python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
python3 scratch/first.py /tmp/models/tiny-1b 2>&1 | grep -v Warn
echo ---- second process
python3 scratch/first.py /tmp/models/tiny-1b 2>&1 | grep -v Warn
ls ~/.cache 2>/dev/null
