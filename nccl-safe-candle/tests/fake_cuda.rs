//! DDP's CUDA path run on a CPU: candle's `CudaStorage`, the communication stream and the
//! events that order it against candle's stream, over nccl-safe's fake CUDA driver, with
//! the host provider presented as NVIDIA's NCCL.
//!
//! The fake runs each operation inside its call, in host order, so values alone cannot
//! show a missing event. Its stream-order model can: every pair of accesses to the same
//! memory (one a write) that CUDA's events and host synchronizations leave unordered is a
//! race, which a GPU may run the other way round. NCCL's accesses reach the model through
//! the wrappers below. Checked, with cudarc's event tracking on (candle's default) and off
//! (then only the crate's own events order the two streams):
//! - the gradients are the average over the ranks, bit for bit, through several buckets,
//!   a parameter larger than a bucket and a missing gradient (zero-filled);
//! - the parameters are rank 0's after construction;
//! - no race, no stream, event or allocation left behind, no kernel the fake lacks;
//! - a step that fails (a peer left) after handing a bucket to NCCL on the communication
//!   stream still makes candle's stream wait for it before the bucket's buffer is freed;
//! - the tensor collectives reach the right elements of a view that starts inside candle's
//!   storage (in place, and as the input of all_gather and reduce_scatter).
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
/// write on their stream first (the driver does not see NCCL's kernels).
mod wrap {
    use super::*;
    use nccl_sys::bindings as b;
    use nccl_sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};

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

    /// Reads `send_len` bytes at `s` and writes `recv_len` at `r` on stream `st`.
    fn accessed(
        st: cudaStream_t,
        (s, send_len): (*const c_void, usize),
        (r, recv_len): (*mut c_void, usize),
    ) {
        // SAFETY: `st` is the stream the caller gave NCCL, one of the fake driver's; the
        // addresses are only compared.
        let rc =
            unsafe { (fake().access)(st as *mut c_void, s as u64, send_len, r as u64, recv_len) };
        assert_eq!(
            rc, 0,
            "NCCL was given a stream the fake driver does not know"
        );
    }

    fn nranks(c: ncclComm_t) -> usize {
        let mut n: c_int = 0;
        // SAFETY: `c` is the live communicator of the call in progress; writes one int.
        unsafe { (host().ncclCommCount)(c, &mut n) };
        n.max(1) as usize
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
        accessed(st, (s, bytes(n, t)), (r, bytes(n, t)));
        // SAFETY: forwarded unchanged to the host provider's entry point.
        unsafe { (host().ncclAllReduce)(s, r, n, t, op, c, st) }
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
        accessed(st, (s, bytes(n, t)), (r, bytes(n, t)));
        // SAFETY: as above.
        unsafe { (host().ncclBroadcast)(s, r, n, t, root, c, st) }
    }

    pub unsafe extern "C" fn all_gather(
        s: *const c_void,
        r: *mut c_void,
        n: usize,
        t: ncclDataType_t,
        c: ncclComm_t,
        st: cudaStream_t,
    ) -> ncclResult_t {
        accessed(st, (s, bytes(n, t)), (r, bytes(n * nranks(c), t)));
        // SAFETY: as above.
        unsafe { (host().ncclAllGather)(s, r, n, t, c, st) }
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
        accessed(st, (s, bytes(n * nranks(c), t)), (r, bytes(n, t)));
        // SAFETY: as above.
        unsafe { (host().ncclReduceScatter)(s, r, n, t, op, c, st) }
    }
}

fn lookup(name: &CStr) -> *const c_void {
    match name.to_bytes() {
        b"ncclAllReduce" => wrap::all_reduce as *const c_void,
        b"ncclBroadcast" => wrap::broadcast as *const c_void,
        b"ncclAllGather" => wrap::all_gather as *const c_void,
        b"ncclReduceScatter" => wrap::reduce_scatter as *const c_void,
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

/// Rank `rank`'s candle device (cudarc's event tracking on or off), its communicator and
/// its parameters (rank-dependent values).
fn set_up(
    rank: usize,
    id: &UniqueId,
    tracking: bool,
) -> Result<(Device, Communicator, VarMap), BoxError> {
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
        WORLD,
        rank,
        id,
        &Config::default(),
    )?;
    let device = Device::Cuda(dev);
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
    let id = UniqueId::new_with(&nccl()).unwrap();
    let ready = Barrier::new(WORLD);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..WORLD)
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
