//! Elastic communicators on the host provider (issue 37): revoke stops work in flight and
//! refuses what follows; a shrink in NCCL's abort mode makes a working communicator of
//! the ranks left after one died (its work hung, or NCCL flagged it failed); grow adds a
//! rank that joins with the id; each call on an NCCL too old is `Unsupported`. Every
//! test checks that each handle was torn down exactly once.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use nccl_safe::host::fault::{self, Fault};
use nccl_safe::host::stuck_ops;
use nccl_safe::{
    CommDevice, Communicator, Config, Error, Library, ReduceOp, Stream, UniqueId, Version,
};
use support::assert_balanced;

const S: Stream = Stream::Host;

/// Waits until `released` is set, or `bound` passed (which bounds a test on code that
/// never sets it), then sets it and runs `release` (the fault's release).
fn release_at_the_latest(released: &AtomicBool, bound: Duration, release: impl FnOnce()) {
    let until = Instant::now() + bound;
    while Instant::now() < until && !released.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(10));
    }
    released.store(true, Ordering::Release);
    release();
}

fn config() -> Config {
    Config::new().timeout(Duration::from_secs(30))
}

/// Revoke on ranks whose collective never completes (a rank that is gone, on a GPU):
/// the work in flight ends at once, later operations fail with a typed error naming the
/// revoke (NCCL itself refuses the collective: ncclInvalidUsage), a second revoke is
/// refused, and each handle is aborted once by its drop, quickly (nothing left in flight).
#[test]
fn revoke_stops_work_in_flight_and_refuses_what_follows() {
    let id = CommDevice::Host.unique_id().unwrap();
    fault::inject(&id.to_raw(), Fault::StuckWork);
    // Both inits have ended before either rank goes on (and aborts in the end): the stuck
    // collective does not wait for the peer, so a fast rank's abort could otherwise fail
    // its peer's init, still being polled.
    let inited = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        for rank in 0..2 {
            let inited = &inited;
            s.spawn(move || {
                let comm =
                    Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &config()).unwrap();
                inited.wait();
                let mut x = vec![1.0f32; 8];
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                let raw = comm.as_raw() as usize;
                assert_eq!(stuck_ops(raw), 1, "the all_reduce is in flight");
                comm.revoke().unwrap();
                assert!(comm.is_revoked() && comm.is_failed());
                assert_eq!(stuck_ops(raw), 0, "revoke ended the work in flight");
                match comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S) {
                    Err(Error::CommunicatorFailed { cause, .. }) => {
                        assert!(cause.contains("revoked"), "{cause}")
                    }
                    other => panic!("expected CommunicatorFailed, got {other:?}"),
                }
                // NCCL's own refusal, through the raw table (enqueue.cc:2983-2986).
                let t = comm.library().table();
                // SAFETY: host buffers of 8 floats; the handle is live (owned by `comm`).
                let r = unsafe {
                    (t.ncclAllReduce)(
                        x.as_ptr().cast(),
                        x.as_mut_ptr().cast(),
                        8,
                        nccl_sys::bindings::ncclFloat32,
                        nccl_sys::bindings::ncclSum,
                        comm.as_raw(),
                        std::ptr::null_mut(),
                    )
                };
                assert_eq!(r, nccl_sys::bindings::ncclInvalidUsage);
                assert!(matches!(comm.revoke(), Err(Error::InvalidArgument { .. })));
                let t0 = Instant::now();
                drop(comm);
                assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
            });
        }
    });
    fault::clear(&id.to_raw());
    let st = support::settled_stats(&id);
    // Two misuses: the raw all_reduce on each revoked handle, refused as NCCL refuses it.
    assert_eq!(
        (st.created, st.destroyed, st.aborted, st.live, st.misused),
        (2, 0, 2, 0, 2),
        "{st:?}"
    );
}

/// Three ranks; rank 2 dies in the middle of a collective without telling anyone (its
/// handle is never torn down: a SIGKILLed process). The survivors' collective hangs, as
/// a GPU kernel waiting for a dead peer does, and NCCL records no error. The survivors
/// shrink in abort mode: NCCL stops their hung work, and the child of 2 ranks computes
/// correct results. The parent is healthy in NCCL's eyes, so it is destroyed; the child
/// too: exactly once each.
fn shrink_after_a_silent_death(lib: &Arc<Library>) {
    let id = UniqueId::new_with(lib).unwrap();
    fault::inject(&id.to_raw(), Fault::StuckWork);
    let issued = Barrier::new(3);
    let dead_handle = std::sync::Mutex::new(0usize);
    std::thread::scope(|s| {
        for rank in 0..3 {
            let (issued, dead_handle, lib) = (&issued, &dead_handle, Arc::clone(lib));
            s.spawn(move || {
                let comm =
                    Communicator::init_rank_in(&lib, &CommDevice::Host, 3, rank, &id, &config())
                        .unwrap();
                let mut x = vec![rank as f64; 4];
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                issued.wait();
                if rank == 2 {
                    *dead_handle.lock().unwrap() = comm.into_raw() as usize;
                    fault::clear(&id.to_raw()); // the survivors' child runs normally
                    issued.wait();
                    return;
                }
                issued.wait();
                let raw = comm.as_raw() as usize;
                assert_eq!(stuck_ops(raw), 1);
                let small = comm.shrink_after_failure(&[2]).unwrap();
                assert_eq!(stuck_ops(raw), 0, "the abort mode stopped the hung work");
                assert_eq!((small.world_size(), small.rank()), (2, rank));
                let mut y = vec![rank as f64 + 1.0; 4];
                small
                    .all_reduce_in_place(&mut y, ReduceOp::Sum, &S)
                    .unwrap();
                assert_eq!(y, vec![3.0; 4]);
                drop(small);
                drop(comm);
            });
        }
    });
    // The dead rank's handle, torn down here as its process's end would.
    let dead = *dead_handle.lock().unwrap() as nccl_sys::ncclComm_t;
    // SAFETY: the handle rank 2 gave up with `into_raw`, torn down once here.
    let r = unsafe { (lib.table().ncclCommAbort)(dead) };
    assert_eq!(r, nccl_sys::bindings::ncclSuccess);
    let st = assert_balanced(&id);
    // With a revoke (2.29+) the survivors revoke their parent first (its work was in
    // flight: the shrink's own stream wait would be unbounded) and abort it at its drop.
    let parents_aborted = if lib.table().ncclCommRevoke.is_some() {
        2
    } else {
        0
    };
    assert_eq!(
        (st.created, st.destroyed, st.aborted),
        (5, 4 - parents_aborted, 1 + parents_aborted),
        "{st:?}"
    );
}

#[test]
fn shrink_after_failure_recovers_a_hung_communicator() {
    shrink_after_a_silent_death(&Library::host());
}

/// NCCL 2.28 (no revoke): the abort mode alone recovers a hung communicator.
#[test]
fn shrink_after_failure_recovers_a_hung_communicator_on_2_28() {
    shrink_after_a_silent_death(&Library::host_as_version(2, 28).unwrap());
}

/// Three ranks; rank 2's NCCL aborts (a death its peers are told of: NCCL records the
/// error on every survivor, and the crate sees it from `ncclCommGetAsyncError`). On 2.29+ `shrink_after_failure` revokes
/// first, which clears NCCL's error, then shrinks: the child works. On 2.28 NCCL refuses
/// the shrink of a communicator in error (init.cc:2762), and that error is returned. Either
/// way every handle is torn down once: the failed parents by an abort.
fn shrink_after_a_reported_death(lib: &Arc<Library>, revokes: bool) {
    let id = UniqueId::new_with(lib).unwrap();
    let ready = Barrier::new(3);
    std::thread::scope(|s| {
        for rank in 0..3 {
            let (ready, lib) = (&ready, Arc::clone(lib));
            s.spawn(move || {
                let comm =
                    Communicator::init_rank_in(&lib, &CommDevice::Host, 3, rank, &id, &config())
                        .unwrap();
                ready.wait(); // every init complete
                if rank == 2 {
                    // NCCL's abort of a rank whose process ends: its peers' NCCL records
                    // the error (a departure the crate's own diagnostics never see: their
                    // watchdog would abort the survivors' handles).
                    let raw = comm.into_raw();
                    // SAFETY: the handle given up by `into_raw`, torn down once here.
                    let r = unsafe { (lib.table().ncclCommAbort)(raw) };
                    assert_eq!(r, nccl_sys::bindings::ncclSuccess);
                    ready.wait();
                    return;
                }
                ready.wait();
                let e = comm.async_error().unwrap_err();
                assert_eq!(e.code(), Some(nccl_safe::ResultCode::RemoteError), "{e}");
                assert!(comm.is_failed(), "{e}");
                let r = comm.shrink_after_failure(&[2]);
                if !revokes {
                    let e = r.unwrap_err();
                    assert_eq!(e.code(), Some(nccl_safe::ResultCode::RemoteError), "{e}");
                    assert!(!comm.is_revoked());
                    return;
                }
                let small = r.unwrap();
                assert!(comm.is_revoked());
                assert_eq!((small.world_size(), small.rank()), (2, rank));
                let mut y = vec![rank as i32 + 5; 3];
                small
                    .all_reduce_in_place(&mut y, ReduceOp::Sum, &S)
                    .unwrap();
                assert_eq!(y, vec![11; 3]);
                small.destroy().map_err(|(_, e)| e).unwrap();
            });
        }
    });
    let st = assert_balanced(&id);
    if revokes {
        assert_eq!((st.created, st.destroyed, st.aborted), (5, 2, 3), "{st:?}");
    } else {
        assert_eq!((st.created, st.destroyed, st.aborted), (3, 0, 3), "{st:?}");
    }
}

#[test]
fn shrink_after_failure_revokes_a_communicator_nccl_failed() {
    shrink_after_a_reported_death(&Library::host(), true);
}

#[test]
fn nccl_2_28_refuses_to_shrink_a_communicator_in_error() {
    shrink_after_a_reported_death(&Library::host_as_version(2, 28).unwrap(), false);
}

/// Two ranks grow to three: rank 0 (the root) takes the id and hands it to a new rank,
/// which joins as rank 2; rank 1 (a boundary rank) waits in its grow for the root's id.
/// Collectives on the grown communicator are correct, the parent stays usable, and
/// every handle (2 parents, 3 grown) is destroyed once.
#[test]
fn grow_adds_a_rank_that_joins_with_the_id() {
    let id = CommDevice::Host.unique_id().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<UniqueId>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let grow_id = rx.recv().unwrap();
            let big =
                Communicator::join_grown(&CommDevice::Host, 3, 2, &grow_id, &config()).unwrap();
            assert_eq!((big.rank(), big.world_size()), (2, 3));
            let mut x = vec![10.0f32; 5];
            big.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
            assert_eq!(x, vec![10.0 + 1.0 + 2.0; 5]);
            let mut all = vec![0u32; 3];
            big.all_gather(&[7], &mut all, &S).unwrap();
            assert_eq!(all, vec![0, 1, 7]);
            big.destroy().map_err(|(_, e)| e).unwrap();
        });
        for rank in 0..2 {
            let tx = tx.clone();
            s.spawn(move || {
                let comm =
                    Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &config()).unwrap();
                let big = if rank == 0 {
                    let grow_id = comm.grow_id().unwrap();
                    tx.send(grow_id).unwrap();
                    comm.grow(3, Some(&grow_id)).unwrap()
                } else {
                    // A boundary rank: NCCL's grow waits here for the root's id.
                    comm.grow(3, None).unwrap()
                };
                assert_eq!((big.rank(), big.world_size()), (rank, 3));
                let mut x = vec![rank as f32 + 1.0; 5];
                big.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                assert_eq!(x, vec![10.0 + 1.0 + 2.0; 5]);
                let mut all = vec![0u32; 3];
                big.all_gather(&[rank as u32], &mut all, &S).unwrap();
                assert_eq!(all, vec![0, 1, 7]);
                // The parent is untouched by the grow.
                let mut p = vec![1u8; 2];
                comm.all_reduce_in_place(&mut p, ReduceOp::Sum, &S).unwrap();
                assert_eq!(p, vec![2, 2]);
                big.destroy().map_err(|(_, e)| e).unwrap();
                comm.destroy().map_err(|(_, e)| e).unwrap();
            });
        }
    });
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.destroyed, st.aborted), (5, 5, 0), "{st:?}");
}

/// Growing to a size that is not larger, and joining at a rank outside the new size,
/// are refused before NCCL is called.
#[test]
fn grow_refuses_sizes_that_do_not_grow() {
    let id = CommDevice::Host.unique_id().unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config()).unwrap();
    assert!(matches!(
        comm.grow(1, None),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        Communicator::join_grown(&CommDevice::Host, 2, 2, &id, &config()),
        Err(Error::RankOutOfRange { .. })
    ));
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);
}

/// Each call on an NCCL too old for it is `Unsupported`, naming the entry point and the
/// release that introduced it, before anything reaches NCCL (the communicator stays
/// healthy and is destroyed).
#[test]
fn each_call_on_an_nccl_too_old_is_unsupported() {
    let unsupported = |e: Result<(), Error>, sym: &str, minor: u32, found: Version| match e {
        Err(Error::Unsupported {
            symbol,
            needs,
            found: f,
        }) if symbol == sym && needs == Version::new(2, minor, 0) && f == found => {}
        other => panic!("{sym}: expected Unsupported, got {other:?}"),
    };
    let lib = Library::host_as_version(2, 28).unwrap();
    let v = lib.version();
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &config()).unwrap();
    unsupported(comm.revoke(), "ncclCommRevoke", 29, v);
    unsupported(comm.grow_id().map(drop), "ncclCommGetUniqueId", 29, v);
    unsupported(comm.grow(2, None).map(drop), "ncclCommGrow", 29, v);
    unsupported(
        Communicator::join_grown_in(&lib, &CommDevice::Host, 2, 1, &id, &config()).map(drop),
        "ncclCommGrow",
        29,
        v,
    );
    assert!(!comm.is_failed() && !comm.is_revoked());
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);

    let lib = Library::host_as_version(2, 26).unwrap();
    let v = lib.version();
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &config()).unwrap();
    // The version gate comes before the exclude list's checks.
    unsupported(
        comm.shrink_after_failure(&[]).map(drop),
        "ncclCommShrink",
        27,
        v,
    );
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);
}

/// The host provider's C ABI follows NCCL 2.29.7's asynchronous contract (see
/// `src/comm/elastic.rs`): a revoke on a non-blocking communicator returns ncclInProgress,
/// its state reads ncclInProgress while the job runs (and other calls are refused with
/// ncclInvalidArgument) and ncclSuccess after; bad flags and a second revoke are refused.
/// A grow returns ncclSuccess with the new handle already written, reading ncclInProgress
/// until every rank joined, the parent untouched; bad arguments write nothing.
#[test]
fn the_host_abi_follows_nccl_2_29s_contract() {
    use nccl_sys::bindings::*;
    let lib = Library::host();
    let t = lib.table();
    let id = CommDevice::Host.unique_id().unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config()).unwrap();
    let raw = comm.as_raw();
    let state = |c: ncclComm_t| {
        let mut s = ncclSuccess;
        // SAFETY: a live handle and a writable result.
        assert_eq!(unsafe { (t.ncclCommGetAsyncError)(c, &mut s) }, ncclSuccess);
        s
    };

    // Grow: refused arguments write nothing.
    let (get_id, grow) = (t.ncclCommGetUniqueId.unwrap(), t.ncclCommGrow.unwrap());
    let mut gid = ncclUniqueId { internal: [0; 128] };
    // SAFETY: live handle, writable id.
    assert_eq!(unsafe { get_id(raw, &mut gid) }, ncclSuccess);
    let sentinel = 0x1234usize as ncclComm_t;
    let mut out = sentinel;
    // SAFETY: as above; `out` writable.
    let r = unsafe { grow(raw, 1, &gid, -1, &mut out, std::ptr::null_mut()) };
    assert_eq!(
        (r, out),
        (ncclInvalidArgument, sentinel),
        "nRanks not above 1"
    );
    // SAFETY: as above.
    let r = unsafe { grow(raw, 2, &gid, -1, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(r, ncclInvalidArgument, "newcomm NULL");
    // The existing rank's grow: ncclSuccess, the handle written in the call, in progress.
    // SAFETY: as above.
    let r = unsafe { grow(raw, 2, &gid, -1, &mut out, std::ptr::null_mut()) };
    assert_eq!(r, ncclSuccess);
    assert!(!out.is_null() && out != sentinel);
    let existing = out;
    assert_eq!(state(existing), ncclInProgress);
    assert_eq!(state(raw), ncclSuccess, "the parent is untouched");
    let new_rank = std::thread::spawn(move || {
        let mut mine: ncclComm_t = std::ptr::null_mut();
        // SAFETY: a valid id and a writable out-pointer; NULL config = blocking.
        let r = unsafe {
            grow(
                std::ptr::null_mut(),
                2,
                &gid,
                1,
                &mut mine,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(r, ncclSuccess);
        mine as usize
    })
    .join()
    .unwrap() as ncclComm_t;
    let until = Instant::now() + Duration::from_secs(10);
    while state(existing) == ncclInProgress && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(state(existing), ncclSuccess);
    for c in [existing, new_rank] {
        let mut n = 0;
        // SAFETY: live handles, writable count.
        assert_eq!(unsafe { (t.ncclCommCount)(c, &mut n) }, ncclSuccess);
        assert_eq!(n, 2);
        // SAFETY: torn down once here.
        assert_eq!(unsafe { (t.ncclCommDestroy)(c) }, ncclSuccess);
    }

    // Revoke, with its job held.
    let revoke = t.ncclCommRevoke.unwrap();
    // SAFETY: live handle.
    assert_eq!(
        unsafe { revoke(raw, 1) },
        ncclInvalidArgument,
        "flags must be 0"
    );
    fault::inject(&id.to_raw(), Fault::HeldJobs);
    // SAFETY: live handle.
    assert_eq!(unsafe { revoke(raw, 0) }, ncclInProgress);
    assert_eq!(state(raw), ncclInProgress);
    // SAFETY: live handle, writable id.
    assert_eq!(
        unsafe { get_id(raw, &mut gid) },
        ncclInvalidArgument,
        "refused meanwhile"
    );
    fault::release_jobs(&id.to_raw());
    let until = Instant::now() + Duration::from_secs(10);
    while state(raw) == ncclInProgress && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(state(raw), ncclSuccess);
    // SAFETY: live handle.
    assert_eq!(
        unsafe { revoke(raw, 0) },
        ncclInvalidArgument,
        "a second revoke"
    );
    fault::clear(&id.to_raw());
    drop(comm); // destroyed: NCCL allows a destroy once the revoke ended
    let st = support::settled_stats(&id);
    assert_eq!(
        (st.created, st.destroyed, st.aborted, st.live),
        (3, 3, 0, 0),
        "{st:?}"
    );
}

/// NCCL's grow job keeps using the parent until it ends (bootstrap.cc:777-779, init.cc:1716
/// of v2.29.7-1), and the parent's abort neither stops nor joins it: the host provider
/// counts a teardown of a parent whose grow is still pending as misuse (NCCL would touch
/// freed memory), and none once the new communicator was aborted first.
#[test]
fn the_host_counts_a_parent_torn_down_under_a_pending_grow() {
    use nccl_sys::bindings::*;
    let lib = Library::host();
    let t = lib.table();
    let (get_id, grow) = (t.ncclCommGetUniqueId.unwrap(), t.ncclCommGrow.unwrap());
    for parent_first in [false, true] {
        let id = CommDevice::Host.unique_id().unwrap();
        let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config()).unwrap();
        let raw = comm.into_raw();
        let mut gid = ncclUniqueId { internal: [0; 128] };
        // SAFETY: live handle, writable id.
        assert_eq!(unsafe { get_id(raw, &mut gid) }, ncclSuccess);
        let mut out: ncclComm_t = std::ptr::null_mut();
        // SAFETY: live handle, the id from it, writable out-pointer; no new rank joins.
        let r = unsafe { grow(raw, 2, &gid, -1, &mut out, std::ptr::null_mut()) };
        assert_eq!(r, ncclSuccess);
        let order = if parent_first { [raw, out] } else { [out, raw] };
        for c in order {
            // SAFETY: live handles, each torn down once.
            assert_eq!(unsafe { (t.ncclCommAbort)(c) }, ncclSuccess);
        }
        let st = support::settled_stats(&id);
        assert_eq!((st.created, st.aborted), (2, 2), "{st:?}");
        assert_eq!(st.misused, u64::from(parent_first), "{st:?}");
    }
}

/// NCCL refuses a shrink that excludes no rank, and a NULL list, with ncclInvalidArgument
/// before it writes anything (`PtrCheck(excludeRanksList)` and `excludeRanksCount > 0`,
/// init.cc:2561-2562 of 2.28.9); the host provider did a shrink to the whole world.
#[test]
fn the_host_refuses_a_shrink_that_excludes_no_rank() {
    use nccl_sys::bindings::*;
    let lib = Library::host();
    let shrink = lib.table().ncclCommShrink.unwrap();
    let id = CommDevice::Host.unique_id().unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config()).unwrap();
    let sentinel = 0x1234usize as ncclComm_t;
    let mut list = [0 as std::ffi::c_int; 1];
    let null = std::ptr::null_mut();
    for (ptr, n) in [(null, 0), (list.as_mut_ptr(), 0), (null, 1)] {
        let mut out = sentinel;
        let flags = NCCL_SHRINK_DEFAULT as std::ffi::c_int;
        // SAFETY: a live handle, a list of `n` entries or NULL, a writable out-pointer.
        let r = unsafe { shrink(comm.as_raw(), ptr, n, &mut out, std::ptr::null_mut(), flags) };
        assert_eq!(
            (r, out),
            (ncclInvalidArgument, sentinel),
            "list {ptr:?}, count {n}"
        );
    }
    assert!(!comm.is_failed());
    drop(comm);
    let st = support::settled_stats(&id);
    let counts = (st.created, st.destroyed, st.aborted, st.misused);
    assert_eq!(counts, (1, 1, 0, 3), "{st:?}");
}

/// NCCL's destroy reads the communicator's asynchronous state first
/// (`ncclCommEnsureReady`, init.cc:373-389, which returns its error), and a revoke's job
/// stores its own result there (`ncclCommSetAsyncError(comm, res)`, init.cc:2635 of
/// 2.29.7). So a peer's abort leaves the state at ncclRemoteError, the revoke brings it back
/// to ncclSuccess, and the destroy that follows succeeds, as NCCL's own revoke tests expect
/// of a destroy after a revoke. The host provider reads one state for both calls.
#[test]
fn a_destroy_after_a_revoke_reads_the_revokes_state_not_the_peers_failure() {
    use nccl_sys::bindings::*;
    let lib = Library::host();
    let id = CommDevice::Host.unique_id().unwrap();
    let ready = Barrier::new(2);
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (ready, lib) = (&ready, Arc::clone(&lib));
            s.spawn(move || {
                let t = lib.table();
                let comm = Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &config());
                let raw = comm.unwrap().into_raw();
                ready.wait(); // both inits complete
                if rank == 1 {
                    // SAFETY: the handle given up by `into_raw`, torn down once here.
                    assert_eq!(unsafe { (t.ncclCommAbort)(raw) }, ncclSuccess);
                    ready.wait();
                    return;
                }
                ready.wait(); // the peer aborted
                let state = || {
                    let mut st = ncclSuccess;
                    // SAFETY: a live handle and a writable result.
                    assert_eq!(
                        unsafe { (t.ncclCommGetAsyncError)(raw, &mut st) },
                        ncclSuccess
                    );
                    st
                };
                assert_eq!(state(), ncclRemoteError, "the peer's abort");
                // SAFETY: a live handle; NCCL_REVOKE_DEFAULT.
                let r = unsafe { (t.ncclCommRevoke.unwrap())(raw, 0) };
                assert!(r == ncclSuccess || r == ncclInProgress, "revoke: {r}");
                let until = Instant::now() + Duration::from_secs(10);
                while state() == ncclInProgress && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert_eq!(state(), ncclSuccess, "the revoke's own result");
                // SAFETY: the handle given up by `into_raw`, torn down once here.
                assert_eq!(unsafe { (t.ncclCommDestroy)(raw) }, ncclSuccess);
            });
        }
    });
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.destroyed, st.aborted), (2, 1, 1), "{st:?}");
}

/// Three ranks of one process with `Config::elastic`; rank 2 drops its communicator
/// (destroyed: a thread that failed and left) while ranks 0 and 1 wait in an all-reduce
/// it never calls. The crate's diagnostics see the departure: without `elastic` the
/// watchdog aborts the survivors' handles, and nothing can be shrunk; with it the
/// watchdog revokes them in place, their all-reduce fails naming rank 2, `lost_rank()` is
/// 2, and `shrink_after_failure(&[2])` makes a working communicator of two. Every handle
/// is torn down once: rank 2's destroyed, the survivors' revoked parents aborted by their
/// drop, the children destroyed. The watchdog is the `diag` feature's.
#[cfg(feature = "diag")]
fn survivors_of_a_departure(elastic: bool) {
    let id = CommDevice::Host.unique_id().unwrap();
    let ready = Barrier::new(3);
    let cfg = config().elastic(elastic);
    std::thread::scope(|s| {
        for rank in 0..3 {
            let (ready, cfg) = (&ready, cfg.clone());
            s.spawn(move || {
                let comm = Communicator::init_rank(&CommDevice::Host, 3, rank, &id, &cfg).unwrap();
                let mut x = vec![1.0f32; 4];
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                ready.wait();
                if rank == 2 {
                    std::thread::sleep(Duration::from_millis(50)); // the others wait
                    drop(comm);
                    return;
                }
                let t0 = Instant::now();
                let e = comm
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                    .unwrap_err();
                // Woken by the watchdog's revoke (or abort) within its grace, long before
                // any timeout.
                assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
                assert!(e.to_string().contains("rank 2 left"), "{e}");
                let said = if elastic { "revoked" } else { "aborted" };
                assert!(e.to_string().contains(said), "{e}");
                assert!(comm.is_failed());
                assert_eq!(comm.lost_rank(), Some(2));
                let r = comm.shrink_after_failure(&[2]);
                if !elastic {
                    let e = r.unwrap_err();
                    // The handle is gone: the watchdog aborted it.
                    assert!(
                        matches!(e, Error::RankLeft { rank: 2, .. } | Error::Timeout { .. }),
                        "{e:?}"
                    );
                    return;
                }
                assert!(comm.is_revoked(), "the watchdog revoked it in place");
                let small = r.unwrap();
                assert_eq!((small.world_size(), small.rank()), (2, rank));
                let mut y = vec![rank as f32 + 1.0; 4];
                small
                    .all_reduce_in_place(&mut y, ReduceOp::Sum, &S)
                    .unwrap();
                assert_eq!(y, vec![3.0; 4]);
                small.destroy().map_err(|(_, e)| e).unwrap();
                drop(comm);
            });
        }
    });
    let st = assert_balanced(&id);
    if elastic {
        assert_eq!((st.created, st.destroyed, st.aborted), (5, 3, 2), "{st:?}");
    } else {
        assert_eq!((st.created, st.destroyed, st.aborted), (3, 1, 2), "{st:?}");
    }
}

#[test]
#[cfg(feature = "diag")]
fn elastic_survivors_keep_a_handle_they_can_shrink() {
    survivors_of_a_departure(true);
}

/// The obstacle `Config::elastic` removes: by default the watchdog aborts the survivors'
/// handles, and a shrink finds them gone.
#[test]
#[cfg(feature = "diag")]
fn without_elastic_the_watchdog_aborts_the_survivors() {
    survivors_of_a_departure(false);
}

/// A rank that is alive but stuck in its own code past the watchdog's timeout counts as
/// lost once the timeout names it: three ranks with `Config::elastic` and a 300 ms timeout,
/// rank 2 sleeps while ranks 0 and 1 wait in an all-reduce it has not called. The
/// watchdog times them out, revokes their handles in place, and its report finds rank 2
/// the only one behind, so `lost_rank()` is 2 on both and they shrink without it. Rank 2,
/// back from its sleep, finds its communicator failed, and names no rank (it lost none).
/// Without the rank behind in the report, `lost_rank()` was `None` here.
#[test]
#[cfg(feature = "diag")]
fn a_rank_stuck_past_the_timeout_is_the_lost_rank() {
    let id = CommDevice::Host.unique_id().unwrap();
    let ready = Barrier::new(3);
    let cfg = Config::new()
        .elastic(true)
        .timeout(Duration::from_millis(300));
    std::thread::scope(|s| {
        for rank in 0..3 {
            let (ready, cfg) = (&ready, cfg.clone());
            s.spawn(move || {
                let comm = Communicator::init_rank(&CommDevice::Host, 3, rank, &id, &cfg).unwrap();
                let mut x = vec![1.0f32; 4];
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                ready.wait();
                if rank == 2 {
                    std::thread::sleep(Duration::from_millis(1500)); // stuck in its own code
                    let e = comm
                        .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                        .unwrap_err();
                    assert!(comm.is_failed(), "{e}");
                    assert_eq!(comm.lost_rank(), None, "rank 2 lost no rank: {e}");
                    return;
                }
                let e = comm
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                    .unwrap_err();
                assert!(e.to_string().contains("rank(s) [2] are behind"), "{e}");
                assert!(e.to_string().contains("the watchdog revoked"), "{e}");
                assert_eq!(comm.lost_rank(), Some(2), "{e}");
                let small = comm.shrink_after_failure(&[2]).unwrap();
                assert_eq!((small.world_size(), small.rank()), (2, rank));
                let mut y = vec![rank as f32 + 1.0; 4];
                small
                    .all_reduce_in_place(&mut y, ReduceOp::Sum, &S)
                    .unwrap();
                assert_eq!(y, vec![3.0; 4]);
                small.destroy().map_err(|(_, e)| e).unwrap();
            });
        }
    });
    let st = assert_balanced(&id);
    assert_eq!(st.created, 5, "{st:?}");
}

/// Four ranks with `Config::elastic`; ranks 1 and 2 drop their communicators at once while
/// ranks 0 and 3 wait in an all-reduce, then rank 2's drop is delayed by 10 ms (it is lost
/// while the survivors begin their recovery). Either way `agree_lost_ranks()` is `[1, 2]`
/// on both survivors and their shrink makes a working communicator of two. With
/// `lost_rank()` (the first departure only) they named rank 1 alone, and the shrink
/// excluding it waited for rank 2 until the timeout.
#[cfg(feature = "diag")]
fn survivors_of_two_departures(stagger: Duration) {
    let id = CommDevice::Host.unique_id().unwrap();
    let ready = Barrier::new(4);
    let cfg = Config::new().elastic(true).timeout(Duration::from_secs(2));
    support::within(Duration::from_secs(20), move || {
        std::thread::scope(|s| {
            for rank in 0..4 {
                let (ready, cfg) = (&ready, cfg.clone());
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 4, rank, &id, &cfg).unwrap();
                    let mut x = vec![1.0f32; 4];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                    ready.wait();
                    if rank == 1 || rank == 2 {
                        std::thread::sleep(Duration::from_millis(50)); // the others wait
                        if rank == 2 {
                            std::thread::sleep(stagger);
                        }
                        drop(comm);
                        return;
                    }
                    let e = comm
                        .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                        .unwrap_err();
                    assert!(comm.is_failed(), "{e}");
                    assert_eq!(comm.agree_lost_ranks(), vec![1, 2], "{e}");
                    let small = comm.shrink_after_failure(&[1, 2]).unwrap();
                    assert_eq!((small.world_size(), small.rank()), (2, rank.min(1)));
                    let mut y = vec![rank as f32; 4];
                    small
                        .all_reduce_in_place(&mut y, ReduceOp::Sum, &S)
                        .unwrap();
                    assert_eq!(y, vec![3.0; 4]);
                    small.destroy().map_err(|(_, e)| e).unwrap();
                });
            }
        });
    });
    let st = assert_balanced(&id);
    assert_eq!(st.created, 6, "{st:?}");
}

#[test]
#[cfg(feature = "diag")]
fn two_ranks_lost_at_once_are_both_excluded() {
    survivors_of_two_departures(Duration::ZERO);
}

#[test]
#[cfg(feature = "diag")]
fn a_rank_lost_while_the_survivors_recover_is_excluded_too() {
    survivors_of_two_departures(Duration::from_millis(10));
}

/// Two ranks grow to three, but the standby the root handed the id to dies before it
/// joins (it never calls `join_grown`). Each existing rank's grow fails with a timeout
/// within its own bound, and the parent is untouched: not failed, its all-reduce works,
/// and it is destroyed (not aborted). The new communicators are aborted before the
/// parents are torn down (NCCL's grow job uses the parent until it ends; the host
/// provider counts a parent torn down under a pending grow as misuse). With and without
/// `Config::elastic`. Before, the grow was watched as an operation of the parent: the
/// watchdog's timeout failed the parent (aborted it, or revoked it with elastic), with
/// the grow's job still pending.
#[cfg(feature = "diag")]
fn a_standby_that_never_joins(elastic: bool) {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new()
        .elastic(elastic)
        .timeout(Duration::from_millis(500));
    support::within(Duration::from_secs(20), move || {
        std::thread::scope(|s| {
            for rank in 0..2 {
                let cfg = cfg.clone();
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &cfg).unwrap();
                    let grow_id = (rank == 0).then(|| comm.grow_id().unwrap());
                    // The standby got the id and died: nobody joins.
                    // A timeout, or NCCL's error once the other rank gave up on its grow.
                    let e = comm.grow(3, grow_id.as_ref()).unwrap_err();
                    assert!(matches!(e, Error::Timeout { .. } | Error::Nccl(_)), "{e:?}");
                    let text = e.to_string();
                    assert!(text.contains("ncclCommGrow"), "{text}");
                    assert!(text.contains("stays usable"), "{text}");
                    assert!(!comm.is_failed(), "the grow failed the parent: {e}");
                    assert!(!comm.is_revoked(), "the grow revoked the parent: {e}");
                    let mut x = vec![rank as f32 + 1.0; 4];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                    assert_eq!(x, vec![3.0; 4]);
                    comm.destroy().map_err(|(_, e)| e).unwrap();
                });
            }
        });
    });
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.destroyed, st.aborted), (4, 2, 2), "{st:?}");
}

#[test]
#[cfg(feature = "diag")]
fn a_standby_that_never_joins_costs_the_grow_only() {
    a_standby_that_never_joins(false);
}

#[test]
#[cfg(feature = "diag")]
fn a_standby_that_never_joins_leaves_an_elastic_parent_usable() {
    a_standby_that_never_joins(true);
}

/// A failed grow across processes' shared memory leaves nothing in `/dev/shm`: two ranks
/// on a shared id grow to three, nobody joins, and once both grows failed the grown
/// communicator's segment is gone (before, it stayed until the provider's own wait limit,
/// 300 s, ran out, or for good when the process exited first). So does a failed init's:
/// one rank of two inits and the other never comes.
#[test]
#[cfg(feature = "diag")]
fn a_failed_grow_or_init_leaves_nothing_in_dev_shm() {
    let path = |id: &UniqueId| nccl_safe::host::shared_segment_path(&id.to_raw()).unwrap();
    let cfg = Config::new().timeout(Duration::from_millis(500));
    let id = UniqueId::from_raw(nccl_safe::host::shared_unique_id());
    let grow_path = support::within(Duration::from_secs(20), move || {
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let cfg = cfg.clone();
                    s.spawn(move || {
                        let comm =
                            Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &cfg).unwrap();
                        let grow_id = (rank == 0).then(|| comm.grow_id().unwrap());
                        comm.grow(3, grow_id.as_ref()).unwrap_err();
                        comm.destroy().map_err(|(_, e)| e).unwrap();
                        grow_id
                    })
                })
                .collect();
            let ids: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            path(ids[0].as_ref().unwrap())
        })
    });
    assert!(
        !std::path::Path::new(&grow_path).exists(),
        "{grow_path} was left"
    );
    assert!(!std::path::Path::new(&path(&id)).exists());
    assert_balanced(&id);

    let id = UniqueId::from_raw(nccl_safe::host::shared_unique_id());
    let cfg = Config::new().timeout(Duration::from_millis(300));
    Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &cfg).unwrap_err();
    assert!(
        !std::path::Path::new(&path(&id)).exists(),
        "{} was left",
        path(&id)
    );
}

/// The same with the survivors' all-reduce in a [`nccl_safe::Group`] (`Group::run`): the
/// group pins its communicators against the watchdog for its end, so the end times itself
/// out. It must do what the watchdog does for a single collective: name rank 2 behind (so
/// `lost_rank()` is 2), revoke the elastic handles in place, and leave them to a shrink;
/// its error names the caller's line, not nccl-safe's `src/group.rs`. Before, the report
/// named no rank behind (`lost_rank()` was `None`), the handles were not revoked, and the
/// line was `src/group.rs`'s.
#[test]
#[cfg(feature = "diag")]
fn a_rank_stuck_past_the_timeout_of_a_group_is_the_lost_rank() {
    let id = CommDevice::Host.unique_id().unwrap();
    let ready = Barrier::new(3);
    // Survivors done (counted on a panic too, so that rank 2 never waits forever).
    let done = std::sync::atomic::AtomicUsize::new(0);
    struct Done<'a>(&'a std::sync::atomic::AtomicUsize);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let cfg = Config::new()
        .elastic(true)
        .timeout(Duration::from_millis(300));
    std::thread::scope(|s| {
        for rank in 0..3 {
            let (ready, done, cfg) = (&ready, &done, cfg.clone());
            s.spawn(move || {
                let comm = Communicator::init_rank(&CommDevice::Host, 3, rank, &id, &cfg).unwrap();
                let mut x = vec![1.0f32; 4];
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                ready.wait();
                if rank == 2 {
                    // Stuck in its own code until the others recovered.
                    support::until(Duration::from_secs(30), || {
                        done.load(std::sync::atomic::Ordering::SeqCst) == 2
                    });
                    assert!(comm.is_failed());
                    return;
                }
                let _done = Done(done);
                let e = nccl_safe::Group::run(|g| {
                    g.push(comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)?)
                })
                .unwrap_err();
                let text = e.to_string();
                assert!(matches!(e, Error::Timeout { .. }), "{e}");
                assert!(text.contains("rank(s) [2] are behind"), "{e}");
                assert!(text.contains("tests/elastic.rs"), "the caller's line: {e}");
                assert!(!text.contains("src/group.rs"), "nccl-safe's line: {e}");
                assert!(comm.is_revoked(), "the elastic handle was not revoked: {e}");
                assert_eq!(comm.lost_rank(), Some(2), "{e}");
                assert_eq!(comm.lost_ranks(), vec![2], "{e}");
                let small = comm.shrink_after_failure(&comm.lost_ranks()).unwrap();
                assert_eq!((small.world_size(), small.rank()), (2, rank));
                let mut y = vec![rank as f32 + 1.0; 4];
                small
                    .all_reduce_in_place(&mut y, ReduceOp::Sum, &S)
                    .unwrap();
                assert_eq!(y, vec![3.0; 4]);
                small.destroy().map_err(|(_, e)| e).unwrap();
            });
        }
    });
    let st = assert_balanced(&id);
    assert_eq!(st.created, 5, "{st:?}");
}

/// Four ranks shrink with exclude lists that disagree: ranks 0 and 1 exclude rank 3,
/// rank 2 excludes ranks 1 and 3 (rank 3 is not told). NCCL compares no lists
/// (init.cc:2758, 1609-1622 of v2.29.7-1), so ranks 0 and 1 would wait for rank 2 in a
/// child of three, rank 2 for rank 0 in a child of two, until the timeout. Each of ranks
/// 0-2 gets `Error::ExcludeMismatch` naming every rank's list, nothing is called, and the
/// parent is as it was: they shrink again with the list they agree on, and their child
/// works. Before, the shrinks ran out of time (or, where the host provider saw both posts
/// of one rendezvous, failed with its `InvalidArgument`) and the retry found the
/// communicator failed.
#[test]
#[cfg(feature = "diag")]
fn shrinks_that_disagree_on_the_excluded_ranks_fail_naming_each_list() {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new()
        .elastic(true)
        .timeout(Duration::from_millis(500));
    let done = Arc::new(Barrier::new(4));
    support::within(Duration::from_secs(20), move || {
        std::thread::scope(|s| {
            for rank in 0..4 {
                let (cfg, done) = (cfg.clone(), Arc::clone(&done));
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 4, rank, &id, &cfg).unwrap();
                    let mut x = vec![1.0f32; 4];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                    if rank == 3 {
                        done.wait();
                        return;
                    }
                    let exclude: &[usize] = if rank == 2 { &[3, 1] } else { &[3] };
                    let e = comm.shrink_after_failure(exclude).unwrap_err();
                    let Error::ExcludeMismatch { rank: r, lists, .. } = &e else {
                        panic!("expected ExcludeMismatch, got {e:?}");
                    };
                    assert_eq!(*r, rank);
                    // Rank 2's list (sorted) and at least one of the others' are named.
                    assert!(lists.contains(&(2, vec![1, 3])), "{e}");
                    assert!(
                        lists.contains(&(0, vec![3])) || lists.contains(&(1, vec![3])),
                        "{e}"
                    );
                    assert!(e.to_string().contains("rank 2 excludes [1, 3]"), "{e}");
                    assert!(!comm.is_failed(), "{e}");
                    let small = comm.shrink_after_failure(&[3]).unwrap();
                    assert_eq!((small.world_size(), small.rank()), (3, rank));
                    let mut y = vec![rank as f32; 4];
                    small
                        .all_reduce_in_place(&mut y, ReduceOp::Sum, &S)
                        .unwrap();
                    assert_eq!(y, vec![3.0; 4]);
                    small.destroy().map_err(|(_, e)| e).unwrap();
                    done.wait();
                });
            }
        });
    });
    let st = assert_balanced(&id);
    assert_eq!(st.created, 7, "{st:?}");
}

/// A boundary rank's grow waits in NCCL's call for the root's id through the parent
/// (init.cc:2913-2924 of v2.29.7-1) and uses the parent after the wait: without
/// `Config::elastic`, two ranks and a 300 ms timeout, rank 1 grows while rank 0 (the
/// root) never calls `grow_id`. The watchdog times the call out and revokes the parent
/// (its abort flags end the wait) rather than aborting it under the call: rank 1's grow
/// fails within the bound, and the host provider counts no misuse. Before, the watchdog
/// aborted the parent while the call still waited in it (the host provider counts it: a
/// use after free in NCCL).
#[test]
#[cfg(feature = "diag")]
fn the_watchdog_never_aborts_a_parent_under_its_grow_call() {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new().timeout(Duration::from_millis(300));
    let grown = std::sync::atomic::AtomicBool::new(false);
    support::within(Duration::from_secs(20), move || {
        std::thread::scope(|s| {
            for rank in 0..2 {
                let (cfg, grown) = (cfg.clone(), &grown);
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &cfg).unwrap();
                    if rank == 0 {
                        // The root never hands out the id; it waits for rank 1's grow.
                        while !grown.load(std::sync::atomic::Ordering::SeqCst) {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        return;
                    }
                    let t0 = Instant::now();
                    let e = comm.grow(3, None).unwrap_err();
                    grown.store(true, std::sync::atomic::Ordering::SeqCst);
                    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
                    assert!(e.to_string().contains("ncclCommGrow"), "{e}");
                    assert!(comm.is_failed(), "{e}");
                });
            }
        });
    });
    let st = support::settled_stats(&id);
    assert_eq!(
        st.misused,
        0,
        "{st:?}: {:?}",
        nccl_safe::host::recent_misuse()
    );
    assert_eq!((st.created, st.live), (2, 0), "{st:?}");
}

/// A standby that dies during the grow, after it registered: two ranks grow to three; the
/// standby joins with the id (its rank posted to the new communicator's init) and dies
/// before the others come (its join gives up after 50 ms and aborts its communicator, as
/// its process's end would). The existing ranks' grow then fails within its own bound
/// (`Config::timeout`, 500 ms, plus the teardown), the parents are untouched (not failed,
/// their all-reduce works, destroyed), and nothing is misused.
#[test]
#[cfg(feature = "diag")]
fn a_standby_that_dies_after_it_registered_costs_the_grow_only() {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new().timeout(Duration::from_millis(500));
    let (tx, rx) = std::sync::mpsc::channel::<UniqueId>();
    let gone = Barrier::new(3);
    support::within(Duration::from_secs(20), move || {
        std::thread::scope(|s| {
            let (cfg2, gone2) = (cfg.clone(), &gone);
            s.spawn(move || {
                let grow_id = rx.recv().unwrap();
                let short = cfg2.timeout(Duration::from_millis(50));
                let e = Communicator::join_grown(&CommDevice::Host, 3, 2, &grow_id, &short)
                    .unwrap_err();
                assert!(matches!(e, Error::Timeout { .. } | Error::Nccl(_)), "{e:?}");
                gone2.wait(); // dead: its communicator was aborted
            });
            for rank in 0..2 {
                let (cfg, gone, tx) = (cfg.clone(), &gone, tx.clone());
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &cfg).unwrap();
                    let grow_id = (rank == 0).then(|| comm.grow_id().unwrap());
                    if let Some(g) = &grow_id {
                        tx.send(*g).unwrap();
                    }
                    gone.wait();
                    let t0 = Instant::now();
                    let e = comm.grow(3, grow_id.as_ref()).unwrap_err();
                    let bound = Duration::from_millis(500) + Duration::from_secs(3);
                    assert!(t0.elapsed() < bound, "{:?}: {e}", t0.elapsed());
                    assert!(e.to_string().contains("stays usable"), "{e}");
                    assert!(!comm.is_failed(), "the grow failed the parent: {e}");
                    let mut x = vec![rank as f32 + 1.0; 4];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                    assert_eq!(x, vec![3.0; 4]);
                    comm.destroy().map_err(|(_, e)| e).unwrap();
                });
            }
        });
    });
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.destroyed), (5, 2), "{st:?}");
}

/// NCCL's revoke joins the communicator's group job (`ncclGroupJobAbort`, group.cc:875-877
/// of v2.29.7-1) and may block there. Clique A (`Config::elastic`, 200 ms timeout, work
/// that never completes) has its revoke blocked by the host provider
/// (`Fault::BlockingRevoke`); meanwhile clique B's rank 0 waits in an all-reduce its peer
/// never calls, and both of A's owners abort. B's timeout still fires (the watchdog's
/// thread is not the one stuck in A's revoke), and A's owners' aborts return within their
/// bound (`Config::abort_timeout`, 500 ms): the one whose revoke blocks with
/// `Error::Timeout`, its handle left to the watchdog's worker, which aborts it once the
/// revoke returns: each handle torn down exactly once. Before, the watchdog revoked on
/// its one thread: B's rank 0 waited until A's revoke was released (after 8 s) and A's
/// blocked owner waited as long on the lock its teardown shares with the revoke.
#[test]
#[cfg(feature = "diag")]
fn a_revoke_that_blocks_in_nccl_stops_neither_other_timeouts_nor_its_owners_teardown() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    let (a, b) = (
        CommDevice::Host.unique_id().unwrap(),
        CommDevice::Host.unique_id().unwrap(),
    );
    fault::inject(&a.to_raw(), Fault::StuckWork);
    fault::inject(&a.to_raw(), Fault::BlockingRevoke(None));
    let cfg = Config::new()
        .elastic(true)
        .timeout(Duration::from_millis(200))
        .abort_timeout(Duration::from_millis(500));
    let blocked = || fault::blocked_revokes(&a.to_raw());
    let released = AtomicBool::new(false);
    let go_abort = Barrier::new(3);
    let inited = Barrier::new(2);
    let (tx, rx) = mpsc::channel::<(usize, Result<(), Error>, usize)>();
    std::thread::scope(|s| {
        // Bounds the test on the old code: A's revokes go on after 8 s.
        s.spawn(|| {
            release_at_the_latest(&released, Duration::from_secs(8), || {
                fault::release_revokes(&a.to_raw())
            })
        });
        for rank in 0..2 {
            let (cfg, go_abort, inited, tx) = (cfg.clone(), &go_abort, &inited, tx.clone());
            s.spawn(move || {
                let comm = Communicator::init_rank(&CommDevice::Host, 2, rank, &a, &cfg).unwrap();
                inited.wait();
                let mut x = vec![1.0f32; 4];
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                go_abort.wait();
                let r = comm.abort();
                tx.send((rank, r, blocked())).unwrap();
            });
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while blocked() == 0 {
            assert!(Instant::now() < deadline, "A's revoke never blocked");
            std::thread::sleep(Duration::from_millis(2));
        }
        // B: rank 0 waits for rank 1, which never calls.
        let (b_out, b_tx) = {
            let (t, r) = mpsc::channel::<()>();
            (r, t)
        };
        let cfg_b = cfg.clone();
        let waiter = s.spawn(move || {
            let comm = Communicator::init_rank(&CommDevice::Host, 2, 1, &b, &cfg_b).unwrap();
            let _ = b_out.recv();
            drop(comm);
        });
        let comm = Communicator::init_rank(&CommDevice::Host, 2, 0, &b, &cfg).unwrap();
        let mut x = vec![1.0f32; 4];
        let e = comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
            .unwrap_err();
        let b_still = blocked();
        drop(comm);
        let _ = b_tx.send(());
        waiter.join().unwrap();
        go_abort.wait();
        let a_results: Vec<_> = (0..2).map(|_| rx.recv().unwrap()).collect();
        released.store(true, Ordering::Release);
        // Checked once every thread is done with its part (a failed check here would
        // leave the others waiting at a barrier).
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert_eq!(b_still, 1, "B timed out only once A's revoke went on: {e}");
        let mut overdue = 0;
        for (rank, r, still) in a_results {
            assert_eq!(
                still, 1,
                "rank {rank} of A: its abort waited for the revoke"
            );
            if let Err(e) = r {
                assert!(e.to_string().contains("abort bound"), "rank {rank}: {e}");
                overdue += 1;
            }
        }
        assert_eq!(
            overdue, 1,
            "the owner whose revoke blocks gets the bound's error"
        );
    });
    fault::clear(&a.to_raw());
    let st = assert_balanced(&a);
    assert_eq!((st.created, st.aborted), (2, 2), "{st:?}");
    assert_balanced(&b);
}

/// NCCL's revoke sets only this rank's abort flags (init.cc:2662 of v2.29.7-1): it ends
/// this rank's wait in a collective, not its peers'. Three ranks in threads (30 s
/// timeout, so no watchdog acts); ranks 0 and 1 wait in an all-reduce rank 2 never calls.
/// Rank 0's handle is revoked (raw, from another thread, as the watchdog does): its call
/// fails; rank 1's still waits until its own handle is revoked. Before, the host
/// provider's revoke ended every waiting rank's call at once.
#[test]
fn a_revoke_ends_only_its_own_ranks_wait() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    let id = CommDevice::Host.unique_id().unwrap();
    let lib = Library::host();
    let revoke = lib
        .table()
        .ncclCommRevoke
        .expect("the host provider has ncclCommRevoke");
    let done = [AtomicBool::new(false), AtomicBool::new(false)];
    let (tx, rx) = mpsc::channel::<(usize, usize)>();
    let end = AtomicBool::new(false);
    let mut seen_waiting = false;
    std::thread::scope(|s| {
        for rank in 0..3 {
            let (done, tx) = (&done, tx.clone());
            let (end, wait_only) = (&end, rank == 2);
            s.spawn(move || {
                let comm =
                    Communicator::init_rank(&CommDevice::Host, 3, rank, &id, &config()).unwrap();
                if wait_only {
                    // Never calls the all-reduce (bounded: a failed check of the test's
                    // thread must not leave it here).
                    let t0 = Instant::now();
                    while !end.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(20) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    return;
                }
                tx.send((rank, comm.as_raw() as usize)).unwrap();
                let mut x = vec![1.0f32; 4];
                let r = comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S);
                assert!(
                    r.is_err(),
                    "rank {rank}: the revoke ended the wait with an error"
                );
                done[rank].store(true, Ordering::Release);
                // Kept until both revokes were made (a teardown fails the others' waits).
                let t0 = Instant::now();
                while !end.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(20) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                drop(comm);
            });
        }
        let mut raw = [0usize; 2];
        for _ in 0..2 {
            let (r, h) = rx.recv().unwrap();
            raw[r] = h;
        }
        std::thread::sleep(Duration::from_millis(300)); // both wait in the all-reduce
                                                        // SAFETY: rank 0's handle is live (its owner is inside its all-reduce, which the
                                                        // revoke ends) and the flags are NCCL_REVOKE_DEFAULT.
        let r = unsafe { revoke(raw[0] as nccl_sys::ncclComm_t, 0) };
        assert!(r == nccl_sys::bindings::ncclSuccess || r == nccl_sys::bindings::ncclInProgress);
        let t0 = Instant::now();
        while !done[0].load(Ordering::Acquire) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "rank 0's wait never ended"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(300));
        seen_waiting = !done[1].load(Ordering::Acquire);
        // SAFETY: as above, for rank 1.
        let r = unsafe { revoke(raw[1] as nccl_sys::ncclComm_t, 0) };
        assert!(r == nccl_sys::bindings::ncclSuccess || r == nccl_sys::bindings::ncclInProgress);
        end.store(true, Ordering::Release);
    });
    assert!(seen_waiting, "rank 0's revoke ended rank 1's wait too");
    assert_balanced(&id);
}

/// NCCL 2.29-2.30's `ncclCommRevoke` aborts the group job a non-blocking group end linked
/// to the communicator and leaves `comm->groupJob` pointing at it (init.cc:2664 -> 404,
/// group.cc:873-884 of v2.29.7-1): the next `ncclCommGetAsyncError` that reads ncclSuccess
/// completes the freed job (init.cc:3105-3110), a use after free. A job stays linked from
/// its group end until a poll reads ncclSuccess, so a split whose job failed (a rank's
/// NCCL aborted under it, unseen by the crate's diagnostics) leaves it linked for good.
/// `shrink_after_failure`, which revokes a communicator NCCL reports in error, must then
/// abort it instead, and say that it cannot be shrunk. The host provider links jobs as
/// NCCL does and counts every use of a deleted one as misuse (before: the revoke went
/// ahead, its poll completed the deleted job, one misuse on each survivor, and the
/// shrink "succeeded" over NCCL's freed job).
#[test]
fn a_communicator_whose_job_failed_is_aborted_not_revoked() {
    let lib = Library::host();
    let id = UniqueId::new_with(&lib).unwrap();
    let ready = Barrier::new(3);
    std::thread::scope(|s| {
        for rank in 0..3 {
            let (ready, lib) = (&ready, Arc::clone(&lib));
            s.spawn(move || {
                let comm =
                    Communicator::init_rank_in(&lib, &CommDevice::Host, 3, rank, &id, &config())
                        .unwrap();
                ready.wait(); // every init complete
                if rank == 2 {
                    // NCCL's abort of a rank whose process ends, once its peers' split
                    // waits for its color.
                    std::thread::sleep(Duration::from_millis(200));
                    let raw = comm.into_raw();
                    // SAFETY: the handle given up by `into_raw`, torn down once here.
                    let r = unsafe { (lib.table().ncclCommAbort)(raw) };
                    assert_eq!(r, nccl_sys::bindings::ncclSuccess);
                    return;
                }
                let e = comm.split(Some(0), rank as i32).unwrap_err();
                assert!(comm.is_failed(), "{e}");
                let e = comm.shrink_after_failure(&[2]).unwrap_err();
                assert!(
                    !comm.is_revoked(),
                    "rank {rank}: revoked with its failed job linked"
                );
                let msg = e.to_string();
                assert!(
                    msg.contains("could not be revoked") && msg.contains("new communicator"),
                    "rank {rank}: {msg}"
                );
                // A second try says the same, and calls nothing.
                let again = comm.shrink_after_failure(&[2]).unwrap_err();
                assert!(
                    again.to_string().contains("could not be revoked"),
                    "rank {rank}: {again}"
                );
            });
        }
    });
    let st = support::settled_stats(&id);
    assert_eq!(
        st.misused,
        0,
        "{st:?}; the process's latest misuses: {:#?}",
        nccl_safe::host::recent_misuse()
    );
    assert_eq!(st.live, 0, "{st:?}");
}

/// NCCL's shrink in abort mode waits in the call for the communicator's device stream
/// (init.cc:2844-2848 of v2.29.7-1), for ever when work there is stalled behind the user's
/// own. Three ranks whose all-reduce ran but whose stream has not drained
/// (`Fault::StalledWork`, which the host provider's shrink and revoke now wait for, as
/// NCCL's stream synchronize does); ranks 0 and 1 (`Config::elastic`, 1 s timeout) then
/// shrink rank 2 away at once. `shrink_after_failure` revokes first (the revoke's job
/// waits for the same streams, off the caller's thread) and fails with `Error::Timeout`
/// naming the work, without entering `ncclCommShrink`. Before: it entered the shrink,
/// which waited until the test released the stalls 5 s later, then succeeded.
#[test]
#[cfg(feature = "diag")]
fn a_shrink_after_failure_behind_stalled_work_fails_within_its_bound_naming_the_work() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let id = CommDevice::Host.unique_id().unwrap();
    fault::inject(&id.to_raw(), Fault::StalledWork);
    let released = AtomicBool::new(false);
    let done = Barrier::new(4);
    std::thread::scope(|s| {
        // Bounds the test on the old code.
        s.spawn(|| {
            release_at_the_latest(&released, Duration::from_secs(5), || {
                fault::release_stalls(&id.to_raw())
            })
        });
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                let (id, done, released) = (&id, &done, &released);
                s.spawn(move || {
                    let cfg = if rank == 2 {
                        config()
                    } else {
                        Config::new().elastic(true).timeout(Duration::from_secs(1))
                    };
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 3, rank, id, &cfg).unwrap();
                    let mut x = vec![1.0f32; 4];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                    let r = (rank < 2).then(|| {
                        let r = comm.shrink_after_failure(&[2]).map(drop);
                        (r, released.load(Ordering::Acquire))
                    });
                    done.wait();
                    done.wait(); // the stalls released
                    drop(comm);
                    r
                })
            })
            .collect();
        done.wait();
        released.store(true, Ordering::Release);
        fault::release_stalls(&id.to_raw());
        done.wait();
        for (rank, h) in ranks.into_iter().enumerate().take(2) {
            let (r, late) = h.join().unwrap().unwrap();
            let e = r.expect_err("the shrink waited behind the stalled work");
            assert!(
                !late,
                "rank {rank}: returned only once the stalls were released: {e}"
            );
            assert!(matches!(e, Error::Timeout { .. }), "rank {rank}: {e}");
            let msg = e.to_string();
            for part in [
                "ncclStrongStreamSynchronize",
                "ncclAllReduce(",
                "did not enter ncclCommShrink",
            ] {
                assert!(msg.contains(part), "rank {rank}: no {part:?} in: {msg}");
            }
        }
    });
    fault::clear(&id.to_raw());
    assert_balanced(&id);
}

/// A user's `revoke()` is bounded as the watchdog's is: NCCL's revoke joins the
/// communicator's group job (group.cc:875-877 of v2.29.7-1) and may block
/// (`Fault::BlockingRevoke`). Two ranks (abort bound 300 ms) revoke: each call returns
/// `Error::Timeout` within the bound while NCCL's revoke still blocks, later calls fail
/// without reaching NCCL, and the drop hands the handle over: it is aborted once the
/// revoke returned, once. Before: `revoke()` blocked on the owner's thread until the test
/// released the revokes 5 s later.
#[test]
#[cfg(feature = "diag")]
fn a_users_revoke_that_blocks_in_nccl_returns_within_the_abort_bound() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let id = CommDevice::Host.unique_id().unwrap();
    fault::inject(&id.to_raw(), Fault::BlockingRevoke(None));
    let cfg = Config::new()
        .elastic(true)
        .timeout(Duration::from_secs(30))
        .abort_timeout(Duration::from_millis(300));
    let released = AtomicBool::new(false);
    std::thread::scope(|s| {
        // Bounds the test on the old code.
        s.spawn(|| {
            release_at_the_latest(&released, Duration::from_secs(5), || {
                fault::release_revokes(&id.to_raw())
            })
        });
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (id, cfg, released) = (&id, cfg.clone(), &released);
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, id, &cfg).unwrap();
                    let mut x = vec![1.0f32; 4];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                    let e = comm.revoke().unwrap_err();
                    let late = released.load(Ordering::Acquire);
                    let later = comm.async_error().unwrap_err();
                    let shrunk = comm
                        .shrink_after_failure(&[1 - rank])
                        .map(drop)
                        .unwrap_err();
                    let revoked = comm.is_revoked();
                    drop(comm);
                    (e, late, later, shrunk, revoked)
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        released.store(true, Ordering::Release);
        for (rank, (e, late, later, shrunk, revoked)) in results.into_iter().enumerate() {
            assert!(
                !late,
                "rank {rank}: the revoke returned only once NCCL's did: {e}"
            );
            assert!(matches!(e, Error::Timeout { .. }), "rank {rank}: {e}");
            assert!(
                e.to_string()
                    .contains("did not return within Config::abort_timeout"),
                "rank {rank}: {e}"
            );
            assert!(revoked, "rank {rank}");
            for later in [later, shrunk] {
                assert!(
                    matches!(later, Error::CommunicatorFailed { .. }),
                    "rank {rank}: {later}"
                );
            }
        }
    });
    fault::clear(&id.to_raw());
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.aborted), (2, 2), "{st:?}");
}
