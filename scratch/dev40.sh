timeout 100 python3 scratch/hot64.py /tmp/models/tiny-1b 2>&1 | grep -v Warn
MLX_CUDA_USE_CUDNN_SDPA=0 timeout 100 python3 scratch/hot64.py /tmp/models/tiny-1b 2>&1 | grep -v Warn
