#!/usr/bin/env bash
# nccl-safe under PyTorch's real torchrun, no GPU needed:
#   1. `torchrun --nproc_per_node=4 --no-python` on the launcher test's child rank: every
#      rank gets the unique id through torchrun's agent store (nothing bound, no token), and
#      all four print byte-identical ids; then, without a GPU, every rank fails to join with
#      the same clear error, and none hangs;
#   2. the allreduce example under torchrun with `--launcher env --backend nccl`: every rank
#      fails at once with the same clear error naming CUDA_VISIBLE_DEVICES (without a GPU);
#   3. the allreduce and train examples with `--launcher env --backend host`: 4 processes on
#      the CPU, meeting in shared memory;
#   4. the c10d store client against PyTorch's own TCPStore servers (libuv, torchrun's
#      default, and the older one): every request, a wait that times out, the board, and
#      keys under the same names on both sides (Python sets one the client reads, and
#      reads one the client sets); then the same against the oldest PyTorch the client
#      supports, 2.2 (servers before 2.4 have no PING: spoken to without it), from its own
#      venv ($cache/torch-2.2-venv, about 4 GB, 2 minutes the first time);
#   5. `torchrun --max-restarts 1` on the multi-process fault test: rank 1 is SIGKILLed in
#      the first attempt, torchrun stops the others and restarts the job, and the second
#      attempt completes on fresh keys (the first attempt's id named a segment that is
#      gone) with nothing left in /dev/shm.
# PyTorch comes from PyPI into a venv (default $NCCL_SAFE_CACHE/torch-venv, i.e.
# ~/.cache/nccl-safe/torch-venv; set NCCL_SAFE_TORCH_VENV to use another). PyPI's torch wheel
# brings its CUDA libraries (about 5 GB installed, 2-3 minutes the first time): torchrun
# imports torch, which loads them even on a machine without a GPU. Without network access
# the script says why it skips (with NCCL_SAFE_REQUIRE_TORCH=1, as in CI, it fails). With the
# venv in place it takes about 30 s.
#   scripts/test-torchrun.sh --install   only installs both venvs, if missing (.ci/run runs
#                                        it in the background while it builds)
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
cache="${NCCL_SAFE_CACHE:-$HOME/.cache/nccl-safe}"
venv="${NCCL_SAFE_TORCH_VENV:-$cache/torch-venv}"
fail() { echo "test-torchrun: FAILED: $*" >&2; exit 1; }
# NCCL_SAFE_REQUIRE_TORCH=1 (CI) makes a missing torch a failure instead of a skip.
skip() {
  [ "${NCCL_SAFE_REQUIRE_TORCH:-0}" != 1 ] || fail "torch is required here: $*"
  echo "test-torchrun: SKIPPED: $*"
  exit 0
}

old_venv="${NCCL_SAFE_OLD_TORCH_VENV:-$cache/torch-2.2-venv}"
install_only=0
case "${1:-}" in
  "") ;;
  --install) install_only=1 ;;
  *) echo "usage: scripts/test-torchrun.sh [--install]" >&2; exit 2 ;;
esac

if [ ! -x "$venv/bin/torchrun" ]; then
  py="$(command -v python3 || command -v python)" || skip "no python3 to create a venv with"
  "$py" -m venv "$venv" || skip "python3 -m venv $venv failed (install python3-venv)"
  echo "installing torch from PyPI into $venv (about 5 GB with its CUDA libraries, 2-3 minutes) ..."
  if ! "$venv/bin/pip" install --quiet torch; then
    rm -rf "$venv"
    skip "pip could not install torch from PyPI (no network access?)"
  fi
fi
# The oldest supported store server (step 4), in its own venv.
if [ ! -x "$old_venv/bin/python" ] || ! "$old_venv/bin/python" -W ignore -c "import torch.distributed" 2>/dev/null; then
  rm -rf "$old_venv"
  echo "installing torch 2.2.2 (the oldest supported store server) into $old_venv ..."
  python3 -m venv "$old_venv" && "$old_venv/bin/pip" install --quiet torch==2.2.2 \
    || { rm -rf "$old_venv"; skip "pip could not install torch 2.2.2 from PyPI"; }
fi
if [ "$install_only" = 1 ]; then
  echo "test-torchrun: torch installed in $venv and $old_venv after $(( $(date +%s) - t0 ))s"
  exit 0
fi
torchrun="$venv/bin/torchrun"
"$venv/bin/python" -W ignore -c "import torch.distributed.run" 2>/dev/null \
  || skip "torch in $venv cannot import torch.distributed.run"
echo "torch $("$venv/bin/python" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null) at $venv"

nccl_dir="$(scripts/fetch-nccl.sh | tail -n 1)"
export NCCL_LIBRARY="$nccl_dir/2.32.3/nvidia/nccl/lib/libnccl.so.2"
unset NCCL_SAFE_RENDEZVOUS_TOKEN CUDA_VISIBLE_DEVICES

echo "building the launcher test and the allreduce example ..."
# test_exe NAME: the executable of tests/NAME.rs (built if needed).
test_exe() {
  cargo test --test "$1" --no-run --message-format=json 2>/dev/null | "$venv/bin/python" -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1"
}
exe="$(test_exe launcher)"
[ -x "$exe" ] || fail "could not build tests/launcher.rs"
cargo build --quiet --example allreduce
example="${CARGO_TARGET_DIR:-target}/debug/examples/allreduce"

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
# torchrun's own chatter (warnings about OMP_NUM_THREADS, NumPy) is left in the logs.
run() { # name timeout args...
  local name="$1" limit="$2"; shift 2
  local s; s=$(date +%s)
  set +e
  timeout --kill-after=10 "$limit" "$torchrun" --standalone "$@" >"$logs/$name" 2>&1
  local rc=$?
  set -e
  echo "  $name: exit $rc after $(( $(date +%s) - s ))s"
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || { cat "$logs/$name"; fail "$name hung (killed after ${limit}s)"; }
  return "$rc"
}
same_error() { # log pattern count [min]: count identical lines (at least min, when given)
  # Only the match is compared: torchrun merges the ranks' output, so another rank's text
  # (libtest's "ok", say) can end up on the same line before it.
  local lines n distinct
  lines="$(grep -oE "$2" "$1" | sed -E 's/rank [0-9]+ \(local rank [0-9]+\)/rank R (local rank R)/')"
  n="$(printf '%s\n' "$lines" | grep -c . || true)"
  distinct="$(printf '%s\n' "$lines" | sort -u | grep -c . || true)"
  [ "$n" -le "$3" ] && [ "$n" -ge "${4:-$3}" ] && [ "$distinct" -eq 1 ] \
    || { cat "$1"; fail "expected ${4:-$3} to $3 identical '$2' lines, got $n ($distinct distinct)"; }
  printf '%s\n' "$lines" | head -n 1
}

echo "1. four ranks exchange the id through torchrun's agent store, then fail to join alike"
NCCL_SAFE_TEST_LAUNCH_CHILD=1 run ids 120 --nproc_per_node=4 --no-python \
  "$exe" --exact child_rank_entry --ignored --nocapture --test-threads=1 \
  || { cat "$logs/ids"; fail "a rank failed the id exchange"; }
ids="$(grep -o '@@ID=[0-9a-f]*' "$logs/ids" || true)"
[ "$(printf '%s\n' "$ids" | grep -c .)" -eq 4 ] || { cat "$logs/ids"; fail "expected 4 ids"; }
[ "$(printf '%s\n' "$ids" | sort -u | wc -l)" -eq 1 ] || { printf '%s\n' "$ids"; fail "the ranks got different ids"; }
[ "$(printf '%s\n' "$ids" | head -n 1 | wc -c)" -eq $((5 + 256 + 1)) ] || fail "an id is not 128 bytes"
echo "  all 4 ranks: ${ids:0:37}... (byte-identical)"
# An assignment, not inside echo: a failure in $(...) then ends the script (set -e).
line="$(same_error "$logs/ids" '@@INIT=error: .*no CUDA device' 4)"
echo "  each rank: $line"

echo "2. the allreduce example under torchrun, --launcher env --backend nccl"
if run allreduce 120 --nproc_per_node=4 --no-python "$example" --launcher env --backend nccl --count 16; then
  fail "the example succeeded without a GPU"
fi
# (torchrun SIGTERMs the other ranks once one exits non-zero: a slow one may not print.)
line="$(same_error "$logs/allreduce" '^error: .*no CUDA device.*CUDA_VISIBLE_DEVICES' 4 2)"
echo "  each rank: $line"

echo "3. the allreduce and train examples under torchrun, --launcher env --backend host (CPU)"
cargo build --quiet --example train
run host 120 --nproc_per_node=4 --no-python "$example" --launcher env --backend host --count 100000 \
  || { cat "$logs/host"; fail "allreduce --launcher env --backend host failed"; }
[ "$(grep -cE '^ +[0-3]  host +10  ok$' "$logs/host" || true)" -eq 4 ] || { cat "$logs/host"; fail "expected 4 verified ranks"; }
run train 120 --nproc_per_node=4 --no-python "${example%/allreduce}/train" --launcher env --backend host \
  || { cat "$logs/train"; fail "train --launcher env --backend host failed"; }
[ "$(grep -c 'parameters identical on every rank: yes' "$logs/train" || true)" -eq 4 ] || { cat "$logs/train"; fail "expected 4 ranks with identical parameters"; }
echo "  4 ranks verified; train's parameters identical on 4 ranks"

echo "4. the store client against PyTorch's own TCPStore servers (libuv and the older one), current and 2.2"
store_exe="$(test_exe store)"
[ -x "$store_exe" ] || fail "could not build tests/store.rs"
# real_store PYTHON: the test against the servers of that torch (NCCL_SAFE_TEST_C10D_OLD=1
# in the environment: a server from before PING).
real_store() {
timeout --kill-after=10 120 "$1" -W ignore - "$store_exe" >"$logs/real-store" 2>&1 <<'PY' \
  || { cat "$logs/real-store"; fail "the store client failed against PyTorch's server ($1)"; }
import os, subprocess, sys
from datetime import timedelta
import torch, torch.distributed as dist
for libuv in (True, False):
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                          wait_for_workers=False, use_libuv=libuv)
    # A key for the Rust client to read under the same name, and one it sets for us.
    store.set("interop/from_python", b"hello from python")
    env = dict(os.environ, NCCL_SAFE_TEST_C10D_STORE=f"127.0.0.1:{store.port}")
    out = subprocess.run([sys.argv[1], "--exact", "against_a_real_pytorch_store", "--ignored", "--nocapture"],
                         env=env, capture_output=True, text=True, timeout=60)
    ok = out.returncode == 0 and "@@REAL-STORE-OK" in out.stdout
    if ok:
        store.wait(["interop/from_rust"], timedelta(seconds=5))
        ok = store.get("interop/from_rust") == b"hello from rust"
        print(f"  torch {torch.__version__}, use_libuv={libuv}: Python read the Rust client's key: {ok}")
    print(f"  torch {torch.__version__}, use_libuv={libuv}: {'ok' if ok else 'FAILED'}")
    if not ok:
        print(out.stdout, out.stderr)
        sys.exit(1)
PY
cat "$logs/real-store"
}
NCCL_SAFE_TEST_C10D_OLD=0 real_store "$venv/bin/python"
NCCL_SAFE_TEST_C10D_OLD=1 real_store "$old_venv/bin/python"

echo "5. torchrun --max-restarts 1: rank 1 is SIGKILLed in the first attempt; the job restarts and completes on fresh keys"
mp_exe="$(test_exe multiprocess)"
[ -x "$mp_exe" ] || fail "could not build tests/multiprocess.rs"
shm_before="$(ls /dev/shm | grep '^nccl-safe-' || true)"
NCCL_SAFE_TEST_MP=launcher NCCL_SAFE_HOST_TIMEOUT_MS=8000 run restart 120 --nproc_per_node=4 --max-restarts 1 --no-python \
  "$mp_exe" --exact a_job_restarted_by_torchrun_completes_on_fresh_keys --ignored --nocapture --test-threads=1 \
  || { cat "$logs/restart"; fail "the restarted job did not complete"; }
# (torchrun stops the survivors with SIGTERM once it sees a rank fail: some may have
# reported rank 1's death first, some not.)
[ "$(grep -c 'KILLED_AT_MS' "$logs/restart" || true)" -eq 1 ] \
  || { cat "$logs/restart"; fail "rank 1 was not killed (once) in the first attempt"; }
named="$(grep -c 'rank 1 (pid [0-9]*) died' "$logs/restart" || true)"
[ "$(grep -c 'COMPLETED ATTEMPT "1"' "$logs/restart" || true)" -eq 4 ] \
  || { cat "$logs/restart"; fail "expected 4 ranks to complete the second attempt"; }
left="$(comm -13 <(printf '%s\n' "$shm_before" | sort) <(ls /dev/shm | grep '^nccl-safe-' | sort) || true)"
[ -z "$left" ] || fail "the restarted job left in /dev/shm: $left"
echo "  attempt 0: rank 1 SIGKILLed ($named survivor(s) named it before torchrun stopped them), torchrun restarted the job; attempt 1: all 4 ranks completed; /dev/shm clean"

echo "test-torchrun: OK in $(( $(date +%s) - t0 ))s"
