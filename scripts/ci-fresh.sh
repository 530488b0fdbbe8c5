#!/usr/bin/env bash
# Runs .ci/run as a fresh CI machine would: in a fresh clone of this repository's HEAD, with
# an empty CARGO_TARGET_DIR, an empty NCCL cache (NVIDIA's wheels and NCCL built from
# source) and LIBCLANG_PATH unset.
#
#   scripts/ci-fresh.sh [--hide-libclang] [--keep]
#
# --hide-libclang  removes Debian's packages that provide libclang.so* (libclang-dev,
#                  libclang-N-dev, libclang1-N) before the run, so .ci/run's install step
#                  runs as on a machine that never had them; .ci/run installs them again.
#                  Needs root or sudo. libclang-cpp is left alone: it is not what bindgen
#                  loads, and a fresh machine has it.
# --keep           keeps the scratch folder (clone, target, cache) for a look afterwards.
#
# Commits only: uncommitted changes are not in the clone. Prints .ci/run's exit status, then
# a table of its steps' times (the failed one marked) and the total.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci-lib.sh

hide=0 keep=0
for arg in "$@"; do
  case "$arg" in
    --hide-libclang) hide=1 ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "ci-fresh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

scratch="$(mktemp -d "${TMPDIR:-/tmp}/ci-fresh.XXXXXX")"
cleanup() { if [ "$keep" = 1 ]; then echo "ci-fresh: kept $scratch"; else rm -rf "$scratch"; fi; }
trap cleanup EXIT

if [ "$hide" = 1 ]; then
  # Every installed package owning a libclang.so* / libclang-N.so* file (not libclang-cpp).
  # Exactly the files bindgen loads (the names have_libclang accepts), not libclang-cpp
  # or compiler-rt's libclang_rt.*.
  mapfile -t pkgs < <(dpkg -S 'libclang*.so*' 2>/dev/null \
    | grep -E '/libclang(-[0-9][0-9.]*)?\.so(\.[0-9]+)*$' \
    | cut -d: -f1 | tr ',' '\n' | sed 's/^ *//' | sort -u)
  if [ "${#pkgs[@]}" -gt 0 ]; then
    echo "ci-fresh: removing ${pkgs[*]} so that .ci/run must install libclang"
    sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get remove -y -qq "${pkgs[@]}" >/dev/null
  fi
  if have_libclang; then
    echo "ci-fresh: libclang is still visible after removing its packages:" >&2
    ldconfig -p | grep -E 'libclang[-.]' | grep -v cpp >&2 || true
    exit 1
  fi
  echo "ci-fresh: libclang hidden (ldconfig -p lists no libclang.so*)"
fi

git clone --quiet --no-local . "$scratch/repo"
echo "ci-fresh: fresh clone of $(git rev-parse --short HEAD) in $scratch/repo"
mkdir -p "$scratch/target" "$scratch/nccl-cache"
times="$scratch/step-times.tsv"
: >"$times"
t0=$(date +%s)
status=0
(
  cd "$scratch/repo"
  unset LIBCLANG_PATH NCCL_SAFE_TEST_NCCL_DIR NCCL_SAFE_SOURCE_NCCL NCCL_LIBRARY NCCL_HOME NCCL_ROOT CUDA_HOME VIRTUAL_ENV CONDA_PREFIX
  export CARGO_TARGET_DIR="$scratch/target" NCCL_SAFE_CACHE="$scratch/nccl-cache" CI=true
  export CI_STEP_TIMES="$times"
  bash .ci/run </dev/null
) || status=$?
echo "ci-fresh: .ci/run exited with status $status"
echo "ci-fresh: step times (cold: fresh clone, empty target folder and NCCL cache)"
awk -F'\t' -v total=$(( $(date +%s) - t0 )) '
  function mmss(s) { return sprintf("%3dm%02ds", int(s / 60), s % 60) }
  { printf "  %-12s %s  %s\n", $3, mmss($1), ($2 == "ok" ? "" : $2); sum += $1 }
  END { printf "  %-12s %s\n  %-12s %s  (with the clone and set-up)\n", "steps", mmss(sum), "total", mmss(total) }
' "$times"
exit "$status"
