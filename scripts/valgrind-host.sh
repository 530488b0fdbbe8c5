#!/usr/bin/env bash
# Runs the host-provider test binaries, the safe layer's multi-rank and diagnostics tests
# (lock-free records, watchdog aborts), and the CUDA code path over the fake driver (cudarc
# buffers and events, the watchdog's CUDA tracker, a stalled stream, the stream-order
# model), under valgrind memcheck (errors fail the run; leaks are not checked: the provider
# keeps a small process-wide registry on purpose).
# The conformance matrix runs on world sizes 2 and 3 only (HOST_CONFORMANCE_WORLDS) to keep
# the run to a few minutes; the semantics tests run in full.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
VALGRIND="${VALGRIND:-/usr/bin/valgrind}"

mapfile -t bins < <(cargo test --no-run --message-format=json --test host_conformance --test host_semantics \
    --test safe_collectives --test diag --test cuda_path --test stream_order --test group_rule \
    --test per_thread_stream \
    | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/')
if [ "${#bins[@]}" -eq 0 ]; then
    echo "no test binaries found" >&2
    exit 1
fi

status=0
for bin in "${bins[@]}"; do
    echo "== valgrind: $bin"
    start=$(date +%s)
    if HOST_CONFORMANCE_WORLDS="${HOST_CONFORMANCE_WORLDS:-2,3}" NCCL_SAFE_HOST_TIMEOUT_MS=120000 \
        "$VALGRIND" --tool=memcheck --error-exitcode=1 --leak-check=no --quiet \
        "$bin" --test-threads=2; then
        echo "== ok ($(($(date +%s) - start)) s): $bin"
    else
        echo "== FAILED ($(($(date +%s) - start)) s): $bin"
        status=1
    fi
done
exit "$status"
