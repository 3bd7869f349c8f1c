python3 scratch/decode.py /tmp/models/tiny-1b 8000 2>&1 | grep -v Warn
MLX_CUDA_USE_CUDNN_SDPA=0 python3 scratch/decode.py /tmp/models/tiny-1b 8000 2>&1 | grep -v Warn
MLX_CUDA_USE_CUDNN_SDPA=0 python3 scratch/hothit.py /tmp/models/tiny-1b 2>&1 | grep -v Warn | grep -E "hot|cold|mlx-lm"
