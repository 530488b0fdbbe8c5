#!/usr/bin/env bash
# Runs N seeds of the chaos test (tests/chaos.rs, seeded_chaos_runs) in release, from seed
# FIRST (1 by default) on, with the named regression seeds; prints each violation with the
# line that replays its seed, the run's summary, and exits non-zero on a violation.
#
#   scripts/chaos.sh N [FIRST]       e.g. scripts/chaos.sh 10000 (about 20 min on two cores)
#
# A replay line runs the debug build; add --release after `cargo test` to replay a seed as
# this run did.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  ''|-h|--help) sed -n '2,9p' "$0"; exit 2 ;;
esac
n="$1" first="${2:-1}"
log="$(mktemp "${TMPDIR:-/tmp}/chaos.XXXXXX")"
trap 'rm -f "$log"' EXIT
echo "chaos: seeds $first to $((first + n - 1)) in release"
status=0
NCCL_SAFE_CHAOS_SEEDS="$n" NCCL_SAFE_CHAOS_FROM="$first" \
  cargo test --release --test chaos -- --exact seeded_chaos_runs --nocapture >"$log" 2>&1 || status=$?
# Each violation is two lines: what broke, then its replay command.
grep -A1 -E '^(VIOLATION|known violation) ' "$log" || echo "chaos: no violation"
grep -E '^chaos: ' "$log" || true
if [ "$status" != 0 ] && ! grep -qE '^(VIOLATION|known violation) ' "$log"; then
  tail -n 40 "$log" # a build or harness failure, not a violation
fi
exit "$status"
