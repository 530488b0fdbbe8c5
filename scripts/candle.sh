#!/usr/bin/env bash
# nccl-safe-candle, its own workspace (like examples/candle_ddp, so candle stays out of
# nccl-safe's build and dependency tree), built in the same target folder as the example:
#   scripts/candle.sh test   its tests: 4 host-provider ranks as threads (DDP against one
#                            rank, ZeRO-1 against DDP, buckets, bad input, a failed rank),
#                            and DDP with its 4 ranks in processes against threads
#   scripts/candle.sh lint   cargo fmt --check, clippy -D warnings (benches included) and
#                            cargo doc -D warnings
# A cold build takes about 3 minutes on 2 cores (candle); its Cargo.lock pins candle, and a
# dependency nccl-safe gains later is added to it on the fly.
set -euo pipefail
cd "$(dirname "$0")/../nccl-safe-candle"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/../target}/candle"
case "${1:-}" in
  test)
    cargo test
    ;;
  lint)
    cargo fmt -- --check
    (cd ../examples/candle_ddp && cargo fmt -- --check)
    cargo clippy --all-targets -- -D warnings
    (cd ../examples/candle_ddp && cargo clippy -- -D warnings)
    RUSTDOCFLAGS=-Dwarnings cargo doc --no-deps
    ;;
  *)
    echo "usage: scripts/candle.sh test|lint" >&2
    exit 2
    ;;
esac
