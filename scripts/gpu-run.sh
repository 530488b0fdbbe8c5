#!/usr/bin/env bash
# The GPU checks of nccl-safe on a machine with NVIDIA GPUs and no Rust toolchain: every GPU
# test binary with --ignored, the examples, the bandwidth bench (cudarc event tracking off and
# on) and the CUDA overhead bench, and nccl-tests 2.19.6 at the same sizes, with the
# bandwidth tables printed side by side. Not part of CI: for whoever has a GPU. With a CUDA
# toolkit on the build machine, `collect` also builds examples/candle_ddp with CUDA tensors
# (nccl-safe-candle's DDP, its buckets on a communication stream of their own), which `run`
# runs with the other examples.
#
# On a build machine (with cargo), gather the binaries into a folder:
#   scripts/gpu-run.sh collect DIR
# On the GPU machine:
#   scripts/gpu-run.sh run DIR --venv VENV --nccl-tests nccl-tests-2.19.6.tar.gz [--out OUT]
#   (or name binaries one by one: --gpu-test BIN (repeatable), --bandwidth BIN,
#    --overhead BIN, --example BIN (repeatable); DIR may then be `-`)
#
# VENV is a Python environment holding NVIDIA's NCCL wheel (nvidia/nccl/lib/libnccl.so.2 and
# nvidia/nccl/include under its site-packages); nccl-tests is built against it with nvcc
# (CUDA toolkit needed for that part only; --no-nccl-tests skips it). Everything is written
# under OUT (default ./gpu-run-out), each step's output in its own log; a failed step is
# reported and the others still run; the exit status is 1 if any step failed.
#
# Every step has a bound of its own (`timeout`), so that one hang costs its own limit and not
# the run: each GPU test alone (GPU_RUN_TEST_S, 90 s), each example (GPU_RUN_EXAMPLE_S,
# 60 s), each bench (GPU_RUN_BENCH_S, 120 s), nccl-tests' build and runs (GPU_RUN_BENCH_S).
# A healthy run takes under 6 minutes; a step past its bound is reported as timed out.
set -uo pipefail

TEST_S=${GPU_RUN_TEST_S:-90}
EXAMPLE_S=${GPU_RUN_EXAMPLE_S:-60}
BENCH_S=${GPU_RUN_BENCH_S:-120}

SIZES=(-b 8 -e 64K -f 4 -g 1)

die() { echo "gpu-run: $*" >&2; exit 2; }

collect() {
    local dir=$1
    command -v cargo >/dev/null || die "collect needs cargo (run it on the build machine)"
    mkdir -p "$dir/examples"
    local json
    json=$(mktemp)
    cargo test --release --test gpu --no-run --message-format=json >"$json" || die "cargo test failed"
    cargo bench --no-run --message-format=json >>"$json" || die "cargo bench failed"
    cargo build --release --examples --message-format=json >>"$json" || die "cargo build failed"
    python3 - "$json" "$dir" <<'EOF'
import json, shutil, sys, os
src, dst = sys.argv[1], sys.argv[2]
for line in open(src):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") != "compiler-artifact" or not exe:
        continue
    kinds = m["target"]["kind"]
    name = m["target"]["name"]
    if "example" in kinds:
        shutil.copy2(exe, os.path.join(dst, "examples", name))
    elif name in ("gpu", "bandwidth", "overhead"):
        shutil.copy2(exe, os.path.join(dst, name))
    else:
        continue
    print("collected", name)
EOF
    rm -f "$json"
    # examples/candle_ddp with CUDA tensors (DDP on nccl-safe-candle, its five buckets
    # pipelined on a communication stream beside candle's): needs
    # a CUDA toolkit here (nvcc; cublas, curand, nvrtc to link).
    local root
    root="$(cd "$(dirname "$0")/.." && pwd)"
    if command -v nvcc >/dev/null; then
        local target="${CARGO_TARGET_DIR:-$root/target}/candle-cuda"
        if (cd "$root/examples/candle_ddp" && CARGO_TARGET_DIR="$target" cargo build --release --features cuda); then
            cp "$target/release/candle-ddp" "$dir/examples/candle-ddp"
            echo "collected candle-ddp (CUDA tensors)"
        else
            echo "gpu-run: candle-ddp's CUDA build failed; collecting the rest" >&2
        fi
    else
        echo "gpu-run: no nvcc, so no CUDA build of examples/candle_ddp (it needs a CUDA toolkit)" >&2
    fi
}

[ $# -ge 2 ] || die "usage: $0 collect DIR | run DIR [options] (see the comment at the top)"
mode=$1
dir=$2
shift 2
if [ "$mode" = collect ]; then
    collect "$dir"
    exit $?
fi
[ "$mode" = run ] || die "unknown mode $mode (collect or run)"

venv="${VIRTUAL_ENV:-}"
tarball=""
out="$PWD/gpu-run-out"
skip_nccl_tests=0
gpu_tests=()
examples=()
bandwidth=""
overhead=""
while [ $# -gt 0 ]; do
    case $1 in
        --venv) venv=$2; shift 2 ;;
        --nccl-tests) tarball=$2; shift 2 ;;
        --no-nccl-tests) skip_nccl_tests=1; shift ;;
        --out) out=$2; shift 2 ;;
        --gpu-test) gpu_tests+=("$2"); shift 2 ;;
        --example) examples+=("$2"); shift 2 ;;
        --bandwidth) bandwidth=$2; shift 2 ;;
        --overhead) overhead=$2; shift 2 ;;
        *) die "unknown option $1" ;;
    esac
done
if [ "$dir" != - ]; then
    [ -d "$dir" ] || die "$dir is not a folder"
    for f in "$dir"/gpu "$dir"/gpu-*; do [ -x "$f" ] && gpu_tests+=("$f"); done
    for f in "$dir"/examples/*; do [ -x "$f" ] && examples+=("$f"); done
    [ -z "$bandwidth" ] && [ -x "$dir/bandwidth" ] && bandwidth=$dir/bandwidth
    [ -z "$overhead" ] && [ -x "$dir/overhead" ] && overhead=$dir/overhead
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

# NVIDIA's NCCL from the venv, for our binaries (NCCL_LIBRARY) and for nccl-tests.
nccl_dir=""
if [ -n "$venv" ]; then
    nccl_dir=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/nccl 2>/dev/null | head -1)
    [ -n "$nccl_dir" ] || die "no nvidia/nccl in $venv"
    export NCCL_LIBRARY="$nccl_dir/lib/libnccl.so.2"
    echo "# NCCL: $NCCL_LIBRARY"
fi

failed=()
step() { # step LIMIT_S NAME CMD...: runs CMD within LIMIT_S, logs to $out/NAME.log, records a failure
    local limit=$1 name=$2
    shift 2
    echo "### $name: $*"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.log"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "### $name: TIMED OUT after ${limit} s"
        failed+=("$name")
    elif [ $rc -ne 0 ]; then
        echo "### $name: FAILED (exit $rc, $((SECONDS - t0)) s)"
        failed+=("$name")
    else
        echo "### $name: ok ($((SECONDS - t0)) s)"
    fi
}

nvidia-smi -L 2>/dev/null | sed 's/^/# /'

for t in "${gpu_tests[@]}"; do
    # One test at a time, each with its own bound (child_*: child processes its tests
    # spawn themselves).
    mapfile -t names < <("$t" --list --ignored 2>/dev/null | sed -n 's/: test$//p' | grep -v '^child_')
    [ ${#names[@]} -gt 0 ] || { echo "### $(basename "$t"): no tests listed"; failed+=("list-$(basename "$t")"); }
    for n in "${names[@]}"; do
        step "$TEST_S" "test-$(basename "$t")-$n" "$t" --exact "$n" --ignored --test-threads=1 --nocapture
    done
done
for e in "${examples[@]}"; do
    step "$EXAMPLE_S" "example-$(basename "$e")" "$e"
done
if [ -n "$bandwidth" ]; then
    step "$BENCH_S" bandwidth-tracking-off "$bandwidth" "${SIZES[@]}" --backend nccl -E 0 \
        --op all_reduce,all_gather,broadcast
    step "$BENCH_S" bandwidth-tracking-on "$bandwidth" "${SIZES[@]}" --backend nccl -E 1 \
        --op all_reduce,all_gather,broadcast
else
    echo "# no bandwidth bench binary given"
fi
if [ -n "$overhead" ]; then
    step "$BENCH_S" overhead-nccl "$overhead" --backend nccl
    # Without the completion marker at enqueue (Config::exact_completion(false)): what the
    # marker's three driver calls cost on this GPU.
    step "$BENCH_S" overhead-nccl-lazy "$overhead" --backend nccl --lazy-completion
    # The same path on the fake driver: this CPU's cost for the crate's own work, apart
    # from the driver's (needs `cc`, and tests/support/fakes/cuda.c under the current folder).
    step "$BENCH_S" overhead-fake-cuda "$overhead" --backend fake-cuda
    step "$BENCH_S" overhead-host "$overhead" --no-host
else
    echo "# no overhead bench binary given"
fi

# nccl-tests 2.19.6 against the same NCCL, at the same sizes.
if [ $skip_nccl_tests -eq 0 ]; then
    if [ -z "$tarball" ] || [ -z "$nccl_dir" ]; then
        echo "# nccl-tests skipped: give --nccl-tests TARBALL and --venv VENV"
        failed+=(nccl-tests-missing)
    else
        H=$out/nccl-home
        mkdir -p "$H/lib" "$out/nccl-tests"
        ln -sf "$nccl_dir/lib/libnccl.so.2" "$H/lib/libnccl.so.2"
        ln -sf "$nccl_dir/lib/libnccl.so.2" "$H/lib/libnccl.so"
        rm -rf "$H/include"
        cp -r "$nccl_dir/include" "$H/include"
        tar -xzf "$tarball" -C "$out/nccl-tests" --strip-components=1
        step "$BENCH_S" nccl-tests-build make -C "$out/nccl-tests" -j16 MPI=0 NCCL_HOME="$H" \
            NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90 src.build
        for c in all_reduce all_gather broadcast; do
            LD_LIBRARY_PATH="$H/lib:${LD_LIBRARY_PATH:-}" \
                step "$BENCH_S" "nccl-tests-$c" "$out/nccl-tests/build/${c}_perf" "${SIZES[@]}"
        done
    fi
fi

# Side by side: size, then time (us) out-of-place and in-place, nccl-tests and nccl-safe.
side_by_side() { # COLLECTIVE OURS_LOG THEIRS_LOG
    python3 - "$@" <<'EOF'
import sys, re
coll, ours, theirs = sys.argv[1:4]
def rows(path, section):
    try:
        text = open(path).read()
    except OSError:
        return {}
    if section:
        m = re.search(r"Collective test starting: %s\n(.*?)Collective test concluded" % section, text, re.S)
        text = m.group(1) if m else ""
    out = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 13 and not line.lstrip().startswith("#") and f[0].isdigit():
            # size count type redop root time algbw busbw #wrong time algbw busbw #wrong
            out[int(f[0])] = (f[5], f[9])
    return out
a, b = rows(theirs, None), rows(ours, coll)
print("# %s: time per operation (us)" % coll)
print("# %10s  %14s %14s  %14s %14s" % ("size (B)", "nccl-tests oop", "nccl-safe oop", "nccl-tests ip", "nccl-safe ip"))
for size in sorted(set(a) | set(b)):
    t, o = a.get(size, ("-", "-")), b.get(size, ("-", "-"))
    print("  %10d  %14s %14s  %14s %14s" % (size, t[0], o[0], t[1], o[1]))
EOF
}
for tracking in off on; do
    echo "#"
    echo "# ---- nccl-tests vs nccl-safe (cudarc event tracking $tracking) ----"
    for c in all_reduce all_gather broadcast; do
        side_by_side "$c" "$out/bandwidth-tracking-$tracking.log" "$out/nccl-tests-$c.log"
    done
done
grep -h "^# target" "$out"/overhead-*.log 2>/dev/null

echo "#"
if [ ${#failed[@]} -gt 0 ]; then
    echo "# FAILED: ${failed[*]} (logs in $out)"
    exit 1
fi
echo "# all steps passed (logs in $out)"
