#!/usr/bin/env bash
# Builds and runs examples/candle_ddp (written on nccl-safe-candle; its own workspace, so
# candle stays out of nccl-safe's build, in the same target folder as scripts/candle.sh) on
# the host provider with CPU tensors: the loss must fall and every rank must end
# with bit-identical parameters, also with 4 micro-batches per step (no_sync). Then runs it
# with a plain SGD step instead of the data-parallel one, where the drift check must fail,
# naming the line: the check can tell. A cold build takes about 2.5 minutes on
# 2 cores; the runs take seconds. Its Cargo.lock pins candle; a dependency nccl-safe gains
# later is added to it on the fly.
set -euo pipefail
cd "$(dirname "$0")/../examples/candle_ddp"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/../../target}/candle"
cargo build --quiet
bin="$CARGO_TARGET_DIR/debug/candle-ddp"
"$bin" --ranks 4 --steps 200
"$bin" --ranks 4 --steps 100 --accumulate 4
if out="$("$bin" --ranks 2 --steps 30 --no-allreduce 2>&1)"; then
  printf '%s\n' "$out"
  echo "candle-ddp: without the all-reduce the ranks must diverge, but the check passed" >&2
  exit 1
fi
grep -q "parameter drift .*src/main.rs:" <<<"$out" || {
  printf '%s\n' "$out"
  echo "candle-ddp: without the all-reduce it failed, but not on the drift check" >&2
  exit 1
}
echo "without the all-reduce: the drift check fails, as it must"
