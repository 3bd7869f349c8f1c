set -x
mkdir -p /tmp/models
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
timeout 150 python3 scratch/bucket_probe.py /tmp/models/tiny-1b 8192 4096
timeout 200 python3 scratch/bucket_probe.py /tmp/models/tiny-8b 8192 4096
timeout 200 python3 scratch/bucket_probe.py /tmp/models/tiny-8b 32768 4096
