//! Raw-handle interop on the host provider: an adopted handle is torn down exactly once, a
//! released one never, a borrowed one never by the view (and never by the watchdog).
//! What must not compile is in tests/ui (comm_ref_*.rs).

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_safe::host::{root_id_of, stats_for, HostStats};
use nccl_safe::{
    CommDevice, CommRef, Communicator, Config, Error, Group, Library, ReduceOp, Stream,
};
use nccl_sys::{bindings::ncclSuccess, ncclComm_t, ncclUniqueId};
use support::within;

/// Handles made the way C, C++ or PyTorch would make them: one `ncclCommInitAll` through
/// the raw table. Owns them: `Drop` destroys each one still held, once.
struct ForeignComms {
    lib: Arc<Library>,
    raws: Vec<ncclComm_t>,
    id: ncclUniqueId,
}

// SAFETY: the handles are only opaque pointers; the tests use each from one thread at a time.
unsafe impl Send for ForeignComms {}
// SAFETY: as above: shared access only reads the pointer values.
unsafe impl Sync for ForeignComms {}

impl ForeignComms {
    fn new(n: usize) -> ForeignComms {
        let lib = Library::host();
        let mut raws = vec![std::ptr::null_mut(); n];
        let devs: Vec<i32> = (0..n as i32).collect();
        // SAFETY: `raws` and `devs` hold `n` entries each.
        let r =
            unsafe { (lib.table().ncclCommInitAll)(raws.as_mut_ptr(), n as i32, devs.as_ptr()) };
        assert_eq!(r, ncclSuccess);
        let id = root_id_of(raws[0]).expect("a live host handle has a root id");
        ForeignComms { lib, raws, id }
    }

    fn stats(&self) -> HostStats {
        stats_for(&self.id)
    }

    /// Hands handle `i` over (adoption): this owner no longer tears it down.
    fn give(&mut self, i: usize) -> ncclComm_t {
        std::mem::replace(&mut self.raws[i], std::ptr::null_mut())
    }

    /// Aborts handle `i` (as an owner's own watchdog would), from any thread.
    fn abort(&self, i: usize) {
        // SAFETY: handle `i` is live and this is its one teardown (it is nulled in `Drop`
        // by the caller's `forget`); the host provider wakes calls blocked on it.
        let r = unsafe { (self.lib.table().ncclCommAbort)(self.raws[i]) };
        assert_eq!(r, ncclSuccess);
    }

    /// After `abort(i)`: forget handle `i` so that `Drop` does not tear it down again.
    fn forget(&mut self, i: usize) {
        self.raws[i] = std::ptr::null_mut();
    }
}

impl Drop for ForeignComms {
    fn drop(&mut self) {
        for &raw in &self.raws {
            if !raw.is_null() {
                // SAFETY: each handle still held is live and torn down once, here.
                unsafe { (self.lib.table().ncclCommDestroy)(raw) };
            }
        }
    }
}

fn sum_of_ranks(comm: &Communicator) -> nccl_safe::Result<Vec<f32>> {
    let mut x = vec![comm.rank() as f32 + 1.0; 8];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
    Ok(x)
}

fn teardowns(st: &HostStats) -> (u64, u64, u64, u64) {
    (st.created, st.destroyed, st.aborted, st.misused)
}

/// An adopted handle works like any communicator and is destroyed once, by drop.
#[test]
fn an_adopted_handle_is_destroyed_once_by_drop() {
    let mut foreign = ForeignComms::new(2);
    let raws = [foreign.give(0), foreign.give(1)];
    let raws = raws.map(|r| r as usize);
    std::thread::scope(|s| {
        for raw in raws {
            s.spawn(move || {
                // SAFETY: the handle was handed over above and nothing else uses it.
                let comm = unsafe {
                    Communicator::from_raw(
                        Library::host(),
                        raw as ncclComm_t,
                        CommDevice::Host,
                        &Config::new(),
                    )
                }
                .expect("adopt");
                assert_eq!(comm.world_size(), 2);
                assert_eq!(sum_of_ranks(&comm).unwrap(), vec![3.0; 8]);
                assert_eq!(comm.as_raw() as usize, raw);
            });
        }
    });
    assert_eq!(teardowns(&foreign.stats()), (2, 2, 0, 0));
    let id = foreign.id;
    drop(foreign); // holds nothing any more: no second teardown
    assert_eq!(teardowns(&stats_for(&id)), (2, 2, 0, 0));
}

/// An adopted handle's explicit teardowns are its one teardown too.
#[test]
fn an_adopted_handle_is_aborted_or_destroyed_once_explicitly() {
    let mut foreign = ForeignComms::new(1);
    let lib = Library::host();
    // SAFETY: handed over; nothing else uses it.
    let comm = unsafe {
        Communicator::from_raw(
            Arc::clone(&lib),
            foreign.give(0),
            CommDevice::Host,
            &Config::new(),
        )
    }
    .unwrap();
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    comm.abort().unwrap();
    assert_eq!(teardowns(&foreign.stats()), (1, 0, 1, 0));

    let mut foreign = ForeignComms::new(1);
    // SAFETY: as above.
    let comm =
        unsafe { Communicator::from_raw(lib, foreign.give(0), CommDevice::Host, &Config::new()) }
            .unwrap();
    sum_of_ranks(&comm).unwrap();
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_eq!(teardowns(&foreign.stats()), (1, 1, 0, 0));
}

/// Bad handles are typed errors, and a failed adoption leaves the handle to the caller.
#[test]
fn a_failed_adoption_leaves_the_handle_alone() {
    let lib = Library::host();
    // SAFETY: null is rejected before any NCCL call.
    let e = unsafe {
        Communicator::from_raw(
            Arc::clone(&lib),
            std::ptr::null_mut(),
            CommDevice::Host,
            &Config::new(),
        )
    }
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");

    // A destroyed handle: the host provider reports the misuse, which becomes an error.
    let mut foreign = ForeignComms::new(1);
    let raw = foreign.give(0);
    // SAFETY: the handle was taken from `foreign` above: this is its one teardown.
    assert_eq!(unsafe { (lib.table().ncclCommDestroy)(raw) }, ncclSuccess);
    // SAFETY: violates from_raw's contract on purpose: the host provider detects a dead
    // handle (real NCCL would not), which shows the error path makes no teardown.
    let e =
        unsafe { Communicator::from_raw(lib, raw, CommDevice::Host, &Config::new()) }.unwrap_err();
    assert!(matches!(e, Error::Nccl(_)), "{e}");
    let st = foreign.stats();
    assert_eq!((st.created, st.destroyed, st.aborted), (1, 1, 0), "{st:?}");
    assert!(st.misused >= 1, "{st:?}");
}

/// A released handle is not torn down; it stays usable, and adopting it again closes the
/// circle with exactly one teardown.
#[test]
fn a_released_handle_is_not_torn_down() {
    let id = CommDevice::Host.unique_id().unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new()).unwrap();
    sum_of_ranks(&comm).unwrap();
    let raw = comm.into_raw();
    assert!(!raw.is_null());
    let st = stats_for(&id.to_raw());
    assert_eq!(teardowns(&st), (1, 0, 0, 0));
    assert_eq!(st.live, 1);
    // Still live: a raw all-reduce on it works.
    let mut x = [5.0f32; 4];
    let lib = Library::host();
    // SAFETY: `raw` is live and ours; `x` holds 4 floats; null stream is the host stream.
    let r = unsafe {
        (lib.table().ncclAllReduce)(
            x.as_ptr().cast(),
            x.as_mut_ptr().cast(),
            4,
            nccl_sys::bindings::ncclFloat32,
            nccl_sys::bindings::ncclSum,
            raw,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, ncclSuccess);
    assert_eq!(x, [5.0; 4]);
    // SAFETY: handed back to a Communicator, which owns it from now on.
    let again =
        unsafe { Communicator::from_raw(lib, raw, CommDevice::Host, &Config::new()) }.unwrap();
    sum_of_ranks(&again).unwrap();
    drop(again);
    assert_eq!(teardowns(&stats_for(&id.to_raw())), (1, 1, 0, 0));
}

/// Views run collectives, groups and splits on handles someone else owns, and never tear
/// them down; a child split through a view is owned (destroyed by its drop).
#[test]
fn a_borrowed_view_never_tears_down() {
    let foreign = ForeignComms::new(2);
    std::thread::scope(|s| {
        for i in 0..2 {
            let foreign = &foreign;
            s.spawn(move || {
                // SAFETY: `foreign` keeps handle `i` alive and makes no call on it meanwhile.
                let view = unsafe {
                    CommRef::from_raw_borrowed(
                        foreign,
                        Library::host(),
                        foreign.raws[i],
                        CommDevice::Host,
                        &Config::new(),
                    )
                }
                .expect("borrow");
                assert_eq!((view.rank(), view.world_size()), (i, 2));
                assert_eq!(sum_of_ranks(&view).unwrap(), vec![3.0; 8]);
                // A group through the view.
                let send = vec![1.0f32; 4];
                let mut recv = vec![0.0f32; 4];
                let mut g = Group::new();
                view.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &Stream::Host)
                    .and_then(|op| g.push(op))
                    .unwrap();
                g.end().unwrap();
                assert_eq!(recv, vec![2.0; 4]);
                // A child of a borrowed communicator is ours.
                let child = view.split(Some(0), 0).unwrap().expect("a color");
                assert_eq!(sum_of_ranks(&child).unwrap(), vec![3.0; 8]);
                drop(child);
                drop(view);
            });
        }
    });
    // Two children destroyed by their drops; the borrowed handles untouched.
    assert_eq!(teardowns(&foreign.stats()), (4, 2, 0, 0));
    let id = foreign.id;
    drop(foreign);
    assert_eq!(teardowns(&stats_for(&id)), (4, 4, 0, 0));
}

/// On a timeout the watchdog aborts an adopted handle (once: the drop afterwards does
/// nothing) but never a borrowed one: it marks the view failed, and the call blocked
/// inside NCCL returns the timeout report once the owner aborts the handle.
#[test]
fn the_watchdog_aborts_an_adopted_handle_but_never_a_borrowed_one() {
    let config = Config::new().timeout(Duration::from_millis(100));

    // Adopted: rank 1 never joins the all-reduce.
    let mut foreign = ForeignComms::new(2);
    let raw = foreign.give(0) as usize;
    let cfg = config.clone();
    let (e, comm) = within(Duration::from_secs(20), move || {
        // SAFETY: handed over; nothing else uses it.
        let comm = unsafe {
            Communicator::from_raw(Library::host(), raw as ncclComm_t, CommDevice::Host, &cfg)
        }
        .unwrap();
        (sum_of_ranks(&comm).unwrap_err(), comm)
    });
    assert!(
        matches!(&e, Error::Timeout { what, .. } if what.contains("did not complete in time")),
        "{e}"
    );
    assert!(comm.diagnostics().aborted_by_watchdog);
    drop(comm); // the watchdog's abort was the one teardown
    assert_eq!(teardowns(&foreign.stats()), (2, 0, 1, 0));
    foreign.abort(1);
    foreign.forget(1);
    assert_eq!(teardowns(&foreign.stats()), (2, 0, 2, 0));

    // Borrowed: the same stall, through a view.
    let foreign = Arc::new(ForeignComms::new(2));
    let owner = Arc::clone(&foreign);
    let cfg = config.clone();
    let started = Instant::now();
    let blocked = std::thread::spawn(move || {
        // SAFETY: `owner` keeps handle 0 alive; its only call meanwhile is the abort that
        // an owner's own watchdog would make, which NCCL allows from another thread.
        let view = unsafe {
            CommRef::from_raw_borrowed(
                &*owner,
                Library::host(),
                owner.raws[0],
                CommDevice::Host,
                &cfg,
            )
        }
        .unwrap();
        let e = sum_of_ranks(&view).unwrap_err();
        let again = sum_of_ranks(&view).unwrap_err();
        let aborted = view.diagnostics().aborted_by_watchdog;
        drop(view);
        (e, again, aborted)
    });
    // Long past the timeout: the watchdog has seen the stall many times over.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        !blocked.is_finished(),
        "nothing may wake the call but its owner"
    );
    assert_eq!(
        teardowns(&foreign.stats()),
        (2, 0, 0, 0),
        "the watchdog aborted a borrowed handle"
    );
    foreign.abort(0); // the owner's decision
    let (e, again, aborted) = blocked.join().unwrap();
    assert!(started.elapsed() >= Duration::from_millis(1000));
    assert!(
        matches!(&e, Error::Timeout { what, .. } if what.contains("did not complete in time")),
        "{e}"
    );
    assert!(matches!(&again, Error::Timeout { .. }), "{again}");
    assert!(aborted);
    foreign.abort(1);
    let mut foreign = Arc::try_unwrap(foreign).ok().expect("the view is gone");
    foreign.forget(0);
    foreign.forget(1);
    assert_eq!(teardowns(&foreign.stats()), (2, 0, 2, 0));
}

/// A non-blocking handle given back and adopted again (with a non-blocking config) keeps
/// working through the non-blocking path, and is torn down once.
#[test]
fn a_non_blocking_handle_round_trips() {
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().blocking(false);
    let world = 2;
    std::thread::scope(|s| {
        for rank in 0..world {
            let config = config.clone();
            s.spawn(move || {
                let comm =
                    Communicator::init_rank(&CommDevice::Host, world, rank, &id, &config).unwrap();
                let raw = comm.into_raw();
                // SAFETY: given back above; adopted again with the config it was made with.
                let comm = unsafe {
                    Communicator::from_raw(Library::host(), raw, CommDevice::Host, &config)
                }
                .unwrap();
                assert_eq!((comm.rank(), comm.world_size()), (rank, world));
                assert_eq!(sum_of_ranks(&comm).unwrap(), vec![3.0; 8]);
                comm.finalize(Duration::from_secs(20)).unwrap();
            });
        }
    });
    let st = stats_for(&id.to_raw());
    assert_eq!(teardowns(&st), (2, 2, 0, 0));
    assert_eq!(st.finalized, 2);
}
