#!/usr/bin/env bash
# What to run on a GPU (CUDA or Metal) before calling a change done there; CI has no GPU. On a lent CUDA
# machine the HTTP tests and the smoke also need scripts/device_wheels.sh's wheels installed there.
#
#   bash scripts/gpu_check.sh smoke    # a random 1B-shaped bf16 model: the server end to end (hot, disk, restart)
#   bash scripts/gpu_check.sh tests    # the tests whose paths differ on a GPU (loads, uploads, restores, batching,
#                                      # structured output's masks)
#   bash scripts/gpu_check.sh bench    # bench.tails 8B 8k, bench.restore 1B 8k and 8B 8k / 32k (the issues' figures)
#   bash scripts/gpu_check.sh          # all three, in that order
#
# Each part stays under ten minutes on an H100 / H200. Models are built locally (engine.models.tiny,
# random weights) under $MODELS (default /tmp/models); nothing is downloaded. PY: the Python to use.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
MODELS=${MODELS:-/tmp/models}
SCRATCH=${SCRATCH:-/tmp/tkv-gpu-check}
mkdir -p "$MODELS" "$SCRATCH"
"$PY" -c 'import mlx.core as mx; print("device:", mx.default_device())'

model() {  # model NAME SIZE: build the random model once
  [ -d "$MODELS/$1" ] || "$PY" -m engine.cli model tiny "$MODELS/$1" --size "$2" | tail -1
}

smoke() {
  model tiny-1b 1b
  timeout 300 "$PY" -m engine.cli smoke "$MODELS/tiny-1b" --prefix-words 6000 --max-tokens 64 --no-peer
}

tests() {
  timeout 540 "$PY" -m pytest -q -rfE -p no:cacheprovider -m "not slow" \
    tests/tiered_kv/restore tests/tiered_kv/cold/test_codec.py tests/tiered_kv/cold/test_gpu.py \
    tests/tiered_kv/cold/test_ranged.py tests/tiered_kv/cold/test_landing.py tests/tiered_kv/cold/test_tier.py \
    tests/tiered_kv/cold/test_loads.py \
    tests/tiered_kv/test_background.py tests/tiered_kv/test_tiered.py tests/tiered_kv/test_finding.py \
    tests/tiered_kv/test_cache_types.py \
    tests/engine/test_restore.py tests/engine/test_prefill.py tests/engine/test_leasing.py \
    tests/engine/test_batch.py tests/engine/test_worker.py tests/engine/test_metrics.py \
    tests/engine/test_structured.py tests/engine/test_harmony.py
}

bench() {
  timeout 120 "$PY" -m bench.tails --shape 8b --tokens 8192 --reps 3 --dir "$SCRATCH"
  timeout 150 "$PY" -m bench.restore --size 1b --models-dir "$MODELS" --tokens 8192 --repeats 5 --dir "$SCRATCH/r1"
  rm -rf "$SCRATCH/r1"
  timeout 300 "$PY" -m bench.restore --size 8b --models-dir "$MODELS" --tokens 8192,32768 --repeats 3 \
    --dir "$SCRATCH/r8"
  rm -rf "$SCRATCH/r8"
}

status=0
for part in "${@:-smoke tests bench}"; do
  for p in $part; do
    echo "== $p"
    case "$p" in
      smoke | tests | bench) "$p" || status=$? ;;
      *) echo "unknown part: $p (smoke | tests | bench)" >&2; exit 2 ;;
    esac
  done
done
exit "$status"
