//! A fake CUDA driver (`cuda.c`, beside this file) and the host provider presented as
//! NCCL: together they run the crate's CUDA code path (cudarc contexts, streams, buffers
//! and events; the watchdog's CUDA tracker; `Provider::Nccl` communicators) on a machine
//! without a GPU, with every driver call counted and a stream that can be stalled.
//!
//! The driver is compiled with the system C compiler (`$CC`, else `cc`) at first use and
//! loaded before cudarc looks for `libcuda.so`: its file's soname is `libcuda.so`, and the
//! dynamic loader answers a later `dlopen("libcuda.so")` with an object already loaded
//! under that soname, so cudarc's own search finds it. Load it before anything touches
//! CUDA in the process ([`driver`] does, and every helper here calls it first).
#![allow(dead_code)]

use std::ffi::{c_char, c_int, CStr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaStream;
use nccl_safe::{Library, Provider};

/// The loaded fake driver and its control functions.
pub struct FakeDriver {
    _lib: libloading::os::unix::Library,
    mark_thread: unsafe extern "C" fn(c_int),
    calls_at: unsafe extern "C" fn(c_int, c_int) -> i64,
    call_name: unsafe extern "C" fn(c_int) -> *const c_char,
    stall: unsafe extern "C" fn(*mut std::ffi::c_void, c_int) -> c_int,
    sticky: unsafe extern "C" fn(c_int),
    set_capturing: unsafe extern "C" fn(*mut std::ffi::c_void, c_int) -> c_int,
    capture_of: unsafe extern "C" fn(*mut std::ffi::c_void, *mut *mut std::ffi::c_void) -> i64,
    hold_completion: unsafe extern "C" fn(c_int),
    gauge: unsafe extern "C" fn(c_int) -> i64,
    release_wait: unsafe extern "C" fn(c_int),
    check_order: unsafe extern "C" fn(c_int),
    access: unsafe extern "C" fn(*mut std::ffi::c_void, u64, usize, u64, usize) -> c_int,
    last_race: unsafe extern "C" fn() -> *const c_char,
}

/// What [`FakeDriver::gauge`] reads.
#[derive(Debug, Clone, Copy)]
pub enum Gauge {
    LiveStreams = 0,
    LiveEvents = 1,
    LiveAllocations = 2,
    LivePinned = 3,
    /// Events recorded on a capturing stream (captured events: no work on the stream).
    RecordsOnCapturing = 4,
    StalledWaits = 5,
    StalledWaitTimeouts = 6,
    BadHandles = 7,
    /// NCCL teardowns (abort, destroy, deregistration, ncclMemFree) that waited in the
    /// driver behind a stalled stream of their device.
    ReleaseWaits = 8,
    /// NCCL teardowns in the driver right now (blocked, while a stall lasts).
    ReleasesInProgress = 9,
    /// With the stream-order model on: pairs of accesses CUDA leaves unordered.
    Races = 10,
    /// With the stream-order model on: accesses checked.
    AccessesChecked = 11,
    /// With the stream-order model on: operations it could not track (no clock id left).
    UntrackedOps = 12,
    /// Kernels looked up that the fake does not run.
    UnknownKernels = 13,
    /// Queries or synchronizations of a captured event while the capture that recorded it
    /// was still open (CUDA: invalid; it may invalidate the capture).
    QueriesInCapture = 14,
}

/// The fake's C source `name` (beside this file): where it was built, else under the
/// current folder (a binary carried to another machine and run from a checkout there).
fn fake_source(name: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/support/fakes")
        .join(name);
    if built.exists() {
        built
    } else {
        PathBuf::from("tests/support/fakes").join(name)
    }
}

/// Compiles `src` into a shared object named `soname` and loads it with RTLD_GLOBAL, so
/// that the dynamic loader answers a later `dlopen(soname)` (cudarc's, NCCL's) and later
/// objects' undefined symbols with it.
fn compile_and_load(
    src: &std::path::Path,
    soname: &str,
    args: &[String],
) -> libloading::os::unix::Library {
    let mut dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fake-cuda");
    if std::fs::create_dir_all(&dir).is_err() {
        dir = std::env::temp_dir();
    }
    // Its own file per process: test binaries may build it at the same time.
    let so = dir.join(format!("{soname}-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Wextra"])
        .args(args)
        .arg(format!("-Wl,-soname,{soname}"))
        .arg("-o")
        .arg(&so)
        .arg(src)
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler `{cc}`: {e}"));
    assert!(
        out.status.success(),
        "compiling {}: {}\n{}",
        src.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: the fakes' initialisers are C's defaults.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some(&so),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    }
    .unwrap_or_else(|e| panic!("loading {}: {e}", so.display()));
    let _ = std::fs::remove_file(&so);
    lib
}

/// With the CUDA runtime's headers here (set by [`source_nccl`] before the driver is
/// loaded), the fake driver is built with the fake runtime (`cudart.c`) in the same object.
static RUNTIME_HEADERS: OnceLock<PathBuf> = OnceLock::new();

/// Compiles (once per process) and loads the fake driver.
pub fn driver() -> &'static FakeDriver {
    static DRIVER: OnceLock<FakeDriver> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let lib = match RUNTIME_HEADERS.get() {
            None => compile_and_load(&fake_source("cuda.c"), "libcuda.so", &[]),
            Some(headers) => compile_and_load(
                &fake_source("cudart.c"),
                "libcuda.so",
                &[format!("-I{}", headers.display())],
            ),
        };
        // SAFETY: each symbol is the C function of that name in cuda.c, with this signature.
        unsafe {
            FakeDriver {
                mark_thread: *lib.get(b"fake_cuda_mark_thread\0").unwrap(),
                calls_at: *lib.get(b"fake_cuda_calls_at\0").unwrap(),
                call_name: *lib.get(b"fake_cuda_call_name\0").unwrap(),
                stall: *lib.get(b"fake_cuda_stall\0").unwrap(),
                sticky: *lib.get(b"fake_cuda_sticky_error\0").unwrap(),
                set_capturing: *lib.get(b"fake_cuda_set_capturing\0").unwrap(),
                capture_of: *lib.get(b"fake_cuda_capture_of\0").unwrap(),
                hold_completion: *lib.get(b"fake_cuda_hold_completion\0").unwrap(),
                gauge: *lib.get(b"fake_cuda_gauge\0").unwrap(),
                release_wait: *lib.get(b"fake_cuda_release_wait\0").unwrap(),
                check_order: *lib.get(b"fake_cuda_check_order\0").unwrap(),
                access: *lib.get(b"fake_cuda_access\0").unwrap(),
                last_race: *lib.get(b"fake_cuda_last_race\0").unwrap(),
                _lib: lib,
            }
        }
    })
}

impl FakeDriver {
    /// Counts this thread's calls apart (the caller's thread of a measurement).
    pub fn mark_this_thread(&self, on: bool) {
        // SAFETY: sets a thread-local flag.
        unsafe { (self.mark_thread)(on as c_int) }
    }

    /// Every entry point's calls so far: on marked threads only, or on all.
    pub fn counts(&self, marked: bool) -> Counts {
        let mut v = Vec::new();
        for i in 0.. {
            // SAFETY: returns a static string or null past the last entry point.
            let name = unsafe { (self.call_name)(i) };
            if name.is_null() {
                break;
            }
            // SAFETY: a NUL-terminated static string.
            let name = unsafe { CStr::from_ptr(name) }.to_str().unwrap();
            // SAFETY: reads counter `i`, which exists (its name did).
            v.push((name, unsafe { (self.calls_at)(i, marked as c_int) } as u64));
        }
        Counts(v)
    }

    /// The counter of entry point `name` (for [`calls_of`](Self::calls_of)), if the fake
    /// driver has it.
    pub fn counter(&self, name: &str) -> Option<c_int> {
        for i in 0.. {
            // SAFETY: returns a static string or null past the last entry point.
            let n = unsafe { (self.call_name)(i) };
            if n.is_null() {
                return None;
            }
            // SAFETY: a NUL-terminated static string.
            if unsafe { CStr::from_ptr(n) }.to_bytes() == name.as_bytes() {
                return Some(i);
            }
        }
        None
    }

    /// The calls so far of the entry point of `counter` ([`counter`](Self::counter)), on
    /// marked threads only or on all: one read, cheap enough between two timed calls.
    pub fn calls_of(&self, counter: c_int, marked: bool) -> u64 {
        // SAFETY: reads a counter that exists (`counter` found its name).
        unsafe { (self.calls_at)(counter, marked as c_int) as u64 }
    }

    /// Makes every later call that touches the device's work fail with `code` (a sticky
    /// error, as a device fault leaves a context); 0 clears it.
    pub fn sticky_error(&self, code: i32) {
        // SAFETY: one int argument.
        unsafe { (self.sticky)(code) }
    }

    /// Stalls a stream (its events stay incomplete, synchronizing it blocks) or releases it.
    pub fn stall(&self, stream: &CudaStream, on: bool) {
        // SAFETY: the handle is a live stream of the fake driver.
        let r = unsafe { (self.stall)(stream.cu_stream() as *mut _, on as c_int) };
        assert_eq!(r, 0, "not a stream of the fake driver");
    }

    /// Makes a stream report a capture in progress, or none.
    pub fn set_capturing(&self, stream: &CudaStream, on: bool) {
        // SAFETY: as in `stall`.
        let r = unsafe { (self.set_capturing)(stream.cu_stream() as *mut _, on as c_int) };
        assert_eq!(r, 0, "not a stream of the fake driver");
    }

    /// The capture the raw stream handle `stream` is in, asked without a counted driver
    /// call: the stream as the driver resolves the handle (0x2: the calling thread's own),
    /// and the number of the capture in progress on it (`None` when none is, or when
    /// `stream` is no stream of the fake).
    pub fn capture_of(&self, stream: usize) -> (usize, Option<i64>) {
        let mut resolved = std::ptr::null_mut();
        // SAFETY: reads the fake's stream table; `resolved` is writable.
        let gen = unsafe { (self.capture_of)(stream as *mut _, &mut resolved) };
        (resolved as usize, (gen > 0).then_some(gen))
    }

    /// Holds the device behind (every event query reads not ready, as while the GPU still
    /// runs the work before it) or releases it: what completes once released is what a
    /// stall did not hold. Process-wide: for tests that run alone (`serial`).
    pub fn hold_completion(&self, on: bool) {
        // SAFETY: sets a flag.
        unsafe { (self.hold_completion)(on as c_int) }
    }

    /// Turns the stream-order model on or off (`cuda.c`, "stream order"): process-wide, so
    /// a test that reads its gauges runs alone in its binary.
    pub fn check_order(&self, on: bool) {
        ORDER_ON.store(on, std::sync::atomic::Ordering::Release);
        // SAFETY: sets a flag.
        unsafe { (self.check_order)(on as c_int) }
    }

    /// The latest race the stream-order model found, described; empty while none.
    pub fn last_race(&self) -> String {
        // SAFETY: a NUL-terminated string in a static buffer.
        unsafe { CStr::from_ptr((self.last_race)()) }
            .to_string_lossy()
            .into_owned()
    }

    pub fn gauge(&self, g: Gauge) -> i64 {
        // SAFETY: reads a counter.
        unsafe { (self.gauge)(g as c_int) }
    }

    /// A gauge of the fake runtime; `None` when the driver was built without it.
    pub fn runtime_gauge(&self, g: RuntimeGauge) -> Option<i64> {
        // SAFETY: `fake_cudart_gauge(int) -> int64_t`, when the object has it.
        let f = unsafe {
            self._lib
                .get::<unsafe extern "C" fn(c_int) -> i64>(b"fake_cudart_gauge\0")
        };
        // SAFETY: reads a counter.
        f.ok().map(|f| unsafe { f(g as c_int) })
    }
}

/// Calls per driver entry point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counts(pub Vec<(&'static str, u64)>);

impl Counts {
    pub fn get(&self, name: &str) -> u64 {
        self.0
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("the fake driver has no {name}"))
            .1
    }

    /// Calls of `name` in counts from [`since`](Self::since) (0 when not called).
    pub fn of(&self, name: &str) -> u64 {
        self.0
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, c)| *c)
    }

    /// The calls made between `before` and `self`, only the entry points called.
    pub fn since(&self, before: &Counts) -> Counts {
        Counts(
            self.0
                .iter()
                .zip(&before.0)
                .map(|((n, a), (_, b))| (*n, a - b))
                .filter(|(_, d)| *d > 0)
                .collect(),
        )
    }

    pub fn total(&self) -> u64 {
        self.0.iter().map(|(_, c)| c).sum()
    }
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, (n, c)) in self.0.iter().enumerate() {
            write!(f, "{}{n} {c}", if i > 0 { ", " } else { "" })?;
        }
        Ok(())
    }
}

/// The host provider presented as NVIDIA's NCCL (`Provider::Nccl`): communicators on CUDA
/// devices, whose collectives run on the calling thread over the fake driver's "device"
/// memory (host memory) and ignore the stream. Its `ncclAllReduce`, `ncclAllGather` and
/// `ncclBroadcast` also log their arguments on threads that [`record_calls`], and one
/// launched on a stream under capture is held by that capture's graph: the last teardown
/// of its communicators waits until the test destroys it ([`destroy_graphs`]), as NCCL's.
pub fn nccl() -> Arc<Library> {
    static LIB: OnceLock<Arc<Library>> = OnceLock::new();
    driver();
    Arc::clone(LIB.get_or_init(|| {
        // SAFETY: `recording_lookup` returns the host provider's own `extern "C"`
        // functions, or the logging wrappers below with the same signatures, all living
        // for the whole process.
        unsafe { Library::from_lookup(Provider::Nccl, None, recording_lookup) }
            .expect("the host provider exports NCCL's API")
    }))
}

/// NVIDIA's NCCL `version` (a tag without its `v`: "2.28.9-1") built from source by
/// `scripts/build-nccl.sh`, over the fake CUDA runtime and driver (one object: `cudart.c`
/// includes `cuda.c`) and the fake NVML (`nvml.c`): NCCL's own host code, with kernels that
/// are recorded and never run. The folders the script printed are in
/// `NCCL_SAFE_SOURCE_NCCL` (`:`-separated; `scripts/test.sh` sets it).
///
/// Sets NCCL's variables for a machine without a GPU (sockets between ranks, no peer
/// access, no shared memory, no VMM, no InfiniBand, no RAS thread), then loads it. One NCCL
/// per process: call it first, before anything touches CUDA, with one version per test
/// binary. Panics (failing the test, never skipping it) when the build is absent.
pub fn source_nccl(version: &str) -> Arc<Library> {
    static LIB: OnceLock<(String, Arc<Library>)> = OnceLock::new();
    let (v, lib) = LIB.get_or_init(|| {
        let dirs = std::env::var("NCCL_SAFE_SOURCE_NCCL").unwrap_or_else(|_| {
            panic!(
                "NCCL_SAFE_SOURCE_NCCL is not set: run scripts/test.sh (it builds NCCL \
                 {version} from source with scripts/build-nccl.sh and sets it)"
            )
        });
        let dir = std::env::split_paths(&dirs)
            .find(|d| {
                d.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{version}-")))
            })
            .unwrap_or_else(|| {
                panic!("no build of NCCL {version} in NCCL_SAFE_SOURCE_NCCL={dirs}")
            });
        let headers = std::fs::read_to_string(dir.join("cuda-include"))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.join("cuda-include").display()));
        assert!(
            RUNTIME_HEADERS.set(PathBuf::from(headers.trim())).is_ok(),
            "the fake driver's headers were set twice"
        );
        for (k, v) in [
            ("NCCL_P2P_DISABLE", "1"),
            ("NCCL_SHM_DISABLE", "1"),
            ("NCCL_CUMEM_ENABLE", "0"),
            ("NCCL_IB_DISABLE", "1"),
            ("NCCL_NVLS_ENABLE", "0"),
            ("NCCL_RAS_ENABLE", "0"),
            ("NCCL_SOCKET_IFNAME", "lo"),
        ] {
            // Before NCCL is loaded and before any thread of this binary reads the
            // environment through it: every test here calls this first.
            std::env::set_var(k, v);
        }
        let d = driver();
        assert!(
            d.runtime_gauge(RuntimeGauge::KernelLaunches).is_some(),
            "the fake driver was loaded without its runtime: call source_nccl first"
        );
        static NVML: OnceLock<libloading::os::unix::Library> = OnceLock::new();
        NVML.get_or_init(|| compile_and_load(&fake_source("nvml.c"), "libnvidia-ml.so.1", &[]));
        let lib = Library::load_from(dir.join("lib/libnccl.so.2"))
            .unwrap_or_else(|e| panic!("loading NCCL {version} built from source: {e}"));
        (version.to_string(), lib)
    });
    assert_eq!(v, version, "one NCCL per process");
    Arc::clone(lib)
}

/// What [`FakeDriver::runtime_gauge`] reads (`cudart.c`'s `fake_cudart_gauge`).
#[derive(Debug, Clone, Copy)]
pub enum RuntimeGauge {
    /// NCCL kernels launched (recorded, not run).
    KernelLaunches = 0,
    /// Host functions enqueued through the runtime.
    HostFuncs = 1,
    /// Memory pools alive.
    LivePools = 2,
    /// Host ranges registered now.
    RegisteredHostRanges = 3,
}

/// How long the fake NCCL's destroy and abort take, in ms (destroy, abort).
static TEARDOWN_MS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new((500 << 32) | 1000);

/// How long the fake NCCL's `ncclCommDestroy` and `ncclCommAbort` take: by default what
/// NVIDIA's NCCL 2.28.9 took for an idle communicator on an H100 (0.5 s and 1 s:
/// measured on an H100 with NCCL 2.28.9), which every test sees unless it shortens them with
/// [`set_teardown_time`].
pub fn teardown_time() -> (std::time::Duration, std::time::Duration) {
    let v = TEARDOWN_MS.load(std::sync::atomic::Ordering::Relaxed);
    (
        std::time::Duration::from_millis(v >> 32),
        std::time::Duration::from_millis(v & 0xffff_ffff),
    )
}

/// Sets [`teardown_time`] for the whole process (a test that tears down many
/// communicators may shorten it; at least one run of each teardown test keeps the default).
pub fn set_teardown_time(destroy: std::time::Duration, abort: std::time::Duration) {
    let v = ((destroy.as_millis() as u64) << 32) | (abort.as_millis() as u64 & 0xffff_ffff);
    TEARDOWN_MS.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// One collective call as NCCL received it: the entry point and every argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclCall {
    pub name: &'static str,
    pub send: usize,
    pub recv: usize,
    pub count: usize,
    pub dtype: i64,
    /// The reduction (all_reduce) or the root (broadcast); 0 for all_gather.
    pub op_or_root: i64,
    pub comm: usize,
    pub stream: usize,
}

/// Whether a test turned the stream-order model on.
static ORDER_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Tells the stream-order model, while it is on, what a collective reads and writes on its
/// stream (the driver does not see NCCL's kernels): its send buffer, then its receive
/// buffer.
fn accessed(call: &NcclCall) {
    if !ORDER_ON.load(std::sync::atomic::Ordering::Acquire) {
        return;
    }
    let elem = match call.dtype as nccl_sys::ncclDataType_t {
        nccl_sys::bindings::ncclInt8
        | nccl_sys::bindings::ncclUint8
        | nccl_sys::bindings::ncclFloat8e4m3
        | nccl_sys::bindings::ncclFloat8e5m2 => 1,
        nccl_sys::bindings::ncclFloat16 | nccl_sys::bindings::ncclBfloat16 => 2,
        nccl_sys::bindings::ncclInt32
        | nccl_sys::bindings::ncclUint32
        | nccl_sys::bindings::ncclFloat32 => 4,
        _ => 8,
    };
    // The collective's extents (as on its root: the most it may touch).
    let (send, recv) = nccl_sys::EntryPoint::from_name(call.name)
        .and_then(nccl_sys::EntryPoint::collective)
        .and_then(|c| c.elements(call.count, nranks(call.comm), true))
        .expect("a collective of small counts");
    let (send, recv) = (send * elem, recv * elem);
    // SAFETY: `stream` is the handle the caller passed to NCCL, a stream of the fake driver
    // (or the null stream); the addresses are only compared.
    unsafe {
        (driver().access)(
            call.stream as *mut _,
            call.send as u64,
            send,
            call.recv as u64,
            recv,
        )
    };
}

/// The communicator's rank count, as the host provider reports it.
fn nranks(comm: usize) -> usize {
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `comm` is a live communicator of the host provider (the call in progress
    // uses it); writes one int.
    unsafe { (wrap::host().ncclCommCount)(comm as _, &mut n) };
    n.max(1) as usize
}

thread_local! {
    static LOG: std::cell::RefCell<Option<Vec<NcclCall>>> = const { std::cell::RefCell::new(None) };
}

/// Starts (`true`) or stops logging this thread's collective calls; stopping returns the log.
pub fn record_calls(on: bool) -> Vec<NcclCall> {
    LOG.with(|l| {
        let mut l = l.borrow_mut();
        let out = l.take().unwrap_or_default();
        if on {
            *l = Some(Vec::new());
        }
        out
    })
}

/// Logs `call` and launches it, or queues it in this thread's group; true when its launch
/// is asynchronous (see [`launch`]).
fn log(call: NcclCall) -> bool {
    LOG.with(|l| {
        if let Some(v) = l.borrow_mut().as_mut() {
            v.push(call.clone());
        }
    });
    let queued = GROUPED.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 > 0 {
            g.1.push(call.clone());
            true
        } else {
            false
        }
    });
    !queued && launch(vec![call])
}

thread_local! {
    /// This thread's NCCL group depth, and the collectives queued in the group: NVIDIA's
    /// NCCL launches them (so they touch their buffers) at the outermost ncclGroupEnd.
    static GROUPED: std::cell::RefCell<(u32, Vec<NcclCall>)> =
        const { std::cell::RefCell::new((0, Vec::new())) };
}

/// Communicators whose launch still runs on NCCL's group thread (a count per
/// communicator): their asynchronous state reads ncclInProgress.
fn launching() -> std::sync::MutexGuard<'static, std::collections::HashMap<usize, usize>> {
    static L: OnceLock<std::sync::Mutex<std::collections::HashMap<usize, usize>>> = OnceLock::new();
    L.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// How long the fake NCCL's launch thread takes before it launches (ms): 2 by default.
static LAUNCH_DELAY_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(2);

/// Sets how long each asynchronous launch takes (a launch NCCL's group thread is slow to
/// make: a peer late to connect). An abort of its communicator ends it early.
pub fn set_launch_delay(d: std::time::Duration) {
    LAUNCH_DELAY_MS.store(d.as_millis() as u64, std::sync::atomic::Ordering::Release);
}

/// Whether launches run inside the call, as a blocking communicator's do (group.cc:740-745
/// of 2.28.9), instead of from a thread of their own: for measuring what the thread costs.
static INLINE_LAUNCH: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes every launch run inside the call (`true`), as on a blocking communicator, or
/// (`false`, the default) from a thread per launch with two or more ranks, as NCCL's
/// non-blocking communicators (the crate's) do.
pub fn set_inline_launch(on: bool) {
    INLINE_LAUNCH.store(on, std::sync::atomic::Ordering::Release);
}

/// Launches of `comm` (a raw handle) still running on NCCL's group thread.
pub fn launches_pending(comm: usize) -> usize {
    launching().get(&comm).copied().unwrap_or(0)
}

/// Communicators aborted while a launch of theirs ran: the launch ends without launching
/// (NCCL's abort flag).
fn aborting() -> std::sync::MutexGuard<'static, std::collections::HashSet<usize>> {
    static A: OnceLock<std::sync::Mutex<std::collections::HashSet<usize>>> = OnceLock::new();
    A.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// As NCCL's `ncclCommAbort` (init.cc:2502-2541): sets the abort flag and joins the job in
/// flight, so no launch of `comm` runs after it returns.
fn abort_launches(comm: usize) {
    if launches_pending(comm) == 0 {
        return;
    }
    aborting().insert(comm);
    while launches_pending(comm) > 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    aborting().remove(&comm);
}

/// NCCL's group jobs as linked to communicators (`comm->groupJob`): a non-blocking group
/// end that launches from its thread links its job to each of its communicators that has
/// none (group.cc:802-818 of v2.29.7-1), an `ncclCommGetAsyncError` that reads ncclSuccess
/// completes and unlinks it (init.cc:3105-3110), and `ncclCommEnsureReady` under the abort
/// flags (a revoke's, init.cc:2664, an abort's, :2713) aborts it (:403-404), deleting it once
/// no communicator holds it (group.cc:873-884) while the pointer stays. Every later use of
/// such a freed job (the next poll that reads ncclSuccess, an abort) is a use after free in
/// NCCL: recorded here ([`stale_group_jobs`]), as the strictest reading of NCCL.
#[derive(Default)]
struct GroupJobs {
    next: u64,
    /// Each communicator's linked job.
    linked: std::collections::HashMap<usize, u64>,
    /// Jobs not yet deleted, with their reference counts.
    live: std::collections::HashMap<u64, usize>,
    /// The uses of deleted jobs.
    stale: Vec<String>,
}

fn group_jobs() -> std::sync::MutexGuard<'static, GroupJobs> {
    static J: OnceLock<std::sync::Mutex<GroupJobs>> = OnceLock::new();
    J.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Every use of an NCCL group job after its deletion so far (see [`GroupJobs`]): a
/// revoke that left `comm->groupJob` dangling, then a call that touched it.
pub fn stale_group_jobs() -> Vec<String> {
    group_jobs().stale.clone()
}

/// A non-blocking group end of `comms`: links its job to each that has none.
fn link_group_job(comms: impl IntoIterator<Item = usize>) {
    let mut j = group_jobs();
    j.next += 1;
    let id = j.next;
    let mut refs = 0;
    for c in comms {
        if let std::collections::hash_map::Entry::Vacant(e) = j.linked.entry(c) {
            e.insert(id);
            refs += 1;
        }
    }
    if refs > 0 {
        j.live.insert(id, refs);
    }
}

/// Drops one reference to `id` (deleting it at zero), or records the use of a deleted job.
fn unref_group_job(j: &mut GroupJobs, id: u64, what: &str) {
    match j.live.get_mut(&id) {
        Some(n) if *n > 1 => *n -= 1,
        Some(_) => {
            j.live.remove(&id);
        }
        None => j.stale.push(format!(
            "{what} used group job {id}, which an earlier ncclCommRevoke had deleted and left linked (a use after free in NCCL 2.29-2.30)"
        )),
    }
}

/// `ncclCommGetAsyncError` read ncclSuccess on `c`: completes and unlinks its job.
fn complete_group_job(c: usize) {
    let mut j = group_jobs();
    if let Some(id) = j.linked.remove(&c) {
        unref_group_job(&mut j, id, "ncclCommGetAsyncError (ncclGroupJobComplete)");
    }
}

/// `ncclCommEnsureReady` under the abort flags: aborts `c`'s job, and leaves it linked
/// (`gone`: the communicator is freed after, as an abort's is).
fn abort_group_job(c: usize, what: &str, gone: bool) {
    let mut j = group_jobs();
    let id = if gone {
        j.linked.remove(&c)
    } else {
        j.linked.get(&c).copied()
    };
    if let Some(id) = id {
        unref_group_job(&mut j, id, what);
    }
}

/// CUDA graphs that hold communicators' work, as NVIDIA's NCCL counts them: a launch on a
/// stream under capture makes its plans persistent, each counted in its communicator's
/// `localPersistentRefs` (enqueue.cc:1542-1546 of 2.28.9), until the graph is destroyed and
/// its destructor has the plans reclaimed (`reclaimPlan`, enqueue.cc:1334-1338). Per graph
/// (the stream it was captured from, as the driver resolves the handle, and the number of
/// its capture), the communicators of the launches it holds, one entry per launch.
type Graphs = std::collections::HashMap<(usize, i64), Vec<usize>>;

fn graphs() -> (
    std::sync::MutexGuard<'static, Graphs>,
    &'static std::sync::Condvar,
) {
    static G: OnceLock<(std::sync::Mutex<Graphs>, std::sync::Condvar)> = OnceLock::new();
    let g = G.get_or_init(Default::default);
    (g.0.lock().unwrap_or_else(|e| e.into_inner()), &g.1)
}

/// Notes each of `calls` launched on a stream under capture in that capture's graph (NCCL
/// asks at the launch: `ncclCudaGetCapturingGraph`, on the calling thread).
fn capture(calls: &[NcclCall]) {
    for c in calls {
        if let (stream, Some(gen)) = driver().capture_of(c.stream) {
            graphs().0.entry((stream, gen)).or_default().push(c.comm);
        }
    }
}

/// Destroys every graph captured from `stream` so far (the user's `cudaGraphDestroy`; 0x2:
/// the calling thread's per-thread stream): NCCL reclaims their plans, and a teardown that
/// waited for them goes on. The number of launches they held.
pub fn destroy_graphs(stream: &CudaStream) -> usize {
    let (resolved, _) = driver().capture_of(stream.cu_stream() as usize);
    let (mut g, changed) = graphs();
    let mut released = 0;
    g.retain(|&(s, _), held| {
        released += if s == resolved { held.len() } else { 0 };
        s != resolved
    });
    changed.notify_all();
    released
}

/// NCCL's `commDestroySync` (init.cc:2232-2234 of 2.28.9), which its destroy and its abort
/// both run for each communicator they reclaim: "keep polling until all graphs referencing
/// us die". Blocks until no graph holds a launch of `comm`.
fn wait_for_graphs(comm: usize) {
    let (mut g, changed) = graphs();
    while g.values().any(|held| held.contains(&comm)) {
        g = changed.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

/// Launches `calls` as NVIDIA's NCCL 2.28 does on non-blocking communicators (the crate's):
/// with one rank, in the call (enqueue.cc:2569-2571); with more, on the group's own thread
/// after the call returned ncclInProgress (group.cc:706-738, enqueue.cc:2658), with the
/// communicators in progress until it is done. The launch is where the stream-order model
/// learns of the buffers' accesses, so an event recorded on the stream before the launch
/// ends does not order them. True when the launch is asynchronous.
fn launch(calls: Vec<NcclCall>) -> bool {
    capture(&calls);
    if INLINE_LAUNCH.load(std::sync::atomic::Ordering::Acquire)
        || calls.iter().all(|c| nranks(c.comm) <= 1)
    {
        calls.iter().for_each(accessed);
        return false;
    }
    {
        let mut l = launching();
        for c in &calls {
            *l.entry(c.comm).or_default() += 1;
        }
    }
    link_group_job(calls.iter().map(|c| c.comm));
    // NCCL's group end starts a thread per group (pthread_create, group.cc:734).
    std::thread::spawn(move || {
        let delay = LAUNCH_DELAY_MS.load(std::sync::atomic::Ordering::Acquire);
        let until = std::time::Instant::now() + std::time::Duration::from_millis(delay);
        let aborted = || calls.iter().any(|c| aborting().contains(&c.comm));
        while std::time::Instant::now() < until && !aborted() {
            std::thread::sleep(
                std::time::Duration::from_millis(1).min(until - std::time::Instant::now()),
            );
        }
        if !aborted() {
            calls.iter().for_each(accessed);
        }
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

mod wrap {
    //! Logging wrappers around the host provider's collectives.
    use super::*;
    use nccl_sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};
    use std::ffi::c_void;

    /// The host provider's entry points, typed by the function table.
    pub(super) fn host() -> nccl_sys::FunctionTable {
        static TABLE: OnceLock<nccl_sys::FunctionTable> = OnceLock::new();
        *TABLE.get_or_init(|| *nccl_safe::Library::host().table())
    }

    /// The CUDA device of each communicator and NCCL allocation, as NVIDIA's NCCL keeps it:
    /// the device current when it was made (a child's is its parent's).
    fn devices() -> std::sync::MutexGuard<'static, std::collections::HashMap<usize, c_int>> {
        static D: OnceLock<std::sync::Mutex<std::collections::HashMap<usize, c_int>>> =
            OnceLock::new();
        D.get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The device of the calling thread's current context, or -1 with none.
    fn current_device() -> c_int {
        let mut d: cudarc::driver::sys::CUdevice = -1;
        // SAFETY: writes one int; fails (leaving -1) when no context is current.
        let r = unsafe { cudarc::driver::sys::cuCtxGetDevice(&mut d) };
        if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            d
        } else {
            -1
        }
    }

    fn device_of(key: usize) -> c_int {
        devices().get(&key).copied().unwrap_or(-1)
    }

    /// Notes the device of what a call wrote to `out` (a communicator or an allocation),
    /// when it wrote something.
    ///
    /// # Safety
    /// `out` is null or points to a readable pointer-sized value.
    unsafe fn remember<T>(out: *const *mut T, device: c_int) {
        // SAFETY: by this function's contract.
        if let Some(p) = unsafe { out.as_ref() }.filter(|p| !p.is_null()) {
            devices().insert(*p as usize, device);
        }
    }

    /// NVIDIA's abort and destroy release the communicator's device memory through the
    /// driver, after making the communicator's device current themselves, and the
    /// driver's frees wait for the device's work: behind a stalled stream they block until
    /// it is released, on whatever thread they run (a teardown lane, the watchdog's
    /// abort). Modelled with the fake's wait on that device first (every device, for one
    /// the fake did not see made: stricter, never kinder).
    fn release_through_the_driver(device: c_int) {
        // SAFETY: one int argument; waits for the fake device's stalled streams.
        unsafe { (driver().release_wait)(device) }
    }

    /// The communicators of one unique id in this process (NCCL's `intraComm0` list) and
    /// how many of them were torn down.
    #[derive(Default)]
    struct Local {
        members: Vec<(usize, c_int)>,
        finalized: usize,
    }

    /// Per unique id (hashed), its communicators in this process; per communicator, its id.
    #[allow(clippy::type_complexity)]
    fn locals() -> std::sync::MutexGuard<
        'static,
        (
            std::collections::HashMap<u64, Local>,
            std::collections::HashMap<usize, u64>,
        ),
    > {
        #[allow(clippy::type_complexity)]
        static L: OnceLock<
            std::sync::Mutex<(
                std::collections::HashMap<u64, Local>,
                std::collections::HashMap<usize, u64>,
            )>,
        > = OnceLock::new();
        L.get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Notes a communicator made from `id` in this process, on `device`.
    ///
    /// # Safety
    /// `out` is null or points to a readable communicator handle.
    unsafe fn join_local(out: *const ncclComm_t, id: &nccl_sys::ncclUniqueId, device: c_int) {
        use std::hash::{Hash, Hasher};
        // SAFETY: by this function's contract.
        let Some(c) = unsafe { out.as_ref() }.filter(|c| !c.is_null()) else {
            return;
        };
        let mut h = std::collections::hash_map::DefaultHasher::new();
        id.internal.hash(&mut h);
        let key = h.finish();
        let mut l = locals();
        l.0.entry(key)
            .or_default()
            .members
            .push((*c as usize, device));
        l.1.insert(*c as usize, key);
    }

    /// NCCL's teardown of `c` (init.cc `commReclaim`, 2304-2354): only the last of the
    /// communicators of its unique id in this process to be destroyed or aborted frees
    /// them all, each on its own device (through the driver: behind a stalled stream of
    /// that device it waits), taking `each` per communicator; the others return at once.
    /// A communicator the fake did not see made (a split child) is alone. Before it frees
    /// any, it waits, for each, until no CUDA graph holds its work (`commDestroySync` for
    /// each, init.cc:2324-2335, then `commCleanup`: [`wait_for_graphs`]).
    fn reclaim(c: ncclComm_t, each: std::time::Duration) {
        let members = {
            let mut l = locals();
            match l.1.remove(&(c as usize)) {
                None => Some(vec![(c as usize, device_of(c as usize))]),
                Some(key) => {
                    let last = l.0.get_mut(&key).is_some_and(|e| {
                        e.finalized += 1;
                        e.finalized >= e.members.len()
                    });
                    if last {
                        l.0.remove(&key).map(|e| e.members)
                    } else {
                        None
                    }
                }
            }
        };
        let members = members.unwrap_or_default();
        for &(comm, _) in &members {
            super::wait_for_graphs(comm);
        }
        for (_, device) in members {
            release_through_the_driver(device);
            std::thread::sleep(each);
        }
    }

    pub unsafe extern "C" fn init_rank_config(
        comm: *mut ncclComm_t,
        n: c_int,
        id: nccl_sys::ncclUniqueId,
        rank: c_int,
        config: *mut nccl_sys::ncclConfig_t,
    ) -> ncclResult_t {
        // SAFETY: forwarded unchanged to the host provider's entry point.
        let r = unsafe { (host().ncclCommInitRankConfig)(comm, n, id, rank, config) };
        // SAFETY: `comm` is the caller's out pointer (NCCL's contract), written by the call.
        unsafe { remember(comm, current_device()) };
        // SAFETY: as above.
        unsafe { join_local(comm, &id, current_device()) };
        r
    }

    pub unsafe extern "C" fn init_rank(
        comm: *mut ncclComm_t,
        n: c_int,
        id: nccl_sys::ncclUniqueId,
        rank: c_int,
    ) -> ncclResult_t {
        // SAFETY: as above.
        let r = unsafe { (host().ncclCommInitRank)(comm, n, id, rank) };
        // SAFETY: as above.
        unsafe { remember(comm, current_device()) };
        // SAFETY: as above.
        unsafe { join_local(comm, &id, current_device()) };
        r
    }

    pub unsafe extern "C" fn split(
        comm: ncclComm_t,
        color: c_int,
        key: c_int,
        child: *mut ncclComm_t,
        config: *mut nccl_sys::ncclConfig_t,
    ) -> ncclResult_t {
        // SAFETY: as above.
        let r = unsafe { (host().ncclCommSplit)(comm, color, key, child, config) };
        // On a non-blocking parent the child is stored later, by the split's job: then it is
        // not known here, and its teardown waits for every device (stricter, never kinder).
        // SAFETY: as above.
        unsafe { remember(child, device_of(comm as usize)) };
        r
    }

    pub unsafe extern "C" fn mem_alloc(p: *mut *mut c_void, size: usize) -> ncclResult_t {
        // SAFETY: as above.
        let r = unsafe {
            (host()
                .ncclMemAlloc
                .expect("the host provider has ncclMemAlloc"))(p, size)
        };
        // SAFETY: as above.
        unsafe { remember(p, current_device()) };
        r
    }

    pub unsafe extern "C" fn abort(c: ncclComm_t) -> ncclResult_t {
        // Stricter than NCCL for a communicator that is not the last of its id here (NCCL
        // frees nothing in its teardown): every teardown waits for its device first.
        super::abort_launches(c as usize);
        super::abort_group_job(c as usize, "ncclCommAbort (ncclGroupJobAbort)", true);
        release_through_the_driver(device_of(c as usize));
        // SAFETY: forwarded unchanged to the host provider's entry point.
        let r = unsafe { (host().ncclCommAbort)(c) };
        // The abort flag ends the peers' waits at once; the reclaim takes its time.
        reclaim(c, super::teardown_time().1);
        r
    }

    pub unsafe extern "C" fn destroy(c: ncclComm_t) -> ncclResult_t {
        release_through_the_driver(device_of(c as usize));
        // SAFETY: as above.
        let r = unsafe { (host().ncclCommDestroy)(c) };
        if r == nccl_sys::bindings::ncclSuccess {
            // Its `ncclCommEnsureReady` read ncclSuccess (init.cc:2578 of v2.29.7-1).
            super::complete_group_job(c as usize);
            reclaim(c, super::teardown_time().0);
        }
        r
    }

    /// A registration's release unmaps through the driver too.
    pub unsafe extern "C" fn deregister(c: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
        release_through_the_driver(device_of(c as usize));
        // SAFETY: as above.
        unsafe {
            (host()
                .ncclCommDeregister
                .expect("the host provider has ncclCommDeregister"))(c, handle)
        }
    }

    pub unsafe extern "C" fn mem_free(p: *mut c_void) -> ncclResult_t {
        release_through_the_driver(device_of(p as usize));
        // SAFETY: as above.
        unsafe {
            (host()
                .ncclMemFree
                .expect("the host provider has ncclMemFree"))(p)
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
        let asynchronous = log(NcclCall {
            name: "ncclAllReduce",
            send: s as usize,
            recv: r as usize,
            count: n,
            dtype: t as i64,
            op_or_root: op as i64,
            comm: c as usize,
            stream: st as usize,
        });
        // SAFETY: forwarded unchanged to the host provider's entry point.
        in_progress_if(asynchronous, unsafe {
            (host().ncclAllReduce)(s, r, n, t, op, c, st)
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
        let asynchronous = log(NcclCall {
            name: "ncclAllGather",
            send: s as usize,
            recv: r as usize,
            count: n,
            dtype: t as i64,
            op_or_root: 0,
            comm: c as usize,
            stream: st as usize,
        });
        // SAFETY: as above.
        in_progress_if(asynchronous, unsafe {
            (host().ncclAllGather)(s, r, n, t, c, st)
        })
    }

    pub unsafe extern "C" fn broadcast(
        s: *const c_void,
        r: *mut c_void,
        n: usize,
        t: ncclDataType_t,
        root: std::ffi::c_int,
        c: ncclComm_t,
        st: cudaStream_t,
    ) -> ncclResult_t {
        let asynchronous = log(NcclCall {
            name: "ncclBroadcast",
            send: s as usize,
            recv: r as usize,
            count: n,
            dtype: t as i64,
            op_or_root: root as i64,
            comm: c as usize,
            stream: st as usize,
        });
        // SAFETY: as above.
        in_progress_if(asynchronous, unsafe {
            (host().ncclBroadcast)(s, r, n, t, root, c, st)
        })
    }

    /// ncclInProgress for a successful call whose launch is asynchronous (the host
    /// provider's own answer, ncclInProgress for work of two ranks or more, included).
    fn in_progress_if(asynchronous: bool, r: ncclResult_t) -> ncclResult_t {
        if asynchronous && r == nccl_sys::bindings::ncclSuccess {
            nccl_sys::bindings::ncclInProgress
        } else {
            r
        }
    }

    pub unsafe extern "C" fn group_start() -> ncclResult_t {
        GROUPED.with(|g| g.borrow_mut().0 += 1);
        // SAFETY: forwarded unchanged to the host provider's entry point.
        unsafe { (host().ncclGroupStart)() }
    }

    /// The outermost end launches the group's collectives (see [`launch`]).
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
        // Before the host provider's end, which leaves its communicators refusing
        // ncclCommCount (as NCCL's launch thread does) until their state is read.
        let asynchronous = !calls.is_empty() && launch(calls);
        // SAFETY: forwarded unchanged to the host provider's entry point.
        let r = unsafe { (host().ncclGroupEnd)() };
        in_progress_if(asynchronous, r)
    }

    /// NCCL's revoke sets the communicator's abort flags and joins its group's job
    /// (init.cc:2662-2664 → group.cc:875-877 of v2.29.7-1): no launch of it runs after.
    pub unsafe extern "C" fn revoke(c: ncclComm_t, flags: std::ffi::c_int) -> ncclResult_t {
        super::abort_launches(c as usize);
        // SAFETY: forwarded unchanged to the host provider's entry point.
        let r = unsafe {
            (host()
                .ncclCommRevoke
                .expect("the host provider has ncclCommRevoke"))(c, flags)
        };
        // Past its refusals, NCCL's revoke aborts the linked job and leaves it linked
        // (init.cc:2664), and its own group end links its job only where none is linked
        // (group.cc:802).
        if r == nccl_sys::bindings::ncclSuccess || r == nccl_sys::bindings::ncclInProgress {
            super::abort_group_job(c as usize, "ncclCommRevoke (ncclGroupJobAbort)", false);
            if r == nccl_sys::bindings::ncclInProgress {
                super::link_group_job([c as usize]);
            }
        }
        r
    }

    /// A communicator whose launch still runs reads ncclInProgress.
    pub unsafe extern "C" fn async_error(c: ncclComm_t, out: *mut ncclResult_t) -> ncclResult_t {
        if launching().contains_key(&(c as usize)) && !out.is_null() {
            // SAFETY: `out` is the caller's writable out-pointer (checked non-null).
            unsafe { out.write(nccl_sys::bindings::ncclInProgress) };
            return nccl_sys::bindings::ncclSuccess;
        }
        // SAFETY: forwarded unchanged to the host provider's entry point.
        let r = unsafe { (host().ncclCommGetAsyncError)(c, out) };
        // SAFETY: `out` was written by the call when it succeeded (checked non-null).
        if r == nccl_sys::bindings::ncclSuccess
            && !out.is_null()
            && unsafe { out.read() } == nccl_sys::bindings::ncclSuccess
        {
            super::complete_group_job(c as usize);
        }
        r
    }
}

fn recording_lookup(name: &CStr) -> *const std::ffi::c_void {
    match name.to_bytes() {
        b"ncclCommInitRankConfig" => wrap::init_rank_config as *const std::ffi::c_void,
        b"ncclCommInitRank" => wrap::init_rank as *const std::ffi::c_void,
        b"ncclCommSplit" => wrap::split as *const std::ffi::c_void,
        b"ncclMemAlloc" => wrap::mem_alloc as *const std::ffi::c_void,
        b"ncclCommAbort" => wrap::abort as *const std::ffi::c_void,
        b"ncclCommDestroy" => wrap::destroy as *const std::ffi::c_void,
        b"ncclMemFree" => wrap::mem_free as *const std::ffi::c_void,
        b"ncclCommDeregister" => wrap::deregister as *const std::ffi::c_void,
        b"ncclAllReduce" => wrap::all_reduce as *const std::ffi::c_void,
        b"ncclAllGather" => wrap::all_gather as *const std::ffi::c_void,
        b"ncclBroadcast" => wrap::broadcast as *const std::ffi::c_void,
        b"ncclGroupStart" => wrap::group_start as *const std::ffi::c_void,
        b"ncclGroupEnd" => wrap::group_end as *const std::ffi::c_void,
        b"ncclCommGetAsyncError" => wrap::async_error as *const std::ffi::c_void,
        b"ncclCommRevoke" => wrap::revoke as *const std::ffi::c_void,
        _ => nccl_safe::host::lookup(name),
    }
}
