//! Zero heap allocations per operation, enforced.
//!
//! An allocation on the per-operation path is a call into the allocator, whose locks and
//! page faults make one rank late now and then: a straggler, one of the failures the crate
//! exists to prevent. This file fails when a single operation or an operation in a group of
//! 8 allocates, after a warm-up (first calls may fill lazy state):
//! - on the host provider, world size 1 and 2 (ranks as threads), `Stream::Host`;
//! - on the CUDA code path over the fake driver (`tests/support/fakes`), with cudarc
//!   buffers, its event tracking on and off, and one stream or two (a compute stream that
//!   last wrote the buffer and a comm stream that NCCL runs on, as candle's DDP does).
//!
//! The counting allocator counts only the thread that is inside a measured operation, so
//! the test harness, the watchdog and the teardown lanes never count. On the fake CUDA path
//! the fake NCCL's own bookkeeping (its call log, its group queue: test scaffolding, not the
//! crate) is excluded by pausing the count inside its entry points; the host provider's runs
//! count, since they are the crate's.
//!
//! `NCCL_SAFE_ALLOC_TRACE=1` prints a backtrace of every counted allocation.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use nccl_safe::{
    CommDevice, Communicator, Config, Group, Library, Provider, ReduceOp, Stream, UniqueId,
};
use nccl_sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};
use support::fakes;

// ---- the counting allocator ----------------------------------------------------------

/// Counts the allocations of threads inside [`counted`]; every call goes to the system
/// allocator unchanged.
struct Counting;

thread_local! {
    /// Whether this thread is inside a measured operation (const: reading it never
    /// allocates, so the allocator may read it).
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    /// Allocations counted on this thread.
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

/// `NCCL_SAFE_ALLOC_TRACE`, read once before anything is counted.
static TRACE: AtomicBool = AtomicBool::new(false);

fn note_allocation() {
    // `try_with`: an allocation during a thread's teardown finds no thread-locals.
    if !COUNTING.try_with(Cell::get).unwrap_or(false) {
        return;
    }
    let _ = COUNT.try_with(|n| n.set(n.get() + 1));
    if TRACE.load(Ordering::Relaxed) {
        // The backtrace allocates too: not counted.
        COUNTING.set(false);
        eprintln!(
            "counted allocation:\n{}",
            std::backtrace::Backtrace::force_capture()
        );
        COUNTING.set(true);
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: the caller's contract is forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: the caller's contract is forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation();
        // SAFETY: the caller's contract is forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` with this thread's allocations counted; returns how many it made.
fn counted(f: impl FnOnce()) -> u64 {
    COUNT.set(0);
    COUNTING.set(true);
    f();
    COUNTING.set(false);
    COUNT.get()
}

/// Stops counting this thread until dropped (inside the fake NCCL's entry points).
struct Paused(bool);

fn pause() -> Paused {
    Paused(COUNTING.replace(false))
}

impl Drop for Paused {
    fn drop(&mut self) {
        COUNTING.set(self.0);
    }
}

// ---- measuring -----------------------------------------------------------------------

/// Untimed calls first: lazy state (a thread's first flight-record slot, cudarc's loaded
/// symbols) is filled once, not per operation.
const WARMUP: usize = 100;
/// Measured steps: enough that an allocation every few hundred operations shows.
const STEPS: usize = 1000;
const GROUP: usize = 8;

/// Rounds of [`STEPS`] at most: the fewest allocations of a round counts.
const ROUNDS: usize = 3;

/// Allocations over [`STEPS`] steps after [`WARMUP`]; `step` does its untimed preparation
/// itself and returns what [`counted`] returned for its operations. A round that allocated
/// is measured again, up to [`ROUNDS`], and the fewest count: an allocation per operation
/// shows in every round (at least [`STEPS`]), while a one-off does not come back (a
/// host-provider group that had to poll for a departed peer, which a starved CPU can make
/// it do, makes its departure check once).
fn allocations(mut step: impl FnMut() -> u64) -> u64 {
    TRACE.store(
        std::env::var_os("NCCL_SAFE_ALLOC_TRACE").is_some_and(|v| v != "0"),
        Ordering::Relaxed,
    );
    for _ in 0..WARMUP {
        step();
    }
    let mut fewest = u64::MAX;
    for _ in 0..ROUNDS {
        fewest = fewest.min((0..STEPS).map(|_| step()).sum());
        if fewest == 0 {
            break;
        }
    }
    fewest
}

/// Every configuration's allocations, checked together so one run names every failure.
#[derive(Default)]
struct Report(Vec<(String, u64, usize)>);

impl Report {
    /// `total` allocations over [`STEPS`] steps of `ops` operations each.
    fn add(&mut self, what: impl Into<String>, total: u64, ops: usize) {
        self.0.push((what.into(), total, STEPS * ops));
    }

    fn assert_none(&self) {
        let failed: Vec<String> = self
            .0
            .iter()
            .filter(|(_, n, _)| *n > 0)
            .map(|(what, n, ops)| {
                format!(
                    "{what}: {n} allocations in {ops} operations ({:.3} per operation)",
                    *n as f64 / *ops as f64
                )
            })
            .collect();
        assert!(
            failed.is_empty(),
            "the per-operation path allocates (NCCL_SAFE_ALLOC_TRACE=1 prints where):\n  {}",
            failed.join("\n  ")
        );
        // Each configuration ran: a report that measured nothing would pass vacuously.
        assert!(!self.0.is_empty());
    }
}

// ---- providers with the count paused inside them --------------------------------------

/// A module `$m` whose `lookup` serves the provider `$table` with the count paused inside
/// the entry points an operation calls. What a provider does inside them is the stand-in
/// for NCCL's own work (the host provider runs the collective there: its plan, scratch and
/// queues; the fakes add a call log and a group queue): the rule here is about the crate's
/// path around them, which NVIDIA's NCCL would share.
macro_rules! paused_provider {
    ($m:ident, $table:expr) => {
        mod $m {
            use super::*;

            fn t() -> &'static nccl_sys::FunctionTable {
                static T: OnceLock<nccl_sys::FunctionTable> = OnceLock::new();
                T.get_or_init(|| $table)
            }

            unsafe extern "C" fn all_reduce(
                s: *const c_void,
                r: *mut c_void,
                n: usize,
                dt: ncclDataType_t,
                op: ncclRedOp_t,
                c: ncclComm_t,
                st: cudaStream_t,
            ) -> ncclResult_t {
                let _p = pause();
                // SAFETY: forwarded unchanged to the provider's entry point.
                unsafe { (t().ncclAllReduce)(s, r, n, dt, op, c, st) }
            }

            unsafe extern "C" fn group_start() -> ncclResult_t {
                let _p = pause();
                // SAFETY: as above.
                unsafe { (t().ncclGroupStart)() }
            }

            unsafe extern "C" fn group_end() -> ncclResult_t {
                let _p = pause();
                // SAFETY: as above.
                unsafe { (t().ncclGroupEnd)() }
            }

            unsafe extern "C" fn async_error(
                c: ncclComm_t,
                out: *mut ncclResult_t,
            ) -> ncclResult_t {
                let _p = pause();
                // SAFETY: as above.
                unsafe { (t().ncclCommGetAsyncError)(c, out) }
            }

            unsafe extern "C" fn count(c: ncclComm_t, out: *mut c_int) -> ncclResult_t {
                let _p = pause();
                // SAFETY: as above.
                unsafe { (t().ncclCommCount)(c, out) }
            }

            pub(super) fn lookup(name: &CStr) -> *const c_void {
                match name.to_bytes() {
                    b"ncclAllReduce" => all_reduce as *const c_void,
                    b"ncclGroupStart" => group_start as *const c_void,
                    b"ncclGroupEnd" => group_end as *const c_void,
                    b"ncclCommGetAsyncError" => async_error as *const c_void,
                    b"ncclCommCount" => count as *const c_void,
                    _ => t().get(name),
                }
            }
        }
    };
}

/// The host provider (`Provider::Host`: the crate's host path, `Group::end`'s deadline and
/// departure check included), with the count paused inside its entry points.
fn host_paused() -> Arc<Library> {
    static LIB: OnceLock<Arc<Library>> = OnceLock::new();
    Arc::clone(LIB.get_or_init(|| {
        // SAFETY: `host::lookup` returns the host provider's entry points, or wrappers with
        // the same signatures that call them, all living for the whole process.
        unsafe { Library::from_lookup(Provider::Host, None, host::lookup) }
            .expect("the host provider exports NCCL's API")
    }))
}

paused_provider!(host, *Library::host().table());

// ---- the host provider ---------------------------------------------------------------

/// One rank's measurements on the host provider: single operations (out of place and in
/// place) and a group of 8 all_reduces.
fn host_rank(comm: &Communicator, report: &mut Report) {
    let rank = comm.rank();
    let send = vec![1.0f32; 1024];
    let mut recv = vec![0.0f32; 1024];
    let sends: Vec<Vec<f32>> = (0..GROUP).map(|_| vec![1.0f32; 1024]).collect();
    let mut recvs: Vec<Vec<f32>> = (0..GROUP).map(|_| vec![0.0f32; 1024]).collect();

    let n = allocations(|| {
        counted(|| {
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &Stream::Host)
                .unwrap()
        })
    });
    report.add(format!("rank {rank}: all_reduce"), n, 1);

    let n = allocations(|| {
        counted(|| {
            comm.all_reduce_in_place(&mut recv, ReduceOp::Sum, &Stream::Host)
                .unwrap()
        })
    });
    report.add(format!("rank {rank}: all_reduce_in_place"), n, 1);

    let n = allocations(|| {
        counted(|| {
            let mut g = Group::new();
            for (s, r) in sends.iter().zip(recvs.iter_mut()) {
                g.push(
                    comm.all_reduce_op(s, r, ReduceOp::Sum, &Stream::Host)
                        .unwrap(),
                )
                .unwrap();
            }
            g.end().unwrap();
        })
    });
    report.add(
        format!("rank {rank}: group of {GROUP} all_reduce"),
        n,
        GROUP,
    );
}

/// `n` ranks of `lib`'s host communicators, each on its own thread (counting its own
/// allocations: the host provider runs a collective on the thread of the rank that
/// completes it), each measured by [`host_rank`].
fn host_ranks(lib: &Arc<Library>, n: usize) -> Report {
    let id = UniqueId::new_with(lib).unwrap();
    let reports: Vec<Report> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let id = &id;
                s.spawn(move || {
                    let comm = Communicator::init_rank_in(
                        lib,
                        &CommDevice::Host,
                        n,
                        rank,
                        id,
                        &Config::new(),
                    )
                    .unwrap();
                    let mut report = Report::default();
                    host_rank(&comm, &mut report);
                    report
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all = Report::default();
    for r in reports {
        all.0.extend(r.0);
    }
    assert_eq!(
        all.0.len(),
        3 * n,
        "every rank measured every configuration"
    );
    all
}

#[test]
fn host_provider_world_size_1() {
    host_ranks(&host_paused(), 1).assert_none();
}

/// With the provider answering a non-blocking launch of two ranks as NCCL does
/// (ncclInProgress, then the crate's wait): the path every group and collective of a real
/// multi-GPU run takes, which built an error per group until this test ran on it.
#[test]
fn host_provider_world_size_2() {
    nccl_safe::host::set_launch_in_progress(true);
    host_ranks(&host_paused(), 2).assert_none();
}

// ---- the CUDA code path on the fake driver -------------------------------------------

/// The fakes' NCCL (the host provider presented as NVIDIA's), with the count paused
/// inside the entry points an operation calls (see [`paused_provider`]).
fn fake_nccl() -> Arc<Library> {
    static LIB: OnceLock<Arc<Library>> = OnceLock::new();
    Arc::clone(LIB.get_or_init(|| {
        // SAFETY: `fake::lookup` returns the fakes' entry points, or wrappers with the same
        // signatures that call them, all living for the whole process.
        unsafe { Library::from_lookup(Provider::Nccl, None, fake::lookup) }
            .expect("the fake NCCL exports NCCL's API")
    }))
}

paused_provider!(fake, *fakes::nccl().table());

/// One configuration of the CUDA path: cudarc's event tracking on or off, one stream or a
/// compute stream beside the comm stream.
fn cuda_config(tracking: bool, two_streams: bool, report: &mut Report) {
    fakes::driver();
    let lib = fake_nccl();
    let ctx = CudaContext::new(0).expect("a fake CUDA context");
    if tracking {
        // SAFETY: cudarc's default; it changes only how buffers made after it are tracked.
        unsafe { ctx.enable_event_tracking() };
    } else {
        // SAFETY: untracked buffers are ordered by the test itself: with two streams the
        // compute stream's writes and the collectives are host-synchronous in the fakes
        // (every driver call completes at once), so no two uses overlap.
        unsafe { ctx.disable_event_tracking() };
    }
    let comm_stream = ctx.new_stream().unwrap();
    let compute: Arc<CudaStream> = if two_streams {
        ctx.new_stream().unwrap()
    } else {
        Arc::clone(&comm_stream)
    };
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(
        &lib,
        &CommDevice::Cuda(ctx.clone()),
        1,
        0,
        &id,
        &Config::new(),
    )
    .unwrap();
    let mut bufs: Vec<CudaSlice<f32>> = (0..GROUP)
        .map(|_| compute.clone_htod(&[1.0f32]).unwrap())
        .collect();
    let what = format!(
        "tracking {}, {}",
        if tracking { "on" } else { "off" },
        if two_streams {
            "compute + comm streams"
        } else {
            "one stream"
        }
    );

    let n = allocations(|| {
        // Untimed: the compute stream writes the buffer, as a training step's backward
        // pass writes a gradient before it is reduced.
        if two_streams {
            compute.memset_zeros(&mut bufs[0]).unwrap();
        }
        counted(|| {
            comm.all_reduce_in_place(&mut bufs[0], ReduceOp::Sum, &comm_stream)
                .unwrap()
        })
    });
    report.add(format!("{what}: all_reduce_in_place"), n, 1);

    let n = allocations(|| {
        if two_streams {
            for b in bufs.iter_mut() {
                compute.memset_zeros(b).unwrap();
            }
        }
        counted(|| {
            let mut g = Group::new();
            for b in bufs.iter_mut() {
                g.push(
                    comm.all_reduce_in_place_op(b, ReduceOp::Sum, &comm_stream)
                        .unwrap(),
                )
                .unwrap();
            }
            g.end().unwrap();
        })
    });
    report.add(
        format!("{what}: group of {GROUP} all_reduce_in_place"),
        n,
        GROUP,
    );

    comm_stream.synchronize().unwrap();
    compute.synchronize().unwrap();
    drop(bufs);
    support::fakes::set_teardown_time(
        std::time::Duration::from_millis(10),
        std::time::Duration::from_millis(10),
    );
    comm.destroy().map_err(|(_, e)| e).unwrap();
}

#[test]
fn fake_cuda_path() {
    let mut report = Report::default();
    for tracking in [false, true] {
        for two_streams in [false, true] {
            cuda_config(tracking, two_streams, &mut report);
        }
    }
    assert_eq!(report.0.len(), 8, "every configuration measured");
    report.assert_none();
}
