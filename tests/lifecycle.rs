//! Teardown accounting: every handle the safe layer creates is destroyed or aborted exactly
//! once, on every path (normal end, errors, peer aborts, panics, dropped pending inits),
//! and no call ever reaches a dead handle. A seeded randomized test walks sequences of
//! create / split / op / bad input / abort / destroy / drop / finalize / panic over 1..=4
//! ranks; targeted tests pin down the individual guarantees.

mod support;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Barrier;
use std::time::Duration;

use nccl_safe::host::stats_for;
use nccl_safe::{
    CommDevice, Communicator, Config, Error, Group, ReduceOp, ResultCode, Stream, UniqueId,
};
use support::{assert_balanced, within};

const S: Stream = Stream::Host;
const T: Duration = Duration::from_secs(30);

/// Keeps the deliberate panics of these tests (messages containing "deliberate") out of
/// the output; every other panic reaches the default hook.
fn quiet_deliberate_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if !msg.contains("deliberate") {
                default(info);
            }
        }));
    });
}

/// xorshift64*: small, seeded, no dependency.
#[derive(Clone)]
struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Debug, Clone, Copy)]
enum Teardown {
    Destroy,
    Drop,
    Finalize,
    Abort,
}

#[derive(Debug, Clone)]
enum Step {
    /// A collective every rank takes part in; 0..6 picks which.
    Op(usize, usize),
    /// Each rank makes a bad call (kind picked per rank) and checks the typed error.
    BadInput,
    /// Split with these per-rank colors and keys, an op on each child, then per-rank
    /// teardown of the children.
    Split(Vec<Option<u32>>, Vec<i32>, Vec<Teardown>),
}

#[derive(Debug, Clone)]
enum Ending {
    /// Each rank tears its communicator down its own way (no abort: peers are healthy).
    Teardown(Vec<Teardown>),
    /// Rank v aborts; the others' next op fails with an NCCL error; then each tears down.
    PeerAbort(usize, Vec<Teardown>),
    /// Every rank posts an all_reduce in a group; rank v panics before `end` (the group's
    /// drop ends it, so the peers complete). `owned`: the panicking closure owns the
    /// communicator (dropped while unwinding) rather than borrowing it.
    Panic(usize, bool, Vec<Teardown>),
    /// The ranks outside `excluded` shrink, run an op on the child and destroy it.
    Shrink(Vec<usize>, Vec<Teardown>),
}

#[derive(Debug, Clone)]
struct Plan {
    world: usize,
    nonblocking: bool,
    /// Non-blocking init only: rank v drops its pending communicator once all ranks joined.
    drop_pending: Option<usize>,
    steps: Vec<Step>,
    ending: Ending,
}

fn teardowns(rng: &mut Rng, world: usize, abort_ok: bool) -> Vec<Teardown> {
    (0..world)
        .map(|_| match rng.below(if abort_ok { 4 } else { 3 }) {
            0 => Teardown::Destroy,
            1 => Teardown::Drop,
            2 => Teardown::Finalize,
            _ => Teardown::Abort,
        })
        .collect()
}

fn plan(seed: u64) -> Plan {
    let mut rng = Rng::new(seed);
    let world = 1 + rng.below(4);
    let nonblocking = rng.below(3) == 0;
    let drop_pending = (nonblocking && rng.below(4) == 0).then(|| rng.below(world));
    let steps = (0..rng.below(5))
        .map(|_| match rng.below(4) {
            0 | 1 => Step::Op(rng.below(6), rng.below(world)),
            2 => Step::BadInput,
            _ => Step::Split(
                (0..world)
                    .map(|_| (rng.below(4) != 0).then(|| rng.below(2) as u32))
                    .collect(),
                (0..world).map(|_| rng.below(3) as i32 - 1).collect(),
                teardowns(&mut rng, world, true),
            ),
        })
        .collect();
    let ending = match rng.below(6) {
        0 | 1 => Ending::Teardown(teardowns(&mut rng, world, false)),
        2 | 3 => Ending::PeerAbort(rng.below(world), teardowns(&mut rng, world, true)),
        4 => Ending::Panic(
            rng.below(world),
            rng.below(2) == 0,
            teardowns(&mut rng, world, false),
        ),
        _ => {
            let mut excluded: Vec<usize> = (0..world).filter(|_| rng.below(3) == 0).collect();
            if excluded.len() == world {
                excluded.pop();
            }
            // NCCL refuses an empty list; one rank alone cannot shrink.
            if excluded.is_empty() && world > 1 {
                excluded.push(rng.below(world));
            }
            if excluded.is_empty() {
                Ending::Teardown(teardowns(&mut rng, world, false))
            } else {
                Ending::Shrink(excluded, teardowns(&mut rng, world, false))
            }
        }
    };
    Plan {
        world,
        nonblocking,
        drop_pending,
        steps,
        ending,
    }
}

/// Tears `comm` down as asked, checking each consuming method's result. `failed`: the
/// communicator saw an error, so destroy/finalize must refuse and hand it back / abort.
/// `peer_may_abort`: a peer may have aborted, so finalize may meet NCCL's remote error.
fn tear_down(comm: Communicator, how: Teardown, peer_may_abort: bool) {
    let failed = comm.is_failed();
    match how {
        Teardown::Destroy => match comm.destroy() {
            Ok(()) => assert!(!failed, "destroy of a failed communicator succeeded"),
            // A peer aborted: the clique failed (another rank waits for the aborted one, or
            // NCCL's asynchronous state reads the peer's abort, and NCCL refuses to destroy
            // a communicator in error), so destroy refuses, with the departure or NCCL's
            // remote error.
            Err((back, e))
                if peer_may_abort
                    && (matches!(e, Error::RankLeft { .. })
                        || e.code() == Some(ResultCode::RemoteError)) =>
            {
                assert!(back.is_failed());
                drop(back); // aborts
            }
            Err((back, e)) => {
                assert!(failed, "destroy of a healthy communicator failed: {e}");
                // Its own error, or (when it saw none) the report of the peer that left.
                assert!(
                    matches!(
                        e,
                        Error::CommunicatorFailed {
                            call: "ncclCommDestroy",
                            ..
                        } | Error::RankLeft { .. }
                    ),
                    "{e:?}"
                );
                assert!(back.is_failed());
                drop(back); // aborts
            }
        },
        Teardown::Drop => drop(comm),
        Teardown::Finalize => match comm.finalize(T) {
            Ok(()) => assert!(!failed, "finalize of a failed communicator succeeded"),
            // NCCL's remote error, or the peer's departure named (a panicking peer fails
            // the whole clique).
            Err(e) if peer_may_abort && e.code() == Some(ResultCode::RemoteError) => {}
            Err(e) => assert!(failed, "finalize of a healthy communicator failed: {e}"),
        },
        Teardown::Abort => comm.abort().unwrap(),
    }
}

/// One of six collectives, values checked: `Σ (rank + 1)`-style results.
fn op(comm: &Communicator, kind: usize, root: usize) -> nccl_safe::Result<()> {
    let (r, w) = (comm.rank(), comm.world_size());
    let root = root % w;
    match kind {
        0 => {
            let mut x = vec![r as i32 + 1; 3];
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S)?;
            assert_eq!(x, vec![(w * (w + 1) / 2) as i32; 3]);
        }
        1 => {
            let mut x = vec![r as f32; 2];
            comm.broadcast_in_place(&mut x, root, &S)?;
            assert_eq!(x, vec![root as f32; 2]);
        }
        2 => {
            let mut all = vec![0u8; w];
            comm.all_gather(&[r as u8][..], &mut all, &S)?;
            assert_eq!(all, (0..w as u8).collect::<Vec<_>>());
        }
        3 => {
            let mut got = vec![u64::MAX; 2];
            let send = vec![r as u64; 2];
            let mut g = Group::new();
            g.push(comm.send_op(&send, (r + 1) % w, &S)?)?;
            g.push(comm.recv_op(&mut got, (r + w - 1) % w, &S)?)?;
            g.end()?;
            assert_eq!(got, vec![((r + w - 1) % w) as u64; 2]);
        }
        4 => {
            let pms = comm.create_pre_mul_sum(2.0f64)?;
            let mut x = vec![1.0f64; 2];
            comm.all_reduce_in_place(&mut x, &pms, &S)?;
            assert_eq!(x, vec![2.0 * w as f64; 2]);
        }
        _ => {
            let send = vec![1i64; 2 * w];
            let mut recv = vec![0i64; 2];
            comm.reduce_scatter(&send, &mut recv, ReduceOp::Max, &S)?;
            assert_eq!(recv, vec![1; 2]);
        }
    }
    Ok(())
}

fn bad_input(comm: &Communicator, kind: usize) {
    let w = comm.world_size();
    let mut buf = vec![0i32; w + 1];
    let e = match kind {
        0 => comm.all_reduce(&[1i32; 2][..], &mut buf[..1], ReduceOp::Sum, &S),
        1 => comm.broadcast_in_place(&mut buf, w, &S),
        2 => comm.send(&buf, w + 3, &S),
        _ => comm.split(Some(u32::MAX), 0).map(drop),
    };
    match (kind, e) {
        (0, Err(Error::LengthMismatch { .. })) => {}
        (1 | 2, Err(Error::RankOutOfRange { .. })) => {}
        (3, Err(Error::InvalidArgument { .. })) => {}
        (k, other) => panic!("bad input {k}: {other:?}"),
    }
    assert!(!comm.is_failed());
}

fn expect_nccl_error(r: nccl_safe::Result<()>, p: &Plan, rank: usize) {
    match r {
        Err(Error::Nccl(e)) => assert_eq!(e.code, ResultCode::RemoteError, "{e}"),
        // The peer's teardown seen by the diagnostics first (what NCCL calls a remote
        // error, named).
        Err(Error::RankLeft { .. }) => {}
        Err(Error::CommunicatorFailed { .. }) => {}
        other => panic!(
            "rank {rank} of {p:?}: expected an NCCL error after a peer aborted, got {other:?}"
        ),
    }
}

/// Rank `rank` of case `p`.
fn run_rank(p: &Plan, rank: usize, id: &UniqueId, barrier: &Barrier, seed: u64) {
    let mut rng = Rng::new(seed ^ ((rank as u64 + 1) << 32));
    let w = p.world;
    let comm = if p.nonblocking {
        let pending =
            Communicator::init_rank_nonblocking(&CommDevice::Host, w, rank, id, &Config::new())
                .unwrap();
        if let Some(v) = p.drop_pending {
            barrier.wait(); // every rank joined: the rendezvous is complete
            if rank == v {
                drop(pending); // aborts the handle
                return;
            }
            match pending.wait(T) {
                Err(_) => return, // aborted on drop by `wait`
                Ok(comm) => {
                    expect_nccl_error(op(&comm, 0, 0), p, rank);
                    assert!(comm.is_failed());
                    let how = teardowns(&mut rng, 1, true)[0];
                    tear_down(comm, how, true);
                    return;
                }
            }
        }
        pending.wait(T).unwrap()
    } else {
        Communicator::init_rank(&CommDevice::Host, w, rank, id, &Config::new()).unwrap()
    };
    // Every rank's init has returned before any rank may abort (an abort during a peer's
    // init fails that init, as with NCCL).
    barrier.wait();
    for step in &p.steps {
        match step {
            Step::Op(kind, root) => op(&comm, *kind, *root).unwrap(),
            Step::BadInput => bad_input(&comm, rng.below(4)),
            Step::Split(colors, keys, how) => {
                let child = comm.split(colors[rank], keys[rank]).unwrap();
                match (colors[rank], child) {
                    (None, None) => {}
                    (Some(c), Some(child)) => {
                        let members = colors.iter().filter(|x| **x == Some(c)).count();
                        assert_eq!(child.world_size(), members);
                        op(&child, 0, 0).unwrap();
                        tear_down(child, how[rank], true);
                    }
                    (c, got) => panic!("color {c:?} gave {got:?}"),
                }
            }
        }
    }
    // Every rank has finished every step before the ending (a rank opting out of a split
    // returns at once, and must not abort while its peers are still splitting).
    barrier.wait();
    match &p.ending {
        Ending::Teardown(how) => tear_down(comm, how[rank], false),
        Ending::PeerAbort(v, how) => {
            // The abort happens before the others' next op: a send/recv between two
            // live ranks could otherwise still complete (the blocked-peer case is
            // `after_an_error_in_one_rank_the_others_get_errors_not_a_hang`).
            if rank == *v {
                comm.abort().unwrap();
                barrier.wait();
            } else {
                barrier.wait();
                expect_nccl_error(op(&comm, rng.below(6), 0), p, rank);
                assert!(comm.is_failed());
                expect_nccl_error(op(&comm, 0, 0), p, rank); // fails fast, NCCL not called
                tear_down(comm, how[rank], false);
            }
        }
        Ending::Panic(v, owned, how) => {
            let mut x = vec![1u32; 2];
            if rank == *v && *owned {
                let r = catch_unwind(AssertUnwindSafe(move || {
                    let comm = comm;
                    let mut g = Group::new();
                    comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)
                        .and_then(|op| g.push(op))
                        .unwrap();
                    panic!("deliberate: rank {rank} panics inside a group");
                }));
                assert!(r.is_err());
            } else if rank == *v {
                let r = catch_unwind(AssertUnwindSafe(|| {
                    let mut g = Group::new();
                    comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)
                        .and_then(|op| g.push(op))
                        .unwrap();
                    panic!("deliberate: rank {rank} panics inside a group");
                }));
                assert!(r.is_err());
                assert_eq!(x, vec![w as u32; 2]);
                tear_down(comm, how[rank], false);
            } else {
                let mut g = Group::new();
                comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)
                    .and_then(|op| g.push(op))
                    .unwrap();
                match g.end() {
                    Ok(()) => assert_eq!(x, vec![w as u32; 2]),
                    // The panicking rank's group is enqueued by its drop, but its owned
                    // communicator is aborted while unwinding: a peer still waiting for
                    // the group's launch (NCCL's ncclInProgress) may see that abort first,
                    // as with NCCL, whose launch thread races the peer's abort.
                    Err(e) if *owned => assert!(
                        e.to_string().contains(&format!("rank {v}")),
                        "the error names the panicking rank {v}: {e}"
                    ),
                    Err(e) => panic!("rank {rank}: {e}"),
                }
                // An owned communicator dropped while unwinding is aborted, so a peer's
                // finalize may meet NCCL's remote error.
                tear_down(comm, how[rank], *owned);
            }
        }
        Ending::Shrink(excluded, how) => {
            if !excluded.contains(&rank) {
                let child = comm.shrink(excluded).unwrap();
                assert_eq!(child.world_size(), w - excluded.len());
                op(&child, 0, 0).unwrap();
                tear_down(child, how[rank], false);
            }
            tear_down(comm, how[rank], false);
        }
    }
}

fn run_case(seed: u64) -> (Plan, nccl_safe::host::HostStats) {
    quiet_deliberate_panics();
    let p = plan(seed);
    let id = CommDevice::Host.unique_id().unwrap();
    let barrier = Barrier::new(p.world);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..p.world)
            .map(|rank| {
                let (p, id, barrier) = (&p, &id, &barrier);
                s.spawn(move || run_rank(p, rank, id, barrier, seed))
            })
            .collect();
        for h in hs {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(e);
            }
        }
    });
    let st = stats_for(&id.to_raw());
    assert_eq!(
        st.created,
        st.destroyed + st.aborted,
        "seed {seed}: {p:?} {st:?}"
    );
    assert_eq!((st.live, st.misused), (0, 0), "seed {seed}: {p:?} {st:?}");
    (p, st)
}

#[test]
fn randomized_lifecycles_tear_down_every_handle_exactly_once() {
    const CASES: u64 = 2000;
    let base: u64 = std::env::var("LIFECYCLE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_2024);
    let (cases, created, destroyed, aborted, finalized) =
        within(Duration::from_secs(120), move || {
            let mut t = (0u64, 0u64, 0u64, 0u64, 0u64);
            for i in 0..CASES {
                let seed = base.wrapping_add(i);
                let (_, st) = run_case(seed);
                t.0 += 1;
                t.1 += st.created;
                t.2 += st.destroyed;
                t.3 += st.aborted;
                t.4 += st.finalized;
            }
            t
        });
    println!(
        "lifecycle: {cases} cases (seed base {base:#x}), {created} handles: \
         {destroyed} destroyed, {aborted} aborted ({finalized} finalized first)"
    );
    assert_eq!(cases, CASES);
    assert_eq!(created, destroyed + aborted);
    assert!(aborted > 0 && destroyed > 0 && finalized > 0);
}

/// Rank 1 aborts; rank 0's all_reduce fails with NCCL's error and marks it failed.
fn failed_pair(rank0: impl FnOnce(Communicator) + Send) -> nccl_safe::host::HostStats {
    let id = CommDevice::Host.unique_id().unwrap();
    let both_joined = Barrier::new(2);
    std::thread::scope(|s| {
        s.spawn(|| {
            let c = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &Config::new()).unwrap();
            both_joined.wait();
            c.abort().unwrap();
        });
        let c = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &Config::new()).unwrap();
        both_joined.wait();
        let mut x = vec![1.0f32; 2];
        let e = c
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
            .unwrap_err();
        assert_eq!(e.code(), Some(ResultCode::RemoteError), "{e}");
        assert!(c.is_failed());
        rank0(c);
    });
    assert_balanced(&id)
}

#[test]
fn drop_of_a_failed_communicator_aborts_it() {
    let st = failed_pair(drop);
    assert_eq!((st.created, st.destroyed, st.aborted), (2, 0, 2));
}

#[test]
fn destroy_of_a_failed_communicator_hands_it_back_with_the_error() {
    let st = failed_pair(|c| {
        let (back, e) = c.destroy().unwrap_err();
        assert!(
            matches!(
                &e,
                Error::CommunicatorFailed {
                    call: "ncclCommDestroy",
                    rank: 0,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(back.is_failed());
        let mut y = vec![0i32; 1];
        assert!(matches!(
            back.all_reduce_in_place(&mut y, ReduceOp::Sum, &S),
            Err(Error::CommunicatorFailed {
                call: "ncclAllReduce",
                ..
            })
        ));
        let e = back.finalize(T).unwrap_err();
        assert!(
            matches!(
                e,
                Error::CommunicatorFailed {
                    call: "ncclCommFinalize",
                    ..
                }
            ),
            "{e:?}"
        );
    });
    assert_eq!((st.created, st.destroyed, st.aborted), (2, 0, 2));
}

/// Rank 0 leaves its group early with `?` (after queuing a good all_reduce) or by a
/// panic; the group's drop still calls ncclGroupEnd, so the peers' all_reduce completes.
fn group_left_early(panic: bool) {
    quiet_deliberate_panics();
    let id = CommDevice::Host.unique_id().unwrap();
    within(Duration::from_secs(30), move || {
        std::thread::scope(|s| {
            for rank in 0..3 {
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 3, rank, &id, &Config::new())
                            .unwrap();
                    let mut x = vec![rank as i64 + 1; 4];
                    if rank == 0 {
                        let body = |x: &mut Vec<i64>| -> nccl_safe::Result<()> {
                            let mut short = vec![0i64; 1];
                            let mut g = Group::new();
                            g.push(comm.all_reduce_in_place_op(x, ReduceOp::Sum, &S)?)?;
                            if panic {
                                panic!("deliberate: rank 0 panics with a group open");
                            }
                            g.push(comm.all_gather_op(&[1i64; 2][..], &mut short, &S)?)?;
                            g.end()
                        };
                        let r = catch_unwind(AssertUnwindSafe(|| body(&mut x)));
                        match (panic, r) {
                            (true, Err(_)) => {}
                            (false, Ok(Err(Error::LengthMismatch { .. }))) => {}
                            (_, other) => panic!("unexpected: {:?}", other.map(|_| ())),
                        }
                    } else {
                        let mut g = Group::new();
                        comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)
                            .and_then(|op| g.push(op))
                            .unwrap();
                        g.end().unwrap();
                    }
                    assert_eq!(x, vec![6; 4], "rank {rank}");
                    assert!(!comm.is_failed());
                    comm.destroy().map_err(|(_, e)| e).unwrap();
                });
            }
        });
    });
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.destroyed), (3, 3));
}

#[test]
fn group_ends_when_left_by_question_mark() {
    group_left_early(false);
}

#[test]
fn group_ends_when_left_by_panic() {
    group_left_early(true);
}

#[test]
fn after_an_error_in_one_rank_the_others_get_errors_not_a_hang() {
    let id = CommDevice::Host.unique_id().unwrap();
    within(Duration::from_secs(30), move || {
        std::thread::scope(|s| {
            for rank in 0..4 {
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 4, rank, &id, &Config::new())
                            .unwrap();
                    if rank == 2 {
                        // An application error on rank 2: it aborts instead of joining,
                        // after the others are (most likely) blocked in the collective.
                        std::thread::sleep(Duration::from_millis(50));
                        comm.abort().unwrap();
                        return;
                    }
                    let mut x = vec![1.0f64; 8];
                    let e = comm
                        .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                        .unwrap_err();
                    assert_eq!(e.code(), Some(ResultCode::RemoteError), "{e}");
                    assert!(comm.is_failed());
                    // Later calls fail fast without reaching NCCL; drop aborts.
                    assert!(matches!(
                        comm.split(Some(0), 0),
                        Err(Error::CommunicatorFailed { .. } | Error::RankLeft { rank: 2, .. })
                    ));
                });
            }
        });
    });
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.destroyed, st.aborted), (4, 0, 4));
}

/// A healthy communicator dropped while its thread unwinds is aborted, not destroyed, so
/// a peer already waiting in a collective gets an error instead of waiting forever.
#[test]
fn a_communicator_dropped_while_panicking_aborts_and_wakes_its_peer() {
    quiet_deliberate_panics();
    let id = nccl_safe::CommDevice::Host.unique_id().unwrap();
    let cfg = nccl_safe::Config::new();
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let comm =
                Communicator::init_rank(&nccl_safe::CommDevice::Host, 2, 1, &id, &cfg).unwrap();
            let mut x = vec![1.0f32; 4];
            let r = comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S);
            assert!(r.is_err(), "the peer's abort must end the wait");
        });
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _comm =
                Communicator::init_rank(&nccl_safe::CommDevice::Host, 2, 0, &id, &cfg).unwrap();
            std::thread::sleep(Duration::from_millis(50)); // let the peer enter its all_reduce
            panic!("deliberate: rank 0 panics holding its communicator");
        }));
        assert!(r.is_err());
        waiter.join().unwrap();
    });
    assert!(started.elapsed() < Duration::from_secs(10));
    // The watchdog may still be aborting the peer's communicator (it takes the handle when
    // the panicking rank leaves, so that drop returns at once): its counters once settled.
    let st = support::settled_stats(&id);
    assert_eq!((st.created, st.live, st.misused), (2, 0, 0), "{st:?}");
    assert!(st.aborted >= 1, "{st:?}");
}

/// Two ranks with a parent and a split child each; rank 1 aborts its parent, which fails the
/// parent's clique in NCCL (its asynchronous state reads ncclRemoteError on rank 0) while
/// rank 0's `Communicator` has not seen it. Then `rank0(parent, child)` runs on rank 0's
/// thread; rank 1 all-reduces on its child (10 s bound) and drops it.
fn unseen_peer_abort(
    rank0: impl FnOnce(Communicator, Communicator) + Send,
) -> nccl_safe::host::HostStats {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new().timeout(Duration::from_secs(10));
    let (split, aborted) = (Barrier::new(2), Barrier::new(2));
    std::thread::scope(|s| {
        s.spawn(|| {
            let c = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &cfg).unwrap();
            let child = c.split(Some(0), 1).unwrap().expect("a color");
            split.wait();
            c.abort().unwrap();
            aborted.wait();
            let mut x = vec![2.0f32; 2];
            let r = child.all_reduce_in_place(&mut x, ReduceOp::Sum, &S);
            assert!(
                r.is_ok() && x == vec![3.0; 2],
                "rank 1's child: {r:?} {x:?}"
            );
        });
        let c = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &cfg).unwrap();
        let child = c.split(Some(0), 0).unwrap().expect("a color");
        split.wait();
        aborted.wait();
        assert!(!c.is_failed(), "rank 0 must not know of the abort yet");
        rank0(c, child);
    });
    assert_balanced(&id)
}

/// NCCL refuses to destroy a communicator whose asynchronous state is an error, and then
/// leaves the calling thread one group level deep with nothing torn down (init.cc:2372-2381
/// of 2.28.9). Dropping it must abort it instead, and leave the teardown lane able to tear
/// down the next communicator of the family (with the level left open, the child's destroy
/// would be queued for a group end that never comes, and leak).
#[test]
fn drop_after_an_unseen_peer_abort_aborts_and_leaves_no_group_level_open() {
    let st = within(T, || {
        unseen_peer_abort(|parent, child| {
            drop(parent);
            let mut x = vec![1.0f32; 2];
            child
                .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                .unwrap();
            assert_eq!(x, vec![3.0; 2]);
            drop(child);
        })
    });
    // Both parents aborted (rank 0's as the fallback of its refused destroy), both
    // children destroyed on the same lane afterwards.
    assert_eq!((st.created, st.destroyed, st.aborted), (4, 2, 2), "{st:?}");
}

/// The same through `destroy()`: the communicator comes back failed with NCCL's error, and
/// the caller's thread is left outside any group level, so its next collective (on the
/// child) runs instead of being queued.
#[test]
fn destroy_after_an_unseen_peer_abort_hands_it_back_and_leaves_no_group_level_open() {
    let st = within(T, || {
        unseen_peer_abort(|parent, child| {
            let (back, e) = parent.destroy().unwrap_err();
            assert_eq!(e.code(), Some(ResultCode::RemoteError), "{e}");
            assert!(back.is_failed());
            drop(back);
            let mut x = vec![1.0f32; 2];
            child
                .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                .unwrap();
            assert_eq!(x, vec![3.0; 2], "the child's all_reduce ran");
            child.destroy().map_err(|(_, e)| e).unwrap();
        })
    });
    assert_eq!((st.created, st.destroyed, st.aborted), (4, 2, 2), "{st:?}");
}

/// Runs `child_under_an_nccl_parameter` with `var=value` (NCCL reads its parameters once
/// per process, and so does the host provider: hence a child process), which checks what
/// the crate does under it.
fn under(var: &str, value: &str) {
    let child = support::spawn_child("child_under_an_nccl_parameter", var, value);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{var}={value}: {err}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("child: checked"), "{var}={value}: {stdout}");
}

/// `NCCL_COMM_BLOCKING=1` overrides the non-blocking mode the crate asks for
/// (init.cc:1646-1649 of 2.28.9), so NCCL's init would wait inside the call for a rank
/// that never joins, past `Config::timeout`: the crate refuses to create a communicator
/// under it, at once and by name, whether the environment or an nccl.conf sets it.
#[test]
fn a_forced_blocking_mode_is_refused_before_it_can_hang_an_init() {
    under("NCCL_COMM_BLOCKING", "1");
    let dir = support::temp_dir("nccl-conf");
    let conf = dir.join("nccl.conf");
    std::fs::write(
        &conf,
        "# a comment\nNCCL_DEBUG=WARN\nNCCL_COMM_BLOCKING=0x1\n",
    )
    .unwrap();
    under("NCCL_CONF_FILE", conf.to_str().unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `NCCL_COMM_BLOCKING=0` makes `ncclCommInitAll`'s communicators non-blocking, and the
/// call returns ncclInProgress: `init_all` waits for them instead of failing (and leaking
/// the handles NCCL wrote).
#[test]
fn init_all_waits_for_communicators_made_non_blocking() {
    under("NCCL_COMM_BLOCKING", "0");
}

/// Resource sharing between a parent and its split or shrink children shares NCCL's abort
/// flag (init.cc:2582-2588): a split or shrink that would share is refused, whether the
/// parent's config or NCCL's variables ask for it; the parent itself is made and works.
#[test]
fn resource_sharing_is_refused_where_children_are_made() {
    for (cfg, shrink) in [
        (Config::new().split_share(1), false),
        (Config::new().shrink_share(1), true),
    ] {
        let id = CommDevice::Host.unique_id().unwrap();
        let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &cfg).unwrap();
        let child = match shrink {
            false => comm.split(Some(0), 0).map(Option::unwrap),
            true => comm.shrink(&[1]),
        };
        match child {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("Share = 1)"), "{reason}")
            }
            other => panic!("expected the refusal, got {other:?}"),
        }
        let mut x = vec![1i32; 2];
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
        comm.destroy().unwrap();
    }
    // Nor is a handle made with it adopted (and it stays the caller's).
    use nccl_sys::bindings::ncclSuccess;
    let (lib, raw) = raw_one_rank();
    let cfg = Config::new().split_share(1);
    // SAFETY: `raw` is a live host communicator that nothing else uses or tears down.
    let adopted = unsafe { Communicator::from_raw(lib.clone(), raw, CommDevice::Host, &cfg) };
    assert!(
        matches!(adopted, Err(Error::InvalidArgument { .. })),
        "{adopted:?}"
    );
    // SAFETY: the refusal gave `raw` back; it is torn down once, here.
    assert_eq!(unsafe { (lib.table().ncclCommDestroy)(raw) }, ncclSuccess);
    // Sharing off: the split goes on.
    let id = CommDevice::Host.unique_id().unwrap();
    let off = Config::new().split_share(0).shrink_share(0);
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &off).unwrap();
    drop(comm.split(Some(0), 0).unwrap().unwrap());
    drop(comm);
    under("NCCL_COMM_SPLIT_SHARE_RESOURCES", "1");
    // Any shrinkShare but 0 shares (init.cc:2582).
    under("NCCL_COMM_SHRINK_SHARE_RESOURCES", " 2");
}

/// Under `NCCL_COMM_ID` every unique id of the job is the same (bootstrap.cc:414-425 of
/// 2.28.9), so communicators created one after another through it share an id: a failure
/// of one must not fail the others, which the diagnostics key by that id (without them,
/// nothing tells a departure to the peers that wait).
#[cfg(feature = "diag")]
#[test]
fn communicators_of_one_nccl_comm_id_fail_apart() {
    under("NCCL_COMM_ID", "127.0.0.1:29517");
    under("NCCL_COMM_ID", "no address");
}

#[test]
#[ignore = "run as a child process by the tests that call under()"]
fn child_under_an_nccl_parameter() {
    let var = [
        "NCCL_COMM_BLOCKING",
        "NCCL_CONF_FILE",
        "NCCL_COMM_SPLIT_SHARE_RESOURCES",
        "NCCL_COMM_SHRINK_SHARE_RESOURCES",
        "NCCL_COMM_ID",
    ]
    .into_iter()
    .find(|v| std::env::var_os(v).is_some())
    .expect("run only as a child process");
    let value = std::env::var(var).unwrap();
    let refused = |r: nccl_safe::Result<Communicator>, what: &str| match r {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains(what), "{reason}")
        }
        other => panic!("expected the refusal, got {other:?}"),
    };
    #[cfg(feature = "diag")]
    if var == "NCCL_COMM_ID" {
        nccl_comm_id(&value);
        println!("child: checked");
        return;
    }
    let id = CommDevice::Host.unique_id().unwrap();
    match (var, value.as_str()) {
        ("NCCL_COMM_BLOCKING", "0") => {
            let comms = Communicator::init_all(&[CommDevice::Host, CommDevice::Host]).unwrap();
            let mut bufs = [vec![1i32, 2], vec![10, 20]];
            Group::run(|g| {
                for (c, b) in comms.iter().zip(bufs.iter_mut()) {
                    g.push(c.all_reduce_in_place_op(b, ReduceOp::Sum, &S)?)?;
                }
                Ok(())
            })
            .unwrap();
            assert_eq!(bufs, [vec![11, 22], vec![11, 22]]);
            for c in comms {
                c.destroy().unwrap();
            }
            // ncclCommInitRank returns ncclSuccess with its init still running (rank 1
            // joins later): from_raw waits for it, though its config says blocking.
            let lib = nccl_safe::Library::host();
            std::thread::scope(|sc| {
                for rank in 0..2 {
                    let (lib, id) = (&lib, &id);
                    sc.spawn(move || {
                        std::thread::sleep(Duration::from_millis(200 * rank as u64));
                        let mut raw = core::ptr::null_mut();
                        // SAFETY: `raw` is writable; rank and size are in range.
                        let r = unsafe {
                            (lib.table().ncclCommInitRank)(&mut raw, 2, id.to_raw(), rank as i32)
                        };
                        assert_eq!(r, nccl_sys::bindings::ncclSuccess);
                        // SAFETY: a live host communicator that nothing else tears down.
                        let comm = unsafe {
                            Communicator::from_raw(
                                lib.clone(),
                                raw,
                                CommDevice::Host,
                                &Config::new(),
                            )
                        };
                        let comm = comm.unwrap();
                        assert_eq!((comm.rank(), comm.world_size()), (rank, 2));
                        comm.destroy().unwrap();
                    });
                }
            });
        }
        ("NCCL_COMM_BLOCKING" | "NCCL_CONF_FILE", _) => {
            // Rank 1 never joins. Without the refusal, NCCL's init blocks in the call.
            let cfg = Config::new().timeout(Duration::from_millis(300));
            let r = within(Duration::from_secs(20), move || {
                Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &cfg)
            });
            refused(r, "NCCL_COMM_BLOCKING=1");
            if var == "NCCL_COMM_BLOCKING" {
                raw_init_is_blocking();
            }
        }
        _ => {
            // Communicators are made (by init, init_all, or elsewhere and adopted), but
            // not split or shrunk under the variable: the child would share the abort flag.
            let made = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new());
            let all = Communicator::init_all(&[CommDevice::Host]).unwrap();
            for comm in [made.unwrap(), adopted_one_rank()].into_iter().chain(all) {
                let r = match var {
                    "NCCL_COMM_SPLIT_SHARE_RESOURCES" => comm.split(Some(0), 0).map(Option::unwrap),
                    _ => comm.shrink(&[1]),
                };
                refused(r, &format!("{var}={}", value.trim()));
                comm.destroy().unwrap();
            }
        }
    }
    println!("child: checked");
}

/// The provider applies NCCL_COMM_BLOCKING=1 as NCCL does: a non-blocking config's init of
/// one rank returns ncclSuccess in the call, not ncclInProgress.
fn raw_init_is_blocking() {
    use nccl_sys::bindings::*;
    // SAFETY: the host provider's lookup returns functions with NCCL's signatures.
    let t = unsafe { nccl_sys::FunctionTable::load(nccl_safe::host::lookup) }.unwrap();
    // SAFETY: ncclConfig_t is plain data; all-zero is a valid bit pattern.
    let mut config: ncclConfig_t = unsafe { core::mem::zeroed() };
    config.size = core::mem::size_of::<ncclConfig_t>();
    (config.magic, config.version) = (NCCL_API_MAGIC, NCCL_VERSION_CODE);
    config.blocking = 0;
    let id = CommDevice::Host.unique_id().unwrap();
    let mut comm = core::ptr::null_mut();
    // SAFETY: a writable out-pointer, a one-rank id and a valid config.
    unsafe {
        let rc = (t.ncclCommInitRankConfig)(&mut comm, 1, id.to_raw(), 0, &mut config);
        assert_eq!(rc, ncclSuccess);
        assert_eq!((t.ncclCommDestroy)(comm), ncclSuccess);
    }
}

/// Two communicators of two ranks through the one id `NCCL_COMM_ID` gives (`at`); the
/// second's rank 1 leaves while rank 0 waits in a collective, and the first still works.
#[cfg(feature = "diag")]
fn nccl_comm_id(at: &str) {
    if at == "no address" {
        let e = CommDevice::Host.unique_id().unwrap_err();
        assert_eq!(e.code(), Some(ResultCode::InvalidArgument), "{e}");
        return;
    }
    let id = CommDevice::Host.unique_id().unwrap();
    assert_eq!(
        CommDevice::Host.unique_id().unwrap(),
        id,
        "NCCL_COMM_ID fixes the id"
    );
    let barrier = Barrier::new(2);
    std::thread::scope(|sc| {
        for rank in 0..2 {
            let (barrier, id) = (&barrier, &id);
            sc.spawn(move || {
                let init =
                    || Communicator::init_rank(&CommDevice::Host, 2, rank, id, &Config::new());
                let first = init().unwrap();
                barrier.wait();
                let second = init().unwrap();
                barrier.wait();
                if rank == 0 {
                    let mut x = vec![1i32; 4];
                    let e = second
                        .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                        .unwrap_err();
                    assert!(matches!(e, Error::RankLeft { rank: 1, .. }), "{e}");
                }
                drop(second);
                barrier.wait();
                let mut x = vec![rank as i32 + 1; 4];
                first
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                    .unwrap();
                assert_eq!(x, vec![3; 4]);
                assert!(!first.is_failed());
                first.destroy().unwrap();
            });
        }
    });
}

/// A one-rank communicator made through the raw table and adopted.
fn adopted_one_rank() -> Communicator {
    let (lib, raw) = raw_one_rank();
    // SAFETY: `raw` is a live host communicator that nothing else uses or tears down.
    unsafe { Communicator::from_raw(lib, raw, CommDevice::Host, &Config::new()) }.unwrap()
}

/// A one-rank host communicator made through the raw table, and its library.
fn raw_one_rank() -> (std::sync::Arc<nccl_safe::Library>, nccl_sys::ncclComm_t) {
    let lib = nccl_safe::Library::host();
    let id = CommDevice::Host.unique_id().unwrap();
    let mut raw = core::ptr::null_mut();
    // SAFETY: `raw` is writable; a one-rank communicator needs no peer.
    let r = unsafe { (lib.table().ncclCommInitRank)(&mut raw, 1, id.to_raw(), 0) };
    assert_eq!(r, nccl_sys::bindings::ncclSuccess);
    (lib, raw)
}
