#!/usr/bin/env bash
# Installs nvcc and the CUDA 13.0 runtime's headers and libraries from PyPI's wheels into a
# cache (once per machine), and prints the folder holding their bin/, include/ and lib/.
# nvvm and crt are pinned to the same release: a newer nvvm emits PTX that 13.0's ptxas
# rejects. Used by scripts/candle-ddp-cuda-check.sh (nvcc for candle's kernels) and
# scripts/build-nccl.sh (the headers NCCL's host code includes).
set -euo pipefail
cache="${NCCL_SAFE_CUDA_WHEELS:-$HOME/.cache/nccl-safe/cuda-13.0}"
cuda="$cache/nvidia/cu13"
mkdir -p "$(dirname "$cache")"
# One install at a time (CI builds NCCL in the background while candle's step starts).
exec 9>"$cache.lock"
flock 9
if [ ! -x "$cuda/bin/nvcc" ] || [ ! -f "$cuda/include/cuda_runtime_api.h" ]; then
  python3 -m pip install -q --target "$cache" "nvidia-cuda-nvcc==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" \
    "nvidia-cuda-crt==13.0.*" >&2
fi
echo "$cuda"
