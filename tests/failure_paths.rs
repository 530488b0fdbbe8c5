//! The failure paths, with the GPU's failure modes injected into the host provider
//! (`nccl_safe::host::fault`): work that never completes (a stuck stream), an abort that
//! blocks (`cudaFree` behind that stream), a process that exits while the abort is blocked
//! (the CUDA runtime's teardown), a peer that never arrives at init, and a registration or
//! poll that the driver holds up while the watchdog times its communicator out, ranks that
//! leave, and windows dropped behind stuck work.
//!
//! The stuck-work scenarios run 20 times in a loop ([`ROUNDS`]), the held-up local calls 3
//! times each, the others once. Bounds: timeout + 1 s for a failure to reach every rank,
//! abort_timeout + 100 ms for a teardown.

mod support;

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use nccl_launch::Launcher;
use nccl_safe::host::fault::{self, Fault};
use nccl_safe::host::stats_for;
use nccl_safe::{CommDevice, Communicator, Config, Error, ReduceOp, ResultCode, Stream, UniqueId};
use support::{assert_balanced, until, within};

const S: Stream = Stream::Host;
const TIMEOUT: Duration = Duration::from_millis(200);
/// The bound on every failure: the configured timeout + 1 s.
const BOUND: Duration = Duration::from_millis(1200);
const ROUNDS: usize = 20;

fn config() -> Config {
    Config::new()
        .timeout(TIMEOUT)
        .abort_timeout(Duration::from_secs(20))
}

fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. })
}

/// Every rank's collective is accepted and never completes; the abort blocks. Every rank
/// must see `is_failed()` and get `Error::Timeout` from its next call (and from
/// `async_error`) within timeout + 1 s, while the aborts are still blocked.
fn stuck_work_round(world: usize) -> (Duration, Duration) {
    let id = CommDevice::Host.unique_id().unwrap();
    fault::inject(&id.to_raw(), Fault::StuckWork);
    fault::inject(&id.to_raw(), Fault::BlockingAbort(None));
    let barrier = Barrier::new(world);
    let times = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let (id, barrier) = (&id, &barrier);
                sc.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, world, rank, id, &config())
                            .unwrap();
                    let mut x = vec![1.0f32; 16];
                    let start = Instant::now();
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                        .expect("a stuck collective is accepted");
                    let failed = until(BOUND, || comm.is_failed())
                        .unwrap_or_else(|| panic!("rank {rank}: is_failed() still false"));
                    let e = comm
                        .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                        .expect_err("the next call fails");
                    let next = start.elapsed();
                    assert!(is_timeout(&e), "rank {rank}: {e}");
                    assert!(e.to_string().contains("did not complete in time"), "{e}");
                    assert!(next <= BOUND, "rank {rank}: the next call took {next:?}");
                    assert!(matches!(comm.async_error(), Err(Error::Timeout { .. })));
                    barrier.wait();
                    (failed, next, comm)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    // The callers above have their errors; the watchdog's abort blocks (it may start only
    // now: the clique was failed before it).
    until(BOUND, || fault::blocked_aborts(&id.to_raw()) >= 1).expect("the abort blocks");
    let worst_failed = times.iter().map(|t| t.0).max().unwrap();
    let worst_next = times.iter().map(|t| t.1).max().unwrap();
    fault::release_aborts(&id.to_raw());
    drop(times); // the communicators: the watchdog already took their handles
    within(Duration::from_secs(10), move || {
        // Every abort thread (some may start only now) returns once released.
        until(Duration::from_secs(5), || {
            fault::blocked_aborts(&id.to_raw()) == 0 && stats_for(&id.to_raw()).live == 0
        })
        .expect("released aborts return");
        let st = assert_balanced(&id);
        assert_eq!(
            (st.created, st.aborted, st.destroyed),
            (world as u64, world as u64, 0)
        );
    });
    (worst_failed, worst_next)
}

#[test]
fn stuck_work_and_a_blocking_abort_fail_every_rank_fast() {
    let mut worst = (Duration::ZERO, Duration::ZERO);
    for round in 0..ROUNDS {
        let (f, n) = stuck_work_round(1 + round % 3);
        worst = (worst.0.max(f), worst.1.max(n));
    }
    eprintln!(
        "stuck work + blocking abort, {ROUNDS} rounds, timeout {TIMEOUT:?}: is_failed() after at most {:?} (from the stuck call's return), next call's error at most {:?} after the stuck call",
        worst.0, worst.1
    );
}

/// While one clique's abort is blocked, the watchdog still serves another clique.
#[test]
fn a_blocked_abort_does_not_stop_the_watchdog() {
    let a = CommDevice::Host.unique_id().unwrap();
    fault::inject(&a.to_raw(), Fault::StuckWork);
    fault::inject(&a.to_raw(), Fault::BlockingAbort(None));
    let ca = Communicator::init_rank(&CommDevice::Host, 1, 0, &a, &config()).unwrap();
    let mut x = vec![1u32; 4];
    ca.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
    until(BOUND, || fault::blocked_aborts(&a.to_raw()) == 1).expect("the first abort blocks");
    for _ in 0..5 {
        let b = CommDevice::Host.unique_id().unwrap();
        fault::inject(&b.to_raw(), Fault::StuckWork);
        let cb = Communicator::init_rank(&CommDevice::Host, 1, 0, &b, &config()).unwrap();
        let start = Instant::now();
        cb.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
        until(BOUND, || cb.is_failed()).expect("the second clique times out too");
        let e = cb
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
            .unwrap_err();
        assert!(is_timeout(&e) && start.elapsed() <= BOUND, "{e}");
        drop(cb);
        until(Duration::from_secs(5), || stats_for(&b.to_raw()).live == 0).unwrap();
        assert_balanced(&b);
    }
    fault::release_aborts(&a.to_raw());
    drop(ca);
    until(Duration::from_secs(5), || stats_for(&a.to_raw()).live == 0).unwrap();
    assert_balanced(&a);
}

/// Dropping a failed communicator whose abort blocks returns within the abort bound.
#[test]
fn drop_waits_at_most_the_abort_bound() {
    let id = CommDevice::Host.unique_id().unwrap();
    fault::inject(&id.to_raw(), Fault::BlockingAbort(None));
    let bound = Duration::from_millis(300);
    let comm = Communicator::init_rank(
        &CommDevice::Host,
        1,
        0,
        &id,
        &Config::new().abort_timeout(bound),
    )
    .unwrap();
    let e = comm.all_reduce_in_place(&mut [1u8][..], ReduceOp::Prod, &Stream::Host);
    assert!(e.is_ok());
    let start = Instant::now();
    let e = comm.abort().expect_err("the abort outlives its bound");
    let took = start.elapsed();
    assert!(is_timeout(&e), "{e}");
    assert!(
        took >= bound && took < bound + Duration::from_millis(100),
        "{took:?}"
    );
    // A blocked abort has done nothing yet (as NVIDIA's, blocked in the driver); released,
    // it tears the handle down, once.
    assert_eq!(stats_for(&id.to_raw()).aborted, 0);
    assert_eq!(fault::blocked_aborts(&id.to_raw()), 1);
    fault::release_aborts(&id.to_raw());
    until(Duration::from_secs(5), || stats_for(&id.to_raw()).live == 0).unwrap();
    assert_eq!(stats_for(&id.to_raw()).aborted, 1);
    assert_balanced(&id);
}

/// Behind stuck work, with the op timeout far away (4 s), every teardown keeps the abort
/// bound (200 ms, + 100 ms): `abort()` (before, it drained the stuck work until the op
/// timeout), the drop of a healthy communicator whose work is stuck, and a drop during a
/// panic. Each handle is torn down once, when its blocked abort is released.
#[test]
fn teardowns_behind_stuck_work_keep_the_abort_bound() {
    let bound = Duration::from_millis(200);
    let limit = bound + Duration::from_millis(100);
    let config = Config::new()
        .timeout(Duration::from_secs(4))
        .abort_timeout(bound);
    let stuck = |id: &nccl_safe::UniqueId| {
        fault::inject(&id.to_raw(), Fault::StuckWork);
        fault::inject(&id.to_raw(), Fault::BlockingAbort(None));
        let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, id, &config).unwrap();
        comm.all_reduce_in_place(&mut [1u8][..], ReduceOp::Sum, &S)
            .unwrap();
        comm
    };
    let ids: Vec<_> = (0..3)
        .map(|_| CommDevice::Host.unique_id().unwrap())
        .collect();
    let comm = stuck(&ids[0]);
    let t = Instant::now();
    let e = comm.abort().expect_err("the abort blocks");
    assert!(t.elapsed() < limit, "abort() took {:?}", t.elapsed());
    assert!(is_timeout(&e), "{e}");

    let comm = stuck(&ids[1]);
    assert!(!comm.is_failed());
    let t = Instant::now();
    drop(comm);
    assert!(t.elapsed() < limit, "drop took {:?}", t.elapsed());

    let comm = stuck(&ids[2]);
    /// Notes when unwinding reaches it (after the panic hook's report), just before the
    /// communicator declared before it is dropped.
    struct Mark<'a>(&'a std::cell::Cell<Option<Instant>>);
    impl Drop for Mark<'_> {
        fn drop(&mut self) {
            self.0.set(Some(Instant::now()));
        }
    }
    let took = std::thread::spawn(move || {
        let at = std::cell::Cell::new(None);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _held = comm;
            let _mark = Mark(&at);
            panic!("a rank panics while holding its communicator");
        }));
        assert!(r.is_err());
        at.get().expect("unwound").elapsed()
    })
    .join()
    .unwrap();
    assert!(took < limit, "the drop during the panic took {took:?}");

    for id in &ids {
        assert_eq!(fault::blocked_aborts(&id.to_raw()), 1);
        fault::release_aborts(&id.to_raw());
        until(Duration::from_secs(5), || stats_for(&id.to_raw()).live == 0).unwrap();
        assert_balanced(id);
        assert_eq!(stats_for(&id.to_raw()).aborted, 1);
    }
}

/// A window dropped behind stuck work keeps the abort bound (200 ms, + 100 ms), with the op
/// timeout far away (4 s). The host provider's window deregistration waits behind the
/// communicator's uncompleted work, as NCCL's unmapping does, so before, the drop waited
/// until the watchdog's timeout. Now the drop skips the collective deregistration past
/// the bound and fails the communicator, whose abort releases the window, once.
#[test]
fn a_window_dropped_behind_stuck_work_keeps_the_abort_bound() {
    let bound = Duration::from_millis(200);
    let limit = bound + Duration::from_millis(100);
    let config = Config::new()
        .timeout(Duration::from_secs(4))
        .abort_timeout(bound);
    let id = CommDevice::Host.unique_id().unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config).unwrap();
    let mut mem = nccl_safe::NcclMemory::<f32>::alloc_zeros(&comm, 4, Stream::Host).unwrap();
    let win = comm
        .register_window(&mut mem, nccl_safe::WindowFlags::COLL_SYMMETRIC)
        .unwrap();
    fault::inject(&id.to_raw(), Fault::StuckWork);
    comm.all_reduce_in_place(&mut [1u8][..], ReduceOp::Sum, &S)
        .unwrap();
    let t = Instant::now();
    drop(win);
    assert!(
        t.elapsed() < limit,
        "the window's drop took {:?}",
        t.elapsed()
    );
    assert!(
        comm.is_failed(),
        "the skipped deregistration fails the communicator"
    );
    drop(mem);
    drop(comm);
    until(Duration::from_secs(5), || stats_for(&id.to_raw()).live == 0).unwrap();
    let st = assert_balanced(&id);
    assert_eq!(
        (
            st.aborted,
            st.windows_registered,
            st.windows_deregistered,
            st.live_at_teardown
        ),
        (1, 1, 0, 1),
        "the abort released the window, once"
    );
}

/// `abort()` of a communicator whose handle the watchdog took waits (bounded) for the
/// watchdog's abort and reports it, instead of returning `Ok` while it is still blocked.
#[test]
fn abort_reports_the_watchdogs_blocked_abort() {
    let id = CommDevice::Host.unique_id().unwrap();
    fault::inject(&id.to_raw(), Fault::StuckWork);
    fault::inject(&id.to_raw(), Fault::BlockingAbort(None));
    let bound = Duration::from_millis(300);
    let config = Config::new().timeout(TIMEOUT).abort_timeout(bound);
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config).unwrap();
    comm.all_reduce_in_place(&mut [1u8][..], ReduceOp::Sum, &S)
        .unwrap();
    until(BOUND, || fault::blocked_aborts(&id.to_raw()) == 1).expect("the watchdog aborts");
    let t = Instant::now();
    let e = comm
        .abort()
        .expect_err("the watchdog's abort is still blocked");
    assert!(is_timeout(&e), "{e}");
    assert!(
        t.elapsed() < bound + Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    fault::release_aborts(&id.to_raw());
    until(Duration::from_secs(5), || stats_for(&id.to_raw()).live == 0).unwrap();
    assert_balanced(&id);
}

/// A call on the handle that is not an operation, made while the watchdog times the
/// communicator out (finding 5 of issue 23, through the public API).
#[derive(Debug, Clone, Copy)]
enum LocalCall {
    Register,
    Deregister,
    AsyncError,
}

/// How long `Fault::SlowCalls` holds each local call: far beyond the watchdog's timeout,
/// so the watchdog times the communicator out while its owner is inside the call.
const SLOW_CALL: Duration = Duration::from_millis(700);

/// The communicator is idle with stuck work in flight, which the watchdog may claim and
/// abort, and its owner is inside a slow `ncclCommRegister`, `ncclCommDeregister` or
/// `ncclCommGetAsyncError` when the timeout expires. The call is pinned against the
/// watchdog: the clique is failed during the call (every rank fails fast), but the handle
/// is aborted only once the call returned, so no call reaches a torn-down handle
/// (`misused == 0`) and the handle is torn down once. The call returns within its own
/// time plus the slack, and the communicator ends failed with `Error::Timeout`.
fn local_call_during_a_timeout(call: LocalCall) {
    let id = CommDevice::Host.unique_id().unwrap();
    fault::inject(&id.to_raw(), Fault::StuckWork);
    let barrier = Barrier::new(2);
    std::thread::scope(|sc| {
        // Rank 1: stuck work too; it sees when the watchdog failed the clique.
        let peer = sc.spawn(|| {
            let comm = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &config()).unwrap();
            barrier.wait();
            comm.all_reduce_in_place(&mut [1u32; 4][..], ReduceOp::Sum, &S)
                .expect("a stuck collective is accepted");
            let failed_at = until(BOUND, || comm.is_failed()).map(|_| Instant::now());
            (failed_at, comm)
        });
        let comm = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &config()).unwrap();
        let (mut held, mut buf) = (vec![0u32; 8], vec![0u32; 8]);
        let mut early = match call {
            LocalCall::Deregister => Some(comm.register(&mut held).unwrap()),
            _ => None,
        };
        barrier.wait();
        let mut x = vec![1u32; 4];
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
            .expect("a stuck collective is accepted");
        // Idle with work in flight: the watchdog may claim it, but not during these calls.
        fault::inject(&id.to_raw(), Fault::SlowCalls(SLOW_CALL));
        let start = Instant::now();
        // A new registration is kept (its drop would deregister, slowly, at once).
        let r = match call {
            LocalCall::Register => comm.register(&mut buf).map(Some),
            LocalCall::Deregister => early
                .take()
                .expect("registered")
                .deregister()
                .map(|()| None),
            LocalCall::AsyncError => comm.async_error().map(|_| None),
        };
        let took = start.elapsed();
        let returned_at = start + took;
        assert!(
            took >= SLOW_CALL && took <= SLOW_CALL + BOUND - TIMEOUT,
            "{call:?}: the call took {took:?}"
        );
        let (failed_at, peer) = peer.join().unwrap();
        let failed_at = failed_at.unwrap_or_else(|| panic!("{call:?}: is_failed() still false"));
        assert!(
            failed_at < returned_at,
            "{call:?}: the watchdog failed the clique only after the call returned"
        );
        // The handle was live during the call: it succeeded, reported the timeout, or (a
        // poll) the peer's abort by the watchdog, never a dead handle.
        assert!(
            match &r {
                Ok(_) | Err(Error::Timeout { .. }) => true,
                Err(e) => e.code() == Some(ResultCode::RemoteError),
            },
            "{call:?}: {r:?}"
        );
        assert_eq!(stats_for(&id.to_raw()).misused, 0, "{call:?}");
        // Once the call returned, the watchdog aborts its handle too.
        until(BOUND, || stats_for(&id.to_raw()).aborted == 2)
            .unwrap_or_else(|| panic!("{call:?}: the watchdog never aborted the handle"));
        let e = comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
            .expect_err("a failed communicator");
        assert!(is_timeout(&e), "{call:?}: {e}");
        assert!(
            matches!(comm.async_error(), Err(Error::Timeout { .. })),
            "{call:?}"
        );
        // The abort released the registration: its drop makes no call.
        drop((r, early));
        drop(comm);
        drop(peer);
    });
    let st = assert_balanced(&id);
    assert_eq!((st.aborted, st.destroyed), (2, 0), "{call:?}: {st:?}");
}

#[test]
fn local_calls_are_never_aborted_under_their_owner() {
    for _ in 0..3 {
        for call in [
            LocalCall::Register,
            LocalCall::Deregister,
            LocalCall::AsyncError,
        ] {
            local_call_during_a_timeout(call);
        }
    }
}

/// Settings no communicator can work with are typed errors, never a panic or a
/// communicator that times out at once.
#[test]
fn impossible_settings_are_refused() {
    let id = CommDevice::Host.unique_id().unwrap();
    for (config, what) in [
        (Config::new().timeout(Duration::ZERO), "timeout"),
        (Config::new().abort_timeout(Duration::ZERO), "abort timeout"),
        (
            Config::new().flight_record_len(usize::MAX),
            "flight record length",
        ),
    ] {
        let e =
            Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config).expect_err("refused");
        assert!(
            matches!(&e, Error::InvalidArgument { reason, .. } if reason.contains(what)),
            "{e}"
        );
    }
    // The largest accepted length still works.
    let ok = Config::new().flight_record_len(nccl_safe::diag::MAX_FLIGHT_RECORD_LEN);
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &ok).unwrap();
    comm.destroy().map_err(|(_, e)| e).unwrap();
}

// ---- a rank that leaves ------------------------------------------------------------

/// A long timeout, so that only the departure can end these runs in time.
fn patient() -> Config {
    Config::new()
        .timeout(Duration::from_secs(60))
        .abort_timeout(Duration::from_secs(5))
}

/// A rank whose communicator is torn down while its peer waits in a collective it never
/// called: the peer fails at once with `RankLeft`, naming it, how it left and the
/// operation the peer was in (before, the peer waited out the whole timeout).
#[test]
fn a_rank_torn_down_under_a_waiting_peer_is_reported_at_once() {
    let id = CommDevice::Host.unique_id().unwrap();
    let start = Instant::now();
    let (e, took) = within(Duration::from_secs(30), move || {
        std::thread::scope(|s| {
            let leaver = s.spawn(|| {
                let c = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &patient()).unwrap();
                c.all_reduce_in_place(&mut [1.0f32][..], ReduceOp::Sum, &S)
                    .unwrap();
                std::thread::sleep(Duration::from_millis(200));
                drop(c);
            });
            let c = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &patient()).unwrap();
            c.all_reduce_in_place(&mut [1.0f32][..], ReduceOp::Sum, &S)
                .unwrap();
            let t = Instant::now();
            let e = c
                .all_reduce_in_place(&mut [1.0f32][..], ReduceOp::Sum, &S)
                .expect_err("rank 1 left");
            leaver.join().unwrap();
            (e, t.elapsed())
        })
    });
    assert!(took < Duration::from_secs(2), "took {took:?}");
    match &e {
        Error::RankLeft { rank, what } => {
            assert_eq!(*rank, 1);
            assert!(
                what.contains("rank 1 left: its communicator was dropped after 1 collective(s)"),
                "{what}"
            );
            assert!(
                what.contains("ncclAllReduce") && what.contains("seq 1"),
                "{what}"
            );
            assert!(what.contains("failure_paths.rs"), "where it left: {what}");
        }
        e => panic!("expected RankLeft: {e}"),
    }
    until(Duration::from_secs(5), || stats_for(&id.to_raw()).live == 0).unwrap();
    assert_balanced(&id);
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// A rank that ends with `abort()` before its peers enter the next collective: on the
/// host provider that collective then fails at once with NCCL's remote error (the clique
/// is broken), and an idle rank that skipped it must still learn that its clique can
/// complete nothing more (`is_failed()`), as when the abort finds a peer already waiting.
/// Before, nothing failed the clique: the idle rank stayed healthy for ever (chaos seed
/// 338 of 600, under load).
#[test]
fn a_collective_failed_by_a_peers_abort_fails_the_idle_ranks_too() {
    let id = CommDevice::Host.unique_id().unwrap();
    let aborted = std::sync::Barrier::new(3);
    let (e, idle_failed) = within(Duration::from_secs(30), move || {
        std::thread::scope(|s| {
            let aborted = &aborted;
            let leaver = s.spawn(move || {
                let c = Communicator::init_rank(&CommDevice::Host, 3, 1, &id, &patient()).unwrap();
                c.all_reduce_in_place(&mut [1.0f32][..], ReduceOp::Sum, &S)
                    .unwrap();
                c.abort().unwrap();
                aborted.wait();
            });
            let caller = s.spawn(move || {
                let c = Communicator::init_rank(&CommDevice::Host, 3, 2, &id, &patient()).unwrap();
                c.all_reduce_in_place(&mut [1.0f32][..], ReduceOp::Sum, &S)
                    .unwrap();
                aborted.wait();
                // Rank 1 is gone (its abort returned): this collective can never complete.
                c.all_reduce_in_place(&mut [1.0f32][..], ReduceOp::Sum, &S)
                    .expect_err("rank 1 aborted")
            });
            // Rank 0 skips that collective and only watches.
            let c = Communicator::init_rank(&CommDevice::Host, 3, 0, &id, &patient()).unwrap();
            c.all_reduce_in_place(&mut [1.0f32][..], ReduceOp::Sum, &S)
                .unwrap();
            aborted.wait();
            leaver.join().unwrap();
            let e = caller.join().unwrap();
            let idle_failed = until(BOUND, || c.is_failed());
            (e, idle_failed)
        })
    });
    // The caller keeps the provider's own error.
    assert_eq!(e.code(), Some(ResultCode::RemoteError), "{e}");
    assert!(
        idle_failed.is_some(),
        "rank 0 never saw its clique fail after rank 2's collective failed for rank 1's abort"
    );
    until(Duration::from_secs(5), || stats_for(&id.to_raw()).live == 0).unwrap();
    assert_balanced(&id);
}

/// The same with the failed call a group's end: rank 2 waits in `Group::end` for a
/// collective that rank 1 issued (its part returned at once: stuck work) and rank 0 never
/// calls; rank 1 then leaves with `abort()`, which breaks the group with NCCL's remote
/// error. The group's communicators are pinned through the call, so its error is judged by
/// `Group::end`, not by the single call's path: it must still fail the clique, or idle
/// rank 0 stays healthy for ever (chaos seed 835777875, about 1 run in 6).
#[test]
fn a_group_failed_by_a_peers_abort_fails_the_idle_ranks_too() {
    let id = CommDevice::Host.unique_id().unwrap();
    let (e, idle_failed) = within(Duration::from_secs(30), move || {
        let (joined, in_group, aborted) = (Barrier::new(3), Barrier::new(2), Barrier::new(2));
        std::thread::scope(|s| {
            let (joined, in_group, aborted) = (&joined, &in_group, &aborted);
            let caller = s.spawn(move || {
                let c = Communicator::init_rank(&CommDevice::Host, 3, 2, &id, &patient()).unwrap();
                joined.wait();
                let (send, mut recv) = (vec![1.0f32; 8], vec![0.0f32; 8]);
                let mut g = nccl_safe::Group::new();
                g.push(
                    c.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &S)
                        .unwrap(),
                )
                .unwrap();
                in_group.wait();
                g.end().expect_err("rank 1 aborted")
            });
            let leaver = s.spawn(move || {
                let c = Communicator::init_rank(&CommDevice::Host, 3, 1, &id, &patient()).unwrap();
                joined.wait();
                in_group.wait();
                // Rank 2 is (normally) inside Group::end by now, waiting: rank 1's part of
                // the collective returns at once and never completes.
                std::thread::sleep(Duration::from_millis(300));
                fault::inject(&id.to_raw(), Fault::StuckWork);
                let (send, mut recv) = (vec![1.0f32; 8], vec![0.0f32; 8]);
                let mut g = nccl_safe::Group::new();
                g.push(
                    c.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &S)
                        .unwrap(),
                )
                .unwrap();
                g.end().unwrap();
                let _ = c.abort();
                aborted.wait();
            });
            // Rank 0 never calls the collective and only watches.
            let c = Communicator::init_rank(&CommDevice::Host, 3, 0, &id, &patient()).unwrap();
            joined.wait();
            let e = caller.join().unwrap();
            aborted.wait();
            leaver.join().unwrap();
            let idle_failed = until(BOUND, || c.is_failed());
            (e, idle_failed)
        })
    });
    // The caller keeps the provider's own error.
    assert_eq!(e.code(), Some(ResultCode::RemoteError), "{e}");
    assert!(
        idle_failed.is_some(),
        "rank 0 never saw its clique fail after rank 2's group failed for rank 1's abort"
    );
    until(Duration::from_secs(5), || stats_for(&id.to_raw()).live == 0).unwrap();
    assert_balanced(&id);
}

/// A group whose peer never joins it: the group's communicators are pinned against the
/// watchdog for `ncclGroupEnd`, so on the host provider (which runs the group inside the
/// call) the wait must end by the communicators' own timeout, not the provider's 300 s
/// limit. `Group::end` then fails with a timeout, the clique is timed out for every rank
/// (the idle peer's `is_failed()` too), and each handle is torn down once.
#[test]
fn a_group_whose_peer_never_joins_ends_at_the_timeout() {
    let id = CommDevice::Host.unique_id().unwrap();
    let (e, took, peer_failed) = within(Duration::from_secs(30), move || {
        let (joined, done) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|s| {
            let peer = s.spawn(|| {
                let c = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &config()).unwrap();
                joined.wait();
                // Never joins the group; reads its own state once rank 0's group ended.
                done.wait();
                until(BOUND, || c.is_failed()).is_some()
            });
            let c = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &config()).unwrap();
            joined.wait();
            let (send, mut recv) = (vec![1.0f32; 8], vec![0.0f32; 8]);
            let t = Instant::now();
            let mut g = nccl_safe::Group::new();
            g.push(
                c.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &S)
                    .unwrap(),
            )
            .unwrap();
            let e = g.end().expect_err("the peer never joins");
            let took = t.elapsed();
            assert!(c.is_failed());
            done.wait();
            (e, took, peer.join().unwrap())
        })
    });
    assert!(
        took < TIMEOUT + Duration::from_secs(1),
        "Group::end took {took:?}"
    );
    assert!(is_timeout(&e), "{e}");
    assert!(e.to_string().contains("a peer never joined it"), "{e}");
    assert!(
        e.to_string().contains("failure_paths.rs"),
        "names the group's line: {e}"
    );
    assert!(peer_failed, "the idle peer's is_failed() stayed false");
    assert_balanced(&id);
}

/// The flight record tells a group's operations by how the group's end went: completed
/// when it ran (the host provider runs the group inside its end), failed when its end
/// failed. Before, the host provider's operations were marked completed as they were
/// queued in the open group, so a group that timed out reported its all-reduce
/// "(completed)".
#[test]
fn a_failed_groups_operations_are_reported_failed_not_completed() {
    use nccl_safe::diag::OpState;
    let id = CommDevice::Host.unique_id().unwrap();
    let (ran, failed, text) = within(Duration::from_secs(30), move || {
        let (joined, done) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|s| {
            let (joined, done) = (&joined, &done);
            let group = |c: &Communicator| {
                let (send, mut sum, mut max) = (vec![1.0f32; 8], vec![0.0f32; 8], vec![0.0; 8]);
                let mut g = nccl_safe::Group::new();
                g.push(c.all_reduce_op(&send, &mut sum, ReduceOp::Sum, &S)?)?;
                g.push(c.all_reduce_op(&send, &mut max, ReduceOp::Max, &S)?)?;
                g.end()
            };
            s.spawn(move || {
                let c = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &config()).unwrap();
                joined.wait();
                group(&c).unwrap();
                // Never joins the second group.
                done.wait();
            });
            let c = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &config()).unwrap();
            joined.wait();
            group(&c).unwrap();
            let ran: Vec<OpState> = (c.flight_record().entries.iter())
                .filter(|e| e.op == "ncclAllReduce")
                .map(|e| e.state)
                .collect();
            let e = group(&c).expect_err("the peer never joins");
            let fr = c.flight_record();
            let failed: Vec<OpState> = (fr.entries.iter().filter(|e| e.op == "ncclAllReduce"))
                .skip(2)
                .map(|e| e.state)
                .collect();
            done.wait();
            (ran, failed, format!("{fr}\n{e}"))
        })
    });
    assert_eq!(ran, [OpState::Completed; 2], "the group that ran");
    assert_eq!(
        failed,
        [OpState::Failed; 2],
        "the group that timed out:\n{text}"
    );
    // The desync report describes rank 0's last operation, the timed-out group's, as
    // under way when it timed out, not completed.
    let rank0 = (text.lines().find(|l| l.trim_start().starts_with("rank 0:")))
        .unwrap_or_else(|| panic!("no desync report: {text}"));
    assert!(!rank0.contains("(completed)"), "{rank0}\n{text}");
    assert_balanced(&id);
}

/// The same when the peer does not stay: it drops its communicator at once, while rank 0
/// is inside `Group::end` waiting for it (on the host provider the group runs inside that
/// call, with its communicators pinned against the watchdog). The group fails at once with
/// `RankLeft` naming rank 1, not at the 60 s timeout.
#[test]
fn a_group_whose_peer_left_fails_at_once() {
    let id = CommDevice::Host.unique_id().unwrap();
    let (e, took) = within(Duration::from_secs(30), move || {
        let joined = Barrier::new(2);
        std::thread::scope(|s| {
            s.spawn(|| {
                let c = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &patient()).unwrap();
                joined.wait();
                // Leave once rank 0 is (normally) inside Group::end.
                std::thread::sleep(Duration::from_millis(100));
                drop(c);
            });
            let c = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &patient()).unwrap();
            joined.wait();
            let (send, mut recv) = (vec![1.0f32; 8], vec![0.0f32; 8]);
            let t = Instant::now();
            let mut g = nccl_safe::Group::new();
            // On a slow machine the departure may already be known at the push, which
            // then fails the same way.
            let r = g
                .push(
                    c.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &S)
                        .unwrap(),
                )
                .and_then(|()| g.end());
            let e = r.expect_err("the peer left");
            (e, t.elapsed())
        })
    });
    assert!(took < Duration::from_secs(5), "Group::end took {took:?}");
    assert!(matches!(e, Error::RankLeft { rank: 1, .. }), "{e}");
    assert!(
        e.to_string().contains("failure_paths.rs"),
        "names the group's line: {e}"
    );
    assert_balanced(&id);
}

/// Under the launcher: rank 2 returns while its peers still call collectives (a loop of a
/// different length on one rank). The run fails within a second, not after the 60 s
/// timeout, naming rank 2 as the culprit (another rank failed first, waiting for it); the
/// report is in the error once, not once per rank.
#[test]
fn a_rank_that_returns_early_fails_the_run_at_once() {
    let t = Instant::now();
    let e = Launcher::host(4)
        .config(patient())
        .run(|rank| {
            let steps = if rank.rank() == 2 { 2 } else { 5 };
            for _ in 0..steps {
                let mut g = vec![1.0f32; 4];
                rank.comm()
                    .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream())?;
            }
            if rank.rank() == 2 {
                // The others finish the collectives rank 2 shared with them first: one
                // still waiting for NCCL's launch of one (ncclInProgress) when rank 2
                // leaves is aborted with the clique, and its count would say nothing.
                std::thread::sleep(Duration::from_millis(200));
            }
            Ok(())
        })
        .expect_err("ranks 0, 1 and 3 wait for rank 2");
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let text = e.to_string();
    match &e {
        nccl_launch::Error::RankFailed {
            rank, first, cause, ..
        } => {
            assert_eq!(*rank, 2, "rank 2 left the others waiting: {text}");
            assert_ne!(*first, 2, "rank 2 returned Ok: {text}");
            assert!(
                cause.contains("it returned after 2 collective(s) while the others called 3"),
                "{text}"
            );
            assert!(text.starts_with("rank 2 caused the failure"), "{text}");
        }
        e => panic!("expected RankFailed: {e}"),
    }
    // The report in the cause, then one line per rank (its error's first line).
    let nccl_launch::Error::RankFailed { cause, .. } = &e else {
        unreachable!()
    };
    assert!(text.lines().count() <= cause.lines().count() + 4, "{text}");
    for r in 0..4 {
        let lines = text
            .lines()
            .filter(|l| l.starts_with(&format!("rank {r}: ")))
            .count();
        assert_eq!(lines, 1, "rank {r}: {text}");
    }
}

/// Only rank 0 runs one more collective after the loop: it fails at once.
#[test]
fn one_extra_collective_on_one_rank_fails_at_once() {
    let t = Instant::now();
    let e = Launcher::host(3)
        .config(patient())
        .run(|rank| {
            let mut g = vec![1.0f32; 4];
            rank.comm()
                .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream())?;
            if rank.rank() == 0 {
                rank.comm()
                    .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream())?;
            } else {
                // As in `a_rank_that_returns_early_fails_the_run_at_once`: every rank ends
                // the shared collective's launch before the first leaves.
                std::thread::sleep(Duration::from_millis(200));
            }
            Ok(())
        })
        .expect_err("rank 0's extra collective has no peers");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    match &e {
        nccl_launch::Error::RankFailed { rank: 0, cause, .. } => {
            assert!(cause.contains("left"), "{e}");
            assert!(cause.contains("an extra collective on rank 0"), "{e}");
        }
        e => panic!("expected rank 0 to be named: {e}"),
    }
}

/// `RankFailed` names the first rank to fail, not the lowest-numbered: rank 2 fails, and
/// ranks 0 and 1 fail after it because it aborted. A timeout's desync report appears once
/// in the error, with one line per rank.
#[test]
fn rank_failed_names_the_first_rank_to_fail_and_reports_once() {
    let e = Launcher::host(3)
        .config(patient())
        .run(|rank| {
            if rank.rank() == 2 {
                return Err(Error::InvalidArgument {
                    call: "the test",
                    reason: "rank 2 fails first".into(),
                });
            }
            let mut g = vec![1.0f32; 4];
            rank.comm()
                .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream())?;
            Ok(())
        })
        .expect_err("rank 2 fails");
    match &e {
        nccl_launch::Error::RankFailed { rank, cause, .. } => {
            assert_eq!(*rank, 2, "{e}");
            assert!(cause.contains("rank 2 fails first"), "{e}");
        }
        e => panic!("expected RankFailed: {e}"),
    }
    let e = Launcher::host(3)
        .config(Config::new().timeout(TIMEOUT))
        .run(|rank| {
            if rank.rank() == 1 {
                std::thread::sleep(TIMEOUT * 5); // a straggler, not a leaver
            }
            let mut g = vec![1.0f32; 4];
            rank.comm()
                .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream())?;
            Ok(())
        })
        .expect_err("rank 1 is too late");
    let text = e.to_string();
    assert!(
        matches!(&e, nccl_launch::Error::RankFailed { rank: 1, .. }),
        "the straggler is the culprit: {text}"
    );
    assert!(
        text.starts_with("rank 1 caused the failure: it was behind"),
        "{text}"
    );
    assert_eq!(text.matches("Desync report").count(), 1, "{text}");
    for r in 0..3 {
        let lines = text
            .lines()
            .filter(|l| l.starts_with(&format!("rank {r}: ")))
            .count();
        assert_eq!(lines, 1, "rank {r}: {text}");
    }
}

// ---- a process that exits while an abort is blocked ----------------------------------

const CHILD_VAR: &str = "NCCL_SAFE_TEST_EXIT_CHILD";

/// What the exit handler the child registers before anything of the crate prints.
const EARLIER_HANDLER: &str = "child: the earlier exit handler ran";

extern "C" fn earlier_exit_handler() {
    let msg = format!("{EARLIER_HANDLER}\n");
    // SAFETY: writes a valid buffer of `msg.len()` bytes to the process's stdout.
    unsafe {
        libc::write(1, msg.as_ptr().cast(), msg.len());
    }
}

/// The child's part (run only as a child process, see `exit_while_an_abort_is_blocked`):
/// an exit handler registered first (as C stdio, a profiler or Python's would be), then a
/// timed-out clique whose abort blocks, then the process ends as
/// `NCCL_SAFE_TEST_EXIT_CHILD` says: `{stuck,slow}-{exit3,return}`. `stuck`: the abort
/// never returns (past its bound of 300 ms, the guard ends the process); `slow`: it returns
/// after 1.5 s, within its bound of 5 s (the guard waits for it). `exit3` is
/// `std::process::exit(3)`, `return` a return to the harness's main (status 0).
#[test]
#[ignore = "run as a child process by exit_while_an_abort_is_blocked"]
fn child_exits_while_an_abort_is_blocked() {
    let Ok(mode) = std::env::var(CHILD_VAR) else {
        panic!("run only as a child process ({CHILD_VAR} unset)");
    };
    // SAFETY: registers a plain `extern "C" fn()`.
    unsafe {
        libc::atexit(earlier_exit_handler);
    }
    let (block, bound) = if mode.starts_with("slow") {
        (Some(Duration::from_millis(1500)), Duration::from_secs(5))
    } else {
        (None, Duration::from_millis(300))
    };
    let id = CommDevice::Host.unique_id().unwrap();
    fault::inject(&id.to_raw(), Fault::StuckWork);
    fault::inject(&id.to_raw(), Fault::BlockingAbort(block));
    let config = Config::new().timeout(TIMEOUT).abort_timeout(bound);
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config).unwrap();
    let mut x = vec![0i64; 8];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
    until(Duration::from_secs(5), || {
        fault::blocked_aborts(&id.to_raw()) == 1
    })
    .expect("the watchdog's abort blocks");
    assert!(comm.is_failed());
    std::mem::forget(comm); // as a process that ends without dropping it
    println!("child: abort blocked, ending with {mode}");
    if mode.ends_with("exit3") {
        std::process::exit(3);
    }
}

/// The process ends with its own status, never a signal, while the watchdog's abort is
/// blocked. An abort that is only slow is waited for, and every earlier exit handler runs;
/// one blocked past its bound ends the process early (skipping them, which would crash
/// under a blocked abort). 5 children of each of the four modes.
#[test]
fn exit_while_an_abort_is_blocked() {
    let exe = std::env::current_exe().unwrap();
    for (mode, want, handlers) in [
        ("stuck-exit3", 3, false),
        ("stuck-return", 0, false),
        ("slow-exit3", 3, true),
        ("slow-return", 0, true),
    ] {
        let children: Vec<_> = (0..5)
            .map(|_| {
                Command::new(&exe)
                    .args([
                        "--exact",
                        "child_exits_while_an_abort_is_blocked",
                        "--ignored",
                        "--nocapture",
                    ])
                    .env(CHILD_VAR, mode)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let out = c.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                text.contains("child: abort blocked"),
                "{mode}: the child did not reach its exit: {text}"
            );
            assert_eq!(
                out.status.signal(),
                None,
                "{mode}: killed by a signal: {text}"
            );
            assert_eq!(out.status.code(), Some(want), "{mode}: {text}");
            assert_eq!(
                text.contains(EARLIER_HANDLER),
                handlers,
                "{mode}: the earlier exit handler must run exactly when no call is blocked past its bound: {text}"
            );
        }
    }
}

// ---- a peer that never arrives ---------------------------------------------------------

fn assert_names_missing(e: &Error, missing: usize) {
    assert!(is_timeout(e), "{e}");
    let text = e.to_string();
    assert!(
        text.contains(&format!("never seen here: [{missing}]")),
        "the report names rank {missing}: {text}"
    );
}

#[test]
fn a_missing_rank_at_blocking_init_is_a_timeout_naming_it() {
    for _ in 0..ROUNDS {
        let id = CommDevice::Host.unique_id().unwrap();
        let start = Instant::now();
        let e = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &config()).unwrap_err();
        assert!(start.elapsed() <= BOUND, "{:?}", start.elapsed());
        assert_names_missing(&e, 1);
        assert_balanced(&id);
    }
}

#[test]
fn a_missing_rank_at_nonblocking_init_is_a_timeout_naming_it() {
    for _ in 0..ROUNDS {
        let id = CommDevice::Host.unique_id().unwrap();
        let start = Instant::now();
        let pending =
            Communicator::init_rank_nonblocking(&CommDevice::Host, 3, 2, &id, &config()).unwrap();
        let e = pending.wait(TIMEOUT).unwrap_err();
        assert!(start.elapsed() <= BOUND, "{:?}", start.elapsed());
        assert!(is_timeout(&e), "{e}");
        assert!(e.to_string().contains("never seen here: [0, 1]"), "{e}");
        assert_balanced(&id);
    }
}

/// Ranks 0 and 1 init; rank 1 then never calls the split (or shrink), so rank 0 waits.
fn missing_at_child_creation(shrink: bool) {
    within(Duration::from_secs(20), move || {
        missing_at_child_creation_inner(shrink)
    });
}

fn missing_at_child_creation_inner(shrink: bool) {
    let id = UniqueId::new_with(&CommDevice::Host.library().unwrap()).unwrap();
    let world = 3;
    let barrier = Barrier::new(world);
    std::thread::scope(|sc| {
        for rank in 0..world {
            let (id, barrier) = (&id, &barrier);
            sc.spawn(move || {
                let comm =
                    Communicator::init_rank(&CommDevice::Host, world, rank, id, &config()).unwrap();
                barrier.wait();
                if rank == 0 {
                    let start = Instant::now();
                    let e = if shrink {
                        comm.shrink(&[2]).map(drop).unwrap_err()
                    } else {
                        comm.split(Some(0), 0).map(drop).unwrap_err()
                    };
                    assert!(start.elapsed() <= BOUND, "{:?}", start.elapsed());
                    assert!(is_timeout(&e), "{e}");
                    assert!(
                        e.to_string().contains("rank 1"),
                        "names the rank behind: {e}"
                    );
                } else if rank == 2 && !shrink {
                    // Joins the split; gets the timeout too once rank 0's clique fails.
                    let r = comm.split(Some(0), 0).map(drop);
                    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
                }
                barrier.wait();
            });
        }
    });
    until(Duration::from_secs(5), || stats_for(&id.to_raw()).live == 0)
        .expect("every handle torn down");
    assert_balanced(&id);
}

#[test]
fn a_missing_rank_at_split_is_a_timeout() {
    for _ in 0..ROUNDS {
        missing_at_child_creation(false);
    }
}

#[test]
fn a_missing_rank_at_shrink_is_a_timeout() {
    for _ in 0..ROUNDS {
        missing_at_child_creation(true);
    }
}

// ---- the culprit, in words -------------------------------------------------------------

/// A rank that panics is the culprit even when a peer's failure came first in time, and its
/// peers' errors say that it panicked (not NCCL's stock "remote process exited"); a
/// backtrace that an error type prints in its message (candle's, with `RUST_BACKTRACE=1`)
/// stays out of the report.
#[test]
fn a_panicking_rank_is_the_culprit_and_its_peers_say_it_panicked() {
    let e = Launcher::host(3)
        .config(patient())
        .run(|rank| {
            let mut g = vec![1.0f32; 4];
            rank.comm()
                .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream())?;
            if rank.rank() == 1 {
                panic!("rank 1 exploded");
            }
            rank.comm()
                .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream())?;
            Ok(())
        })
        .expect_err("rank 1 panics");
    let text = e.to_string();
    let nccl_launch::Error::RankFailed {
        rank, cause, ranks, ..
    } = &e
    else {
        panic!("expected RankFailed: {text}");
    };
    assert_eq!(*rank, 1, "{text}");
    assert!(cause.contains("rank 1 exploded"), "{text}");
    for r in [0, 2] {
        assert!(
            ranks[r].contains("panicked (\"rank 1 exploded\")"),
            "rank {r} should say that rank 1 panicked: {text}"
        );
    }

    let e = Launcher::host(2)
        .try_run(|rank| -> Result<(), String> {
            if rank.rank() == 0 {
                return Err("shape mismatch\nStack backtrace:\n   0: candle_core::error".into());
            }
            Ok(())
        })
        .expect_err("rank 0 fails");
    let text = e.to_string();
    assert!(
        matches!(&e, nccl_launch::Error::RankFailed { rank: 0, .. }),
        "{text}"
    );
    assert!(text.contains("shape mismatch"), "{text}");
    assert!(
        !text.contains("candle_core::error"),
        "a backtrace in the report: {text}"
    );
}

/// Set in the child of `a_rank_that_waits_long_gets_a_notice_naming_the_rank_behind`.
const NOTICE_VAR: &str = "NCCL_SAFE_TEST_NOTICE_CHILD";

/// A rank that waits long in a collective gets a notice on stderr, once, long before its
/// timeout (a quarter of it, at most a minute), naming the rank of its process that has not
/// called it yet; the run then completes normally when that rank arrives.
#[test]
fn a_rank_that_waits_long_gets_a_notice_naming_the_rank_behind() {
    let child = support::spawn_child("child_waits_long_for_rank_2", NOTICE_VAR, "1");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let notices: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("nccl-safe: rank "))
        .collect();
    assert!(!notices.is_empty(), "no notice: {err}");
    for n in &notices {
        assert!(n.contains("has waited"), "{n}");
        assert!(
            n.contains("rank(s) [2] of this process have not called it yet"),
            "{n}"
        );
        assert!(
            n.contains("tests/failure_paths.rs:"),
            "the caller's line: {n}"
        );
    }
    // Ranks 0 and 1 each once, for their one stuck collective.
    assert_eq!(notices.len(), 2, "{err}");
}

#[test]
#[ignore = "run as a child process by a_rank_that_waits_long_gets_a_notice_naming_the_rank_behind"]
fn child_waits_long_for_rank_2() {
    if std::env::var_os(NOTICE_VAR).is_none() {
        return;
    }
    const TIMEOUT: Duration = Duration::from_secs(8);
    Launcher::host(3)
        .config(Config::new().timeout(TIMEOUT))
        .run(|rank| {
            if rank.rank() == 2 {
                // Past the notice (TIMEOUT / 4), well within the timeout.
                std::thread::sleep(TIMEOUT / 2);
            }
            let mut g = vec![1.0f32; 4];
            rank.comm()
                .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream())?;
            Ok(())
        })
        .expect("rank 2 arrives within the timeout");
}

/// The same notice for a collective in a [`nccl_safe::Group`]: the group's end pins its
/// communicators against the watchdog, and the watchdog looked only at operations inside
/// their own call or published on a stream, so a group waiting for a stuck rank printed
/// nothing until its timeout.
#[test]
fn a_group_that_waits_long_gets_a_notice_naming_the_rank_behind() {
    let child = support::spawn_child("child_group_waits_long_for_rank_2", NOTICE_VAR, "1");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let notices: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("nccl-safe: rank "))
        .collect();
    assert!(!notices.is_empty(), "no notice: {err}");
    for n in &notices {
        assert!(n.contains("has waited"), "{n}");
        assert!(
            n.contains("rank(s) [2] of this process have not called it yet"),
            "{n}"
        );
        assert!(
            n.contains("tests/failure_paths.rs:"),
            "the caller's line: {n}"
        );
    }
    assert_eq!(notices.len(), 2, "{err}");
}

#[test]
#[ignore = "run as a child process by a_group_that_waits_long_gets_a_notice_naming_the_rank_behind"]
fn child_group_waits_long_for_rank_2() {
    if std::env::var_os(NOTICE_VAR).is_none() {
        return;
    }
    const TIMEOUT: Duration = Duration::from_secs(8);
    Launcher::host(3)
        .config(Config::new().timeout(TIMEOUT))
        .run(|rank| {
            if rank.rank() == 2 {
                // Past the notice (TIMEOUT / 4), well within the timeout.
                std::thread::sleep(TIMEOUT / 2);
            }
            let mut g = vec![1.0f32; 4];
            let (comm, s) = (rank.comm(), rank.stream());
            nccl_safe::Group::run(|grp| {
                grp.push(comm.all_reduce_in_place_op(&mut g, ReduceOp::Sum, s)?)
            })?;
            Ok(())
        })
        .expect("rank 2 arrives within the timeout");
}

/// A group left by `?` (never ended: its `Drop` ends it) whose peer never joins names the
/// line that made the group, not nccl-safe's `Drop`, and the rank behind.
#[test]
fn a_dropped_group_names_its_line_and_the_rank_behind() {
    let id = CommDevice::Host.unique_id().unwrap();
    let e = within(Duration::from_secs(30), move || {
        let (joined, done) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|s| {
            s.spawn(|| {
                let c = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &config()).unwrap();
                joined.wait();
                done.wait();
                drop(c);
            });
            let c = Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &config()).unwrap();
            joined.wait();
            let (send, mut recv) = (vec![1.0f32; 8], vec![0.0f32; 8]);
            let mut g = nccl_safe::Group::new();
            g.push(
                c.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &S)
                    .unwrap(),
            )
            .unwrap();
            drop(g); // as a `?` out of the function would
                     // The drop's error is lost; the next call returns the clique's report.
            let e = c
                .all_reduce(&send, &mut recv, ReduceOp::Sum, &S)
                .unwrap_err();
            done.wait();
            e
        })
    });
    let text = e.to_string();
    assert!(is_timeout(&e), "{e}");
    assert!(text.contains("rank(s) [1] are behind"), "{e}");
    assert!(!text.contains("src/group.rs"), "nccl-safe's line: {e}");
    assert_balanced(&id);
}

/// Rank 2 of `stuck_run` sleeps in its own code until this is set (or 60 s).
static RELEASE_RANK_2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Set when rank 2 of `stuck_run` got its collective's result, after its release.
static RANK_2_DONE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// 3 ranks; rank 2 stays in its own code (waiting for [`RELEASE_RANK_2`]) while the others
/// wait for it in an all_reduce and time out after 500 ms.
fn stuck_rank(rank: &nccl_launch::Rank) -> nccl_safe::Result<()> {
    use std::sync::atomic::Ordering;
    if rank.rank() == 2 {
        let t = Instant::now();
        while !RELEASE_RANK_2.load(Ordering::Acquire) && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let mut g = vec![1.0f32; 4];
    let r = rank
        .comm()
        .all_reduce_in_place(&mut g, ReduceOp::Sum, rank.stream());
    if rank.rank() == 2 {
        *RANK_2_DONE.lock().unwrap() = Some(format!("{r:?}"));
    }
    r
}

const STUCK_TIMEOUT: Duration = Duration::from_millis(500);

/// `try_run_detached` returns once every other rank failed and rank 2 stayed in its own
/// code for `STUCK_AFTER`, naming it the culprit and leaving its thread running; released
/// later, that thread's collective fails at once (its communicator failed with the
/// others') and it tears its communicator down.
#[test]
fn a_rank_stuck_in_its_own_code_is_named_and_its_thread_detached() {
    use nccl_launch::STUCK_AFTER;
    use std::sync::atomic::Ordering;
    let t = Instant::now();
    let r = within(Duration::from_secs(30), || {
        Launcher::host(3)
            .config(Config::new().timeout(STUCK_TIMEOUT))
            .try_run_detached(stuck_rank)
    });
    let took = t.elapsed();
    assert!(
        !RELEASE_RANK_2.load(Ordering::Acquire),
        "returned only once rank 2 was released"
    );
    match &r {
        Err(nccl_launch::Error::RankFailed {
            rank, cause, ranks, ..
        }) => {
            assert_eq!(*rank, 2, "rank 2 is the culprit: {r:?}");
            assert!(cause.contains("stuck in its own code"), "{cause}");
            assert!(ranks[2].contains("still running"), "{ranks:?}");
        }
        other => panic!("expected RankFailed naming rank 2: {other:?}"),
    }
    assert!(
        took >= STUCK_AFTER && took < STUCK_AFTER + Duration::from_secs(10),
        "returned after {took:?}"
    );
    assert!(RANK_2_DONE.lock().unwrap().is_none());
    // Released: its collective fails at once and its thread ends.
    RELEASE_RANK_2.store(true, Ordering::Release);
    until(Duration::from_secs(10), || {
        RANK_2_DONE.lock().unwrap().is_some()
    })
    .expect("the detached rank's collective returned");
    let done = RANK_2_DONE.lock().unwrap().clone().unwrap();
    assert!(done.starts_with("Err("), "rank 2's late collective: {done}");
}

const STUCK_VAR: &str = "NCCL_SAFE_TEST_STUCK_CHILD";

/// `run` waits for a rank stuck in its own code (its closure may borrow from the caller),
/// says so on stderr once the others failed, and names it once it ends.
#[test]
fn run_waits_for_a_rank_stuck_in_its_own_code_and_says_so() {
    let child = support::spawn_child("child_run_with_a_stuck_rank", STUCK_VAR, "1");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let notes: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("nccl-safe: Launcher::run: rank(s) [2] still in their closure"))
        .collect();
    assert_eq!(notes.len(), 1, "one note naming rank 2: {err}");
    assert!(notes[0].contains("try_run_detached"), "{}", notes[0]);
    assert!(err.contains("RESULT rank 2 is the culprit"), "{err}");
}

#[test]
#[ignore = "run as a child process by run_waits_for_a_rank_stuck_in_its_own_code_and_says_so"]
fn child_run_with_a_stuck_rank() {
    use nccl_launch::STUCK_AFTER;
    use std::sync::atomic::Ordering;
    if std::env::var_os(STUCK_VAR).is_none() {
        return;
    }
    let release = STUCK_AFTER * 2;
    std::thread::spawn(move || {
        std::thread::sleep(release);
        RELEASE_RANK_2.store(true, Ordering::Release);
    });
    let t = Instant::now();
    let r = Launcher::host(3)
        .config(Config::new().timeout(STUCK_TIMEOUT))
        .run(stuck_rank);
    assert!(
        t.elapsed() >= release,
        "run returned before rank 2's thread ended"
    );
    match r {
        Err(nccl_launch::Error::RankFailed { rank: 2, .. }) => {
            eprintln!("RESULT rank 2 is the culprit")
        }
        other => panic!("expected RankFailed naming rank 2: {other:?}"),
    }
}
