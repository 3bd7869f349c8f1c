set -x
python3 -m engine.cli model tiny /tmp/models/tiny-1b --size 1b 2>&1 | tail -1
timeout 90 python3 -m bench.step_shapes --model /tmp/models/tiny-1b 2>&1 | grep -v Warn
MLX_CUDA_USE_CUDNN_SDPA=0 timeout 90 python3 -m bench.step_shapes --model /tmp/models/tiny-1b 2>&1 | grep -v Warn
time python3 -m engine.cli model tiny /tmp/models/tiny-8b --size 8b 2>&1 | tail -1
timeout 120 python3 -m bench.step_shapes --model /tmp/models/tiny-8b 2>&1 | grep -v Warn
MLX_CUDA_USE_CUDNN_SDPA=0 timeout 120 python3 -m bench.step_shapes --model /tmp/models/tiny-8b 2>&1 | grep -v Warn
