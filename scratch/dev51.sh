set -x
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -2
timeout 240 python3 -m engine.cli smoke /tmp/models/tiny-1b --prefix-words 6000 --max-tokens 64 --no-peer 2>&1 | grep -v " INFO " | tail -25
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_decoding.py tests/engine/test_sampler.py tests/tiered_kv/cold/test_writes.py tests/tiered_kv/cold/test_index.py tests/tiered_kv/test_policy.py 2>&1 | tail -6
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_server.py -k "sampling_fields or logprobs or no_max_tokens or template_kwargs" 2>&1 | tail -6
