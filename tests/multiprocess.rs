//! The host provider with ranks in separate processes (a shared unique id, one process per
//! rank), as torchrun, srun or mpirun start them: every collective gives the same bytes as
//! ranks in threads, and a rank that is killed, skips a collective, leaves early, panics,
//! runs an extra collective or is stuck makes every other rank fail with an error naming
//! it and the user's file:line, well within the timeout, with nothing left in /dev/shm.
//!
//! Each test re-runs this test binary as its ranks (the child runs only that test, with
//! `NCCL_SAFE_TEST_MP` set); the parent checks their exit codes and output. With
//! `NCCL_SAFE_TEST_MP=launcher` the ranks come from torchrun, srun or mpirun instead and
//! exchange the id through the launcher (`scripts/test-processes.sh` runs the fault tests so, under mpirun and srun).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use half::f16;
use nccl_launch::desync::{BoardClient, DesyncBoard};
use nccl_launch::Launcher;
use nccl_safe::host::shared_unique_id;
use nccl_safe::{
    AsStream, CommDevice, Communicator, Config, Error, Group, NcclType, ReduceOp, Result, Stream,
    UniqueId,
};

const ENV: &str = "NCCL_SAFE_TEST_MP";
/// The host provider's wait limit in the children.
const TIMEOUT_MS: u64 = 8_000;
/// A child still running after this is hung.
const HUNG: Duration = Duration::from_secs(40);

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// A child's part: (rank, world size, communicator).
fn child() -> Option<(usize, usize, Communicator)> {
    let spec = std::env::var(ENV).ok()?;
    if spec == "launcher" {
        // Started by mpirun, srun or torchrun (scripts/test-processes.sh): the id comes
        // through the launcher's rendezvous.
        let rank = Launcher::from_env()
            .and_then(|l| {
                let (r, n) = (l.env().rank, l.env().world_size);
                l.host().config(staggered(Config::new(), r, n)).init()
            })
            .unwrap_or_else(|e| {
                eprintln!("init failed: {e}");
                std::process::exit(2)
            });
        let (r, n) = (rank.rank(), rank.world_size());
        return Some((r, n, rank.into_comm()));
    }
    let mut it = spec.split(':');
    let rank: usize = it.next()?.parse().ok()?;
    let n: usize = it.next()?.parse().ok()?;
    let hex = it.next()?;
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect();
    let id = UniqueId::from_bytes(&bytes).expect("a unique id");
    // A desync board when the test serves one, or rank 0 does (as under a launcher).
    if let (0, Ok(addr), Ok(_)) = (
        rank,
        std::env::var(BOARD_ENV),
        std::env::var(BOARD_SERVE_ENV),
    ) {
        let board = DesyncBoard::serve(&addr, n, BOARD_TOKEN).expect("serve the board");
        std::mem::forget(board); // served until the process ends
    }
    let config = match std::env::var(BOARD_ENV) {
        Ok(addr) => Config::new().desync_board(BoardClient::new(addr, n, BOARD_TOKEN)),
        Err(_) => Config::new(),
    };
    let config = staggered(config, rank, n);
    match Communicator::init_rank(&CommDevice::Host, n, rank, &id, &config) {
        Ok(c) => Some((rank, n, c)),
        Err(e) => {
            eprintln!("rank {rank}: init failed: {e}");
            std::process::exit(2)
        }
    }
}

/// With [`STAGGER_ENV`] set, watchdog timeouts one apart per rank, the last rank's first
/// and rank 0's last (under a launcher rank 0's process serves the desync board, which
/// goes when it exits).
fn staggered(config: Config, rank: usize, world: usize) -> Config {
    let ms = std::env::var(STAGGER_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    match ms {
        Some(ms) => config.timeout(Duration::from_millis(ms * (world - rank) as u64)),
        None => config,
    }
}

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn shm_files_of(pids: &[u32]) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    pids.iter()
                        .any(|p| n.starts_with(&format!("nccl-safe-{p}-")))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Runs test `name` as `n` processes and returns what each did (in rank order). Fails
/// the test when one hangs, or when something is left in /dev/shm.
fn spawn(name: &str, n: usize, extra: &[(&str, &str)]) -> Vec<Out> {
    let id = UniqueId::from_raw(shared_unique_id());
    let hex: String = id.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().expect("test binary");
    let mut kids: Vec<_> = (0..n)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args([name, "--exact", "--nocapture", "--test-threads=1"])
                .env(ENV, format!("{r}:{n}:{hex}"))
                .env("NCCL_SAFE_HOST_TIMEOUT_MS", TIMEOUT_MS.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra {
                c.env(k, v);
            }
            c.spawn().expect("spawn a rank")
        })
        .collect();
    let pids: Vec<u32> = kids.iter().map(|k| k.id()).collect();
    let start = Instant::now();
    let mut codes: Vec<Option<Option<i32>>> = vec![None; n];
    while codes.iter().any(|c| c.is_none()) {
        for (i, k) in kids.iter_mut().enumerate() {
            if codes[i].is_none() {
                if let Ok(Some(st)) = k.try_wait() {
                    codes[i] = Some(st.code());
                }
            }
        }
        if start.elapsed() > HUNG {
            for k in &mut kids {
                let _ = k.kill();
                let _ = k.wait();
            }
            panic!("{name}: a rank hung for {HUNG:?}: exit codes so far {codes:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let outs: Vec<Out> = kids
        .iter_mut()
        .zip(codes)
        .map(|(k, code)| {
            let (mut stdout, mut stderr) = (String::new(), String::new());
            if let Some(o) = k.stdout.as_mut() {
                let _ = o.read_to_string(&mut stdout);
            }
            if let Some(e) = k.stderr.as_mut() {
                let _ = e.read_to_string(&mut stderr);
            }
            Out {
                code: code.flatten(),
                stdout,
                stderr,
            }
        })
        .collect();
    for (r, o) in outs.iter().enumerate() {
        eprintln!("--- rank {r} exit {:?}\n{}{}", o.code, o.stdout, o.stderr);
    }
    let left = shm_files_of(&pids);
    assert!(left.is_empty(), "{name}: left in /dev/shm: {left:?}");
    outs
}

/// A value every element type holds exactly.
trait V: NcclType + Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static {
    fn of(v: i64) -> Self;
}
impl V for f32 {
    fn of(v: i64) -> Self {
        v as f32
    }
}
impl V for f64 {
    fn of(v: i64) -> Self {
        v as f64
    }
}
impl V for i32 {
    fn of(v: i64) -> Self {
        v as i32
    }
}
impl V for u8 {
    fn of(v: i64) -> Self {
        v as u8
    }
}
impl V for f16 {
    fn of(v: i64) -> Self {
        f16::from_f64(v as f64)
    }
}

fn input<T: V>(rank: usize, len: usize, salt: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::of(((rank * 31 + i * 7 + salt * 5) % 13) as i64 + 1))
        .collect()
}

/// Every collective, in every form, with every built-in reduction and a PreMulSum; the
/// outputs in order.
fn every_collective<T: V>(
    c: &Communicator,
    s: &impl AsStream,
    count: usize,
) -> Result<Vec<Vec<T>>> {
    let (r, n) = (c.rank(), c.world_size());
    let mut outs = Vec::new();
    let x = input::<T>(r, count, 0);
    for op in [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ] {
        let mut y = vec![T::default(); count];
        c.all_reduce(&x, &mut y, op, s)?;
        outs.push(y);
    }
    let pre = c.create_pre_mul_sum(T::of(r as i64 + 2))?;
    let mut y = vec![T::default(); count];
    c.all_reduce(&x, &mut y, &pre, s)?;
    outs.push(y);
    let mut y = input::<T>(r, count, 1);
    c.all_reduce_in_place(&mut y, ReduceOp::Sum, s)?;
    outs.push(y);
    let mut y = vec![T::default(); count];
    c.reduce(&x, &mut y, ReduceOp::Max, 1 % n, s)?;
    outs.push(y);
    let mut y = vec![T::default(); count];
    c.broadcast(&x, &mut y, 2 % n, s)?;
    outs.push(y);
    let mut y = input::<T>(r, count, 5);
    c.reduce_in_place(&mut y, ReduceOp::Prod, n - 1, s)?;
    outs.push(y);
    let mut y = input::<T>(r, count, 6);
    c.broadcast_in_place(&mut y, 1 % n, s)?;
    outs.push(y);
    let mut y = vec![T::default(); count * n];
    c.all_gather(&x, &mut y, s)?;
    outs.push(y);
    let mut y = input::<T>(r, count * n, 2);
    c.all_gather_in_place(&mut y, s)?;
    outs.push(y);
    let big = input::<T>(r, count * n, 3);
    let mut y = vec![T::default(); count];
    c.reduce_scatter(&big, &mut y, ReduceOp::Sum, s)?;
    outs.push(y);
    let mut y = big.clone();
    c.reduce_scatter_in_place(&mut y, ReduceOp::Min, s)?;
    outs.push(y);
    let mut y = vec![T::default(); count * n];
    c.all_to_all(&big, &mut y, s)?;
    outs.push(y);
    let mut y = vec![T::default(); count * n];
    c.gather(&x, &mut y, n - 1, s)?;
    outs.push(y);
    let mut y = vec![T::default(); count];
    c.scatter(&big, &mut y, 0, s)?;
    outs.push(y);
    // Two collectives in one group.
    let (mut y, mut z) = (vec![T::default(); count], vec![T::default(); count * n]);
    let mut g = Group::new();
    g.push(c.all_reduce_op(&x, &mut y, ReduceOp::Max, s)?)?;
    g.push(c.all_gather_op(&x, &mut z, s)?)?;
    g.end()?;
    outs.push(y);
    outs.push(z);
    // Send/receive rings in one group: a short message and one of many channel chunks.
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for len in [count, count * 97] {
        let send = input::<T>(r, len, 4);
        let mut got = vec![T::default(); len];
        let mut g = Group::new();
        g.push(c.send_op(&send, next, s)?)?;
        g.push(c.recv_op(&mut got, prev, s)?)?;
        g.end()?;
        outs.push(got);
    }
    // A split (the last rank opts out), and an all-reduce on the child.
    let color = if r == n - 1 && n > 2 {
        None
    } else {
        Some((r % 2) as u32)
    };
    if let Some(sub) = c.split(color, -(r as i32))? {
        let mut y = vec![T::default(); count];
        sub.all_reduce(&x, &mut y, ReduceOp::Sum, s)?;
        outs.push(y);
        outs.push(vec![
            T::of(sub.rank() as i64),
            T::of(sub.world_size() as i64),
        ]);
    }
    Ok(outs)
}

/// This rank's outputs against the same collectives on ranks in threads of this process.
fn check_type<T: V>(c: &Communicator, count: usize) -> bool {
    let (r, n) = (c.rank(), c.world_size());
    let mine =
        every_collective::<T>(c, &Stream::Host, count).expect("collectives across processes");
    let reference = Launcher::host(n)
        .run(move |rank| every_collective::<T>(rank.comm(), rank.stream(), count))
        .expect("collectives in threads");
    let same = mine == reference[r];
    if !same {
        let op = (0..mine.len()).find(|&i| mine[i] != reference[r][i]);
        eprintln!(
            "rank {r}: {} x {count}: collective {op:?} differs from ranks in threads",
            std::any::type_name::<T>()
        );
    }
    same
}

#[test]
fn every_collective_across_processes_matches_ranks_in_threads() {
    if let Some((_, _, c)) = child() {
        // Counts below, at and above a slot (4 KiB here), not multiples of the world size.
        let mut ok = true;
        for count in [0, 1, 7, 1000, 3001] {
            ok &= check_type::<f32>(&c, count);
            ok &= check_type::<f16>(&c, count);
            ok &= check_type::<i32>(&c, count);
            ok &= check_type::<u8>(&c, count);
            ok &= check_type::<f64>(&c, count);
        }
        drop(c);
        std::process::exit(if ok { 0 } else { 1 });
    }
    let outs = spawn(
        "every_collective_across_processes_matches_ranks_in_threads",
        3,
        &[("NCCL_SAFE_HOST_SHM_SLOT_BYTES", "4096")],
    );
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(0), "rank {r}: {}", o.stderr);
    }
}

/// The fault scenarios: `steps` all-reduces; `bad` does its fault at step 3
/// (`kill-first-attempt`: a SIGKILL in the first attempt of a torchrun job only):
/// - `kill`: SIGKILLs itself;
/// - `skip`: skips the step's collective;
/// - `leave`: returns early (drops its communicator and exits 0);
/// - `panic`: panics, unwinding through its communicator's drop;
/// - `extra`: runs one more all-reduce (of another size, on its own line) before the step's;
/// - `stuck`: sleeps in its own code, for twice the host provider's wait limit, while the
///   others wait in the step's collective.
fn faulty(fault: &str) {
    let Some((r, _, c)) = child() else { return };
    let attempt = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
    let fault = match fault {
        "kill-first-attempt" if attempt == "0" => "kill",
        "kill-first-attempt" => "none",
        f => f,
    };
    let bad: usize = std::env::var(BAD_RANK_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let fail = |step: usize, e: nccl_safe::Error| -> ! {
        // One write, so that lines of ranks under mpirun do not interleave.
        let text = format!("ERROR_AT_MS {:.1}\nrank {r} step {step}: {e}\n", now_ms());
        let _ = std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes());
        std::process::exit(1);
    };
    for step in 0..20 {
        // Sizes change with the step, as a training loop's buckets do, so a rank that
        // skips one is out of step with the others.
        let mut x = vec![1.0f32; (1 << 16) + step];
        if r == bad && step == 3 {
            match fault {
                "kill" => {
                    println!("KILLED_AT_MS {:.1}", now_ms());
                    // SAFETY: kill(2) on our own pid; nothing is touched.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                "skip" => continue,
                "stop" => {
                    // The whole process stops (SIGSTOP), its board server included; a
                    // shell sends SIGCONT after `STUCK_MS_ENV`.
                    let ms: u64 = std::env::var(STUCK_MS_ENV)
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(4000);
                    let pid = std::process::id();
                    let wake = format!("sleep {}; kill -CONT {pid}", ms as f64 / 1e3);
                    let mut waker = Command::new("sh").args(["-c", &wake]).spawn().expect("sh");
                    println!("STUCK_AT_MS {:.1}", now_ms());
                    // SAFETY: kill(2) on our own pid; nothing is touched.
                    unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
                    let _ = waker.wait(); // it woke us: reaped here
                }
                "none" => {}
                "panic" => {
                    println!("PANICKED_AT_MS {:.1}", now_ms());
                    panic!("rank 1 exploded");
                }
                "extra" => {
                    println!("EXTRA_LINE {}", line!() + 1);
                    let r = c.all_reduce_in_place(&mut [0.0f32; 8], ReduceOp::Sum, &Stream::Host);
                    if let Err(e) = r {
                        drop(c);
                        fail(step, e);
                    }
                }
                "stuck" => {
                    // Twice the host provider's wait limit, past which the others fail
                    // (or `STUCK_MS_ENV`'s, for the watchdog's timeout).
                    let limit: u64 = std::env::var("NCCL_SAFE_HOST_TIMEOUT_MS")
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(TIMEOUT_MS);
                    let sleep = std::env::var(STUCK_MS_ENV)
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(2 * limit);
                    println!("STUCK_AT_MS {:.1}", now_ms());
                    std::thread::sleep(Duration::from_millis(sleep));
                }
                _ => {
                    println!("LEFT_AT_MS {:.1}", now_ms());
                    drop(c);
                    std::process::exit(0);
                }
            }
        }
        if step == 0 {
            // The line of the all_reduce below, which every rank's report names.
            println!("CALL_LINE {}", line!() + 2);
        }
        if let Err(e) = c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host) {
            println!("LOST_RANK {:?}", c.lost_rank());
            println!("LOST_RANKS {:?}", c.lost_ranks());
            drop(c);
            fail(step, e);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("RANK {r} COMPLETED ATTEMPT {attempt:?}");
    drop(c);
    std::process::exit(0);
}

fn stamp(o: &Out, key: &str) -> Option<f64> {
    stamp_in(&o.stdout, key)
}

fn stamp_in(text: &str, key: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.find(key).map(|i| &l[i + key.len()..]))
        .and_then(|v| v.trim().parse().ok())
}

/// Checks every rank but 1 failed naming rank 1 (with `what` in its error) and the line
/// it called the collective from, and returns the slowest survivor's time from `key`'s
/// stamp on rank 1 to its error.
fn survivors_name_rank_1(outs: &[Out], key: &str, what: &str) -> Option<f64> {
    let t0 = stamp(&outs[1], key);
    let mut worst: Option<f64> = None;
    for (r, o) in outs.iter().enumerate().filter(|(r, _)| *r != 1) {
        assert_eq!(o.code, Some(1), "rank {r} must fail: {}", o.stderr);
        assert!(
            o.stderr.contains(what),
            "rank {r}'s error must say {what:?}: {}",
            o.stderr
        );
        let line = stamp(o, "CALL_LINE").expect("the call's line");
        let at = format!("called at tests/multiprocess.rs:{line}");
        assert!(
            o.stderr.contains(&at),
            "rank {r}'s error must name the user's line ({at}): {}",
            o.stderr
        );
        if let (Some(t0), Some(t)) = (t0, stamp_in(&o.stderr, "ERROR_AT_MS")) {
            worst = Some(worst.unwrap_or(0.0).max(t - t0));
        }
    }
    worst
}

/// Under `torchrun --max-restarts 1` (run so by `scripts/test-torchrun.sh`): rank 1 is
/// SIGKILLed in the first attempt, torchrun stops the others and restarts the job, and the
/// second attempt exchanges a fresh id under its own keys and completes.
#[test]
#[ignore = "run under torchrun --max-restarts 1 by scripts/test-torchrun.sh"]
fn a_job_restarted_by_torchrun_completes_on_fresh_keys() {
    assert!(
        std::env::var_os("TORCHELASTIC_RESTART_COUNT").is_some(),
        "run under torchrun"
    );
    faulty("kill-first-attempt");
    panic!("{ENV} must be `launcher`: the ranks come from torchrun");
}

#[test]
fn a_killed_rank_fails_every_other_rank_naming_it() {
    faulty("kill");
    let outs = spawn("a_killed_rank_fails_every_other_rank_naming_it", 4, &[]);
    assert_eq!(outs[1].code, None, "rank 1 was killed by a signal");
    let t =
        survivors_name_rank_1(&outs, "KILLED_AT_MS", "rank 1 (pid").expect("kill and error times");
    assert!(
        outs.iter()
            .enumerate()
            .all(|(r, o)| r == 1 || o.stderr.contains("died")),
        "the error says the process died"
    );
    eprintln!("time from SIGKILL to the last survivor's error: {t:.1} ms");
    assert!(t < (TIMEOUT_MS + 1000) as f64, "errors took {t} ms");
}

#[test]
fn a_rank_that_skips_a_collective_is_named_on_every_rank() {
    faulty("skip");
    let outs = spawn(
        "a_rank_that_skips_a_collective_is_named_on_every_rank",
        4,
        &[],
    );
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(1), "rank {r} must fail: {}", o.stderr);
        assert!(
            o.stderr.contains("rank(s) [1] called something else"),
            "rank {r} must name rank 1: {}",
            o.stderr
        );
        // And the line rank 1 (and every rank) called from.
        let line = stamp(o, "CALL_LINE").expect("the call's line") as u32;
        let rank_1 = o
            .stderr
            .split("; ")
            .find(|s| s.starts_with("rank 1: collective #3 "))
            .unwrap_or_else(|| panic!("rank {r} does not say what rank 1 called: {}", o.stderr));
        assert!(
            rank_1.ends_with(&format!(" at tests/multiprocess.rs:{line}"))
                || rank_1.contains(&format!(" at tests/multiprocess.rs:{line}\n")),
            "rank {r} does not name rank 1's line {line}: {rank_1}"
        );
    }
}

#[test]
fn a_rank_that_leaves_early_fails_the_others_naming_it() {
    faulty("leave");
    let outs = spawn(
        "a_rank_that_leaves_early_fails_the_others_naming_it",
        4,
        &[],
    );
    assert_eq!(outs[1].code, Some(0), "rank 1 left cleanly");
    let t = survivors_name_rank_1(&outs, "LEFT_AT_MS", "destroyed its communicator")
        .expect("leave and error times");
    eprintln!("time from rank 1's exit to the last survivor's error: {t:.1} ms");
    assert!(t < (TIMEOUT_MS + 1000) as f64, "errors took {t} ms");
}

/// Rank 1 panics mid-job, unwinding through its communicator's drop, which posts why it
/// leaves to the job's desync board (here served by the test, as a launcher's rank 0 serves
/// it) before it aborts: every other rank fails at once naming rank 1, saying that it
/// panicked and its last call's line, not the provider's "called ncclCommAbort".
#[test]
fn a_rank_that_panics_is_named_by_every_other_rank_as_panicked() {
    faulty("panic");
    let board = DesyncBoard::serve("127.0.0.1:0", 4, BOARD_TOKEN).unwrap();
    let addr = board.local_addr().to_string();
    let outs = spawn(
        "a_rank_that_panics_is_named_by_every_other_rank_as_panicked",
        4,
        &[(BOARD_ENV, &addr)],
    );
    assert_eq!(
        outs[1].code,
        Some(101),
        "rank 1 panicked: {}",
        outs[1].stderr
    );
    let t = survivors_name_rank_1(&outs, "PANICKED_AT_MS", "rank 1 left: it panicked")
        .expect("panic and error times");
    let line = stamp(&outs[1], "CALL_LINE").expect("the call's line");
    for (r, o) in outs.iter().enumerate().filter(|(r, _)| *r != 1) {
        assert!(
            o.stderr.contains(&format!(
                "its last call was ncclAllReduce(float x 65538) seq 2 at tests/multiprocess.rs:{line}"
            )),
            "rank {r} must name rank 1's last call and its line: {}",
            o.stderr
        );
    }
    eprintln!("time from rank 1's panic to the last survivor's error: {t:.1} ms");
    assert!(t < 3000.0, "errors took {t} ms");
}

/// Rank 1 runs one all-reduce more than the others, from its own line: every rank fails
/// at once naming rank 1, what it called and that line, next to the line of the others.
#[test]
fn a_rank_that_runs_an_extra_collective_is_named_with_its_line() {
    faulty("extra");
    let outs = spawn(
        "a_rank_that_runs_an_extra_collective_is_named_with_its_line",
        4,
        &[],
    );
    let extra = stamp(&outs[1], "EXTRA_LINE").expect("the extra call's line");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(1), "rank {r} must fail: {}", o.stderr);
        let line = stamp(o, "CALL_LINE").expect("the call's line");
        let mine = if r == 1 { extra } else { line };
        for want in [
            "rank(s) [1] called something else".to_string(),
            format!(
                "rank 1: collective #3 ncclAllReduce(count=8, float32, sum, root=0) at tests/multiprocess.rs:{extra};"
            ),
            format!(
                "rank 0: collective #3 ncclAllReduce(count=65539, float32, sum, root=0) at tests/multiprocess.rs:{line};"
            ),
            format!("called at tests/multiprocess.rs:{mine})"),
        ] {
            assert!(o.stderr.contains(&want), "rank {r} must say {want:?}: {}", o.stderr);
        }
    }
}

/// The host provider's wait limit for [`a_stuck_rank_is_named_as_behind_within_the_host_timeout`].
const STUCK_TIMEOUT_MS: u64 = 1000;

/// Rank 1 sleeps in its own code, far past the timeout, while the others wait for it in a
/// collective: at the host timeout every other rank fails naming rank 1 as the rank that did
/// not reach the collective, and the line they wait at.
#[test]
fn a_stuck_rank_is_named_as_behind_within_the_host_timeout() {
    faulty("stuck");
    let outs = spawn(
        "a_stuck_rank_is_named_as_behind_within_the_host_timeout",
        4,
        &[("NCCL_SAFE_HOST_TIMEOUT_MS", &STUCK_TIMEOUT_MS.to_string())],
    );
    let t =
        survivors_name_rank_1(&outs, "STUCK_AT_MS", "rank 1 (pid").expect("stuck and error times");
    for (r, o) in outs.iter().enumerate().filter(|(r, _)| *r != 1) {
        assert!(
            o.stderr
                .contains(") did not reach collective #3 by the deadline"),
            "rank {r} must say rank 1 is behind: {}",
            o.stderr
        );
    }
    eprintln!("time from rank 1's stop to the last survivor's error: {t:.1} ms");
    assert!(
        t > (STUCK_TIMEOUT_MS - 100) as f64 && t < (STUCK_TIMEOUT_MS + 1000) as f64,
        "errors took {t} ms (timeout {STUCK_TIMEOUT_MS} ms)"
    );
}

/// How long rank 1 of the `stuck` fault sleeps, when set (ms).
const STUCK_MS_ENV: &str = "NCCL_SAFE_TEST_STUCK_MS";
/// When set (ms), rank r's watchdog timeout is world size - r times it.
const STAGGER_ENV: &str = "NCCL_SAFE_TEST_STAGGER_MS";

/// The stuck rank again, now found by the watchdog (well before the provider's 8 s), with
/// a desync board as under a launcher. Watchdogs fire apart (on GPUs by the moments each
/// rank enqueued; here rank 3's at 1 s, the others' 1 s later each), so the first to abort
/// gives the others NCCL's remote error ("rank 3 called ncclCommAbort") before their own
/// timeout. Every survivor still names rank 1 as behind: the host provider's shared memory
/// says it never reached collective #3 (and it posted nothing on the board).
#[test]
fn a_stuck_rank_is_named_by_every_survivor_when_the_watchdog_fires() {
    faulty("stuck");
    let board = DesyncBoard::serve("127.0.0.1:0", 4, BOARD_TOKEN).unwrap();
    let addr = board.local_addr().to_string();
    let outs = spawn(
        "a_stuck_rank_is_named_by_every_survivor_when_the_watchdog_fires",
        4,
        &[
            (BOARD_ENV, &addr),
            (STAGGER_ENV, "1000"),
            ("NCCL_SAFE_HOST_TIMEOUT_MS", "8000"),
            (STUCK_MS_ENV, "4000"),
        ],
    );
    let t = survivors_name_rank_1(&outs, "STUCK_AT_MS", "rank(s) [1] are behind")
        .expect("stuck and error times");
    eprintln!("time from rank 1's stop to the last survivor's error: {t:.1} ms");
    // Rank 3 at its 1 s timeout; the others after their report waited for rank 1's post
    // (half their own timeout): all before the provider gives up at 8 s.
    assert!(t < 6000.0, "errors took {t} ms (watchdog timeouts 1-4 s)");
    // The timeout found rank 1 the only one behind: the rank each survivor lost, so an
    // elastic loop shrinks without it.
    for r in [0, 2, 3] {
        assert!(
            outs[r].stdout.contains("LOST_RANK Some(1)"),
            "rank {r}: {}",
            outs[r].stdout
        );
    }
}

/// The stuck rank with no desync board (a plain `init_rank`, as the elastic example
/// makes it): rank 3's watchdog fires first (1 s) and aborts its communicator, which
/// fails the collective for everyone. Every survivor names rank 1: rank 3's report finds
/// it behind from the host provider's shared memory (`lost_rank()` is 1), and ranks 0 and
/// 2 are told that rank 1 had not reached the collective (stuck or gone), which
/// `lost_ranks()` counts. Before, ranks 0 and 2 were told only "rank 3 (pid P) called
/// ncclCommAbort" (a healthy rank whose watchdog fired first), and rank 3's report said
/// that no rank in this process was behind: rank 1 was named nowhere.
#[test]
fn a_stuck_rank_is_named_without_a_board() {
    faulty("stuck");
    let outs = spawn(
        "a_stuck_rank_is_named_without_a_board",
        4,
        &[
            (STAGGER_ENV, "1000"),
            ("NCCL_SAFE_HOST_TIMEOUT_MS", "8000"),
            (STUCK_MS_ENV, "4000"),
        ],
    );
    let lost = |o: &Out| {
        (o.stdout.lines())
            .find_map(|l| Some(l.split_once("LOST_RANKS ")?.1.trim().to_string()))
            .unwrap_or_default()
    };
    for r in [0, 2] {
        let o = &outs[r];
        assert_eq!(o.code, Some(1), "rank {r} must fail: {}", o.stderr);
        let pid = "rank 1 (pid ";
        let stuck = "had not reached that collective: it is stuck or gone";
        assert!(
            o.stderr.contains(pid) && o.stderr.contains(stuck),
            "rank {r}: {}",
            o.stderr
        );
        // (Rank 3 may be counted too: it exits once it failed.)
        assert!(lost(o).contains('1'), "rank {r}: {}", o.stdout);
    }
    let o = &outs[3];
    assert_eq!(o.code, Some(1), "rank 3 must fail: {}", o.stderr);
    assert!(
        o.stderr.contains("rank(s) [1] are behind"),
        "rank 3: {}",
        o.stderr
    );
    assert!(
        o.stdout.contains("LOST_RANK Some(1)"),
        "rank 3: {}",
        o.stdout
    );
}

/// Rank 0 stopped (SIGSTOP) while it hosts the desync board, as under a launcher: the
/// survivors cannot read the board, and name rank 0 from the host provider's shared memory
/// instead (the report of rank 3, whose watchdog fires first, finds it behind, without
/// waiting on the board, and the others are told it had not reached the collective):
/// `lost_ranks()` has 0 on every survivor. Before, the reports said "the desync board
/// could not be read" and named nobody.
#[test]
fn a_stopped_rank_0_that_hosts_the_board_is_named() {
    faulty("stop");
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let outs = spawn(
        "a_stopped_rank_0_that_hosts_the_board_is_named",
        4,
        &[
            (BOARD_ENV, &addr),
            (BOARD_SERVE_ENV, "1"),
            (BAD_RANK_ENV, "0"),
            (STAGGER_ENV, "1000"),
            ("NCCL_SAFE_HOST_TIMEOUT_MS", "8000"),
            (STUCK_MS_ENV, "4000"),
        ],
    );
    for (r, o) in outs.iter().enumerate().skip(1) {
        assert_eq!(o.code, Some(1), "rank {r} must fail: {}", o.stderr);
        assert!(
            !o.stderr.contains("could not be read"),
            "rank {r}: {}",
            o.stderr
        );
        let lost = (o.stdout.lines())
            .find_map(|l| Some(l.split_once("LOST_RANKS ")?.1.trim().to_string()))
            .unwrap_or_default();
        assert!(lost.starts_with("[0"), "rank {r}: {}", o.stdout);
    }
    assert!(
        outs[3].stdout.contains("LOST_RANK Some(0)"),
        "{}",
        outs[3].stdout
    );
}

/// Which rank [`faulty`] makes the bad one (1 when unset).
const BAD_RANK_ENV: &str = "NCCL_SAFE_TEST_BAD_RANK";
/// When set, rank 0 serves the desync board at [`BOARD_ENV`]'s address.
const BOARD_SERVE_ENV: &str = "NCCL_SAFE_TEST_MP_BOARD_SERVE";

/// The desync board's address for [`silent_leave`]'s children.
const BOARD_ENV: &str = "NCCL_SAFE_TEST_MP_BOARD";
const BOARD_TOKEN: &str = "multiprocess-departure-token";

/// Rank 1 leaves (drops its communicator and exits) while the others go on; the provider
/// does not tell them ([`Fault::SilentPeers`], as NVIDIA's NCCL does not), so only the
/// departure rank 1 posted to the desync board can end their wait before the provider's
/// deadline (8 s) or the watchdog's timeout (60 s).
fn silent_leave() {
    let Ok(spec) = std::env::var(ENV) else { return };
    let mut it = spec.split(':');
    let (Some(r), Some(n), Some(hex)) = (it.next(), it.next(), it.next()) else {
        std::process::exit(3)
    };
    let (r, n): (usize, usize) = (r.parse().unwrap(), n.parse().unwrap());
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect();
    let id = UniqueId::from_bytes(&bytes).expect("a unique id");
    nccl_safe::host::fault::inject(&id.to_raw(), nccl_safe::host::fault::Fault::SilentPeers);
    let addr = std::env::var(BOARD_ENV).expect("the board's address");
    let config = Config::new()
        .timeout(Duration::from_secs(60))
        .desync_board(BoardClient::new(addr, n, BOARD_TOKEN));
    let c = Communicator::init_rank(&CommDevice::Host, n, r, &id, &config).unwrap_or_else(|e| {
        eprintln!("rank {r}: init failed: {e}");
        std::process::exit(2)
    });
    for step in 0..20 {
        if r == 1 && step == 3 {
            println!("LEFT_AT_MS {:.1}", now_ms());
            drop(c);
            std::process::exit(0);
        }
        let mut x = vec![1.0f32; 1024];
        if let Err(e) = c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host) {
            let text = format!("ERROR_AT_MS {:.1}\nrank {r} step {step}: {e}\n", now_ms());
            let _ = std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes());
            drop(c);
            std::process::exit(1);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::process::exit(0);
}

/// Across processes a departure reaches the peers through the desync board, within about
/// a second, with a provider that does not tell them (as NVIDIA's NCCL).
#[test]
fn a_rank_that_leaves_reaches_other_processes_through_the_board() {
    silent_leave();
    let board = DesyncBoard::serve("127.0.0.1:0", 4, BOARD_TOKEN).unwrap();
    let addr = board.local_addr().to_string();
    let outs = spawn(
        "a_rank_that_leaves_reaches_other_processes_through_the_board",
        4,
        &[(BOARD_ENV, &addr)],
    );
    assert_eq!(outs[1].code, Some(0), "rank 1 left cleanly");
    let left = stamp(&outs[1], "LEFT_AT_MS").expect("rank 1's leave time");
    let (mut t, mut through_board) = (0.0f64, 0);
    for (r, o) in outs.iter().enumerate().filter(|(r, _)| *r != 1) {
        assert_eq!(o.code, Some(1), "rank {r} must fail: {}", o.stderr);
        // Each survivor learns it from the board, or from a peer's abort that the board
        // caused first (the provider passes aborts on).
        let board = o.stderr.contains(
            "rank 1 left: its communicator was dropped after 3 collective(s); its last call was ncclAllReduce",
        ) && o.stderr.contains("(another process, from the desync board)");
        assert!(
            board || o.stderr.contains("called ncclCommAbort"),
            "rank {r}: {}",
            o.stderr
        );
        through_board += usize::from(board);
        let at = stamp_in(&o.stderr, "ERROR_AT_MS").expect("the error's time");
        t = t.max(at - left);
    }
    assert!(through_board > 0, "no rank learned it from the board");
    eprintln!("time from rank 1's exit to the last survivor's error, through the board: {t:.1} ms");
    assert!(
        t < 3000.0,
        "errors took {t} ms (the provider's deadline is {TIMEOUT_MS} ms)"
    );
}

/// Ranks that are threads of several processes share one communicator: 2 processes x 2
/// threads, every collective as in one process.
#[test]
fn threads_of_several_processes_share_one_communicator() {
    const THREADS: usize = 2;
    if let Ok(spec) = std::env::var(ENV) {
        let parts: Vec<&str> = spec.split(':').collect();
        let (p, procs): (usize, usize) = (parts[0].parse().unwrap(), parts[1].parse().unwrap());
        let bytes: Vec<u8> = (0..parts[2].len() / 2)
            .map(|i| u8::from_str_radix(&parts[2][2 * i..2 * i + 2], 16).unwrap_or(0))
            .collect();
        let id = UniqueId::from_bytes(&bytes).expect("a unique id");
        let n = procs * THREADS;
        let mine: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let id = &id;
                    s.spawn(move || {
                        let c = Communicator::init_rank(
                            &CommDevice::Host,
                            n,
                            p * THREADS + t,
                            id,
                            &Config::new(),
                        )?;
                        every_collective::<f32>(&c, &Stream::Host, 1000)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a rank thread").expect("collectives"))
                .collect()
        });
        let reference = Launcher::host(n)
            .run(|rank| every_collective::<f32>(rank.comm(), rank.stream(), 1000))
            .expect("collectives in threads");
        let ok = (0..THREADS).all(|t| mine[t] == reference[p * THREADS + t]);
        if !ok {
            eprintln!("process {p}: differs from ranks in threads");
        }
        std::process::exit(if ok { 0 } else { 1 });
    }
    let outs = spawn(
        "threads_of_several_processes_share_one_communicator",
        2,
        &[("NCCL_SAFE_HOST_SHM_SLOT_BYTES", "8192")],
    );
    for (p, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(0), "process {p}: {}", o.stderr);
    }
}

/// Ranks 0, 2 and 3 shrink the communicator without rank 1 (which calls nothing more)
/// and go on with three ranks.
#[test]
fn ranks_shrink_a_communicator_across_processes() {
    if let Some((r, _, c)) = child() {
        let mut x = vec![1.0f32; 1000];
        for _ in 0..3 {
            c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
                .expect("all_reduce");
        }
        if r == 1 {
            std::thread::sleep(Duration::from_millis(500));
            std::process::exit(0);
        }
        let run = || -> Result<(usize, usize, f32)> {
            let small = c.shrink(&[1])?;
            let mut y = vec![(r + 1) as f32; 1000];
            small.all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)?;
            Ok((small.rank(), small.world_size(), y[999]))
        };
        match run() {
            Ok((sr, sn, sum)) => {
                println!("SHRUNK rank {sr} of {sn}: sum {sum}");
                std::process::exit(0)
            }
            Err(e) => {
                eprintln!("rank {r}: shrink: {e}");
                std::process::exit(3)
            }
        }
    }
    let outs = spawn("ranks_shrink_a_communicator_across_processes", 4, &[]);
    for (r, new) in [(0, 0), (2, 1), (3, 2)] {
        assert_eq!(outs[r].code, Some(0), "rank {r}: {}", outs[r].stderr);
        // Ranks 0, 2 and 3 contribute 1 + 3 + 4.
        assert!(
            outs[r]
                .stdout
                .contains(&format!("SHRUNK rank {new} of 3: sum 8")),
            "rank {r}: {}",
            outs[r].stdout
        );
    }
}

/// The rank and id a child of [`spawn`] was given, without an init (for tests whose
/// ranks do not all join the same communicator).
fn child_spec() -> Option<(usize, UniqueId)> {
    let spec = std::env::var(ENV).ok()?;
    let mut it = spec.split(':');
    let rank: usize = it.next()?.parse().ok()?;
    let _n: usize = it.next()?.parse().ok()?;
    let hex = it.next()?;
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect();
    Some((rank, UniqueId::from_bytes(&bytes).expect("a unique id")))
}

const GROW_FILE_ENV: &str = "NCCL_SAFE_TEST_GROW_FILE";

/// Two processes make a communicator; the root (rank 0) takes a grow id and hands it,
/// through a file, to a third process, which joins as rank 2 while ranks 0 and 1 grow
/// (`ncclCommGrow`). The grown communicator's all_reduce is right on every rank.
#[test]
fn a_process_joins_a_communicator_grown_across_processes() {
    if let Some((r, id)) = child_spec() {
        let file = std::path::PathBuf::from(std::env::var(GROW_FILE_ENV).expect("file"));
        let run = || -> Result<(usize, usize, f32)> {
            let big = if r < 2 {
                let c = Communicator::init_rank(&CommDevice::Host, 2, r, &id, &Config::new())?;
                let big = if r == 0 {
                    let gid = c.grow_id()?;
                    let tmp = file.with_extension("tmp");
                    std::fs::write(&tmp, gid.as_bytes()).expect("write the id");
                    std::fs::rename(&tmp, &file).expect("publish the id");
                    c.grow(3, Some(&gid))?
                } else {
                    c.grow(3, None)?
                };
                c.destroy().map_err(|(_, e)| e)?;
                big
            } else {
                let deadline = Instant::now() + Duration::from_secs(20);
                let bytes = loop {
                    if let Ok(b) = std::fs::read(&file) {
                        break b;
                    }
                    assert!(Instant::now() < deadline, "no grow id");
                    std::thread::sleep(Duration::from_millis(5));
                };
                let gid = UniqueId::from_bytes(&bytes)?;
                Communicator::join_grown(&CommDevice::Host, 3, 2, &gid, &Config::new())?
            };
            let mut y = vec![(r + 1) as f32; 1000];
            big.all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)?;
            Ok((big.rank(), big.world_size(), y[999]))
        };
        match run() {
            Ok((gr, gn, sum)) => {
                println!("GROWN rank {gr} of {gn}: sum {sum}");
                std::process::exit(0)
            }
            Err(e) => {
                eprintln!("rank {r}: grow: {e}");
                std::process::exit(3)
            }
        }
    }
    let dir = std::env::temp_dir().join(format!("nccl-safe-grow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("id");
    let outs = spawn(
        "a_process_joins_a_communicator_grown_across_processes",
        3,
        &[(GROW_FILE_ENV, file.to_str().unwrap())],
    );
    let _ = std::fs::remove_dir_all(&dir);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(0), "rank {r}: {}", o.stderr);
        assert!(
            o.stdout.contains(&format!("GROWN rank {r} of 3: sum 6")),
            "rank {r}: {}",
            o.stdout
        );
    }
}

/// As above, but the standby process SIGKILLs itself once it has the id, before it joins.
/// Ranks 0 and 1 (timeout 1 s) see their grow fail, and carry on: their communicator is
/// untouched (an all-reduce on it is right), nothing is left in /dev/shm (the grown
/// communicator's segment neither), and both exit 0. Before, the grow's timeout failed the
/// parent (the watchdog aborted it) and the segment stayed.
#[test]
fn a_standby_killed_before_it_joins_costs_the_grow_only() {
    if let Some((r, id)) = child_spec() {
        let file = std::path::PathBuf::from(std::env::var(GROW_FILE_ENV).expect("file"));
        if r == 2 {
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::fs::metadata(&file).is_err() {
                assert!(Instant::now() < deadline, "no grow id");
                std::thread::sleep(Duration::from_millis(5));
            }
            // SAFETY: signals this process, which ends here.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let run = || -> Result<f32> {
            let cfg = Config::new().timeout(Duration::from_secs(1));
            let c = Communicator::init_rank(&CommDevice::Host, 2, r, &id, &cfg)?;
            let gid = if r == 0 {
                let gid = c.grow_id()?;
                let path = nccl_safe::host::shared_segment_path(&gid.to_raw()).expect("shared");
                println!("GROW_SEGMENT {path}");
                let tmp = file.with_extension("tmp");
                std::fs::write(&tmp, gid.as_bytes()).expect("write the id");
                std::fs::rename(&tmp, &file).expect("publish the id");
                Some(gid)
            } else {
                None
            };
            let e = c
                .grow(3, gid.as_ref())
                .map(drop)
                .expect_err("nobody joined");
            println!("GROW_FAILED rank {r}: {e}");
            assert!(!c.is_failed(), "{e}");
            let mut y = vec![(r + 1) as f32; 1000];
            c.all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)?;
            c.destroy().map_err(|(_, e)| e)?;
            Ok(y[999])
        };
        match run() {
            Ok(sum) => {
                println!("CARRIED_ON rank {r}: sum {sum}");
                std::process::exit(0)
            }
            Err(e) => {
                eprintln!("rank {r}: {e}");
                std::process::exit(3)
            }
        }
    }
    let dir = std::env::temp_dir().join(format!("nccl-safe-standby-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("id");
    let outs = spawn(
        "a_standby_killed_before_it_joins_costs_the_grow_only",
        3,
        &[(GROW_FILE_ENV, file.to_str().unwrap())],
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        outs[2].code, None,
        "the standby was killed: {}",
        outs[2].stderr
    );
    for (r, o) in outs.iter().take(2).enumerate() {
        assert_eq!(o.code, Some(0), "rank {r}: {}", o.stderr);
        assert!(
            o.stdout.contains(&format!("GROW_FAILED rank {r}: ")),
            "rank {r}: {}",
            o.stdout
        );
        assert!(o.stdout.contains("stays usable"), "rank {r}: {}", o.stdout);
        assert!(
            o.stdout.contains(&format!("CARRIED_ON rank {r}: sum 3")),
            "rank {r}: {}",
            o.stdout
        );
    }
    let segment =
        (outs[0].stdout.lines()).find_map(|l| Some(l.split_once("GROW_SEGMENT ")?.1.trim()));
    let segment = segment.expect("rank 0 named the grow's segment");
    assert!(
        !std::path::Path::new(segment).exists(),
        "{segment} was left"
    );
}

/// As above, but the standby dies after it registered: it joins with the id (its rank
/// posted to the grown communicator's shared segment), and SIGKILLs itself 200 ms later,
/// before ranks 0 and 1 call their grow. Their grow (or, on the host provider, the grown
/// communicator's first all-reduce) fails within its bound, and they carry on at their
/// size (an all-reduce on the parent is right) and exit 0.
#[test]
fn a_standby_killed_after_it_registered_costs_the_grow_only() {
    if let Some((r, id)) = child_spec() {
        let file = std::path::PathBuf::from(std::env::var(GROW_FILE_ENV).expect("file"));
        let killed = file.with_extension("killed");
        if r == 2 {
            let deadline = Instant::now() + Duration::from_secs(20);
            let bytes = loop {
                if let Ok(b) = std::fs::read(&file) {
                    break b;
                }
                assert!(Instant::now() < deadline, "no grow id");
                std::thread::sleep(Duration::from_millis(5));
            };
            let gid = UniqueId::from_bytes(&bytes).expect("a grow id");
            std::thread::spawn(move || {
                let cfg = Config::new().timeout(Duration::from_secs(30));
                let _ = Communicator::join_grown(&CommDevice::Host, 3, 2, &gid, &cfg);
            });
            std::thread::sleep(Duration::from_millis(200));
            std::fs::write(&killed, b"").expect("write the marker");
            // SAFETY: signals this process, which ends here.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let run = || -> Result<f32> {
            let cfg = Config::new().timeout(Duration::from_secs(1));
            let c = Communicator::init_rank(&CommDevice::Host, 2, r, &id, &cfg)?;
            let gid = if r == 0 {
                let gid = c.grow_id()?;
                let tmp = file.with_extension("tmp");
                std::fs::write(&tmp, gid.as_bytes()).expect("write the id");
                std::fs::rename(&tmp, &file).expect("publish the id");
                Some(gid)
            } else {
                None
            };
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::fs::metadata(&killed).is_err() {
                assert!(Instant::now() < deadline, "the standby never registered");
                std::thread::sleep(Duration::from_millis(5));
            }
            let t0 = Instant::now();
            // NCCL's init over the id needs every rank after it registered (its bootstrap),
            // so the grow fails. The host provider completes the join once every rank
            // posted to the segment, and the dead standby is seen only by the grown
            // communicator's first collective: either way the failure costs the bound.
            let e = match c.grow(3, gid.as_ref()) {
                Err(e) => e,
                Ok(big) => {
                    let mut z = vec![1.0f32; 4];
                    big.all_reduce_in_place(&mut z, ReduceOp::Sum, &Stream::Host)
                        .expect_err("the standby died")
                }
            };
            let took = t0.elapsed();
            println!("GROW_FAILED rank {r} after {took:?}: {e}");
            assert!(took < Duration::from_secs(5), "{took:?}: {e}");
            assert!(!c.is_failed(), "{e}");
            let mut y = vec![(r + 1) as f32; 1000];
            c.all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)?;
            c.destroy().map_err(|(_, e)| e)?;
            Ok(y[999])
        };
        match run() {
            Ok(sum) => {
                println!("CARRIED_ON rank {r}: sum {sum}");
                std::process::exit(0)
            }
            Err(e) => {
                eprintln!("rank {r}: {e}");
                std::process::exit(3)
            }
        }
    }
    let dir = std::env::temp_dir().join(format!("nccl-safe-registered-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("id");
    let outs = spawn(
        "a_standby_killed_after_it_registered_costs_the_grow_only",
        3,
        &[(GROW_FILE_ENV, file.to_str().unwrap())],
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        outs[2].code, None,
        "the standby was killed: {}",
        outs[2].stderr
    );
    for (r, o) in outs.iter().take(2).enumerate() {
        assert_eq!(o.code, Some(0), "rank {r}: {}\n{}", o.stderr, o.stdout);
        assert!(
            o.stdout.contains(&format!("CARRIED_ON rank {r}: sum 3")),
            "rank {r}: {}",
            o.stdout
        );
    }
}

/// Three processes; rank 1 SIGKILLs itself between two all-reduces. The survivors'
/// all_reduce fails naming it (NCCL records the error), they shrink in abort mode (on the
/// host provider, as NCCL 2.29: a revoke first clears the error) and carry on with two
/// ranks, with right results.
#[test]
fn survivors_of_a_killed_process_shrink_and_carry_on() {
    if let Some((r, _, c)) = child() {
        let mut x = vec![1.0f32; 1000];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect("all_reduce");
        if r == 1 {
            // SAFETY: kill(2) on our own pid; nothing is touched.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let e = c
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect_err("rank 1 is dead");
        println!("FAILED {e}");
        let run = || -> Result<(usize, usize, f32)> {
            let small = c.shrink_after_failure(&[1])?;
            let mut y = vec![(r + 1) as f32; 1000];
            small.all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)?;
            Ok((small.rank(), small.world_size(), y[999]))
        };
        match run() {
            Ok((sr, sn, sum)) => {
                println!(
                    "SHRUNK rank {sr} of {sn}: sum {sum}, revoked {}",
                    c.is_revoked()
                );
                std::process::exit(0)
            }
            Err(e) => {
                eprintln!("rank {r}: shrink_after_failure: {e}");
                std::process::exit(3)
            }
        }
    }
    let outs = spawn("survivors_of_a_killed_process_shrink_and_carry_on", 3, &[]);
    assert_eq!(outs[1].code, None, "rank 1 was killed by a signal");
    for (r, new) in [(0, 0), (2, 1)] {
        assert_eq!(outs[r].code, Some(0), "rank {r}: {}", outs[r].stderr);
        assert!(
            outs[r]
                .stdout
                .contains(&format!("SHRUNK rank {new} of 2: sum 4, revoked true")),
            "rank {r}: {}",
            outs[r].stdout
        );
    }
}

/// Three processes with elastic communicators ([`Config::elastic`]); rank 1 is SIGKILLed
/// while ranks 0 and 2 wait for it inside an all-reduce. Each survivor's all-reduce fails,
/// its communicator reads failed, and it knows which rank it lost (`lost_rank()`, from the
/// provider's report that rank 1's process is gone: a SIGKILLed process posts no
/// departure), so it shrinks without that rank, chosen by itself, and carries on.
#[test]
fn survivors_of_a_process_killed_mid_collective_know_which_rank_they_lost() {
    if let Some((r, id)) = child_spec() {
        let config = Config::new().elastic(true);
        let c =
            Communicator::init_rank(&CommDevice::Host, 3, r, &id, &config).unwrap_or_else(|e| {
                eprintln!("rank {r}: init failed: {e}");
                std::process::exit(2)
            });
        let mut x = vec![1.0f32; 1000];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect("all_reduce");
        if r == 1 {
            // Let the others reach the next all-reduce and wait in it first.
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: kill(2) on our own pid; nothing is touched.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let e = c
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect_err("rank 1 is dead");
        println!("FAILED {e}");
        let lost = c.lost_rank();
        println!("LOST {lost:?} FAILED {}", c.is_failed());
        let run = || -> Result<(usize, usize, f32)> {
            let small = c.shrink_after_failure(&[lost.unwrap_or(usize::MAX)])?;
            let mut y = vec![(r + 1) as f32; 1000];
            small.all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)?;
            Ok((small.rank(), small.world_size(), y[999]))
        };
        match run() {
            Ok((sr, sn, sum)) => {
                println!("SHRUNK rank {sr} of {sn}: sum {sum}");
                std::process::exit(0)
            }
            Err(e) => {
                eprintln!("rank {r}: shrink_after_failure: {e}");
                std::process::exit(3)
            }
        }
    }
    let outs = spawn(
        "survivors_of_a_process_killed_mid_collective_know_which_rank_they_lost",
        3,
        &[],
    );
    assert_eq!(outs[1].code, None, "rank 1 was killed by a signal");
    for (r, new) in [(0, 0), (2, 1)] {
        assert!(
            outs[r].stdout.contains("LOST Some(1) FAILED true"),
            "rank {r}: {}",
            outs[r].stdout
        );
        assert_eq!(outs[r].code, Some(0), "rank {r}: {}", outs[r].stderr);
        assert!(
            outs[r]
                .stdout
                .contains(&format!("SHRUNK rank {new} of 2: sum 4")),
            "rank {r}: {}",
            outs[r].stdout
        );
    }
}

/// Four processes with elastic communicators; rank 3 is SIGKILLed while the others wait
/// for it in an all-reduce, and rank 2 SIGKILLs itself as soon as its all-reduce failed.
/// Ranks 0 and 1 shrink excluding rank 3 only: the shrink needs rank 2, whose process is
/// gone, and fails at once (NCCL's bootstrap fails its connection to a dead rank), after
/// which both know ranks 2 and 3 lost. Before, the shrink waited out the whole timeout
/// (20 s here) for rank 2 to join the new communicator.
#[test]
fn a_shrink_that_needs_a_dead_process_fails_at_once() {
    if let Some((r, id)) = child_spec() {
        let config = Config::new().elastic(true).timeout(Duration::from_secs(20));
        let c =
            Communicator::init_rank(&CommDevice::Host, 4, r, &id, &config).unwrap_or_else(|e| {
                eprintln!("rank {r}: init failed: {e}");
                std::process::exit(2)
            });
        let mut x = vec![1.0f32; 1000];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect("all_reduce");
        if r == 3 {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: kill(2) on our own pid; nothing is touched.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let e = c
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect_err("rank 3 is dead");
        if r == 2 {
            // SAFETY: as above.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        println!("FAILED {e}");
        // Until rank 2 is seen gone (at most a few ticks), then the shrink that needs it.
        let t0 = Instant::now();
        while !c.lost_ranks().contains(&2) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let t0 = Instant::now();
        let got = c.shrink_after_failure(&[3]);
        println!(
            "SHRINK {} after {} ms; LOST {:?}",
            if got.is_ok() {
                "made a communicator"
            } else {
                "failed"
            },
            t0.elapsed().as_millis(),
            c.lost_ranks()
        );
        std::process::exit(0)
    }
    let outs = spawn("a_shrink_that_needs_a_dead_process_fails_at_once", 4, &[]);
    assert_eq!(
        (outs[2].code, outs[3].code),
        (None, None),
        "ranks 2 and 3 were killed"
    );
    for r in [0, 1] {
        let o = &outs[r];
        assert_eq!(o.code, Some(0), "rank {r}: {}{}", o.stdout, o.stderr);
        let line = o
            .stdout
            .lines()
            .find(|l| l.starts_with("SHRINK "))
            .unwrap_or_else(|| panic!("rank {r}: {}{}", o.stdout, o.stderr));
        assert!(line.contains("SHRINK failed"), "rank {r}: {line}");
        // Both losses known (a rank that had not called the failed shrink yet may be named
        // behind in it as well).
        assert!(line.ends_with("2, 3]"), "rank {r}: {line}");
        let ms: u64 = line
            .split(" after ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap();
        // Well within the 20 s timeout it waited out before.
        assert!(ms < 10_000, "rank {r}: {line}");
    }
}

/// Three processes with elastic communicators and a 1 s watchdog; rank 1 is stuck in its
/// own code for 4 s while ranks 0 and 2 wait for it in an all-reduce. Their watchdogs
/// revoke their handles in place at about 1 s, and each revoke ends its own rank's wait
/// in shared memory then (not at the provider's own 8 s limit): the all-reduce fails
/// within 3 s.
#[test]
fn a_watchdog_revoke_ends_a_wait_in_shared_memory() {
    if let Some((r, id)) = child_spec() {
        let config = Config::new().elastic(true).timeout(Duration::from_secs(1));
        let c =
            Communicator::init_rank(&CommDevice::Host, 3, r, &id, &config).unwrap_or_else(|e| {
                eprintln!("rank {r}: init failed: {e}");
                std::process::exit(2)
            });
        let mut x = vec![1.0f32; 1000];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect("all_reduce");
        if r == 1 {
            std::thread::sleep(Duration::from_secs(4));
        }
        let t0 = Instant::now();
        let r = c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host);
        println!(
            "RETURNED after {} ms, revoked {}, failed {}: {r:?}",
            t0.elapsed().as_millis(),
            c.is_revoked(),
            r.is_err()
        );
        // Stay until the other waiting rank must have returned too (the test asks < 3 s of
        // each): an exit before its own watchdog revoked would end its wait as a departure
        // (`RankLeft`) instead, which is right but not what this test is about.
        std::thread::sleep(Duration::from_millis(3500).saturating_sub(t0.elapsed()));
        std::process::exit(0)
    }
    let outs = spawn("a_watchdog_revoke_ends_a_wait_in_shared_memory", 3, &[]);
    for r in [0, 2] {
        assert_eq!(outs[r].code, Some(0), "rank {r}: {}", outs[r].stderr);
        let ms: u64 = outs[r]
            .stdout
            .split("RETURNED after ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("rank {r}: {}", outs[r].stdout));
        assert!(ms < 3000, "rank {r} waited {ms} ms: {}", outs[r].stdout);
        assert!(
            outs[r].stdout.contains(", failed true"),
            "rank {r}: {}",
            outs[r].stdout
        );
    }
    // A revoke ends only its own rank's wait (as NCCL's): each was revoked by its own.
    for r in [0, 2] {
        assert!(
            outs[r].stdout.contains("revoked true"),
            "rank {r}: {}",
            outs[r].stdout
        );
    }
}

/// Suspend and resume (NCCL 2.30) across processes: every rank's suspend and resume meet
/// its peers' through the shared segment, the memory figures fall and rise, and an
/// all-reduce after the resume gives the sum.
#[test]
fn suspend_and_resume_across_processes() {
    if let Some((rank, n, c)) = child() {
        let run = || -> Result<bool> {
            let before = c.mem_stats()?;
            let suspended = c.suspend().map_err(|(_, e)| e)?;
            let during = suspended.mem_stats()?;
            let c = suspended.resume().map_err(|(_, e)| e)?;
            let after = c.mem_stats()?;
            let mut x = vec![rank as f32 + 1.0; 16];
            c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
            let sum = (n * (n + 1) / 2) as f32;
            let ok = during.suspended
                && during.resident() < before.resident()
                && !after.suspended
                && after.resident() == before.resident()
                && x == vec![sum; 16];
            eprintln!("rank {rank}: {before:?} {during:?} {after:?} ok={ok}");
            c.destroy().map_err(|(_, e)| e)?;
            Ok(ok)
        };
        let ok = run().unwrap_or_else(|e| {
            eprintln!("rank {rank}: {e}");
            false
        });
        std::process::exit(if ok { 0 } else { 1 });
    }
    let outs = spawn("suspend_and_resume_across_processes", 3, &[]);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(0), "rank {r}: {}", o.stderr);
    }
}

/// Four processes with elastic communicators (`Config::timeout` 1 s) and a desync board
/// that rank 0 hosts, as under a launcher; rank 0 stops (SIGSTOP, its board server too)
/// while the others wait for it in an all-reduce. The survivors agree that rank 0 is lost
/// (`agree_lost_ranks`, naming it from the host provider's shared memory, the board
/// unreadable), shrink without it and run an all-reduce on three ranks; each prints how
/// long after rank 0 stopped it got there (`RECOVERED_AFTER_MS`), within the timeout plus
/// 0.5 s (780 ms measured). Rank 0, woken after 6 s, finds its communicator failed.
/// Before, every read of the stopped board cost its bound (1 s), from the watchdog's
/// report, the error of a call a peer's revoke ended, and `agree_lost_ranks`' settling:
/// the survivors disagreed on the lost ranks (one named all three others) and their
/// shrinks failed.
#[test]
fn an_elastic_job_recovers_from_a_stopped_rank_0_that_hosts_the_board() {
    if let Some((r, id)) = child_spec() {
        const N: usize = 4;
        let addr = std::env::var(BOARD_ENV).expect("the board's address");
        if r == 0 {
            let board = DesyncBoard::serve(&addr, N, BOARD_TOKEN).expect("serve the board");
            std::mem::forget(board); // served until the process ends
        }
        let config = Config::new()
            .elastic(true)
            .timeout(Duration::from_secs(1))
            .desync_board(BoardClient::new(addr, N, BOARD_TOKEN));
        let c =
            Communicator::init_rank(&CommDevice::Host, N, r, &id, &config).unwrap_or_else(|e| {
                eprintln!("rank {r}: init failed: {e}");
                std::process::exit(2)
            });
        let mut x = vec![1.0f32; 1000];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect("all_reduce");
        if r == 0 {
            // Let the others reach the next all-reduce first.
            std::thread::sleep(Duration::from_millis(300));
            let pid = std::process::id();
            let mut waker = Command::new("sh")
                .args(["-c", &format!("sleep 6; kill -CONT {pid}")])
                .spawn()
                .expect("sh");
            println!("STUCK_AT_MS {:.1}", now_ms());
            // SAFETY: kill(2) on our own pid; nothing is touched.
            unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
            let _ = waker.wait();
            let e = c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host);
            println!("RANK 0 AFTER ITS STOP: failed {}: {e:?}", c.is_failed());
            std::process::exit(0);
        }
        let e = c
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect_err("rank 0 is stopped");
        println!("FAILED_AT_MS {:.1}", now_ms());
        let run = || -> Result<(usize, usize, f32, Vec<usize>)> {
            let lost = c.agree_lost_ranks();
            println!("AGREED_AT_MS {:.1}", now_ms());
            let small = c.shrink_after_failure(&lost)?;
            println!("SHRUNK_AT_MS {:.1}", now_ms());
            let mut y = vec![r as f32; 1000];
            small.all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)?;
            Ok((small.rank(), small.world_size(), y[999], lost))
        };
        match run() {
            Ok((sr, sn, sum, lost)) => {
                println!("RECOVERED_AT_MS {:.1}", now_ms());
                println!("SHRUNK rank {sr} of {sn}: sum {sum}, lost {lost:?}");
                std::process::exit(0)
            }
            Err(e2) => {
                eprintln!("rank {r}: after {e}: recovery: {e2}");
                std::process::exit(3)
            }
        }
    }
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let outs = spawn(
        "an_elastic_job_recovers_from_a_stopped_rank_0_that_hosts_the_board",
        4,
        &[(BOARD_ENV, &addr)],
    );
    let t0 = stamp(&outs[0], "STUCK_AT_MS").expect("rank 0 stopped");
    for (r, o) in outs.iter().enumerate().skip(1) {
        assert_eq!(o.code, Some(0), "rank {r}: {}", o.stderr);
        assert!(
            o.stdout
                .contains(&format!("SHRUNK rank {} of 3: sum 6, lost [0]", r - 1)),
            "rank {r}: {}",
            o.stdout
        );
        let t = stamp(o, "RECOVERED_AT_MS").unwrap();
        let at = |k| stamp(o, k).map_or(-1.0, |t| t - t0);
        println!(
            "rank {r}: RECOVERED_AFTER_MS {:.0} (failed {:.0}, agreed {:.0}, shrunk {:.0})",
            t - t0,
            at("FAILED_AT_MS"),
            at("AGREED_AT_MS"),
            at("SHRUNK_AT_MS")
        );
        // The bound: `Config::timeout` plus 0.5 s (from the stop, which comes
        // 0.3 s after the survivors' call began).
        assert!(t - t0 < 1500.0, "rank {r}: {:.0} ms: {}", t - t0, o.stdout);
    }
}

/// Four processes with a desync board (rank 0 serves it) shrink with exclude lists that
/// disagree: ranks 0 and 2 exclude rank 3, ranks 1 and 3 exclude rank 2, so each keeps a
/// rank whose list differs. NCCL compares no lists (init.cc:2758, 1609-1622 of
/// v2.29.7-1); the crate compares them through the board before NCCL's call, so ranks 1
/// and 3 fail with `Error::ExcludeMismatch` naming the lists, nothing called, and so do
/// ranks 0 and 2 unless they compare after the retries were posted (then every list they
/// wait for is theirs, and they go on into the retries' shrink). Ranks 0, 1 and 2 end
/// on three ranks. (Failed about 1 run in 3 under load while it asked a mismatch of all.)
/// Before, ranks of other processes were not compared: the shrinks went to NCCL's call
/// with different lists and waited or failed there, and no retry could shrink that parent.
#[test]
fn exclude_lists_that_disagree_across_processes_fail_before_the_call() {
    if let Some((r, id)) = child_spec() {
        const N: usize = 4;
        let addr = std::env::var(BOARD_ENV).expect("the board's address");
        if r == 0 {
            let board = DesyncBoard::serve(&addr, N, BOARD_TOKEN).expect("serve the board");
            std::mem::forget(board); // served until the process ends
        }
        let config = Config::new()
            .timeout(Duration::from_secs(20))
            .desync_board(BoardClient::new(addr, N, BOARD_TOKEN));
        let c =
            Communicator::init_rank(&CommDevice::Host, N, r, &id, &config).unwrap_or_else(|e| {
                eprintln!("rank {r}: init failed: {e}");
                std::process::exit(2)
            });
        let mut x = vec![1.0f32; 8];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect("all_reduce");
        let first: &[usize] = if r % 2 == 0 { &[3] } else { &[2] };
        let small = match c.shrink(first) {
            Err(Error::ExcludeMismatch { lists, .. }) => {
                println!("MISMATCH {lists:?}");
                if r == 3 {
                    std::thread::sleep(Duration::from_millis(500)); // the others shrink without it
                    std::process::exit(0);
                }
                c.shrink(&[3]).unwrap_or_else(|e| {
                    eprintln!("rank {r}: the retry: {e}");
                    std::process::exit(4)
                })
            }
            // Ranks 0 and 2 ask for [3] from the start: one that compares after ranks 1 and
            // 2 (or 0) already retried with [3] finds every list it waits for equal to its
            // own, and rightly goes on into the same shrink as their retries.
            Ok(small) if first == [3] => {
                println!("AGREED with the retries");
                small
            }
            Err(e) => {
                eprintln!("rank {r}: expected a mismatch, got {e}");
                std::process::exit(3)
            }
            Ok(_) => {
                eprintln!("rank {r}: the shrink with lists that disagree went through");
                std::process::exit(3)
            }
        };
        let mut y = vec![(r + 1) as f32; 8];
        small
            .all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)
            .expect("all_reduce on the child");
        println!(
            "SHRUNK rank {} of {}: sum {}",
            small.rank(),
            small.world_size(),
            y[0]
        );
        if r == 0 {
            // The board stays up a while for a rank that compares late (rank 3, slowed by
            // the machine): its comparison needs the board rank 0 serves.
            std::thread::sleep(Duration::from_millis(1500));
        }
        std::process::exit(0)
    }
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let outs = spawn(
        "exclude_lists_that_disagree_across_processes_fail_before_the_call",
        4,
        &[(BOARD_ENV, &addr)],
    );
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(0), "rank {r}: {}{}", o.stdout, o.stderr);
    }
    // Ranks 1 and 3 ask for [2], which no rank that stays ever posts: each is refused.
    for r in [1, 3] {
        assert!(
            outs[r].stdout.contains("MISMATCH ["),
            "rank {r}: {}",
            outs[r].stdout
        );
    }
    // Ranks 0 and 2 are refused too, or agree with the retries already posted.
    for r in [0, 2] {
        let o = &outs[r].stdout;
        assert!(
            o.contains("MISMATCH [") || o.contains("AGREED"),
            "rank {r}: {o}"
        );
    }
    for r in [0, 1, 2] {
        assert!(
            outs[r]
                .stdout
                .contains(&format!("SHRUNK rank {r} of 3: sum 6")),
            "rank {r}: {}",
            outs[r].stdout
        );
    }
}

/// NCCL's revoke sets only this rank's abort flags (init.cc:2662 of v2.29.7-1): a peer
/// that waits for the revoked rank's kernels waits on until its own revoke, abort or
/// timeout. Three processes with elastic communicators; rank 2 is stuck in its own code
/// while ranks 0 (timeout 0.5 s) and 1 (timeout 2 s) wait for it. Rank 0's watchdog
/// revokes its handle first; rank 1 still waits, and its own watchdog revokes it (its
/// error is its own timeout, and its handle reads revoked). Before, the host provider's
/// revoke failed the shared segment, ending rank 1's wait at rank 0's revoke (its handle
/// not revoked, its error rank 0's).
#[test]
fn a_revoke_ends_only_the_revoking_ranks_wait_across_processes() {
    if let Some((r, id)) = child_spec() {
        let timeout = [500, 2000, 2000][r];
        let config = Config::new()
            .elastic(true)
            .timeout(Duration::from_millis(timeout));
        let c =
            Communicator::init_rank(&CommDevice::Host, 3, r, &id, &config).unwrap_or_else(|e| {
                eprintln!("rank {r}: init failed: {e}");
                std::process::exit(2)
            });
        let mut x = vec![1.0f32; 1000];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect("all_reduce");
        if r == 2 {
            std::thread::sleep(Duration::from_secs(4));
            std::process::exit(0);
        }
        let t0 = Instant::now();
        let e = c
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .expect_err("rank 2 is stuck");
        let own = e.to_string().contains(&format!(
            "did not complete within {}",
            if r == 0 { "500ms" } else { "2s" }
        ));
        println!(
            "RETURNED after {} ms, revoked {}, own timeout {own}",
            t0.elapsed().as_millis(),
            c.is_revoked()
        );
        eprintln!("rank {r}: {e}");
        // Alive until the others are done: a process that exits fails its peers' waits.
        std::thread::sleep(Duration::from_millis(3000 - timeout));
        std::process::exit(0)
    }
    let outs = spawn(
        "a_revoke_ends_only_the_revoking_ranks_wait_across_processes",
        3,
        &[],
    );
    for r in [0, 1] {
        assert_eq!(outs[r].code, Some(0), "rank {r}: {}", outs[r].stderr);
        assert!(
            outs[r].stdout.contains("revoked true, own timeout true"),
            "rank {r}: {}{}",
            outs[r].stdout,
            outs[r].stderr
        );
    }
}
