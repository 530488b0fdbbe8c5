//! DDP's CUDA path run on a CPU: candle's `CudaStorage`, the communication stream and the
//! events that order it against candle's stream, over nccl-safe's fake CUDA driver, with
//! the host provider presented as NVIDIA's NCCL.
//!
//! The fake runs each operation inside its call, in host order, so values alone cannot
//! show a missing event. Its stream-order model can: every pair of accesses to the same
//! memory (one a write) that CUDA's events and host synchronizations leave unordered is a
//! race, which a GPU may run the other way round. NCCL's accesses reach the model through
//! the wrappers below, when NVIDIA's NCCL would launch them: with two or more ranks, from a
//! thread of its own after the call returned, where the per-thread stream (0x2, candle's)
//! is that thread's. Checked, with cudarc's event tracking on (candle's default) and off
//! (then only the crate's own events order the two streams):
//! - the gradients are the average over the ranks, bit for bit, through several buckets,
//!   a parameter larger than a bucket and a missing gradient (zero-filled);
//! - the parameters are rank 0's after construction;
//! - no race, no stream, event or allocation left behind, no kernel the fake lacks;
//! - a step that fails (a peer left) after handing a bucket to NCCL on the communication
//!   stream still makes candle's stream wait for it before the bucket's buffer is freed;
//! - the tensor collectives reach the right elements of a view that starts inside candle's
//!   storage (in place, and as the input of all_gather and reduce_scatter);
//! - with 2 and 3 ranks, the tensor collectives on candle's per-thread stream, alone,
//!   bucket by bucket and in a group, are ordered with the kernels that wrote their inputs,
//!   the reads of their results and the frees of both.
//!
//! `scripts/candle-ddp-cuda-check.sh` builds the fake driver and link stubs for the CUDA
//! libraries candle links, then runs these tests; elsewhere they are ignored (a machine
//! with a GPU has no fake to ask).
#![cfg(feature = "cuda")]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Barrier, OnceLock};

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;
use nccl_safe::{CommDevice, Communicator, Config, Library, Provider, UniqueId};
use nccl_safe_candle::DistributedDataParallel;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const WORLD: usize = 2;
/// Name and length of each parameter: `a` is larger than a bucket, `d` gets no gradient.
const PARAMS: [(&str, usize); 5] = [("a", 300), ("b", 10), ("c", 100), ("d", 7), ("e", 200)];
/// 1 KiB: 256 `f32`s, so several buckets.
const BUCKET_CAP: usize = 1024;

/// The fake driver's controls (`tests/support/fakes/cuda.c` of nccl-safe), found in the
/// process: the test binary is linked against the fake as `libcuda.so`.
struct Fake {
    check_order: unsafe extern "C" fn(c_int),
    access: unsafe extern "C" fn(*mut c_void, u64, usize, u64, usize) -> c_int,
    gauge: unsafe extern "C" fn(c_int) -> i64,
    last_race: unsafe extern "C" fn() -> *const c_char,
}

/// The fake's gauges read here (their numbers in `cuda.c`).
#[derive(Clone, Copy, Debug)]
enum Gauge {
    LiveStreams = 0,
    LiveEvents = 1,
    LiveAllocations = 2,
    Races = 10,
    AccessesChecked = 11,
    UntrackedOps = 12,
    UnknownKernels = 13,
}

fn fake() -> &'static Fake {
    static FAKE: OnceLock<Fake> = OnceLock::new();
    FAKE.get_or_init(|| {
        let this = libloading::os::unix::Library::this();
        fn missing<T>(e: libloading::Error) -> T {
            panic!(
                "not nccl-safe's fake CUDA driver ({e}): these tests run under \
                 scripts/candle-ddp-cuda-check.sh"
            )
        }
        // SAFETY: each symbol is the C function of that name in the fake driver, with this
        // signature; the driver stays loaded for the whole process (the binary links it).
        unsafe {
            Fake {
                check_order: *this.get(b"fake_cuda_check_order\0").unwrap_or_else(missing),
                access: *this.get(b"fake_cuda_access\0").unwrap_or_else(missing),
                gauge: *this.get(b"fake_cuda_gauge\0").unwrap_or_else(missing),
                last_race: *this.get(b"fake_cuda_last_race\0").unwrap_or_else(missing),
            }
        }
    })
}

impl Fake {
    fn gauge(&self, g: Gauge) -> i64 {
        // SAFETY: reads a counter.
        unsafe { (self.gauge)(g as c_int) }
    }

    fn last_race(&self) -> String {
        // SAFETY: a NUL-terminated string in a static buffer.
        unsafe { CStr::from_ptr((self.last_race)()) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The host provider's collectives, telling the stream-order model what they read and
/// write on their stream (the driver does not see NCCL's kernels), when NVIDIA's NCCL 2.28
/// would launch them on non-blocking communicators (the crate's; nccl-safe's
/// `tests/support/fakes/mod.rs`, `launch`, does the same):
/// - inside a group (`ncclGroupStart` on this thread, group state being per thread:
///   enqueue.cc:2633/2655, group.cc:669), queued until the outermost `ncclGroupEnd`;
/// - with one rank, inside the call (enqueue.cc:2569-2571);
/// - with more, from the group's own thread after the call returned ncclInProgress
///   (group.cc:705-738 → doLaunches, group.cc:259; enqueue.cc:1493/1658), here a thread
///   spawned for it a couple of ms later, where `CU_STREAM_PER_THREAD` (0x2) is *that*
///   thread's per-thread stream. Until it is done the communicators read ncclInProgress
///   from `ncclCommGetAsyncError`.
///
/// The values are the host provider's, computed in host order; only what the model sees
/// moves to the launch. An event recorded on the stream before the launch ends does not
/// cover it.
mod wrap {
    use super::*;
    use nccl_sys::bindings as b;
    use nccl_sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, MutexGuard};

    fn host() -> &'static nccl_sys::FunctionTable {
        static TABLE: OnceLock<nccl_sys::FunctionTable> = OnceLock::new();
        TABLE.get_or_init(|| *Library::host().table())
    }

    fn bytes(n: usize, t: ncclDataType_t) -> usize {
        n * match t {
            b::ncclInt8 | b::ncclUint8 | b::ncclFloat8e4m3 | b::ncclFloat8e5m2 => 1,
            b::ncclFloat16 | b::ncclBfloat16 => 2,
            b::ncclInt32 | b::ncclUint32 | b::ncclFloat32 => 4,
            _ => 8,
        }
    }

    /// One collective as the model sees it: `send_len` bytes read at `send` and `recv_len`
    /// written at `recv`, on stream handle `stream`, of communicator `comm`.
    #[derive(Clone, Copy)]
    struct Call {
        comm: usize,
        stream: usize,
        send: (usize, usize),
        recv: (usize, usize),
    }

    /// NCCL was given a stream the fake driver does not know (at its launch, on the
    /// launch thread: counted, read by [`unknown_streams`]).
    static UNKNOWN_STREAMS: AtomicU64 = AtomicU64::new(0);

    /// Read by [`async_launches`].
    static ASYNC_LAUNCHES: AtomicU64 = AtomicU64::new(0);

    /// Launches made from a thread of their own (two or more ranks), so far.
    pub fn async_launches() -> u64 {
        ASYNC_LAUNCHES.load(Ordering::Relaxed)
    }

    /// Launches that reported a stream the fake driver did not know, so far.
    pub fn unknown_streams() -> u64 {
        UNKNOWN_STREAMS.load(Ordering::Relaxed)
    }

    /// Tells the model of `c`'s accesses, made on the calling thread (0x2 is that
    /// thread's per-thread stream).
    fn accessed(c: &Call) {
        // SAFETY: `stream` is the handle the caller gave NCCL (a stream of the fake driver
        // when the crate is right; an unknown one is refused and counted); the addresses
        // are only compared.
        let rc = unsafe {
            (fake().access)(
                c.stream as *mut c_void,
                c.send.0 as u64,
                c.send.1,
                c.recv.0 as u64,
                c.recv.1,
            )
        };
        if rc != 0 {
            UNKNOWN_STREAMS.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn nranks(c: ncclComm_t) -> usize {
        let mut n: c_int = 0;
        // SAFETY: `c` is the live communicator of the call in progress; writes one int.
        unsafe { (host().ncclCommCount)(c, &mut n) };
        n.max(1) as usize
    }

    thread_local! {
        /// This thread's NCCL group depth, and the collectives queued in its group.
        static GROUPED: RefCell<(u32, Vec<Call>)> = const { RefCell::new((0, Vec::new())) };
    }

    /// Communicators whose launch still runs (a count each): they read ncclInProgress.
    fn launching() -> MutexGuard<'static, HashMap<usize, usize>> {
        static L: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
        L.get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `call` in this thread's group, or launches it; true when its launch is
    /// asynchronous.
    fn issue(call: Call) -> bool {
        let queued = GROUPED.with(|g| {
            let mut g = g.borrow_mut();
            if g.0 > 0 {
                g.1.push(call);
            }
            g.0 > 0
        });
        !queued && launch(vec![call], call_ranks(&call))
    }

    /// The rank count of `call`'s communicator (alive: the call is in progress).
    fn call_ranks(call: &Call) -> usize {
        nranks(call.comm as ncclComm_t)
    }

    /// Launches `calls` (one rank: here; more: later, on a thread of their own); true when
    /// asynchronous.
    fn launch(calls: Vec<Call>, ranks: usize) -> bool {
        if ranks <= 1 {
            calls.iter().for_each(accessed);
            return false;
        }
        {
            let mut l = launching();
            for c in &calls {
                *l.entry(c.comm).or_default() += 1;
            }
        }
        ASYNC_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(2));
            calls.iter().for_each(accessed);
            let mut l = launching();
            for c in &calls {
                if let Some(n) = l.get_mut(&c.comm) {
                    *n -= 1;
                    if *n == 0 {
                        l.remove(&c.comm);
                    }
                }
            }
        });
        true
    }

    /// ncclInProgress for a successful call whose launch is asynchronous.
    fn in_progress_if(asynchronous: bool, r: ncclResult_t) -> ncclResult_t {
        if asynchronous && r == b::ncclSuccess {
            b::ncclInProgress
        } else {
            r
        }
    }

    pub unsafe extern "C" fn all_reduce(
        s: *const c_void,
        r: *mut c_void,
        n: usize,
        t: ncclDataType_t,
        op: ncclRedOp_t,
        c: ncclComm_t,
        st: cudaStream_t,
    ) -> ncclResult_t {
        let asynchronous = issue(Call {
            comm: c as usize,
            stream: st as usize,
            send: (s as usize, bytes(n, t)),
            recv: (r as usize, bytes(n, t)),
        });
        // SAFETY: forwarded unchanged to the host provider's entry point.
        in_progress_if(asynchronous, unsafe {
            (host().ncclAllReduce)(s, r, n, t, op, c, st)
        })
    }

    pub unsafe extern "C" fn broadcast(
        s: *const c_void,
        r: *mut c_void,
        n: usize,
        t: ncclDataType_t,
        root: c_int,
        c: ncclComm_t,
        st: cudaStream_t,
    ) -> ncclResult_t {
        let asynchronous = issue(Call {
            comm: c as usize,
            stream: st as usize,
            send: (s as usize, bytes(n, t)),
            recv: (r as usize, bytes(n, t)),
        });
        // SAFETY: as above.
        in_progress_if(asynchronous, unsafe {
            (host().ncclBroadcast)(s, r, n, t, root, c, st)
        })
    }

    pub unsafe extern "C" fn all_gather(
        s: *const c_void,
        r: *mut c_void,
        n: usize,
        t: ncclDataType_t,
        c: ncclComm_t,
        st: cudaStream_t,
    ) -> ncclResult_t {
        let asynchronous = issue(Call {
            comm: c as usize,
            stream: st as usize,
            send: (s as usize, bytes(n, t)),
            recv: (r as usize, bytes(n * nranks(c), t)),
        });
        // SAFETY: as above.
        in_progress_if(asynchronous, unsafe {
            (host().ncclAllGather)(s, r, n, t, c, st)
        })
    }

    pub unsafe extern "C" fn reduce_scatter(
        s: *const c_void,
        r: *mut c_void,
        n: usize,
        t: ncclDataType_t,
        op: ncclRedOp_t,
        c: ncclComm_t,
        st: cudaStream_t,
    ) -> ncclResult_t {
        let asynchronous = issue(Call {
            comm: c as usize,
            stream: st as usize,
            send: (s as usize, bytes(n * nranks(c), t)),
            recv: (r as usize, bytes(n, t)),
        });
        // SAFETY: as above.
        in_progress_if(asynchronous, unsafe {
            (host().ncclReduceScatter)(s, r, n, t, op, c, st)
        })
    }

    pub unsafe extern "C" fn group_start() -> ncclResult_t {
        GROUPED.with(|g| g.borrow_mut().0 += 1);
        // SAFETY: forwarded unchanged to the host provider's entry point.
        unsafe { (host().ncclGroupStart)() }
    }

    /// The outermost end launches the group's collectives: asynchronously when any of its
    /// communicators has more than one rank (NCCL's group thread launches them all).
    pub unsafe extern "C" fn group_end() -> ncclResult_t {
        let calls = GROUPED.with(|g| {
            let mut g = g.borrow_mut();
            g.0 = g.0.saturating_sub(1);
            if g.0 == 0 {
                std::mem::take(&mut g.1)
            } else {
                Vec::new()
            }
        });
        // Counted before the end: the host provider's end runs the queued calls, and a
        // communicator may be gone once it returned.
        let ranks = calls.iter().map(call_ranks).max().unwrap_or(0);
        // SAFETY: forwarded unchanged to the host provider's entry point.
        let r = unsafe { (host().ncclGroupEnd)() };
        let asynchronous = !calls.is_empty() && launch(calls, ranks);
        in_progress_if(asynchronous, r)
    }

    /// A communicator whose launch still runs reads ncclInProgress.
    pub unsafe extern "C" fn async_error(c: ncclComm_t, out: *mut ncclResult_t) -> ncclResult_t {
        if !out.is_null() && launching().contains_key(&(c as usize)) {
            // SAFETY: `out` is the caller's writable out-pointer (checked non-null).
            unsafe { out.write(b::ncclInProgress) };
            return b::ncclSuccess;
        }
        // SAFETY: forwarded unchanged to the host provider's entry point.
        unsafe { (host().ncclCommGetAsyncError)(c, out) }
    }
}

fn lookup(name: &CStr) -> *const c_void {
    match name.to_bytes() {
        b"ncclAllReduce" => wrap::all_reduce as *const c_void,
        b"ncclBroadcast" => wrap::broadcast as *const c_void,
        b"ncclAllGather" => wrap::all_gather as *const c_void,
        b"ncclReduceScatter" => wrap::reduce_scatter as *const c_void,
        b"ncclGroupStart" => wrap::group_start as *const c_void,
        b"ncclGroupEnd" => wrap::group_end as *const c_void,
        b"ncclCommGetAsyncError" => wrap::async_error as *const c_void,
        _ => nccl_safe::host::lookup(name),
    }
}

fn nccl() -> Arc<Library> {
    static LIB: OnceLock<Arc<Library>> = OnceLock::new();
    Arc::clone(LIB.get_or_init(|| {
        // SAFETY: `lookup` returns the host provider's own `extern "C"` functions, or the
        // wrappers above with the same signatures, all living for the whole process.
        unsafe { Library::from_lookup(Provider::Nccl, None, lookup) }
            .expect("the host provider exports NCCL's API")
    }))
}

/// Rank `rank`'s value `i` of parameter `p` before the broadcast.
fn init(rank: usize, p: usize, i: usize) -> f32 {
    (rank * 10_000 + p * 1000 + i) as f32
}

/// Rank `rank`'s gradient `i` of parameter `p`: quarters of integers, so that the average
/// over two ranks is exact.
fn grad(rank: usize, p: usize, i: usize) -> f32 {
    ((rank + 1) * 3000 + p * 500 + i) as f32 * 0.25
}

/// What one rank ends with: each parameter's values and gradient, by name.
type Outcome = Vec<(String, Vec<f32>, Vec<f32>)>;

/// Rank `rank`'s candle device (GPU `rank`, cudarc's event tracking on or off) and its
/// communicator of `world` ranks.
fn device_and_comm(
    rank: usize,
    world: usize,
    id: &UniqueId,
    tracking: bool,
) -> Result<(Device, Communicator), BoxError> {
    let Device::Cuda(dev) = Device::new_cuda(rank)? else {
        unreachable!("new_cuda makes a CUDA device")
    };
    if !tracking {
        // SAFETY: the crate orders its two streams with its own events, which is what this
        // run checks; only buffers made after the call are affected.
        unsafe { dev.disable_event_tracking() };
    }
    let ctx = dev.cuda_stream().context().clone();
    let comm = Communicator::init_rank_in(
        &nccl(),
        &CommDevice::Cuda(ctx),
        world,
        rank,
        id,
        &Config::default(),
    )?;
    Ok((Device::Cuda(dev), comm))
}

/// Rank `rank`'s candle device (cudarc's event tracking on or off), its communicator and
/// its parameters (rank-dependent values).
fn set_up(
    rank: usize,
    id: &UniqueId,
    tracking: bool,
) -> Result<(Device, Communicator, VarMap), BoxError> {
    let (device, comm) = device_and_comm(rank, WORLD, id, tracking)?;
    let map = VarMap::new();
    for (p, (name, len)) in PARAMS.iter().enumerate() {
        let values: Vec<f32> = (0..*len).map(|i| init(rank, p, i)).collect();
        let var = Var::from_tensor(&Tensor::from_vec(values, *len, &device)?)?;
        map.data().lock().unwrap().insert(name.to_string(), var);
    }
    Ok((device, comm, map))
}

/// Rank `rank`'s gradients of this step: all but `d`'s (unused this step).
fn gradients(
    rank: usize,
    ddp: &DistributedDataParallel,
    device: &Device,
) -> Result<GradStore, BoxError> {
    let mut grads = GradStore::default();
    for (p, (name, len)) in PARAMS.iter().enumerate() {
        if *name == "d" {
            continue;
        }
        let (_, var) = ddp.params().iter().find(|(n, _)| n == name).unwrap();
        let g: Vec<f32> = (0..*len).map(|i| grad(rank, p, i)).collect();
        grads.insert(var.as_tensor(), Tensor::from_vec(g, *len, device)?);
    }
    Ok(grads)
}

/// One step of DDP on rank `rank`: what it ends with, and its bucket count.
fn rank(
    rank: usize,
    id: &UniqueId,
    tracking: bool,
    ready: &Barrier,
) -> Result<(Outcome, usize), BoxError> {
    let (device, comm, map) = set_up(rank, id, tracking)?;
    let ddp = DistributedDataParallel::with_bucket_cap(&comm, &map, BUCKET_CAP)?;
    let buckets = ddp.plans().iter().map(|p| p.buckets.len()).sum();
    let mut grads = gradients(rank, &ddp, &device)?;
    ready.wait();
    ddp.sync_grads(&mut grads)?;
    let mut out = Vec::new();
    for (name, var) in ddp.params() {
        let g = grads
            .get(var.as_tensor())
            .ok_or_else(|| format!("no gradient for {name} after sync_grads"))?;
        out.push((name.clone(), var.as_tensor().to_vec1()?, g.to_vec1()?));
    }
    Ok((out, buckets))
}

/// Rank 1 leaves after construction; rank 0's step fails with the collective it had
/// handed to NCCL on the communication stream. Returns rank 0's error.
fn left_behind(rank: usize, id: &UniqueId, ready: &Barrier) -> Result<String, BoxError> {
    let (device, comm, map) = set_up(rank, id, false)?;
    let ddp = DistributedDataParallel::with_bucket_cap(&comm, &map, BUCKET_CAP)?;
    let mut grads = gradients(rank, &ddp, &device)?;
    ready.wait();
    if rank == 1 {
        return Ok(String::new()); // its communicator is torn down on the way out
    }
    match ddp.sync_grads(&mut grads) {
        Ok(()) => Err("the step succeeded without rank 1".into()),
        Err(e) => Ok(e.to_string()),
    }
}

/// Turns the model on and returns the gauges that must come back (streams, events,
/// allocations) and the races and accesses so far.
fn start() -> [i64; 5] {
    let f = fake();
    // SAFETY: sets a flag (process-wide: the tests of this file run one at a time).
    unsafe { (f.check_order)(1) };
    [
        Gauge::LiveStreams,
        Gauge::LiveEvents,
        Gauge::LiveAllocations,
        Gauge::Races,
        Gauge::AccessesChecked,
    ]
    .map(|g| f.gauge(g))
}

/// No race since `before`, the model saw the run, and nothing is left behind.
fn check(before: [i64; 5], min_accesses: i64) {
    let f = fake();
    let races = f.gauge(Gauge::Races) - before[3];
    assert_eq!(
        races,
        0,
        "unordered accesses; the latest: {}",
        f.last_race()
    );
    assert_eq!(
        wrap::unknown_streams(),
        0,
        "NCCL was given a stream the fake driver does not know"
    );
    let seen = f.gauge(Gauge::AccessesChecked) - before[4];
    assert!(seen >= min_accesses, "the model saw {seen} accesses");
    assert_eq!(f.gauge(Gauge::UntrackedOps), 0);
    assert_eq!(f.gauge(Gauge::UnknownKernels), 0);
    for (g, was) in [
        Gauge::LiveStreams,
        Gauge::LiveEvents,
        Gauge::LiveAllocations,
    ]
    .into_iter()
    .zip(before)
    {
        assert_eq!(f.gauge(g), was, "{g:?} after every rank dropped its device");
    }
}

/// Runs `f` on `WORLD` rank threads, sharing an id and a barrier.
fn ranks<R: Send>(f: impl Fn(usize, &UniqueId, &Barrier) -> Result<R, BoxError> + Sync) -> Vec<R> {
    ranks_of(WORLD, f)
}

/// Runs `f` on `world` rank threads, sharing an id and a barrier.
fn ranks_of<R: Send>(
    world: usize,
    f: impl Fn(usize, &UniqueId, &Barrier) -> Result<R, BoxError> + Sync,
) -> Vec<R> {
    let id = UniqueId::new_with(&nccl()).unwrap();
    let ready = Barrier::new(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (id, ready, f) = (&id, &ready, &f);
                s.spawn(move || f(r, id, ready).map_err(|e| e.to_string()))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked").expect("a rank failed"))
            .collect()
    })
}

fn run(tracking: bool) {
    let before = start();
    let outcomes = ranks(|r, id, ready| rank(r, id, tracking, ready));
    for (r, (outcome, buckets)) in outcomes.iter().enumerate() {
        assert!(
            *buckets >= 3,
            "rank {r}: {buckets} buckets, the test wants several"
        );
        for (name, values, g) in outcome {
            let p = PARAMS.iter().position(|(n, _)| n == name).unwrap();
            let len = PARAMS[p].1;
            let want: Vec<f32> = (0..len).map(|i| init(0, p, i)).collect();
            assert_eq!(
                values, &want,
                "rank {r}: {name} is not rank 0's after construction"
            );
            let want: Vec<f32> = if name == "d" {
                vec![0.0; len]
            } else {
                (0..len)
                    .map(|i| (0..WORLD).map(|q| grad(q, p, i)).sum::<f32>() / WORLD as f32)
                    .collect()
            };
            assert_eq!(g, &want, "rank {r}: {name}'s gradient is not the average");
        }
    }
    check(before, 50);
}

#[test]
#[ignore = "needs nccl-safe's fake CUDA driver: scripts/candle-ddp-cuda-check.sh"]
fn ddp_buckets_on_the_comm_stream_with_cudarcs_event_tracking() {
    run(true);
}

#[test]
#[ignore = "needs nccl-safe's fake CUDA driver: scripts/candle-ddp-cuda-check.sh"]
fn ddp_buckets_on_the_comm_stream_ordered_by_its_own_events_alone() {
    run(false);
}

#[test]
#[ignore = "needs nccl-safe's fake CUDA driver: scripts/candle-ddp-cuda-check.sh"]
fn a_failed_step_frees_its_buffers_after_the_comm_stream() {
    let before = start();
    let errors = ranks(left_behind);
    assert!(
        errors[0].contains("rank 1"),
        "rank 0's error: {}",
        errors[0]
    );
    check(before, 10);
}

/// Rank `rank`'s tensor collectives on views into one storage: what the storage and the
/// two new tensors hold afterwards.
fn views(rank: usize, id: &UniqueId, _: &Barrier) -> Result<[Vec<f32>; 3], BoxError> {
    use nccl_safe_candle::{all_gather, all_reduce, broadcast, reduce_scatter, ReduceOp};
    let (device, comm, _) = set_up(rank, id, true)?;
    let values: Vec<f32> = (0..20).map(|i| (100 * rank + i) as f32).collect();
    let base = Tensor::from_vec(values, 20, &device)?;
    all_reduce(&comm, &base.narrow(0, 5, 8)?, ReduceOp::Sum)?;
    broadcast(&comm, &base.narrow(0, 2, 3)?, 1)?;
    let gathered = all_gather(&comm, &base.narrow(0, 15, 4)?)?;
    let scattered = reduce_scatter(&comm, &base.narrow(0, 0, 4)?, ReduceOp::Sum)?;
    Ok([base.to_vec1()?, gathered.to_vec1()?, scattered.to_vec1()?])
}

#[test]
#[ignore = "needs nccl-safe's fake CUDA driver: scripts/candle-ddp-cuda-check.sh"]
fn tensor_collectives_reach_the_elements_of_a_view() {
    let before = start();
    let results = ranks(views);
    for (r, [base, gathered, scattered]) in results.iter().enumerate() {
        let want: Vec<f32> = (0..20usize)
            .map(|i| match i {
                2..5 => (100 + i) as f32,      // rank 1's, broadcast
                5..13 => (100 + 2 * i) as f32, // the sum over both ranks
                _ => (100 * r + i) as f32,     // untouched
            })
            .collect();
        assert_eq!(base, &want, "rank {r}'s storage");
        let want = vec![15f32, 16., 17., 18., 115., 116., 117., 118.];
        assert_eq!(gathered, &want, "rank {r}'s all_gather");
        // Elements 0..4 summed (2 and 3 hold rank 1's broadcast on both ranks):
        // [100, 102, 204, 206], half to each rank.
        let want = if r == 0 {
            vec![100f32, 102.]
        } else {
            vec![204f32, 206.]
        };
        assert_eq!(scattered, &want, "rank {r}'s reduce_scatter");
    }
    check(before, 16);
}

/// Elements of each tensor of [`on_candles_stream`]: whole parts for 2 and 3 ranks.
const M: usize = 24;
/// The buckets of the flat tensor reduced bucket by bucket.
const BUCKETS: [std::ops::Range<usize>; 3] = [0..7, 7..15, 15..24];

/// Rank `rank`'s element `i` before doubling.
fn elem(rank: usize, i: usize) -> f32 {
    (100 * rank + i) as f32
}

/// What rank `rank` of `world` reads back from [`on_candles_stream`], by collective.
#[derive(Debug, PartialEq)]
struct OnCandlesStream {
    all_reduce: Vec<f32>,
    broadcast: Vec<f32>,
    all_gather: Vec<f32>,
    reduce_scatter: Vec<f32>,
    scalar: f64,
    buckets: Vec<f32>,
    grouped: Vec<f32>,
}

impl OnCandlesStream {
    /// What rank `rank` of `world` must read.
    fn want(rank: usize, world: usize) -> Self {
        let x = |q: usize, i: usize| 2.0 * elem(q, i);
        let sum = |i: usize| (0..world).map(|q| x(q, i)).sum::<f32>();
        let part = M / world;
        OnCandlesStream {
            all_reduce: (0..M).map(sum).collect(),
            broadcast: (0..M).map(|i| x(world - 1, i)).collect(),
            all_gather: (0..world)
                .flat_map(|q| (0..8).map(move |i| x(q, i)))
                .collect(),
            reduce_scatter: (rank * part..(rank + 1) * part).map(sum).collect(),
            scalar: (1..=world).sum::<usize>() as f64,
            // The maximum is the last rank's.
            buckets: (0..M).map(|i| x(world - 1, i)).collect(),
            grouped: (0..M).map(sum).collect(),
        }
    }
}

/// Rank `rank` of `world`: nccl-safe-candle's tensor collectives on tensors of candle's
/// own device, whose stream is the per-thread stream (0x2): each input written by a kernel
/// on it just before, each result read back on it, every tensor freed on it, with the
/// temporaries freed right after the collective that read them. Alone (each collective),
/// bucket by bucket (several all-reduces of views of one flat tensor, back to back, as
/// DDP's buckets), and in one nccl-safe `Group` of all-reduces over the buckets of a
/// tensor's storage on candle's stream.
fn on_candles_stream(
    rank: usize,
    world: usize,
    id: &UniqueId,
) -> Result<OnCandlesStream, BoxError> {
    use candle_core::op::BackpropOp;
    use candle_core::{CudaStorage, Storage};
    use nccl_safe::Group;
    use nccl_safe_candle::{
        all_gather, all_reduce, all_reduce_scalar, broadcast, reduce_scatter, ReduceOp,
    };

    let (device, comm) = device_and_comm(rank, world, id, true)?;
    let Device::Cuda(dev) = &device else {
        unreachable!("new_cuda makes a CUDA device")
    };
    let stream = dev.cuda_stream();
    assert_eq!(
        stream.cu_stream() as usize,
        2,
        "candle's tensors live on the per-thread stream"
    );
    let a = Tensor::from_vec((0..M).map(|i| elem(rank, i)).collect(), M, &device)?;
    let two = Tensor::from_vec(vec![2f32; M], M, &device)?;
    // Rank `rank`'s doubled elements, written by a kernel (bmul_f32) on candle's stream.
    let doubled = || a.mul(&two);

    let x = doubled()?;
    all_reduce(&comm, &x, ReduceOp::Sum)?;
    let y = doubled()?;
    broadcast(&comm, &y, world - 1)?;
    // The inputs: temporaries, freed as soon as the collective returned.
    let gathered = all_gather(&comm, &doubled()?.narrow(0, 0, 8)?)?;
    let scattered = reduce_scatter(&comm, &doubled()?, ReduceOp::Sum)?;
    let scalar = all_reduce_scalar(
        &comm,
        &Tensor::from_vec(vec![(rank + 1) as f64], 1, &device)?,
        ReduceOp::Sum,
    )?;
    let flat = doubled()?;
    for r in BUCKETS {
        all_reduce(&comm, &flat.narrow(0, r.start, r.len())?, ReduceOp::Max)?;
    }

    // One group over the buckets of a kernel's output, into buffers made on candle's
    // stream and then handed to candle as tensors.
    let src = doubled()?;
    let mut outs = BUCKETS
        .iter()
        .map(|r| stream.alloc_zeros::<f32>(r.len()))
        .collect::<Result<Vec<_>, _>>()?;
    {
        let (storage, layout) = src.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            unreachable!("a tensor of a CUDA device")
        };
        assert_eq!(layout.start_offset(), 0);
        let send = cs.as_cuda_slice::<f32>()?;
        let views: Vec<_> = BUCKETS.iter().map(|r| send.slice(r.clone())).collect();
        Group::run(|g| {
            for (v, out) in views.iter().zip(outs.iter_mut()) {
                g.push(comm.all_reduce_op(v, out, ReduceOp::Sum, &stream)?)?;
            }
            Ok(())
        })?;
    }
    drop(src);
    let grouped = outs
        .into_iter()
        .zip(BUCKETS)
        .map(|(o, r)| {
            let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(o, dev.clone()));
            Tensor::from_storage(storage, r.len(), BackpropOp::none(), false)
        })
        .collect::<Vec<_>>();

    let out = OnCandlesStream {
        all_reduce: x.to_vec1()?,
        broadcast: y.to_vec1()?,
        all_gather: gathered.to_vec1()?,
        reduce_scatter: scattered.to_vec1()?,
        scalar,
        buckets: flat.to_vec1()?,
        grouped: Tensor::cat(&grouped, 0)?.to_vec1()?,
    };
    // Every tensor is freed on candle's stream before the communicator goes.
    drop((a, two, x, y, gathered, scattered, flat, grouped));
    stream.synchronize()?;
    Ok(out)
}

/// NCCL launches the work of a non-blocking communicator of two or more ranks from its
/// group's thread, where 0x2 is that thread's own stream (see [`wrap`]): candle's tensors,
/// on the caller's per-thread stream, must still be ordered with every collective that
/// touches them, alone or in a group.
#[test]
#[ignore = "needs nccl-safe's fake CUDA driver: scripts/candle-ddp-cuda-check.sh"]
fn tensor_collectives_on_candles_per_thread_stream_with_2_and_3_ranks() {
    for world in [2, 3] {
        let before = start();
        let launches = wrap::async_launches();
        let results = ranks_of(world, |r, id, _| on_candles_stream(r, world, id));
        // Every rank's 9 launches (4 collectives alone, the scalar's, 3 buckets, a group of
        // 3), each from a thread of NCCL's.
        assert_eq!(
            wrap::async_launches() - launches,
            9 * world as u64,
            "{world} ranks: launches from NCCL's thread"
        );
        for (r, got) in results.iter().enumerate() {
            assert_eq!(
                got,
                &OnCandlesStream::want(r, world),
                "{world} ranks, rank {r}"
            );
        }
        let f = fake();
        let races = f.gauge(Gauge::Races) - before[3];
        assert_eq!(
            races,
            0,
            "{world} ranks: unordered accesses; the latest: {}",
            f.last_race()
        );
        check(before, 30 * world as i64);
    }
}
