#!/usr/bin/env bash
# Multi-process jobs on the CPU under a real launcher, no GPU needed:
#
#   scripts/test-processes.sh mpirun   # Open MPI's mpirun -np 4
#   scripts/test-processes.sh srun     # srun -n 4 on a one-node Slurm (scripts/slurm-local.sh)
#
#   0. four ranks exchange NVIDIA NCCL's unique id through the rendezvous (under srun from
#      SLURM_JOB_NODELIST and SLURM_JOB_ID alone): byte-identical ids, then the same clear
#      error without a GPU;
#   1. the allreduce and train examples as 4 processes (`--launcher env --backend host`):
#      the id goes over the authenticated TCP rendezvous, the ranks meet in shared memory;
#      then a job of 4 over 2 roots (NCCL_SAFE_ROOTS=2, tests/scalable_params.rs's child):
#      the root ranks' 2 ids go through the rendezvous, every rank is made from both;
#   2. the fault tests of tests/multiprocess.rs as 4 processes; each error names the culprit,
#      rank 1, and the user's file:line:
#      - rank 1 SIGKILLs itself mid-job: every other rank fails naming it (its process is
#        gone) within the host timeout + 1 s;
#      - rank 1 skips a collective: every rank fails naming it, with what each rank called;
#      - rank 1 destroys its communicator and exits 0 early: the others fail naming it;
#      - rank 1 panics: the others fail at once saying that it panicked (from the board);
#      - rank 1 runs an extra collective: every rank fails naming it and the extra's line;
#      - rank 1 sleeps past the host timeout (1 s here): the others fail at that timeout
#        naming it as the rank that did not reach the collective;
#      every time nothing hangs and nothing is left in /dev/shm. The times from the fault
#      to the last survivor's error are printed;
#   3. an elastic job, nccl-safe-candle's examples/elastic.rs, as 4 ranks and a standby:
#      rank 1 is SIGKILLed from outside (its pid, from the file it writes at step 10) while
#      the others wait for it in a collective; they shrink without it and train on 3 ranks,
#      then the standby joins through grow and the 4 end at step 60 with bit-identical
#      parameters and a falling loss. The times from the kill to the first step on 3 ranks
#      and from the grow id to the first step on 4 are printed;
#   4. the same job with ranks 1 and 2 SIGKILLed at once (one kill command) and no standby:
#      the 2 left exclude both and end at step 60, bit-identical;
#   5. the same job with the standby SIGKILLed before it joins, then rank 1: the 3 left
#      recover, their grow fails within its timeout (3 s) and hands each its communicator
#      back, and they end at step 60 on 3 ranks, bit-identical;
#   6. the README's elastic program, nccl-safe-candle's examples/elastic_job.rs (ElasticJob),
#      as 4 ranks and a standby: rank 1 is SIGKILLed at step 40 (its pid from its log line),
#      the 3 left carry on, the grow policy takes the standby back (its grow id over the
#      job's TCP rendezvous), and the 4 end at step 200 with the same final loss.
# Installs Debian's openmpi-bin when mpirun is missing; for srun, scripts/slurm-local.sh
# installs and starts the cluster, and stops it afterwards. Takes a few seconds once built.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci-lib.sh
t0=$(date +%s)
launcher="${1:-}"
fail() { echo "test-processes ($launcher): FAILED: $*" >&2; exit 1; }

case "$launcher" in
  mpirun)
    command -v mpirun >/dev/null 2>&1 || { echo "installing Debian's openmpi-bin"; apt_install openmpi-bin; }
    echo "$(mpirun --version | head -n 1) at $(command -v mpirun)"
    # Open MPI refuses to run as root without these (CI containers run as root).
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_rmaps_base_oversubscribe=1
    ;;
  srun)
    eval "$(scripts/slurm-local.sh start)"
    echo "$(srun --version) at $(command -v srun), SLURM_CONF=$SLURM_CONF"
    ;;
  *) sed -n '2,38p' "$0"; exit 2 ;;
esac
# launch4 [--tolerate-a-dead-rank] PROGRAM ARGS...: sets $cmd to run 4 ranks of PROGRAM
# under the launcher. With --tolerate-a-dead-rank the launcher must not kill the survivors
# when a rank dies, or they could not report (mpirun --enable-recovery; srun does not by
# default, and --kill-on-bad-exit=0 says so); mpirun then exits 0 whatever the ranks did,
# so each rank's error line is checked (a rank that prints one exits 1 right after;
# tests/multiprocess.rs checks the exit codes).
launch4() { launchn 4 "$@"; }
# launchn N [--tolerate-a-dead-rank] PROGRAM ARGS...: the same with N ranks.
launchn() {
  local n="$1" keep=()
  shift
  if [ "$1" = --tolerate-a-dead-rank ]; then
    shift
    case "$launcher" in mpirun) keep=(--enable-recovery) ;; srun) keep=(--kill-on-bad-exit=0) ;; esac
  fi
  case "$launcher" in
    mpirun)
      cmd=(mpirun -np "$n" "${keep[@]}" -x MASTER_ADDR -x MASTER_PORT -x NCCL_SAFE_RENDEZVOUS_TOKEN
        -x NCCL_SAFE_HOST_TIMEOUT_MS -x NCCL_SAFE_TEST_MP -x NCCL_SAFE_TEST_STAGGER_MS
        -x NCCL_SAFE_TEST_STUCK_MS -x NCCL_SAFE_ROOTS -x NCCL_SAFE_TEST_ROOTS_JOB "$@") ;;
    # srun passes the whole environment (--export=ALL is its default).
    srun) cmd=(srun -n "$n" --overcommit "${keep[@]}" "$@") ;;
  esac
}
export NCCL_SAFE_RENDEZVOUS_TOKEN="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
export NCCL_SAFE_HOST_TIMEOUT_MS=8000
unset NCCL_LIBRARY CUDA_VISIBLE_DEVICES

echo "building the examples, tests/multiprocess.rs, tests/launcher.rs and tests/scalable_params.rs ..."
cargo build --quiet --example allreduce --example train
target="${CARGO_TARGET_DIR:-target}"
# test_exe NAME: the executable of tests/NAME.rs.
test_exe() {
  cargo test --test "$1" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1"
}
# The folder scripts/candle.sh builds nccl-safe-candle in (its tests ran in scripts/test.sh,
# so only the example is left to build), made absolute: the build runs in the crate's folder.
candle_target="$(realpath -m "$target")/candle"
echo "building nccl-safe-candle's examples/elastic.rs (its own workspace, in $candle_target) ..."
(cd nccl-safe-candle && CARGO_TARGET_DIR="$candle_target" cargo build --quiet --example elastic --example elastic_job)
elastic_exe="$candle_target/debug/examples/elastic"
exe="$(test_exe multiprocess)"
[ -x "$exe" ] || fail "could not build tests/multiprocess.rs"
launcher_exe="$(test_exe launcher)"
[ -x "$launcher_exe" ] || fail "could not build tests/launcher.rs"
roots_exe="$(test_exe scalable_params)"
[ -x "$roots_exe" ] || fail "could not build tests/scalable_params.rs"
nccl_lib="$(scripts/fetch-nccl.sh | tail -n 1)/2.32.3/nvidia/nccl/lib/libnccl.so.2"
[ -f "$nccl_lib" ] || fail "no NVIDIA NCCL at $nccl_lib"

logs="$(mktemp -d)"
cleanup() {
  rm -rf "$logs"
  [ "$launcher" != srun ] || scripts/slurm-local.sh stop
}
trap cleanup EXIT
shm_before="$(ls /dev/shm | grep '^nccl-safe-' || true)"
# Below Linux's ephemeral range (32768 and up by default), from which every outgoing
# connection takes its local port: a port drawn there was once held by such a connection,
# and rank 0 could not listen on it ("Address already in use").
port=$(( 20000 + RANDOM % 10000 ))
# run NAME [--tolerate-a-dead-rank] PROGRAM ARGS...: 4 ranks under the launcher; sets $rc;
# fails on a hang.
run() {
  local name="$1"; shift
  port=$(( port + 2 )) # rank 0 serves the rendezvous on port and the desync board on port+1
  local s; s=$(date +%s)
  set +e
  launch4 "$@"
  # mpirun passes them; under srun the ranks derive them from SLURM_JOB_NODELIST and
  # SLURM_JOB_ID, as in a real job.
  local where=()
  [ "$launcher" != mpirun ] || where=(MASTER_ADDR=127.0.0.1 MASTER_PORT="$port")
  env "${where[@]}" timeout --kill-after=5 60 "${cmd[@]}" >"$logs/$name" 2>&1
  rc=$?
  set -e
  # (the launcher itself exits non-zero when a rank was SIGKILLed: tell a hang by the clock.)
  [ $(( $(date +%s) - s )) -lt 60 ] || { cat "$logs/$name"; fail "$name hung (killed after 60 s)"; }
  shm_clean "$name"
}
# shm_clean NAME: fails when the job left something in /dev/shm.
shm_clean() {
  local left
  left="$(comm -13 <(printf '%s\n' "$shm_before" | sort) <(ls /dev/shm | grep '^nccl-safe-' | sort) || true)"
  [ -z "$left" ] || fail "$1 left in /dev/shm: $left"
}
# count LOG PATTERN: how many lines match.
count() { grep -cE "$2" "$1" || true; }

echo "0. four $launcher ranks exchange NVIDIA NCCL's unique id through the rendezvous, then fail to join alike (no GPU)"
NCCL_LIBRARY="$nccl_lib" NCCL_SAFE_TEST_LAUNCH_CHILD=1 run ids "$launcher_exe" --exact child_rank_entry --ignored --nocapture --test-threads=1
[ "$rc" -eq 0 ] || { cat "$logs/ids"; fail "a rank failed the id exchange"; }
ids="$(grep -o '@@ID=[0-9a-f]*' "$logs/ids" || true)"
[ "$(printf '%s\n' "$ids" | grep -c .)" -eq 4 ] && [ "$(printf '%s\n' "$ids" | sort -u | wc -l)" -eq 1 ] \
  && [ "$(printf '%s\n' "$ids" | head -n 1 | wc -c)" -eq $((5 + 256 + 1)) ] \
  || { cat "$logs/ids"; fail "expected 4 byte-identical 128-byte ids"; }
[ "$(grep -c '@@INIT=error: .*no CUDA device' "$logs/ids" || true)" -eq 4 ] || { cat "$logs/ids"; fail "expected 4 'no CUDA device' errors"; }
echo "  all 4 ranks: ${ids:0:37}... (byte-identical); each fails to join: no CUDA device"

export NCCL_SAFE_TEST_MP=launcher
echo "1. the examples as 4 $launcher processes, --launcher env --backend host"
run allreduce "$target/debug/examples/allreduce" --launcher env --backend host --count 1000000
[ "$rc" -eq 0 ] && [ "$(count "$logs/allreduce" '^ +[0-3]  host +10  ok$')" -eq 4 ] \
  || { cat "$logs/allreduce"; fail "allreduce: expected 4 verified ranks"; }
echo "  allreduce: 4 ranks verified"
run train "$target/debug/examples/train" --launcher env --backend host
[ "$rc" -eq 0 ] && [ "$(count "$logs/train" 'parameters identical on every rank: yes')" -eq 4 ] \
  || { cat "$logs/train"; fail "train: expected 4 ranks with identical parameters"; }
echo "  train: $(grep -m1 -o 'loss .* -> [0-9.]*' "$logs/train") on each of 4 ranks, parameters identical"
# Two roots forced (NCCL_SAFE_ROOTS): ranks 0 and 2 each make an id, the rendezvous moves
# both, every rank inits with ncclCommInitRankScalable and prints the ids it used.
NCCL_SAFE_ROOTS=2 NCCL_SAFE_TEST_ROOTS_JOB=1 run roots "$roots_exe" --exact a_process_job_over_tcp_uses_the_roots_asked --nocapture --test-threads=1
roots_ids="$(grep -o 'rank [0-3] pid [0-9]* ids [0-9a-f,]*' "$logs/roots" | sed 's/.* ids //' || true)"
[ "$rc" -eq 0 ] && [ "$(printf '%s\n' "$roots_ids" | grep -c .)" -eq 4 ] \
  && [ "$(printf '%s\n' "$roots_ids" | sort -u | wc -l)" -eq 1 ] \
  && [ "$(printf '%s\n' "$roots_ids" | head -n 1 | tr ',' '\n' | grep -c '^[0-9a-f]\{256\}$')" -eq 2 ] \
  || { cat "$logs/roots"; fail "roots: expected 4 ranks made from the same 2 ids"; }
echo "  2 roots: 4 ranks made from the same 2 ids, an all-reduce over all 4"

# stamp LOG KEY: the numbers after KEY, one a line.
stamp() { grep -oE "$2 [0-9.]+" "$1" | awk '{print $NF}'; }
# delay LOG KEY: ms from rank 1's KEY stamp to the last survivor's error (each rank writes
# its ERROR_AT_MS stamp and its error line at once; rank 1's own error does not count).
delay() {
  local t0 t1
  t0="$(stamp "$1" "$2" | head -n 1)"
  t1="$(awk '/^ERROR_AT_MS /{t=$2; next} t!="" && /^rank [023] step /{print t} {t=""}' "$1" | sort -n | tail -n 1)"
  [ -n "$t0" ] && [ -n "$t1" ] || { cat "$1"; fail "no time stamps in $1"; }
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }'
}
limit=$(( NCCL_SAFE_HOST_TIMEOUT_MS + 1000 ))
echo "2. faults as 4 $launcher processes (host timeout ${NCCL_SAFE_HOST_TIMEOUT_MS} ms)"
run kill --tolerate-a-dead-rank "$exe" --exact a_killed_rank_fails_every_other_rank_naming_it --nocapture --test-threads=1
# survivors_say LOG PATTERN: ranks 0, 2 and 3 each print an error, called at the line the
# ranks printed as CALL_LINE, that matches PATTERN (an extended regex).
survivors_say() {
  local line r
  line="$(grep -m1 -oE 'CALL_LINE [0-9]+' "$1" | awk '{print $2}')"
  [ -n "$line" ] || { cat "$1"; fail "no CALL_LINE in $1"; }
  for r in 0 2 3; do
    grep -qE "^rank $r step [0-9]+: .*called at tests/multiprocess.rs:$line[),:].*$2" "$1" \
      || { cat "$1"; fail "$(basename "$1"): rank $r did not fail naming rank 1 and line $line (/$2/)"; }
  done
}
survivors_say "$logs/kill" 'rank 1 \(pid [0-9]+\) died'
t="$(delay "$logs/kill" KILLED_AT_MS)"
awk -v t="$t" -v l="$limit" 'BEGIN { exit !(t < l) }' || fail "kill: errors took $t ms (limit $limit)"
echo "  SIGKILL of rank 1: ranks 0, 2, 3 failed naming it; last error $t ms after the kill"

run skip --tolerate-a-dead-rank "$exe" --exact a_rank_that_skips_a_collective_is_named_on_every_rank --nocapture --test-threads=1
[ "$(count "$logs/skip" '^rank [0-3] step [0-9]+: .*rank\(s\) \[1\] called something else.*rank 1: collective #3 [^;]* at tests/multiprocess.rs:[0-9]+')" -eq 4 ] \
  || { cat "$logs/skip"; fail "skip: expected 4 ranks naming rank 1 and its file:line"; }
echo "  rank 1 skips a collective: all 4 ranks fail naming it and the line it called from"
echo "    rank 0's report: ...$(grep -m1 -oE '^rank 0 step [0-9]+: .*' "$logs/skip" | grep -oE 'rank 1: collective #3 [^;]*' | head -n 1)"

run leave --tolerate-a-dead-rank "$exe" --exact a_rank_that_leaves_early_fails_the_others_naming_it --nocapture --test-threads=1
# From the desync board (the launcher's rank 0 serves one): rank 1's own words and its last
# call's line; the provider's words (rank 1 destroyed its communicator) when the board
# went down with rank 0's process before this rank read it.
survivors_say "$logs/leave" 'rank 1 left \(its communicator was dropped after 3 collective\(s\); its last call was ncclAllReduce\(float x 65538\) seq 2 at tests/multiprocess.rs:[0-9]+ \(another process, from the desync board\)\)|rank 1 \(pid [0-9]+\) destroyed its communicator'
t="$(delay "$logs/leave" LEFT_AT_MS)"
echo "  rank 1 exits early: ranks 0, 2, 3 failed naming it and its last call's line; last error $t ms after it left"

run panic --tolerate-a-dead-rank "$exe" --exact a_rank_that_panics_is_named_by_every_other_rank_as_panicked --nocapture --test-threads=1
survivors_say "$logs/panic" 'rank 1 left \(it panicked after 3 collective\(s\); its last call was ncclAllReduce\(float x 65538\) seq 2 at tests/multiprocess.rs:[0-9]+ \(another process, from the desync board\)\)'
t="$(delay "$logs/panic" PANICKED_AT_MS)"
awk -v t="$t" 'BEGIN { exit !(t < 3000) }' || fail "panic: errors took $t ms (limit 3000)"
echo "  rank 1 panics: ranks 0, 2, 3 failed saying it panicked; last error $t ms after the panic"

run extra --tolerate-a-dead-rank "$exe" --exact a_rank_that_runs_an_extra_collective_is_named_with_its_line --nocapture --test-threads=1
extra_line="$(grep -m1 -oE 'EXTRA_LINE [0-9]+' "$logs/extra" | awk '{print $2}')"
[ -n "$extra_line" ] && [ "$(count "$logs/extra" "^rank [0-3] step [0-9]+: .*called at tests/multiprocess.rs:[0-9]+\).*rank\(s\) \[1\] called something else.*rank 1: collective #3 ncclAllReduce\(count=8, [^;]* at tests/multiprocess.rs:$extra_line;")" -eq 4 ] \
  || { cat "$logs/extra"; fail "extra: expected 4 ranks naming rank 1 and its extra call's line"; }
survivors_say "$logs/extra" 'rank\(s\) \[1\] called something else'
echo "  rank 1 runs an extra collective: all 4 ranks fail naming it and its line ($extra_line)"

stuck_ms=1000
NCCL_SAFE_HOST_TIMEOUT_MS=$stuck_ms run stuck --tolerate-a-dead-rank "$exe" --exact a_stuck_rank_is_named_as_behind_within_the_host_timeout --nocapture --test-threads=1
survivors_say "$logs/stuck" 'rank 1 \(pid [0-9]+\) did not reach collective #3 by the deadline'
t="$(delay "$logs/stuck" STUCK_AT_MS)"
awk -v t="$t" -v l="$stuck_ms" 'BEGIN { exit !(t >= l - 100 && t < l + 1000) }' \
  || { cat "$logs/stuck"; fail "stuck: errors took $t ms (host timeout $stuck_ms ms)"; }
echo "  rank 1 is stuck in its own code: ranks 0, 2, 3 failed naming it as behind; last error $t ms after it stopped (host timeout $stuck_ms ms)"

# The same, found by the watchdogs (rank 3's after 1 s, rank 0's, which serves the board,
# last; the provider's 8 s never comes): rank 3's abort reaches the others before their own
# timeout, and they still name rank 1 as behind, from the provider's shared memory.
NCCL_SAFE_TEST_STAGGER_MS=1000 NCCL_SAFE_TEST_STUCK_MS=4000 run stuck-watchdog --tolerate-a-dead-rank "$exe" --exact a_stuck_rank_is_named_by_every_survivor_when_the_watchdog_fires --nocapture --test-threads=1
# (The report is several lines: each survivor's first line names the call and its line,
# and a line of each report names rank 1.)
survivors_say "$logs/stuck-watchdog" ''
[ "$(count "$logs/stuck-watchdog" '^=> rank\(s\) \[1\] are behind')" -eq 3 ] \
  || { cat "$logs/stuck-watchdog"; fail "stuck-watchdog: expected 3 reports naming rank 1"; }
t="$(delay "$logs/stuck-watchdog" STUCK_AT_MS)"
awk -v t="$t" 'BEGIN { exit !(t < 6000) }' || { cat "$logs/stuck-watchdog"; fail "stuck-watchdog: errors took $t ms"; }
echo "  rank 1 is stuck, found by the watchdogs: ranks 0, 2, 3 failed naming it as behind; last error $t ms after it stopped"
echo "  nothing left in /dev/shm"

echo "3. an elastic job (nccl-safe-candle's examples/elastic.rs): 4 $launcher ranks and a standby; rank 1 is SIGKILLed from outside, 3 carry on, the standby rejoins through grow"
job="$logs/elastic-job"
mkdir "$job"
port=$(( port + 2 ))
# (--timeout-s: a rank that waits for a file or a peer gives up well before the 60 s hang limit.)
launchn 5 --tolerate-a-dead-rank "$elastic_exe" --dir "$job" --timeout-s 20
s=$(date +%s) job_t0=$(date +%s%3N)
# Rank 1 writes its pid at step 10 and from then on takes 100 ms a step, so that the kill
# lands while the others wait for it inside a collective (and a slow machine has 5 s to kill
# it before it would end the job on 4 ranks).
timeout --kill-after=5 60 "${cmd[@]}" >"$logs/elastic" 2>&1 &
job_pid=$!
for ((i = 0; i < 3000; i++)); do [ -s "$job/victim.pid" ] && break; sleep 0.01; done
[ -s "$job/victim.pid" ] || { kill "$job_pid" 2>/dev/null || true; wait "$job_pid" || true; cat "$logs/elastic"; fail "elastic: rank 1 wrote no pid file within 30 s"; }
victim="$(cat "$job/victim.pid")"
killed_at="$(date +%s%3N)"
kill -9 "$victim" || { wait "$job_pid" || true; cat "$logs/elastic"; fail "elastic: could not kill rank 1 (pid $victim)"; }
set +e
wait "$job_pid"
rc=$?
set -e
job_ms=$(( $(date +%s%3N) - job_t0 ))
[ $(( $(date +%s) - s )) -lt 60 ] || { cat "$logs/elastic"; fail "elastic hung (killed after 60 s)"; }
shm_clean elastic
# Every rank that fails prints ERROR and exits 1; the killed one prints nothing more; the
# others print EXIT once their communicators are torn down, and exit 0 right after (under
# mpirun --enable-recovery the launcher's exit code says nothing about them).
[ "$(count "$logs/elastic" '^ERROR ')" -eq 0 ] || { cat "$logs/elastic"; fail "elastic: a rank failed"; }
[ "$(grep -E '^EXIT 0 launcher rank [0-4]$' "$logs/elastic" | awk '{print $5}' | sort | tr -d '\n')" = 0234 ] \
  || { cat "$logs/elastic"; fail "elastic: expected launcher ranks 0, 2, 3 and 4 (not 1) to exit 0"; }
[ "$(count "$logs/elastic" '^RECOVERY rank [023] lost rank 1 at step [0-9]+: 4 -> 3 ranks')" -eq 3 ] \
  || { cat "$logs/elastic"; fail "elastic: expected ranks 0, 2 and 3 to recover without rank 1"; }
finals="$(grep -E '^FINAL rank [0-3] of 4 step 60 params [0-9a-f]{16} ' "$logs/elastic" || true)"
[ "$(printf '%s\n' "$finals" | awk '{print $3}' | sort -u | grep -c .)" -eq 4 ] \
  || { cat "$logs/elastic"; fail "elastic: expected ranks 0-3 of 4 to end at step 60"; }
[ "$(printf '%s\n' "$finals" | awk '{print $9}' | sort -u | wc -l)" -eq 1 ] \
  || { cat "$logs/elastic"; fail "elastic: the 4 ranks' parameters differ"; }
loss="$(printf '%s\n' "$finals" | awk '$3 == 0 {print $11, $13}')"
awk -v f="${loss% *}" -v l="${loss#* }" 'BEGIN { exit !(l < f / 2) }' \
  || { cat "$logs/elastic"; fail "elastic: the loss did not fall ($loss)"; }
on3="$(stamp "$logs/elastic" 'first step on 3 ranks at' | sort -n | tail -n 1)"
grow_at="$(stamp "$logs/elastic" 'GROW_ID at')"
on4="$(awk '/^FIRST_STEP_ON_4 /{print $5}' "$logs/elastic" | sort -n | tail -n 1)"
[ "$(stamp "$logs/elastic" 'first step on 3 ranks at' | grep -c .)" -eq 3 ] && [ -n "$grow_at" ] \
  && [ "$(count "$logs/elastic" '^FIRST_STEP_ON_4 ')" -eq 4 ] || { cat "$logs/elastic"; fail "elastic: missing time stamps"; }
t3="$(awk -v a="$killed_at" -v b="$on3" 'BEGIN { printf "%.1f", b - a }')"
t4="$(awk -v a="$grow_at" -v b="$on4" 'BEGIN { printf "%.1f", b - a }')"
echo "  rank 1 (pid $victim) SIGKILLed: ranks 0, 2, 3 shrank without it and carried on; the standby joined as rank 3"
echo "  4 ranks at step 60, parameters bit-identical ($(printf '%s\n' "$finals" | awk 'NR == 1 {print $9}')), loss ${loss% *} -> ${loss#* }, nothing left in /dev/shm"
echo "  from the kill to the first step on 3 ranks (the last survivor's): $t3 ms; from the grow id to the first step on 4 ranks: $t4 ms; the job took $job_ms ms (launcher exit $rc)"

# elastic_job NAME N ARGS...: starts the elastic example as N launcher ranks in the
# background (its pid in $job_pid), in the folder $job.
elastic_job() {
  local name="$1" n="$2"
  shift 2
  job="$logs/$name-job"
  mkdir "$job"
  port=$(( port + 2 ))
  launchn "$n" --tolerate-a-dead-rank "$elastic_exe" --dir "$job" "$@"
  job_s=$(date +%s)
  timeout --kill-after=5 60 "${cmd[@]}" >"$logs/$name" 2>&1 &
  job_pid=$!
}
# await_files NAME FILE...: waits (30 s at most) until the job wrote each file.
await_files() {
  local name="$1" f ok
  shift
  for ((i = 0; i < 3000; i++)); do
    ok=1
    for f in "$@"; do [ -s "$job/$f" ] || ok=0; done
    [ "$ok" = 1 ] && return 0
    sleep 0.01
  done
  kill "$job_pid" 2>/dev/null || true
  wait "$job_pid" || true
  cat "$logs/$name"
  fail "$name: the job wrote no $* within 30 s"
}
# job_ends NAME RANKS WORLD: the job ended within 60 s, nothing failed, launcher ranks RANKS
# (digits) exited 0, and ranks 0.. of WORLD ended at step 60 bit-identical, the loss falling.
job_ends() {
  local name="$1" ranks="$2" world="$3" finals loss
  set +e
  wait "$job_pid"
  set -e
  [ $(( $(date +%s) - job_s )) -lt 60 ] || { cat "$logs/$name"; fail "$name hung (killed after 60 s)"; }
  shm_clean "$name"
  [ "$(count "$logs/$name" '^ERROR ')" -eq 0 ] || { cat "$logs/$name"; fail "$name: a rank failed"; }
  [ "$(grep -E '^EXIT 0 launcher rank [0-9]$' "$logs/$name" | awk '{print $5}' | sort | tr -d '\n')" = "$ranks" ] \
    || { cat "$logs/$name"; fail "$name: expected launcher ranks $ranks to exit 0"; }
  finals="$(grep -E "^FINAL rank [0-9] of $world step 60 params [0-9a-f]{16} " "$logs/$name" || true)"
  [ "$(printf '%s\n' "$finals" | awk '{print $3}' | sort -u | grep -c .)" -eq "$world" ] \
    || { cat "$logs/$name"; fail "$name: expected ranks 0-$(( world - 1 )) of $world to end at step 60"; }
  [ "$(printf '%s\n' "$finals" | awk '{print $9}' | sort -u | wc -l)" -eq 1 ] \
    || { cat "$logs/$name"; fail "$name: the $world ranks' parameters differ"; }
  loss="$(printf '%s\n' "$finals" | awk '$3 == 0 {print $11, $13}')"
  awk -v f="${loss% *}" -v l="${loss#* }" 'BEGIN { exit !(l < f / 2) }' \
    || { cat "$logs/$name"; fail "$name: the loss did not fall ($loss)"; }
  echo "  $world ranks at step 60, parameters bit-identical ($(printf '%s\n' "$finals" | awk 'NR == 1 {print $9}')), loss ${loss% *} -> ${loss#* }, nothing left in /dev/shm"
}

echo "4. the elastic job with ranks 1 and 2 SIGKILLed at once, no standby: the 2 left carry on"
elastic_job elastic-two 4 --timeout-s 20 --victims 2 --standbys 0
await_files elastic-two victim.pid victim2.pid
kill -9 "$(cat "$job/victim.pid")" "$(cat "$job/victim2.pid")" \
  || { wait "$job_pid" || true; cat "$logs/elastic-two"; fail "elastic-two: could not kill ranks 1 and 2"; }
job_ends elastic-two 03 2
grep -E '^RECOVERY rank 0 ' "$logs/elastic-two" | sed 's/^/  /'

echo "5. the elastic job with the standby SIGKILLed before it joins, then rank 1: the 3 left carry on"
elastic_job elastic-standby 5 --timeout-s 3
await_files elastic-standby standby.pid
kill -9 "$(cat "$job/standby.pid")" \
  || { wait "$job_pid" || true; cat "$logs/elastic-standby"; fail "elastic-standby: could not kill the standby"; }
await_files elastic-standby victim.pid
kill -9 "$(cat "$job/victim.pid")" \
  || { wait "$job_pid" || true; cat "$logs/elastic-standby"; fail "elastic-standby: could not kill rank 1"; }
job_ends elastic-standby 023 3
[ "$(count "$logs/elastic-standby" '^GROW_FAILED rank [0-2]: carrying on at 3 ranks')" -eq 3 ] \
  || { cat "$logs/elastic-standby"; fail "elastic-standby: expected the 3 ranks' grow to fail and hand back their communicator"; }
echo "  the standby died before it joined: each of the 3 grows failed within the 3 s timeout, and they carried on"

echo "6. the README's elastic program (nccl-safe-candle/examples/elastic_job.rs) as 4 $launcher ranks and a standby: rank 1 is SIGKILLed at step 40, the 3 left carry on, the standby is taken back"
port=$(( port + 4 )) # the rendezvous, the desync board, the standby's rendezvous
launchn 5 --tolerate-a-dead-rank "$candle_target/debug/examples/elastic_job"
where=()
[ "$launcher" != mpirun ] || where=(MASTER_ADDR=127.0.0.1 MASTER_PORT="$port")
job_s=$(date +%s)
env "${where[@]}" timeout --kill-after=5 60 "${cmd[@]}" >"$logs/readme" 2>&1 &
job_pid=$!
victim=""
for ((i = 0; i < 3000; i++)); do
  victim="$(grep -m1 -E '^rank 1 of 4 \(pid [0-9]+\): step 40$' "$logs/readme" 2>/dev/null | grep -oE '[0-9]+\)' | tr -d ')' || true)"
  [ -n "$victim" ] && break
  sleep 0.01
done
[ -n "$victim" ] || { kill "$job_pid" 2>/dev/null || true; wait "$job_pid" || true; cat "$logs/readme"; fail "readme: rank 1 did not reach step 40 within 30 s"; }
kill -9 "$victim" || { wait "$job_pid" || true; cat "$logs/readme"; fail "readme: could not kill rank 1 (pid $victim)"; }
set +e
wait "$job_pid"
set -e
[ $(( $(date +%s) - job_s )) -lt 60 ] || { cat "$logs/readme"; fail "readme hung (killed after 60 s)"; }
shm_clean readme
# Each of the 4 ranks at the end prints its final loss: equal parameters, equal losses.
finals="$(grep -E '^done: rank [0-3] of 4 at step 200, ' "$logs/readme" || true)"
[ "$(count "$logs/readme" '^Error: ')" -eq 0 ] || { cat "$logs/readme"; fail "readme: a rank failed"; }
[ "$(printf '%s\n' "$finals" | awk '{print $3}' | sort -u | grep -c .)" -eq 4 ] \
  || { cat "$logs/readme"; fail "readme: expected ranks 0-3 of 4 to end at step 200"; }
[ "$(printf '%s\n' "$finals" | awk '{print $NF}' | sort -u | wc -l)" -eq 1 ] \
  || { cat "$logs/readme"; fail "readme: the 4 ranks' final losses differ"; }
[ "$(count "$logs/readme" '^done: rank [0-3] of 4 at step 200, 1 recoveries, ')" -eq 3 ] \
  && [ "$(count "$logs/readme" '^rank [0-2] of 3 ')" -gt 0 ] \
  || { cat "$logs/readme"; fail "readme: expected 3 ranks to recover once and step on 3 ranks"; }
echo "  rank 1 (pid $victim) SIGKILLed at step 40: 3 ranks carried on, the standby joined; 4 ranks at step 200, final loss $(printf '%s\n' "$finals" | awk 'NR == 1 {print $NF}') on each"

echo "test-processes ($launcher): OK in $(( $(date +%s) - t0 ))s"
