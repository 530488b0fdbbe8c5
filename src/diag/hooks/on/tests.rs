//! Unit tests of the hooks over the host provider: the owner's side of the watchdog's
//! claim, the tracker's calls, the queues' bounds, children's keys, pins, and a user's
//! revoke.

use std::panic::Location;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys::ncclComm_t;

use super::TEST_TRACKER;
use crate::diag::hooks::{shrink_tag, CommDiag};
use crate::diag::supervise::claim::{ABORTING, DECIDING, UNCLAIMED};
use crate::diag::supervise::clique::TimeoutReport;
use crate::diag::supervise::clock;
use crate::diag::supervise::journal::Entry;
use crate::diag::supervise::record::OpState;
use crate::diag::supervise::shared::{QueueWatch, Shared, IDLE, MAX_QUEUES};
use crate::diag::supervise::tracker::{self, Queue, Tracker};
use crate::error::{Error, Result};
use crate::id::UniqueId;
use crate::{CommDevice, Communicator, Config, ReduceOp, Stream};

/// Polls `done` every `every` until it holds or `within` has passed.
fn wait_for(within: Duration, every: Duration, done: impl Fn() -> bool) {
    let limit = Instant::now() + within;
    while !done() && Instant::now() < limit {
        std::thread::sleep(every);
    }
}

/// The host provider's (created, destroyed, aborted, misused) of `id`'s communicators.
fn counts(id: &UniqueId) -> (u64, u64, u64, u64) {
    let s = crate::host::stats_for(&id.to_raw());
    (s.created, s.destroyed, s.aborted, s.misused)
}

fn comm() -> (Communicator, UniqueId) {
    let id = CommDevice::Host.unique_id().unwrap();
    let c = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new()).unwrap();
    (c, id)
}

fn sum(c: &Communicator) -> Result<()> {
    let mut x = vec![1.0f32; 4];
    c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
}

/// In 30 ms, the watchdog's verdict on a claim of `s`: it aborts the communicator with
/// `report`, as its sweep would.
fn abort_soon(s: &Arc<Shared>, report: &'static str) -> std::thread::JoinHandle<()> {
    let s = Arc::clone(s);
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        s.claim.store(ABORTING, Ordering::Release);
        let h = s.take_for_abort(&TimeoutReport::text(report));
        assert_ne!(h, 0);
        // SAFETY: the handle was taken out of the communicator above: its one teardown.
        let r = unsafe { (s.lib.table().ncclCommAbort)(h as ncclComm_t) };
        assert_eq!(r, nccl_sys::bindings::ncclSuccess);
    })
}

/// The owner's side of the claim: an operation that finds the watchdog deciding waits
/// for the verdict; let be, it runs; aborted, it fails without reaching NCCL.
#[test]
fn an_operation_waits_for_the_watchdogs_verdict() {
    let (c, id) = comm();
    let s = Arc::clone(c.diag.shared(c.diag_view()));
    s.claim.store(DECIDING, Ordering::SeqCst);
    let t = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            s.claim.store(UNCLAIMED, Ordering::Release);
        })
    };
    let start = Instant::now();
    sum(&c).expect("the watchdog let it be");
    assert!(start.elapsed() >= Duration::from_millis(25));
    t.join().unwrap();
    assert_eq!(crate::host::stats_for(&id.to_raw()).misused, 0);

    s.claim.store(DECIDING, Ordering::SeqCst);
    let t = abort_soon(&s, "the test's report");
    let e = sum(&c).expect_err("aborted");
    t.join().unwrap();
    assert!(
        matches!(&e, Error::Timeout { what, .. } if what.contains("the test's report")),
        "{e}"
    );
    assert!(matches!(sum(&c), Err(Error::Timeout { .. })));
    let last = c.flight_record().entries.last().copied().unwrap();
    assert_eq!(last.state, OpState::Failed);
    drop(c);
    assert_eq!(counts(&id), (1, 0, 1, 0));
}

/// A counting tracker that expects its calls on this thread.
fn counting_here() -> Arc<tracker::counting::Counting> {
    Arc::new(tracker::counting::Counting::new(
        std::thread::current().id(),
    ))
}

/// A one-rank host communicator whose watched work goes through `counting`.
fn counted(
    counting: &Arc<tracker::counting::Counting>,
    timeout: Duration,
) -> (Communicator, UniqueId) {
    let id = CommDevice::Host.unique_id().unwrap();
    TEST_TRACKER.with(|t| *t.borrow_mut() = Some(Arc::clone(counting) as Arc<dyn Tracker>));
    let c = Communicator::init_rank(
        &CommDevice::Host,
        1,
        0,
        &id,
        &Config::new().timeout(timeout),
    );
    TEST_TRACKER.with(|t| *t.borrow_mut() = None);
    (c.unwrap(), id)
}

/// The per-operation path makes no tracker call (no CUDA event record or query on a
/// CUDA stream) on the caller's thread: the watchdog records at most one marker per
/// queue per tick, on its own thread, and the work is still seen to complete.
#[test]
fn the_per_operation_path_never_calls_the_tracker() {
    let counting = counting_here();
    let (c, _id) = counted(&counting, Duration::from_secs(600));
    let ticks_before = clock::coarse();
    const OPS: u64 = 2000;
    for _ in 0..OPS {
        sum(&c).unwrap();
    }
    let marks_during_ops = counting.marks.load(Ordering::SeqCst);
    let ticks = (clock::coarse() - ticks_before) / clock::TICK.as_nanos() as u64;
    assert_eq!(counting.owner_marks.load(Ordering::SeqCst), 0);
    assert_eq!(counting.owner_queries.load(Ordering::SeqCst), 0);
    assert!(
        marks_during_ops <= ticks + 2,
        "{marks_during_ops} markers in {ticks} ticks for {OPS} operations"
    );
    let s = Arc::clone(c.diag.shared(c.diag_view()));
    let retired = || (s.host_queue.as_ref()).map_or(0, |q| q.retired.load(Ordering::Acquire));
    wait_for(Duration::from_secs(10), Duration::from_millis(5), || {
        retired() >= OPS
    });
    assert_eq!(retired(), OPS, "the watchdog retired every operation");
    assert!(counting.marks.load(Ordering::SeqCst) >= 1);
    eprintln!(
        "{OPS} operations: {} markers and {} queries, all on the watchdog's thread, over {ticks} ticks",
        counting.marks.load(Ordering::SeqCst),
        counting.queries.load(Ordering::SeqCst)
    );
    drop(s);
    c.destroy().map_err(|(_, e)| e).unwrap();
}

/// Markers recorded at enqueue (exact completion) stay bounded when the work runs far
/// behind: past `MAX_PENDING` in flight on a queue, the newest is recorded again and its
/// range extended; once they complete, every position is retired.
#[test]
fn markers_at_enqueue_are_bounded_and_retire_everything() {
    let counting = counting_here();
    counting.complete.store(false, Ordering::SeqCst);
    let (c, _id) = counted(&counting, Duration::from_secs(600));
    let s = Arc::clone(c.diag.shared(c.diag_view()));
    let q = Arc::new(QueueWatch::new(
        Queue::Host(7),
        true,
        Arc::clone(&s.tracker),
    ));
    const N: u64 = 3 * tracker::MAX_PENDING as u64;
    for upto in 1..=N {
        s.mark_at_enqueue(&q, upto);
        q.published.store(upto, Ordering::Release);
    }
    let pending = q.pending();
    assert_eq!(pending.len(), tracker::MAX_PENDING);
    assert_eq!(q.ranges.marked(), N);
    assert_eq!(pending.last(), Some(&(N, true)));
    assert_eq!(counting.owner_now_marks.load(Ordering::SeqCst), N);
    // Marked already: the watchdog's tick records nothing for this queue.
    let marks = counting.marks.load(Ordering::SeqCst);
    s.track_queue(&q);
    assert_eq!(counting.marks.load(Ordering::SeqCst), marks);
    assert_eq!(q.retired.load(Ordering::Acquire), 0);
    counting.complete.store(true, Ordering::SeqCst);
    s.track_queue(&q);
    assert_eq!(q.retired.load(Ordering::Acquire), N);
    assert!(q.pending().is_empty());
    drop(s);
    c.destroy().map_err(|(_, e)| e).unwrap();
}

/// Past `MAX_PENDING` in flight, on a stream whose captures alternate with work that
/// runs: a marker is not recorded again into a capture (the tracker refuses, and the
/// captured operation joins the newest range as it is), and the next one recorded again
/// outside covers it, so the queue stays within `MAX_PENDING` ranges, each with a
/// marker, and everything retires once complete; while the watchdog retires some of
/// them, the owner's next ranges take the freed slots.
#[test]
fn markers_at_enqueue_stay_bounded_when_captures_alternate_with_work() {
    let counting = counting_here();
    counting.complete.store(false, Ordering::SeqCst);
    let (c, _id) = counted(&counting, Duration::from_secs(600));
    let s = Arc::clone(c.diag.shared(c.diag_view()));
    let q = Arc::new(QueueWatch::new(
        Queue::Host(7),
        true,
        Arc::clone(&s.tracker),
    ));
    const N: u64 = 4 * tracker::MAX_PENDING as u64;
    for upto in 1..=N {
        // Work first, then alternately one captured operation and one that runs.
        let captured = upto > tracker::MAX_PENDING as u64 && upto % 2 == 0;
        counting.capturing.store(captured, Ordering::SeqCst);
        s.mark_at_enqueue(&q, upto);
        q.published.store(upto, Ordering::Release);
        let pending = q.pending();
        assert!(
            pending.len() <= tracker::MAX_PENDING,
            "{} ranges after operation {upto}",
            pending.len()
        );
        assert!(pending.iter().all(|p| p.1), "a range without a marker");
        assert_eq!(pending.last().map(|p| p.0), Some(upto));
        if upto == 2 * tracker::MAX_PENDING as u64 {
            // The watchdog retires everything so far: the ring empties and refills.
            counting.complete.store(true, Ordering::SeqCst);
            s.track_queue(&q);
            assert_eq!(q.retired.load(Ordering::Acquire), upto);
            counting.complete.store(false, Ordering::SeqCst);
        }
    }
    counting.capturing.store(false, Ordering::SeqCst);
    counting.complete.store(true, Ordering::SeqCst);
    s.track_queue(&q);
    assert_eq!(q.retired.load(Ordering::Acquire), N);
    assert!(q.pending().is_empty());
    drop(s);
    c.destroy().map_err(|(_, e)| e).unwrap();
}

/// The queues a communicator's watch keeps are bounded, the least recently noted going
/// first: a rank that makes a new stream per step leaks nothing.
#[test]
fn the_watched_queues_are_bounded_and_least_recently_noted_go_first() {
    let (c, _id) = comm();
    let s = Arc::clone(c.diag.shared(c.diag_view()));
    let keys =
        |s: &Shared| -> Vec<usize> { s.queues.lock().unwrap().iter().map(|q| q.key).collect() };
    for k in 1..=40 {
        s.note_queue(Queue::Host(k));
    }
    assert_eq!(keys(&s), (25..=40).collect::<Vec<_>>());
    s.note_queue(Queue::Host(25)); // noted again: now the most recent
    s.note_queue(Queue::Host(41)); // drops 26, the least recent
    let k = keys(&s);
    assert_eq!(k.len(), MAX_QUEUES);
    assert!(!k.contains(&26) && k.ends_with(&[25, 41]), "{k:?}");
    drop(s);
    c.destroy().map_err(|(_, e)| e).unwrap();
}

/// The watchdog's side: an idle host communicator is never claimed, an operation only
/// once it is old enough, and a claim ends in a verdict.
#[test]
fn the_watchdog_claims_only_an_old_operation() {
    let (c, id) = comm();
    let s = Arc::clone(c.diag.shared(c.diag_view()));
    let later = Instant::now() + Duration::from_secs(3600);
    assert!(!s.claim(later, Duration::ZERO));
    let push = || {
        s.journal.push(&Entry {
            seq: 0,
            name: nccl_sys::EntryPoint::ncclAllReduce,
            dtype: None,
            count: 0,
            root: None,
            caller: Location::caller(),
            enqueued: clock::precise(),
            queue: 0,
        })
    };
    let first = push();
    let pos = push();
    s.current.store(pos + 1, Ordering::Release);
    assert!(!s.claim(Instant::now(), Duration::from_secs(60)));
    assert_eq!(s.claim.load(Ordering::Acquire), UNCLAIMED);
    // The watchdog saw the first operation in its call, but the owner has moved on to
    // the next one since: after the fence it sees that and withdraws the claim.
    assert!(!s.claim_seen(first + 1, later, Duration::from_secs(60)));
    assert_eq!(s.claim.load(Ordering::Acquire), UNCLAIMED);
    assert!(s.claim(later, Duration::from_secs(60)));
    assert_eq!(s.claim.load(Ordering::Acquire), ABORTING);
    // Undo the claim (nothing was taken) for an ordinary teardown.
    s.claim.store(UNCLAIMED, Ordering::Release);
    s.current.store(IDLE, Ordering::Release);
    drop(s);
    c.destroy().map_err(|(_, e)| e).unwrap();
    assert_eq!(counts(&id), (1, 1, 0, 0));
}

/// An elastic communicator whose owner found it unsound to revoke after a failed wait (its
/// launch still in flight) and aborts it instead, while the watchdog's claim of the
/// operation still in its call marks it aborted too (its `take_for_abort` finds the handle
/// already taken, or takes it): the owner's call then returns the watchdog's report, which
/// `explain` builds with `peer_timeout`, not the owner's error. That report says the
/// communicator could not be revoked, as the owner's error did. Before, only the owner's
/// error said so: `cuda_path.rs`'s `a_failed_wait_returns_only_once_nccls_launch_has_ended`
/// failed about once in 40 runs under load with the report alone.
#[test]
fn the_watchdogs_report_says_what_its_owner_found_unrevocable() {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new().elastic(true);
    let c = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &cfg).unwrap();
    let s = Arc::clone(c.diag.shared(c.diag_view()));
    // The owner, inside its call, found the revoke unsound.
    let pos = s.journal.push(&Entry {
        seq: 0,
        name: nccl_sys::EntryPoint::ncclAllReduce,
        dtype: None,
        count: 0,
        root: None,
        caller: Location::caller(),
        enqueued: clock::precise(),
        queue: 0,
    });
    s.current.store(pos + 1, Ordering::Release);
    c.mark_unrevocable();
    // The watchdog's claim of that call, and its abort.
    let later = Instant::now() + Duration::from_secs(3600);
    assert!(s.claim(later, Duration::ZERO));
    let report = TimeoutReport::text("the test's report");
    let h = s.take_for_abort(&report);
    assert_ne!(h, 0);
    // SAFETY: the handle was taken out of the communicator above: its one teardown.
    let r = unsafe { (s.lib.table().ncclCommAbort)(h as ncclComm_t) };
    assert_eq!(r, nccl_sys::bindings::ncclSuccess);
    // The error the owner's call returns.
    let rec = s.journal.get(pos).unwrap();
    let e = s.peer_timeout(&rec, &report);
    assert!(
        matches!(&e, Error::Timeout { what, .. }
            if what.contains("the test's report") && what.contains(crate::error::UNREVOCABLE)),
        "{e}"
    );
    s.current.store(IDLE, Ordering::Release);
    drop(s);
    drop(c);
    assert_eq!(counts(&id), (1, 0, 1, 0));
}

/// Two children of one parent made at the same sequence number with the same tag
/// (two shrinks of one exclude list) get distinct clique keys, the same on every rank;
/// a rank that was excluded from an earlier shrink (so never made it) still derives the
/// keys of the later ones as its peers do.
#[test]
fn children_made_at_one_point_get_distinct_keys() {
    let (c, _id) = comm();
    let (drop3, drop2) = (shrink_tag(&[3]), shrink_tag(&[2]));
    assert_ne!(drop3, drop2);
    assert_eq!(
        shrink_tag(&[1, 3]),
        shrink_tag(&[3, 1]),
        "the order of the list"
    );
    let a = c.diag.child(drop3);
    let b = c.diag.child(drop3);
    assert_ne!(a.key, b.key);
    let d = c.diag.child(drop2);
    assert_ne!(d.key, a.key);
    assert_ne!(d.key, b.key);
    assert_eq!(
        a.root, b.root,
        "children share the teardown lane of their family"
    );
    let other = || CommDiag::new(c.diag.settings.clone(), c.diag.key, c.diag.root);
    // Another rank of the parent (same parent key, same order) derives the same keys.
    let o = other();
    assert_eq!(o.child(drop3).key, a.key);
    assert_eq!(o.child(drop3).key, b.key);
    assert_eq!(o.child(drop2).key, d.key);
    // Rank 3, excluded from the shrinks that drop it, made only the one dropping 2.
    assert_eq!(other().child(drop2).key, d.key);
    c.destroy().map_err(|(_, e)| e).unwrap();
}

/// A pinned communicator (inside a call on its handle that is not an operation, or
/// an open group) is never claimed by the watchdog, even with work in flight; a pin
/// taken while the watchdog decides waits for the verdict, and fails when it aborts.
#[test]
fn a_pinned_communicator_is_never_claimed() {
    let counting = counting_here();
    counting.complete.store(false, Ordering::SeqCst);
    let (c, id) = counted(&counting, Duration::from_secs(600));
    sum(&c).unwrap();
    let s = Arc::clone(c.diag.shared(c.diag_view()));
    wait_for(Duration::from_secs(5), Duration::from_millis(2), || {
        s.in_flight()
    });
    assert!(s.in_flight());
    let later = Instant::now() + Duration::from_secs(3600);
    assert!(c.diag.pin().unwrap(), "pinned");
    assert!(!c.diag.pin().unwrap(), "a pin inside a pin is a no-op");
    assert!(!s.claim(later, Duration::ZERO), "claimed while pinned");
    assert_eq!(s.claim.load(Ordering::Acquire), UNCLAIMED);
    c.diag.unpin();
    // Idle with work in flight: claimable again (then the claim is undone).
    assert!(s.claim(later, Duration::ZERO));
    s.claim.store(DECIDING, Ordering::SeqCst);
    let t = abort_soon(&s, "the test's abort");
    let e = c.diag.pin().expect_err("the watchdog aborts it");
    assert!(
        matches!(&e, Error::Timeout { what, .. } if what.contains("the test's abort")),
        "{e}"
    );
    t.join().unwrap();
    counting.complete.store(true, Ordering::SeqCst);
    drop(s);
    drop(c);
    assert_eq!(counts(&id), (1, 0, 1, 0));
}

/// A user's revoke is the watchdog's too: three ranks with `Config::elastic` and a
/// 200 ms timeout whose work stays in flight after the revoke (markers that never
/// complete, as a GPU's may not by the watchdog's next tick). Ranks 0 and 1 revoke;
/// past the timeout the watchdog leaves their handles be (NCCL would refuse its own
/// revoke, init.cc:2655-2657 of v2.29.7-1, and it would abort them instead), and their
/// `shrink_after_failure(&[2])` makes a working communicator of two. Before, the
/// watchdog's revoke was refused (a misuse the host provider counts), it aborted the
/// handles, and the shrink failed.
#[test]
fn the_watchdog_leaves_a_users_revoke_be() {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new()
        .elastic(true)
        .timeout(Duration::from_millis(200));
    // Ranks 0 and 1 count themselves done; rank 2 waits for them (bounded: a rank
    // that panicked never counts).
    let done = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for rank in 0..3 {
            let (cfg, done) = (cfg.clone(), &done);
            sc.spawn(move || {
                let counting = counting_here();
                counting.complete.store(false, Ordering::SeqCst);
                TEST_TRACKER
                    .with(|t| *t.borrow_mut() = Some(Arc::clone(&counting) as Arc<dyn Tracker>));
                let c = Communicator::init_rank(&CommDevice::Host, 3, rank, &id, &cfg);
                TEST_TRACKER.with(|t| *t.borrow_mut() = None);
                let c = c.unwrap();
                let mut x = vec![1.0f32; 4];
                c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
                    .unwrap();
                if rank < 2 {
                    c.revoke().unwrap();
                }
                // Past the timeout, with the work still in flight to the watchdog.
                std::thread::sleep(Duration::from_millis(800));
                if rank < 2 {
                    assert!(!c.diag.aborted_by_watchdog(), "rank {rank}: aborted");
                    let small = c.shrink_after_failure(&[2]).unwrap();
                    let mut y = vec![rank as f32 + 1.0; 4];
                    small
                        .all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)
                        .unwrap();
                    assert_eq!(y, vec![3.0; 4]);
                    small.destroy().map_err(|(_, e)| e).unwrap();
                    done.fetch_add(1, Ordering::SeqCst);
                } else {
                    wait_for(Duration::from_secs(10), Duration::from_millis(5), || {
                        done.load(Ordering::SeqCst) == 2
                    });
                }
                drop(c);
            });
        }
    });
    let (created, _, _, misused) = counts(&id);
    assert_eq!((created, misused), (5, 0));
}
