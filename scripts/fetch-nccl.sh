#!/usr/bin/env bash
# Fetches NVIDIA's NCCL from the nvidia-nccl-cu12 wheels on PyPI into a cache, once:
#   $NCCL_SAFE_CACHE/<version>/nvidia/nccl/{lib/libnccl.so.2,include/nccl.h}
# (default cache: ~/.cache/nccl-safe). The library loads without a GPU, which is all the
# real-NCCL tests need. Prints the cache folder on its last line.
set -euo pipefail
cache="${NCCL_SAFE_CACHE:-$HOME/.cache/nccl-safe}"
versions="${NCCL_SAFE_TEST_VERSIONS:-2.32.3 2.18.3}"
mkdir -p "$cache"
py="$(command -v python3 || command -v python)"
for v in $versions; do
  lib="$cache/$v/nvidia/nccl/lib/libnccl.so.2"
  [ -f "$lib" ] && continue
  tmp="$(mktemp -d)"
  echo "fetching nvidia-nccl-cu12==$v from PyPI ..." >&2
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "nvidia-nccl-cu12==$v" >&2
  "$py" - "$tmp" "$cache/$v" <<'PY'
import glob, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
whl = glob.glob(src + "/*.whl")[0]
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name in ("nvidia/nccl/lib/libnccl.so.2", "nvidia/nccl/include/nccl.h"):
            z.extract(name, dst)
PY
  rm -rf "$tmp"
  [ -f "$lib" ] || { echo "fetch-nccl: $lib missing after extracting the wheel" >&2; exit 1; }
done
echo "$cache"
