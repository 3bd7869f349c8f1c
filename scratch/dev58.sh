export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 -m engine.cli model tiny /tmp/models/gemma3-1b --size gemma3-1b 2>&1 | tail -1
timeout 90 python3 scratch/gemma_chunks.py /tmp/models/gemma3-1b 2>&1 | grep -v " INFO " | tail -6
timeout 60 python3 scratch/gemma_decode.py check /tmp/models/tiny-1b 1b 2>&1 | grep -v " INFO " | tail -2
