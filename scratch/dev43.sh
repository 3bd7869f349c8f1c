python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
rm -rf /tmp/dh; timeout 100 python3 scratch/diskhit.py /tmp/models/tiny-1b /tmp/dh A 2>&1 | grep -v Warn
timeout 100 python3 scratch/diskhit.py /tmp/models/tiny-1b /tmp/dh B 2>&1 | grep -v Warn
