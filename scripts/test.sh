#!/usr/bin/env bash
# The one command that sets up and runs every test of nccl-safe:
#   1. fetches NVIDIA's libnccl.so.2 (nvidia-nccl-cu12 2.32.3 and 2.18.3, the oldest
#      supported) from PyPI into a cache, once;
#   2. builds NCCL's host code from source (third_party/nccl, scripts/build-nccl.sh: the
#      CUDA runtime's headers from PyPI, about 3 minutes on 2 cores per tag), once;
#   3. runs the whole workspace's tests (host provider, safe layer, launcher, examples)
#      with the real-library tests pointed at those caches;
#   4. runs nccl-safe-candle's tests (its own workspace: scripts/candle.sh test).
# No GPU and no CUDA toolkit are needed. Extra arguments go to the workspace's `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
NCCL_SAFE_TEST_NCCL_DIR="$(scripts/fetch-nccl.sh | tail -n 1)"
export NCCL_SAFE_TEST_NCCL_DIR
echo "real NCCL for tests: $NCCL_SAFE_TEST_NCCL_DIR"
NCCL_SAFE_SOURCE_NCCL="$(scripts/build-nccl.sh | paste -sd:)"
export NCCL_SAFE_SOURCE_NCCL
echo "NCCL built from source for tests: $NCCL_SAFE_SOURCE_NCCL"
cargo test --workspace "$@"
scripts/candle.sh test
