#!/usr/bin/env bash
# Type-checks nccl-safe-candle (its tests and bench included) and examples/candle_ddp with
# their `cuda` feature (candle's CudaStorage reduced in place, DDP's buckets on a
# communication stream ordered against candle's by events) on a machine without a CUDA
# toolkit: installs nvcc and the
# CUDA 13.0 headers from PyPI's wheels into a cache (nvvm and crt pinned to the same release:
# a newer nvvm emits PTX that 13.0's ptxas rejects), then runs `cargo check --features
# cuda`. CI runs it: candle's CUDA kernels take about 10 minutes on 2 cores. Building a
# binary also needs libcuda, cublas, cublasLt, curand and nvrtc (a CUDA toolkit has them).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
cache="${NCCL_SAFE_CUDA_WHEELS:-$HOME/.cache/nccl-safe/cuda-13.0}"
cuda="$cache/nvidia/cu13"
if [ ! -x "$cuda/bin/nvcc" ]; then
  python3 -m pip install -q --target "$cache" "nvidia-cuda-nvcc==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" \
    "nvidia-cuda-crt==13.0.*"
fi
export PATH="$cuda/bin:$PATH" CUDA_ROOT="$cuda" CUDA_PATH="$cuda"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
export NVCC_PREPEND_FLAGS="-I$cuda/include -I$cuda/include/cccl"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}/candle-ddp-cuda"
nvcc --version | tail -n 2
(cd nccl-safe-candle && cargo check --all-targets --features cuda)
cd examples/candle_ddp
cargo check --features cuda
