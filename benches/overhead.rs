//! What the safe layer costs per collective call, against a raw call through the same
//! function table.
//!
//! `cargo bench --bench overhead [-- --backend host|nccl|fake-cuda] [--no-host]` (`-h` for
//! help).
//!
//! - `--backend host` (the default): on a "null provider" whose entry points return at
//!   once, so only the crate's own work is timed; target 20 ns and 0 allocations a call.
//!   Also prints the facts of this machine that the per-operation cost depends on (the
//!   watchdog fence in use, the cost of a full fence and of a clock read, the CPU), and
//!   (unless `--no-host`) the host provider's all_reduce bus bandwidth at 64 MiB next to a
//!   plain memcpy of the same size.
//! - `--backend nccl`: NVIDIA's NCCL on CUDA device 0, world size 1, one stream, a
//!   1-element `all_reduce_in_place`: the raw `ncclAllReduce` enqueue against the safe
//!   call, with cudarc's event tracking on and off, single operations and per operation in
//!   a `Group`; target 50 ns over raw with tracking off. Without a GPU it says so and exits 0.
//! - `--backend fake-cuda`: the same, on the tests' fake CUDA driver (`tests/support/fakes`) and the
//!   null provider presented as NCCL, on any machine: what the crate's (and cudarc's) CPU
//!   work on the CUDA code path costs, with every driver call returning at once.

mod common;
#[path = "../tests/support/fakes/mod.rs"]
mod fakes;

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::hint::black_box;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use nccl_safe::{
    CommDevice, Communicator, Config, Group, Library, Provider, ReduceOp, Stream, UniqueId,
};
use nccl_sys::bindings::{ncclFloat32, ncclSuccess, ncclSum};
use nccl_sys::{
    cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
    ncclScalarResidence_t, ncclUniqueId,
};

use common::options::{Average, Backend, Options};
use common::report::Collective;

// ---- counting allocator ------------------------------------------------------------

/// Counts every allocation (alloc, alloc_zeroed, realloc) of the process.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
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

// ---- the null provider ---------------------------------------------------------------

/// The one communicator the null provider hands out: an address nobody dereferences.
static FAKE_COMM: u8 = 0;

fn fake_comm() -> ncclComm_t {
    std::ptr::addr_of!(FAKE_COMM) as ncclComm_t
}

/// Writes `v` through `p` when it is not null.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
unsafe fn put<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: by the caller's contract.
        unsafe { p.write(v) };
    }
}

mod null {
    //! NCCL's required entry points, each returning `ncclSuccess` at once.
    #![allow(non_snake_case, clippy::missing_safety_doc)]
    use super::*;

    pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> ncclResult_t {
        // SAFETY: NCCL's contract: `v` is a writable int.
        unsafe { put(v, 22800) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclGetUniqueId(_: *mut ncclUniqueId) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommInitRankConfig(
        comm: *mut ncclComm_t,
        _: c_int,
        _: ncclUniqueId,
        _: c_int,
        _: *mut ncclConfig_t,
    ) -> ncclResult_t {
        // SAFETY: NCCL's contract: `comm` is writable.
        unsafe { put(comm, fake_comm()) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommInitRank(
        comm: *mut ncclComm_t,
        _: c_int,
        _: ncclUniqueId,
        _: c_int,
    ) -> ncclResult_t {
        // SAFETY: as above.
        unsafe { put(comm, fake_comm()) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommInitAll(
        comm: *mut ncclComm_t,
        n: c_int,
        _: *const c_int,
    ) -> ncclResult_t {
        for i in 0..n.max(0) as usize {
            // SAFETY: NCCL's contract: `comm` has room for `n` handles.
            unsafe { put(comm.add(i), fake_comm()) };
        }
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommFinalize(_: ncclComm_t) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommDestroy(_: ncclComm_t) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommAbort(_: ncclComm_t) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommSplit(
        _: ncclComm_t,
        _: c_int,
        _: c_int,
        new: *mut ncclComm_t,
        _: *mut ncclConfig_t,
    ) -> ncclResult_t {
        // SAFETY: NCCL's contract: `new` is writable.
        unsafe { put(new, fake_comm()) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclGetErrorString(_: ncclResult_t) -> *const c_char {
        c"null provider".as_ptr()
    }
    pub unsafe extern "C" fn ncclGetLastError(_: ncclComm_t) -> *const c_char {
        c"".as_ptr()
    }
    pub unsafe extern "C" fn ncclCommGetAsyncError(
        _: ncclComm_t,
        e: *mut ncclResult_t,
    ) -> ncclResult_t {
        // SAFETY: NCCL's contract: `e` is writable.
        unsafe { put(e, ncclSuccess) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommCount(_: ncclComm_t, n: *mut c_int) -> ncclResult_t {
        // SAFETY: NCCL's contract: `n` is writable.
        unsafe { put(n, 1) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommCuDevice(_: ncclComm_t, d: *mut c_int) -> ncclResult_t {
        // SAFETY: NCCL's contract: `d` is writable.
        unsafe { put(d, 0) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclCommUserRank(_: ncclComm_t, r: *mut c_int) -> ncclResult_t {
        // SAFETY: NCCL's contract: `r` is writable.
        unsafe { put(r, 0) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
        op: *mut ncclRedOp_t,
        _: *mut c_void,
        _: ncclDataType_t,
        _: ncclScalarResidence_t,
        _: ncclComm_t,
    ) -> ncclResult_t {
        // SAFETY: NCCL's contract: `op` is writable.
        unsafe { put(op, 5) };
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclRedOpDestroy(_: ncclRedOp_t, _: ncclComm_t) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclReduce(
        _: *const c_void,
        _: *mut c_void,
        _: usize,
        _: ncclDataType_t,
        _: ncclRedOp_t,
        _: c_int,
        _: ncclComm_t,
        _: cudaStream_t,
    ) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclBcast(
        _: *mut c_void,
        _: usize,
        _: ncclDataType_t,
        _: c_int,
        _: ncclComm_t,
        _: cudaStream_t,
    ) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclBroadcast(
        _: *const c_void,
        _: *mut c_void,
        _: usize,
        _: ncclDataType_t,
        _: c_int,
        _: ncclComm_t,
        _: cudaStream_t,
    ) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclAllReduce(
        _: *const c_void,
        _: *mut c_void,
        _: usize,
        _: ncclDataType_t,
        _: ncclRedOp_t,
        _: ncclComm_t,
        _: cudaStream_t,
    ) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclReduceScatter(
        _: *const c_void,
        _: *mut c_void,
        _: usize,
        _: ncclDataType_t,
        _: ncclRedOp_t,
        _: ncclComm_t,
        _: cudaStream_t,
    ) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclAllGather(
        _: *const c_void,
        _: *mut c_void,
        _: usize,
        _: ncclDataType_t,
        _: ncclComm_t,
        _: cudaStream_t,
    ) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclSend(
        _: *const c_void,
        _: usize,
        _: ncclDataType_t,
        _: c_int,
        _: ncclComm_t,
        _: cudaStream_t,
    ) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclRecv(
        _: *mut c_void,
        _: usize,
        _: ncclDataType_t,
        _: c_int,
        _: ncclComm_t,
        _: cudaStream_t,
    ) -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclGroupStart() -> ncclResult_t {
        ncclSuccess
    }
    pub unsafe extern "C" fn ncclGroupEnd() -> ncclResult_t {
        ncclSuccess
    }
}

/// The null provider's symbol lookup: required entry points only (optional ones absent).
fn null_lookup(name: &CStr) -> *const c_void {
    macro_rules! table {
        ($($f:ident),* $(,)?) => {
            match name.to_bytes() {
                $( n if n == stringify!($f).as_bytes() => null::$f as *const c_void, )*
                _ => std::ptr::null(),
            }
        };
    }
    table!(
        ncclGetVersion,
        ncclGetUniqueId,
        ncclCommInitRankConfig,
        ncclCommInitRank,
        ncclCommInitAll,
        ncclCommFinalize,
        ncclCommDestroy,
        ncclCommAbort,
        ncclCommSplit,
        ncclGetErrorString,
        ncclGetLastError,
        ncclCommGetAsyncError,
        ncclCommCount,
        ncclCommCuDevice,
        ncclCommUserRank,
        ncclRedOpCreatePreMulSum,
        ncclRedOpDestroy,
        ncclReduce,
        ncclBcast,
        ncclBroadcast,
        ncclAllReduce,
        ncclReduceScatter,
        ncclAllGather,
        ncclSend,
        ncclRecv,
        ncclGroupStart,
        ncclGroupEnd,
    )
}

// ---- measuring -------------------------------------------------------------------------

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Best-of-`reps` nanoseconds per call of `f` and allocations per call.
fn measure(iters: u64, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    for _ in 0..iters / 10 {
        f()?;
    }
    let mut best = f64::MAX;
    let mut allocs = 0.0;
    for _ in 0..reps {
        let a0 = ALLOCATIONS.load(Ordering::Relaxed);
        let t0 = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        let ns = t0.elapsed().as_nanos() as f64 / iters as f64;
        let a = (ALLOCATIONS.load(Ordering::Relaxed) - a0) as f64 / iters as f64;
        if ns < best {
            best = ns;
            allocs = a;
        }
    }
    Ok((best, allocs))
}

/// [`measure`] of the safe all_reduce on `comm`.
fn time_all_reduce(
    comm: &Communicator,
    send: &[f32],
    recv: &mut [f32],
    iters: u64,
    reps: usize,
) -> Result<(f64, f64)> {
    measure(iters, reps, || {
        Ok(comm.all_reduce(
            black_box(send),
            black_box(&mut *recv),
            ReduceOp::Sum,
            &Stream::Host,
        )?)
    })
}

fn raw_check(r: ncclResult_t) -> Result<()> {
    if r == ncclSuccess {
        Ok(())
    } else {
        Err(format!("null provider returned {r}").into())
    }
}

fn run(no_host: bool) -> Result<()> {
    const N: usize = 1024;
    const ITERS: u64 = 2_000_000;
    const REPS: usize = 5;
    // SAFETY: `null_lookup` returns only the `extern "C"` functions of `null`, each with
    // exactly NCCL's signature for its name, living for the whole process.
    let lib = unsafe { Library::from_lookup(Provider::Host, None, null_lookup) }?;
    let id = UniqueId::new_with(&lib)?;
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &Config::new())?;
    let t = *lib.table();
    let raw_comm = comm.as_raw();
    let stream: cudaStream_t = std::ptr::null_mut();
    let send = vec![1.0f32; N];
    let mut recv = vec![0.0f32; N];
    let sends: Vec<Vec<f32>> = (0..8).map(|_| vec![1.0f32; N]).collect();
    let mut recvs: Vec<Vec<f32>> = (0..8).map(|_| vec![0.0f32; N]).collect();

    println!("# nccl-safe overhead: safe layer vs raw table call, null provider (every entry point returns ncclSuccess at once)");
    println!("# {N} f32 elements, 1 rank, best of {REPS} x {ITERS} calls; allocations counted by a #[global_allocator]");
    println!(
        "# {:<18} {:>10} {:>10} {:>10} {:>7} {:>13} {:>13}",
        "operation", "safe ns", "raw ns", "diff ns", "ratio", "safe allocs", "raw allocs"
    );
    let worst = std::cell::Cell::new((0.0f64, 0.0f64));
    let report = |name: &str, safe: (f64, f64), raw: (f64, f64)| {
        if name != "group of 8 (all)" && !name.contains("precise") {
            let (d, a) = worst.get();
            worst.set((d.max(safe.0 - raw.0), a.max(safe.1)));
        }
        println!(
            "  {:<18} {:>10.2} {:>10.2} {:>10.2} {:>7.2} {:>13.3} {:>13.3}",
            name,
            safe.0,
            raw.0,
            safe.0 - raw.0,
            safe.0 / raw.0,
            safe.1,
            raw.1
        );
    };

    let safe = time_all_reduce(&comm, &send, &mut recv, ITERS, REPS)?;
    let raw = measure(ITERS, REPS, || {
        // SAFETY: both buffers hold N f32; the null provider reads nothing.
        raw_check(unsafe {
            (t.ncclAllReduce)(
                black_box(send.as_ptr()).cast(),
                black_box(recv.as_mut_ptr()).cast(),
                N,
                ncclFloat32,
                ncclSum,
                raw_comm,
                stream,
            )
        })
    })?;
    report("all_reduce", safe, raw);
    let raw_all_reduce = raw;

    let safe = measure(ITERS, REPS, || {
        Ok(comm.all_gather(black_box(&send), black_box(&mut recv), &Stream::Host)?)
    })?;
    let raw = measure(ITERS, REPS, || {
        // SAFETY: as above (1 rank: recv = send length).
        raw_check(unsafe {
            (t.ncclAllGather)(
                black_box(send.as_ptr()).cast(),
                black_box(recv.as_mut_ptr()).cast(),
                N,
                ncclFloat32,
                raw_comm,
                stream,
            )
        })
    })?;
    report("all_gather", safe, raw);

    let safe = measure(ITERS, REPS, || {
        Ok(comm.broadcast(black_box(&send), black_box(&mut recv), 0, &Stream::Host)?)
    })?;
    let raw = measure(ITERS, REPS, || {
        // SAFETY: as above.
        raw_check(unsafe {
            (t.ncclBroadcast)(
                black_box(send.as_ptr()).cast(),
                black_box(recv.as_mut_ptr()).cast(),
                N,
                ncclFloat32,
                0,
                raw_comm,
                stream,
            )
        })
    })?;
    report("broadcast", safe, raw);

    let group_iters = ITERS / 8;
    let safe = measure(group_iters, REPS, || {
        let mut g = Group::new();
        for (s, r) in sends.iter().zip(recvs.iter_mut()) {
            g.push(comm.all_reduce_op(
                black_box(s),
                black_box(r),
                ReduceOp::Sum,
                &Stream::Host,
            )?)?;
        }
        Ok(g.end()?)
    })?;
    let raw = measure(group_iters, REPS, || {
        // SAFETY: every buffer holds N f32; start and end are paired.
        unsafe {
            raw_check((t.ncclGroupStart)())?;
            for (s, r) in sends.iter().zip(recvs.iter_mut()) {
                raw_check((t.ncclAllReduce)(
                    black_box(s.as_ptr()).cast(),
                    black_box(r.as_mut_ptr()).cast(),
                    N,
                    ncclFloat32,
                    ncclSum,
                    raw_comm,
                    stream,
                ))?;
            }
            raw_check((t.ncclGroupEnd)())
        }
    })?;
    report("group of 8 (all)", safe, raw);
    report(
        "group of 8 (per op)",
        (safe.0 / 8.0, safe.1 / 8.0),
        (raw.0 / 8.0, raw.1 / 8.0),
    );
    comm.destroy().map_err(|(_, e)| e)?;

    // The same all_reduce with the precise clock (`Config::timing`): two Instant::now() an
    // operation instead of coarse-clock loads.
    let id = UniqueId::new_with(&lib)?;
    let precise = Communicator::init_rank_in(
        &lib,
        &CommDevice::Host,
        1,
        0,
        &id,
        &Config::new().timing(true),
    )?;
    let safe = time_all_reduce(&precise, &send, &mut recv, ITERS, REPS)?;
    report("all_reduce precise", safe, raw_all_reduce);
    precise.destroy().map_err(|(_, e)| e)?;

    let (diff, allocs) = worst.get();
    let machine = Machine::probe();
    machine.print();
    let met = diff < 20.0 && allocs == 0.0;
    println!(
        "# target: diff < 20 ns and 0 allocations per call (single operations and per operation in a group, default config): worst diff {diff:.2} ns, worst allocs {allocs:e} -> {}",
        if met { "met" } else { "NOT met" }
    );
    if !met {
        for line in machine.explain(diff) {
            println!("#   {line}");
        }
    }

    if no_host {
        return Ok(());
    }
    host_bandwidth()
}

// ---- the machine -----------------------------------------------------------------------

/// What the per-operation cost depends on, beyond the crate's code.
struct Machine {
    /// `model name` of the first CPU in /proc/cpuinfo.
    cpu: String,
    /// CPUs this process may run on.
    cpus: usize,
    /// The kernel's clock source (`tsc` is a vDSO read; others may be system calls).
    clocksource: String,
    /// Whether the watchdog handshake uses membarrier (a compiler fence on each operation)
    /// or a full fence on each operation.
    asymmetric: bool,
    /// Nanoseconds of one `fence(SeqCst)` here.
    fence_ns: f64,
    /// Nanoseconds of one `Instant::now()` here.
    clock_ns: f64,
    /// The 1-minute load average: other work on the same cores inflates every figure.
    load: f64,
}

impl Machine {
    fn probe() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let clocksource = std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
        const N: u32 = 1_000_000;
        let best = |f: &dyn Fn()| {
            (0..5)
                .map(|_| {
                    let t0 = Instant::now();
                    for _ in 0..N {
                        f();
                    }
                    t0.elapsed().as_nanos() as f64 / N as f64
                })
                .fold(f64::MAX, f64::min)
        };
        let fence_ns = best(&|| std::sync::atomic::fence(Ordering::SeqCst));
        let load = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|t| t.split_whitespace().next().and_then(|v| v.parse().ok()))
            .unwrap_or(0.0);
        let clock_ns = best(&|| {
            black_box(Instant::now());
        });
        Machine {
            cpu,
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            clocksource,
            asymmetric: nccl_safe::diag::asymmetric_fence(),
            fence_ns,
            clock_ns,
            load,
        }
    }

    fn print(&self) {
        println!(
            "# machine: {} ({} CPUs), clock source {}, load average {:.2}",
            self.cpu, self.cpus, self.clocksource, self.load
        );
        println!(
            "# watchdog fence on each operation: {}",
            if self.asymmetric {
                "compiler fence (the watchdog's membarrier(2) orders it)"
            } else {
                "full fence(SeqCst): membarrier(2) refused here (e.g. a container's seccomp filter) or NCCL_SAFE_NO_MEMBARRIER set"
            }
        );
        println!(
            "# costs here: fence(SeqCst) {:.1} ns, Instant::now() {:.1} ns (the default per-operation path reads no clock)",
            self.fence_ns, self.clock_ns
        );
    }

    /// Lines that say what in this machine may explain a missed target of `diff` ns.
    fn explain(&self, diff: f64) -> Vec<String> {
        let mut out = Vec::new();
        if !self.asymmetric {
            out.push(format!(
                "the full fence on every operation costs {:.1} ns here; without it the worst diff would be about {:.1} ns",
                self.fence_ns,
                (diff - self.fence_ns).max(0.0)
            ));
        }
        if self.clocksource != "tsc" {
            out.push(format!(
                "clock source `{}` is not the TSC: clock reads ({:.1} ns here) are slow, which matters with Config::timing",
                self.clocksource, self.clock_ns
            ));
        }
        if self.load > self.cpus as f64 / 2.0 {
            out.push(format!(
                "the machine is busy (load {:.2} on {} CPUs): other work shares the cores and their caches",
                self.load, self.cpus
            ));
        }
        if out.is_empty() {
            out.push(format!(
                "membarrier is in use, the clock is the TSC and the machine is idle: the difference is the CPU itself ({}): its cache and branch costs on the path",
                self.cpu
            ));
        }
        out
    }
}

// ---- the CUDA path ---------------------------------------------------------------------

/// Best-of-`reps` nanoseconds per call of `f`, timed in batches of `batch` calls with
/// `sync` (untimed) after each batch, so the stream's queue never fills.
fn measure_batched(
    iters: u64,
    batch: u64,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
    sync: &dyn Fn() -> Result<()>,
) -> Result<f64> {
    for _ in 0..batch {
        f()?;
    }
    sync()?;
    let mut best = f64::MAX;
    for _ in 0..reps {
        let mut total = std::time::Duration::ZERO;
        for _ in 0..iters / batch {
            let t0 = Instant::now();
            for _ in 0..batch {
                f()?;
            }
            total += t0.elapsed();
            sync()?;
        }
        best = best.min(total.as_nanos() as f64 / (iters / batch * batch) as f64);
    }
    Ok(best)
}

/// What the CUDA mode runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cuda {
    /// NVIDIA's NCCL and CUDA driver, on GPU 0.
    Real,
    /// The fake CUDA driver of the tests (every driver call returns at once, counted) and
    /// the null provider presented as NCCL: the crate's own CPU work on the CUDA code path
    /// (and cudarc's, with its event tracking on), on any machine.
    Fake,
}

/// `--backend nccl` / `--backend fake-cuda`: raw `ncclAllReduce` enqueue against the safe
/// `all_reduce_in_place`.
fn cuda_overhead(source: Cuda) -> Result<()> {
    const ITERS: u64 = 100_000;
    const BATCH: u64 = 1_000;
    const REPS: usize = 5;
    const GROUP: usize = 8;
    println!("# nccl-safe overhead, CUDA path: safe all_reduce_in_place vs raw ncclAllReduce through the function table");
    if source == Cuda::Fake {
        fakes::driver();
        println!("# on the fake CUDA driver (tests/support/fakes/cuda.c) and the null provider as NCCL: no GPU; only the CPU work of the crate and of cudarc on the CUDA code path is timed");
    }
    let count = match common::sweep::quiet_cuda(CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => n,
        Ok(Ok(_)) => return no_gpu("no CUDA device found"),
        Ok(Err(e)) => return no_gpu(&format!("CUDA driver error: {e}")),
        Err(e) => return no_gpu(&e.to_string()),
    };
    let lib = match source {
        // SAFETY: as in `run`: `null_lookup` returns the null provider's functions.
        Cuda::Fake => unsafe { Library::from_lookup(Provider::Nccl, None, null_lookup) }?,
        Cuda::Real => match Library::load() {
            Ok(lib) if lib.provider() != Provider::Host => lib,
            Ok(_) => return no_gpu("the NCCL found is the host provider"),
            Err(e) => return no_gpu(&format!("NVIDIA's NCCL was not found: {e}")),
        },
    };
    let ctx = CudaContext::new(0)?;
    // cudarc's default; the buffers made before the switch below stay tracked.
    common::sweep::set_event_tracking(&ctx, true);
    let stream = ctx.new_stream()?;
    let id = UniqueId::new_with(&lib)?;
    let comm = Communicator::init_rank_in(
        &lib,
        &CommDevice::Cuda(ctx.clone()),
        1,
        0,
        &id,
        &Config::new(),
    )?;
    println!(
        "# NCCL {} ({}), {} ({} device(s) seen, device 0 used), world size 1, one stream, 1 f32 in place",
        lib.version(),
        lib.path()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "in process".into()),
        ctx.name().unwrap_or_else(|_| "CUDA device 0".into()),
        count
    );
    println!(
        "# best of {REPS} x {ITERS} calls, timed in batches of {BATCH} with an untimed stream synchronize after each"
    );
    println!(
        "# watchdog fence on each operation: {}",
        if nccl_safe::diag::asymmetric_fence() {
            "compiler fence (membarrier)"
        } else {
            "full fence(SeqCst) (membarrier refused)"
        }
    );
    let alloc = |stream: &Arc<CudaStream>| -> Result<Vec<CudaSlice<f32>>> {
        (0..GROUP)
            .map(|_| Ok(stream.clone_htod(&[1.0f32])?))
            .collect()
    };
    let mut tracked = alloc(&stream)?;
    common::sweep::set_event_tracking(&ctx, false);
    let mut untracked = alloc(&stream)?;
    stream.synchronize()?;

    println!(
        "# {:<22} {:>9} {:>10} {:>10} {:>10} {:>7}",
        "operation", "tracking", "safe ns", "raw ns", "diff ns", "ratio"
    );
    let t = *lib.table();
    let raw_comm = comm.as_raw();
    let raw_stream: cudaStream_t = stream.cu_stream().cast();
    let sync = || -> Result<()> { Ok(stream.synchronize()?) };
    let mut worst_off = 0.0f64;
    for (tracking, bufs) in [("on", &mut tracked), ("off", &mut untracked)] {
        // The raw call takes each buffer's address once, outside the loop, as a C caller
        // would: no cudarc event work per call.
        let ptrs: Vec<*mut c_void> = bufs
            .iter_mut()
            .map(|b| {
                let (p, _record) = b.device_ptr_mut(&stream);
                p as usize as *mut c_void
            })
            .collect();
        let raw_one = |p: *mut c_void| -> Result<()> {
            // SAFETY: `p` is a live 1-element f32 device buffer of this communicator's
            // device, used in place (send == recv) on this communicator's stream.
            raw_check(unsafe {
                (t.ncclAllReduce)(
                    black_box(p),
                    black_box(p),
                    1,
                    ncclFloat32,
                    ncclSum,
                    raw_comm,
                    raw_stream,
                )
            })
        };
        let raw = measure_batched(ITERS, BATCH, REPS, || raw_one(ptrs[0]), &sync)?;
        let safe = {
            let b = &mut bufs[0];
            measure_batched(
                ITERS,
                BATCH,
                REPS,
                || Ok(comm.all_reduce_in_place(black_box(&mut *b), ReduceOp::Sum, &stream)?),
                &sync,
            )?
        };
        let row = |name: &str, safe: f64, raw: f64| {
            println!(
                "  {:<22} {:>9} {:>10.1} {:>10.1} {:>10.1} {:>7.2}",
                name,
                tracking,
                safe,
                raw,
                safe - raw,
                safe / raw
            );
        };
        row("all_reduce_in_place", safe, raw);
        let raw_group = measure_batched(
            ITERS / GROUP as u64,
            BATCH / GROUP as u64,
            REPS,
            || {
                // SAFETY: start and end are paired; every call as in `raw_one`.
                unsafe { raw_check((t.ncclGroupStart)())? };
                for &p in &ptrs {
                    raw_one(p)?;
                }
                // SAFETY: closes the group opened above.
                raw_check(unsafe { (t.ncclGroupEnd)() })
            },
            &sync,
        )?;
        let safe_group = measure_batched(
            ITERS / GROUP as u64,
            BATCH / GROUP as u64,
            REPS,
            || {
                let mut g = Group::new();
                for b in bufs.iter_mut() {
                    g.push(comm.all_reduce_in_place_op(black_box(b), ReduceOp::Sum, &stream)?)?;
                }
                Ok(g.end()?)
            },
            &sync,
        )?;
        let per = GROUP as f64;
        row(
            &format!("group of {GROUP} (per op)"),
            safe_group / per,
            raw_group / per,
        );
        if tracking == "off" {
            worst_off = worst_off
                .max(safe - raw)
                .max((safe_group - raw_group) / per);
        }
    }
    drop(tracked);
    drop(untracked);
    stream.synchronize()?;
    comm.destroy().map_err(|(_, e)| e)?;
    println!(
        "# target: safe - raw <= 50 ns per call with cudarc event tracking off (single operations and per operation in a group): worst {worst_off:.1} ns -> {}{}",
        if worst_off <= 50.0 { "met" } else { "NOT met" },
        match source {
            Cuda::Real => "",
            Cuda::Fake => " on this CPU, for the crate's CPU work alone (on a GPU the driver calls are the same for both: tests/cuda_path.rs counts them)",
        }
    );
    Ok(())
}

/// The CUDA mode's answer on a machine without a GPU (exit status 0).
fn no_gpu(why: &str) -> Result<()> {
    println!("# no GPU run: {why}");
    println!("# target: safe - raw <= 50 ns per call on the CUDA path -> not measured (no GPU)");
    Ok(())
}

/// The host provider's all_reduce bus bandwidth at 64 MiB (through the bandwidth bench's
/// sweep) next to a plain memcpy of 64 MiB.
fn host_bandwidth() -> Result<()> {
    const BYTES: usize = 64 << 20;
    let opts = Options {
        min_bytes: BYTES,
        max_bytes: BYTES,
        iters: 5,
        warmup_iters: 1,
        ranks: Some(4),
        average: Average::Max,
        backend: Backend::Host,
        collectives: vec![Collective::AllReduce],
        ..Options::default()
    };
    println!(
        "#\n# host provider all_reduce at 64 MiB, {} ranks (threads):",
        4
    );
    let mut table = Vec::new();
    let outcome = common::sweep::run(&opts, &mut table).map_err(|e| e.to_string())?;
    let row = outcome.rows.first().ok_or("no all_reduce row")?;
    let busbw = row.out_of_place.busbw.max(row.in_place.busbw);

    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let mut best = f64::MAX;
    for _ in 0..10 {
        let t0 = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    let memcpy = BYTES as f64 / 1.0e9 / best;
    println!(
        "  all_reduce busbw (best of out-of-place/in-place): {busbw:.2} GB/s  (time {:.0} us, #wrong {})",
        row.out_of_place.time_us,
        row.out_of_place.wrong.unwrap_or(0) + row.in_place.wrong.unwrap_or(0)
    );
    println!("  memcpy 64 MiB (bytes copied / time, best of 10): {memcpy:.2} GB/s");
    println!(
        "  ratio busbw / memcpy: {:.2}",
        if memcpy > 0.0 { busbw / memcpy } else { 0.0 }
    );
    Ok(())
}

const HELP: &str = "\
usage: cargo bench --bench overhead -- [--backend host|nccl|fake-cuda] [--no-host]

  --backend host   the safe layer on a null provider against raw calls (target 20 ns)  [default]
  --backend nccl   NVIDIA's NCCL on CUDA device 0: raw ncclAllReduce enqueue against the
                   safe all_reduce_in_place, cudarc event tracking on and off, single
                   operations and per operation in a Group (target 50 ns with tracking
                   off); without a GPU it says so and exits 0
  --backend fake-cuda
                   the same measurement on a fake CUDA driver (compiled from the tests'
                   C source with `cc`) and a null NCCL: the CPU cost of the CUDA code
                   path on any machine
  --no-host        host backend: skip the host provider's bandwidth against memcpy
  -h, --help       this text";

fn main() -> ExitCode {
    let mut cuda = None;
    let mut no_host = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--no-host" => no_host = true,
            "-h" | "--help" => {
                println!("{HELP}");
                return ExitCode::SUCCESS;
            }
            "--backend" | "--backend=host" | "--backend=nccl" | "--backend=fake-cuda" => {
                let v = match a.split_once('=') {
                    Some((_, v)) => Some(v.to_string()),
                    None => args.next(),
                };
                match v.as_deref() {
                    Some("host") => cuda = None,
                    Some("nccl") => cuda = Some(Cuda::Real),
                    Some("fake-cuda") => cuda = Some(Cuda::Fake),
                    _ => {
                        eprintln!("error: --backend takes host, nccl or fake-cuda\n\n{HELP}");
                        return ExitCode::from(2);
                    }
                }
            }
            _ => {
                eprintln!("error: unknown argument `{a}`\n\n{HELP}");
                return ExitCode::from(2);
            }
        }
    }
    let result = match cuda {
        Some(source) => cuda_overhead(source),
        None => run(no_host),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
