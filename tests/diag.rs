//! Diagnostics on the host provider (ranks as threads): the watchdog turns a skipped
//! collective into `Error::Timeout` on every rank with a desync report, the fingerprint
//! check turns disagreeing collectives into `Error::CollectiveMismatch`, every handle is
//! torn down exactly once, and recording allocates nothing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use nccl_safe::diag::OpState;
use nccl_safe::{CommDevice, Communicator, Config, Error, ReduceOp, Result, Stream, UniqueId};

// ---- a per-thread counting allocator ----------------------------------------------------

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count_one() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one();
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

// ---- helpers ------------------------------------------------------------------------------

/// Runs `f(rank, comm)` on `world` thread ranks of one fresh host communicator; returns each
/// rank's result (after its communicator was dropped) and the unique id.
fn ranks<R: Send>(
    world: usize,
    config: &Config,
    f: impl Fn(usize, &Communicator) -> R + Sync,
) -> (Vec<R>, UniqueId) {
    ranks_or_late_init(world, config, f).expect("init: timed out")
}

/// [`ranks`], for a `config` whose timeout is short enough that a rank's thread may start
/// its init later than that (a loaded machine, valgrind): `None` when an init timed out
/// (nothing is left of it: the caller may run the round again on a fresh id). Other init
/// errors panic.
fn ranks_or_late_init<R: Send>(
    world: usize,
    config: &Config,
    f: impl Fn(usize, &Communicator) -> R + Sync,
) -> Option<(Vec<R>, UniqueId)> {
    let id = CommDevice::Host.unique_id().expect("unique id");
    let out: Vec<Option<R>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let (id, f) = (&id, &f);
                s.spawn(move || {
                    match Communicator::init_rank(&CommDevice::Host, world, rank, id, config) {
                        Ok(comm) => Some(f(rank, &comm)),
                        Err(Error::Timeout { .. }) => None,
                        Err(e) => panic!("init of rank {rank}: {e}"),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    out.into_iter().collect::<Option<Vec<R>>>().map(|v| (v, id))
}

/// Every handle of `id`'s family was torn down exactly once, and nothing was misused. The
/// watchdog's aborts run on threads of their own: waits (up to 10 s) until none is live.
fn assert_exactly_once(id: &UniqueId, world: u64) {
    let limit = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while nccl_safe::host::stats_for(&id.to_raw()).live > 0 && std::time::Instant::now() < limit {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let st = nccl_safe::host::stats_for(&id.to_raw());
    assert_eq!(st.created, world, "{st:?}");
    assert_eq!(st.created, st.destroyed + st.aborted, "{st:?}");
    assert_eq!(
        st.misused,
        0,
        "{st:?}: {:?}",
        nccl_safe::host::recent_misuse()
    );
    assert_eq!(st.live, 0, "{st:?}");
}

fn sum(comm: &Communicator, n: usize) -> Result<()> {
    let mut buf = vec![1.0f32; n];
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &Stream::Host)
}

// ---- watchdog -----------------------------------------------------------------------------

#[test]
fn skipped_collective_times_out_on_every_rank_with_a_desync_report() {
    const WORLD: usize = 3;
    let timeout = Duration::from_secs(1);
    let config = Config::new().timeout(timeout);
    let start = Instant::now();
    let (results, id) = ranks(WORLD, &config, |rank, comm| {
        sum(comm, 4).expect("seq 0, every rank");
        let mut buf = vec![1.0f32; 4];
        if rank != 1 {
            let skipped = line!() + 1;
            let r = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &Stream::Host);
            r.map(|()| skipped)
                .map_err(|e| (e, skipped, start.elapsed()))
        } else {
            // Rank 1 skips it, does something slow, then comes back to a collective.
            std::thread::sleep(timeout + Duration::from_millis(300));
            let r = sum(comm, 4);
            r.map(|()| 0).map_err(|e| (e, 0, start.elapsed()))
        }
    });
    for (rank, r) in results.iter().enumerate() {
        if let Err((e, ..)) = r {
            eprintln!("--- rank {rank}:\n{e}");
        }
    }
    let mut skipped_line = 0;
    for (rank, r) in results.iter().enumerate() {
        let (e, line, at) = match r {
            Ok(_) => panic!("rank {rank} did not fail"),
            Err(x) => x,
        };
        assert!(matches!(e, Error::Timeout { .. }), "rank {rank}: {e}");
        assert!(
            *at < timeout + Duration::from_secs(1),
            "rank {rank} returned after {at:?}"
        );
        if *line != 0 {
            skipped_line = *line;
        }
        let text = e.to_string();
        assert!(text.contains("rank 1: BEHIND"), "rank {rank}: {text}");
        assert!(
            text.contains("rank(s) [1] are behind"),
            "rank {rank}: {text}"
        );
        assert!(text.contains("ncclAllReduce"), "rank {rank}: {text}");
        assert!(
            text.contains(&format!("rank {rank}")),
            "rank {rank}: {text}"
        );
    }
    for (rank, r) in results.iter().enumerate() {
        let text = r
            .as_ref()
            .err()
            .map(|x| x.0.to_string())
            .unwrap_or_default();
        assert!(
            text.contains(&format!("tests/diag.rs:{skipped_line}")),
            "rank {rank} does not name the skipped call's line {skipped_line}: {text}"
        );
    }
    assert_exactly_once(&id, WORLD as u64);
    let st = nccl_safe::host::stats_for(&id.to_raw());
    assert_eq!(st.aborted, WORLD as u64, "{st:?}");
}

/// The watchdog racing operations that end right at their deadline: whichever side wins,
/// no handle is used after its abort (the host provider counts any call on a dead handle as
/// misuse), every handle is torn down exactly once, and each call either succeeds or
/// reports the timeout.
#[test]
fn operations_ending_at_the_deadline_never_race_the_watchdog_into_misuse() {
    const ROUNDS: u64 = 32;
    let config = Config::new().timeout(Duration::from_millis(30));
    // One round: whether it timed out. The init is bounded by the same 30 ms, which a
    // rank's thread may miss on a loaded machine (valgrind): such a round (its init timed
    // out, not the race under test) runs again.
    let round = |late: Duration| {
        let (results, id) = (0..20)
            .find_map(|_| {
                ranks_or_late_init(2, &config, |rank, comm| {
                    let mut outcomes = Vec::new();
                    for _ in 0..3 {
                        if rank == 1 {
                            std::thread::sleep(late);
                        }
                        outcomes.push(sum(comm, 8));
                    }
                    outcomes
                })
            })
            .expect("an init within 30 ms in 20 tries");
        for r in results.iter().flatten() {
            match r {
                Ok(()) => {}
                Err(Error::Timeout { .. }) | Err(Error::CommunicatorFailed { .. }) => {}
                Err(e) => panic!("{late:?} late: unexpected error {e}"),
            }
        }
        assert_exactly_once(&id, 2);
        results.iter().flatten().any(|r| r.is_err())
    };
    let (mut timed_out, mut clean) = (0, 0);
    let mut count = |late| {
        if round(late) {
            timed_out += 1;
        } else {
            clean += 1;
        }
    };
    for step in 0..ROUNDS {
        // Rank 1 arrives 0 to 75 ms late: well inside, around and well past the deadline
        // (30 ms, plus the coarse clock's 10 ms tick).
        count(Duration::from_micros(step * 75_000 / ROUNDS));
    }
    // The watchdog's slack grows with how long the coarse clock stood still around an
    // operation's start, so on a slow machine (valgrind) 75 ms may still be inside it: go
    // further out until one round times out, so that both sides of the race are always
    // exercised.
    let mut late = Duration::from_millis(150);
    let mut late_timed_out = false;
    while !late_timed_out && late <= Duration::from_secs(10) {
        late_timed_out = round(late);
        late *= 2;
    }
    timed_out += u32::from(late_timed_out);
    assert!(
        timed_out > 0 && clean > 0,
        "{timed_out} timed out, {clean} clean"
    );
}

#[test]
fn skipped_collective_with_the_check_on_times_out_in_the_check() {
    const WORLD: usize = 2;
    let timeout = Duration::from_millis(500);
    let config = Config::new().timeout(timeout).check_collectives(true);
    let start = Instant::now();
    let (results, id) = ranks(WORLD, &config, |rank, comm| {
        sum(comm, 2)?;
        if rank == 0 {
            sum(comm, 2)
        } else {
            std::thread::sleep(timeout + Duration::from_millis(200));
            sum(comm, 2)
        }
    });
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("must fail");
        assert!(matches!(e, Error::Timeout { .. }), "rank {rank}: {e}");
        assert!(e.to_string().contains("rank 1: BEHIND"), "{e}");
    }
    assert!(start.elapsed() < timeout + Duration::from_secs(1));
    assert_exactly_once(&id, WORLD as u64);
}

// ---- fingerprint check --------------------------------------------------------------------

/// Runs `call(rank, comm)` once per rank with the check on; every rank must get
/// `CollectiveMismatch` whose table shows `expect` (each string at least once).
fn expect_mismatch(
    world: usize,
    call: impl Fn(usize, &Communicator) -> (Result<()>, u32) + Sync,
    expect: &[&str],
) {
    let config = Config::new()
        .check_collectives(true)
        .timeout(Duration::from_secs(10));
    let start = Instant::now();
    let (results, id) = ranks(world, &config, |rank, comm| {
        let r = call(rank, comm);
        assert!(comm.is_failed(), "a mismatch marks the communicator failed");
        r
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let lines: Vec<u32> = results.iter().map(|r| r.1).collect();
    for (rank, (r, _)) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("every rank fails");
        let Error::CollectiveMismatch {
            rank: er, table, ..
        } = e
        else {
            panic!("rank {rank}: {e}");
        };
        assert_eq!(*er, rank);
        for want in expect {
            assert!(table.contains(want), "rank {rank}: no {want:?} in\n{table}");
        }
        for (r, line) in lines.iter().enumerate() {
            assert!(
                table.contains(&format!("tests/diag.rs:{line}")),
                "rank {rank}: no line of rank {r} in\n{table}"
            );
        }
        assert!(table.contains("differs from rank 0"), "{table}");
    }
    assert_exactly_once(&id, world as u64);
    let st = nccl_safe::host::stats_for(&id.to_raw());
    assert_eq!(st.aborted, world as u64, "{st:?}");
}

#[test]
fn all_reduce_against_all_gather_is_a_mismatch() {
    expect_mismatch(
        3,
        |rank, comm| {
            let send = vec![1.0f32; 4];
            if rank == 1 {
                let mut recv = vec![0.0f32; 12];
                let line = line!() + 1;
                (comm.all_gather(&send, &mut recv, &Stream::Host), line)
            } else {
                let mut recv = vec![0.0f32; 4];
                let r = comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &Stream::Host);
                (r, line!() - 1)
            }
        },
        &["ncclAllReduce(float x 4)", "ncclAllGather(float x 4)"],
    );
}

#[test]
fn different_counts_are_a_mismatch() {
    expect_mismatch(
        4,
        |rank, comm| {
            let mut buf = vec![1i32; if rank == 3 { 5 } else { 4 }];
            let r = comm.all_reduce_in_place(&mut buf, ReduceOp::Max, &Stream::Host);
            (r, line!() - 1)
        },
        &["x 4)", "x 5)"],
    );
}

#[test]
fn different_roots_are_a_mismatch() {
    expect_mismatch(
        2,
        |rank, comm| {
            let mut buf = vec![1.0f64; 3];
            let root = if rank == 0 { 0 } else { 1 };
            let line = line!() + 1;
            (comm.broadcast_in_place(&mut buf, root, &Stream::Host), line)
        },
        &["root 0", "root 1"],
    );
}

#[test]
fn matching_collectives_pass_the_check_and_off_it_never_runs() {
    for on in [true, false] {
        let config = Config::new().check_collectives(on);
        let (results, id) = ranks(2, &config, |_, comm| {
            for _ in 0..5 {
                sum(comm, 8)?;
            }
            Ok::<_, Error>(comm.diagnostics())
        });
        for d in results {
            let d = d.expect("collectives");
            assert_eq!(d.check_enabled, on);
            assert_eq!(d.fingerprint_checks, if on { 5 } else { 0 }, "{d:?}");
            assert_eq!(d.collectives, 5);
        }
        let st = nccl_safe::host::stats_for(&id.to_raw());
        assert_eq!((st.created, st.destroyed, st.misused), (2, 2, 0), "{st:?}");
    }
}

// ---- flight recorder and straggler view ---------------------------------------------------

#[test]
fn flight_record_keeps_the_last_operations_without_allocating() {
    // Allocations of `n` collectives on a 1-rank communicator, after a warm-up.
    fn per_run(config: Config, n: usize) -> u64 {
        let id = CommDevice::Host.unique_id().expect("id");
        let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config).expect("init");
        let mut buf = vec![1.0f32; 16];
        for _ in 0..4 {
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &Stream::Host)
                .expect("warm-up");
        }
        let before = allocs();
        for _ in 0..n {
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &Stream::Host)
                .expect("op");
        }
        allocs() - before
    }
    let n = 200;
    let recording = per_run(Config::new().flight_record_len(8), n);
    let not_recording = per_run(Config::new().flight_record_len(0), n);
    let checked = per_run(
        Config::new().flight_record_len(8).check_collectives(true),
        n,
    );
    assert_eq!(
        recording, not_recording,
        "recording allocated ({recording} vs {not_recording} allocations for {n} ops)"
    );
    assert_eq!(checked, not_recording, "the fingerprint check allocated");

    // The ring keeps the last 8, oldest first, with lines and states.
    let id = CommDevice::Host.unique_id().expect("id");
    let comm = Communicator::init_rank(
        &CommDevice::Host,
        1,
        0,
        &id,
        &Config::new().flight_record_len(8),
    )
    .expect("init");
    let mut buf = vec![1u8; 3];
    let line = line!() + 2;
    for _ in 0..10 {
        comm.broadcast_in_place(&mut buf, 0, &Stream::Host)
            .expect("op");
    }
    let fr = comm.flight_record();
    assert_eq!(fr.entries.len(), 8);
    let seqs: Vec<u64> = fr.entries.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (2..10).collect::<Vec<_>>());
    for e in &fr.entries {
        assert_eq!(e.op, "ncclBroadcast");
        assert_eq!((e.count, e.root), (3, Some(0)));
        assert_eq!(e.state, OpState::Completed);
        assert_eq!(e.caller.line(), line);
    }
    let text = fr.to_string();
    assert!(text.contains(&format!("tests/diag.rs:{line}")), "{text}");
    let dir = std::env::temp_dir().join(format!("nccl-safe-diag-{}", std::process::id()));
    let path = comm.dump_flight_record(&dir).expect("dump");
    let json = std::fs::read_to_string(&path).expect("read");
    assert!(json.starts_with("{\"rank\":0,"), "{json}");
    assert_eq!(
        json.matches("\"op\":\"ncclBroadcast\"").count(),
        8,
        "{json}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn straggler_view_shows_who_waited() {
    let (results, id) = ranks(2, &Config::new(), |rank, comm| {
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        sum(comm, 4).expect("sum");
        comm.diagnostics()
    });
    assert!(results[0].wait >= Duration::from_millis(200), "{results:?}");
    assert!(results[1].wait < Duration::from_millis(200), "{results:?}");
    assert_eq!(results[0].operations, 1);
    assert_exactly_once(&id, 2);
}
