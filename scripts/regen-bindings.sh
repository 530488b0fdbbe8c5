#!/usr/bin/env bash
# Regenerates nccl-sys/src/bindings.rs from the pinned nccl-sys/include/nccl.h (or from
# $NCCL_INCLUDE_DIR/nccl.h when set) with bindgen. Needs libclang (Debian: libclang-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p nccl-sys --features bindgen --message-format=json \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "build-script-executed" and m["package_id"].find("nccl-sys") >= 0:
        print(m["out_dir"])' \
  | tail -n 1 > target/.nccl-sys-out-dir
cp "$(cat target/.nccl-sys-out-dir)/bindings.rs" nccl-sys/src/bindings.rs
echo "regenerated nccl-sys/src/bindings.rs"
