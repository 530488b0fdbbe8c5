#!/usr/bin/env bash
# nccl-safe-candle's and examples/candle_ddp's `cuda` feature (candle's CudaStorage reduced
# in place, DDP's buckets on a communication stream ordered against candle's by events) on
# a machine without a GPU or a CUDA toolkit:
# - installs nvcc and the CUDA 13.0 headers from PyPI's wheels into a cache
#   (scripts/cuda-wheels.sh), which candle's kernels need to build (about 10 minutes on 2
#   cores);
# - builds nccl-safe-candle's tests and bench, linked against nccl-safe's fake CUDA driver
#   as libcuda.so and against stubs for cuBLAS, cuBLASLt, cuRAND, NVRTC and the CUDA
#   runtime (tests/fakes/cuda_libs.c: what candle's device set-up calls works; every other
#   entry point gets a weak definition here that fails);
# - runs DDP's CUDA path on a CPU with them (nccl-safe-candle's tests/fake_cuda.rs), under
#   the fake driver's stream-order model;
# - builds examples/candle_ddp (its dependencies are the units built for the tests: the same
#   lockfile, profile and features).
# Its target folder is scripts/candle.sh's ($CARGO_TARGET_DIR/candle): candle's CUDA kernels
# are built by nvcc once (for CUDA_COMPUTE_CAP only, default 80), and what the `cuda` feature
# does not change is shared with the CPU builds. CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
cuda="$(scripts/cuda-wheels.sh)"
export PATH="$cuda/bin:$PATH" CUDA_ROOT="$cuda" CUDA_PATH="$cuda"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
# candle-kernels' build script (cudaforge) runs nvcc on half the cores by default: one of 2,
# for ~10 minutes, while candle-core waits on it and the other core has little else left to
# build. All of them. (Not part of its fingerprint: changing it rebuilds nothing.)
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
export NVCC_PREPEND_FLAGS="-I$cuda/include -I$cuda/include/cccl"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}/candle"
nvcc --version | tail -n 2

# The fake CUDA libraries the tests link against.
fake="$CARGO_TARGET_DIR/fake-cuda-libs"
mkdir -p "$fake"
cudarc=$(cd nccl-safe-candle && cargo metadata --format-version 1 | python3 -c '
import json, os, sys
print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"]
           if p["name"] == "cudarc"))')
weak='s/.*/__attribute__((weak)) int &(void) { return 801; }/'
# A weak, failing definition of every entry point of cudarc's bindings of the libraries
# named (not of their loader's helpers).
stubs() {
  for lib in "$@"; do
    sed -n 's/^pub unsafe fn \([A-Za-z0-9_]*\)(.*/\1/p' "$cudarc/src/$lib/sys/mod.rs"
  done | grep -vx -e culib -e is_culib_present | sort -u | sed "$weak"
}
stubs driver > "$fake/driver-stubs.c"
stubs cublas cublaslt curand nvrtc > "$fake/library-stubs.c"
# candle's kernel library (`moe`) calls the CUDA runtime: the same for each function the
# runtime of the wheel exports.
nm -D --defined-only "$cuda/lib/libcudart.so.13" | awk '{print $3}' | sed 's/@.*//' |
  grep '^_*cuda' | sort -u | sed "$weak" > "$fake/runtime-stubs.c"
cc=${CC:-cc}
$cc -shared -fPIC -O2 -pthread -Wl,-soname,libcuda.so -o "$fake/libcuda.so" \
  tests/support/fakes/cuda.c "$fake/driver-stubs.c"
for lib in cublas cublasLt curand nvrtc; do
  $cc -shared -fPIC -O2 -Wl,-soname,"lib$lib.so" -o "$fake/lib$lib.so" \
    nccl-safe-candle/tests/fakes/cuda_libs.c "$fake/library-stubs.c"
done
$cc -shared -fPIC -O2 -Wl,-soname,libcudart.so -o "$fake/libcudart.so" "$fake/runtime-stubs.c"

# Builds every target (LIBRARY_PATH: linked against the fakes), then runs the fake-driver
# tests (LD_LIBRARY_PATH: loading them), one at a time: the model's gauges are
# process-wide.
(
  cd nccl-safe-candle
  LIBRARY_PATH="$fake" cargo test --all-targets --features cuda --no-run
  LIBRARY_PATH="$fake" LD_LIBRARY_PATH="$fake" \
    cargo test --features cuda --test fake_cuda -- --ignored --test-threads=1
)
# A build, not a check: a check would compile every dependency again in check mode, where
# the build reuses the ones just built (and links, against the fakes).
(cd examples/candle_ddp && LIBRARY_PATH="$fake" cargo build --features cuda)
