//! The host provider: NCCL's C ABI implemented in Rust over host (CPU) memory, with ranks
//! as threads of one process.
//!
//! [`lookup`] hands out `unsafe extern "C"` functions with NCCL's exact signatures, so
//! `nccl_sys::FunctionTable::load(nccl_host::lookup)` fills the same table a `dlopen`ed
//! `libnccl.so.2` does, and everything above the table runs unchanged. nccl-safe re-exports
//! this crate as `nccl_safe::host` (its `host` feature) and builds `Library::host` on it;
//! the items hidden from these docs are for nccl-safe only.
//!
//! Ranks may also be processes of one machine: an id from [`shared_unique_id`] makes
//! `ncclCommInitRank` meet the other ranks in a shared memory segment instead of inside this
//! process (see [`shared_unique_id`] for what runs there and how a dead peer is reported).
//!
//! [`fault`] injects the GPU's failure modes (work that never completes, aborts that block,
//! the CUDA runtime's teardown at exit), so that failure handling is tested on any machine.
//!
//! # How it maps to NCCL
//! * A `ncclComm_t` is an opaque number (never null, never reused in the process) looked up
//!   in a global registry, never dereferenced. Using a destroyed or aborted handle returns
//!   `ncclInvalidUsage`; a value that was never a handle returns `ncclInvalidArgument`; both
//!   are counted in [`HostStats::misused`] and never crash.
//! * `ncclCommInitRank(Config)` is a rendezvous on the unique id: it completes when `nranks`
//!   ranks joined. Ranks that disagree on `nranks` (or join twice as one rank) all get
//!   `ncclInvalidArgument`.
//! * Every operation is *posted* into its clique as a `PostedOp` (collectives keyed by the
//!   communicator's sequence number, send/recv by (source, destination, per-pair sequence)).
//!   The thread whose post completes it performs the whole operation for every rank (all
//!   buffers are host memory of this process) and wakes the others. Nobody blocks on a peer
//!   before posting everything, so one thread may drive every rank of a clique inside one
//!   group, and send/recv pairs inside a group never deadlock.
//! * Inside `ncclGroupStart`/`ncclGroupEnd` (a per-thread nesting depth) operations are
//!   queued and posted at the outermost `ncclGroupEnd`, which then waits for all of them.
//!   A split or shrink is queued whole, as NCCL queues its job: the call writes NULL and
//!   returns ncclSuccess, and the job runs (and writes the child) at the outermost
//!   `ncclGroupEnd`, before the operations. A window registration likewise: the call
//!   returns ncclSuccess with `*win` untouched, and the window is written at the outermost
//!   `ncclGroupEnd` (from a thread of the provider's, later, on a non-blocking
//!   communicator). An init inside a group joins its clique during
//!   the call and writes its handle then (NCCL writes the handle then too, but joins at the
//!   group's end) and returns ncclSuccess; a blocking group's `ncclGroupEnd` waits for it, a
//!   non-blocking one leaves it to `ncclCommGetAsyncError`.
//! * Reductions fold the ranks' inputs in rank order 0, 1, 2, ... rounding every step to the
//!   element type: integer sum/product
//!   wrap; `f16`/`bf16`/fp8 compute each step in `f32` and round back (fp8 rounds to
//!   nearest-even and saturates to the largest finite value); PreMulSum is the sum of
//!   `scalar_r * x_r` with each product rounded to the type; `avg` is, as NCCL has it, for
//!   integers the truncating division of the wrapped sum by `nranks`, and for floating-point
//!   types a PreMulSum by `T(1/nranks)` on every rank (each input scaled and rounded first).
//!   Max/min keep the accumulator on ties and NaN comparisons.
//! * In-place forms (and any other aliasing) work: the result is as if every input were read
//!   before any output is written. Reductions run in 32 KiB chunks straight from the posted
//!   inputs to the outputs, and copies straight from source to destination, whenever the
//!   buffers' layout makes that equivalent (separate buffers and NCCL's in-place forms);
//!   other layouts go through copies of the inputs.
//!
//! # Documented differences from real NCCL
//! 1. The `stream` argument is ignored: the work happens on the calling thread when the call
//!    (or the outermost `ncclGroupEnd`) runs, so an operation is complete when that call
//!    returns (a reduction of 4 MiB or more also uses scoped threads, up to the machine's
//!    parallelism, that end before it returns). This holds for non-blocking communicators
//!    too: only init, split, shrink, window registration and revoke finish after their call
//!    (polled with `ncclCommGetAsyncError`, as on NCCL).
//! 2. `ncclCommAbort` (from any thread) wakes every rank blocked on that communicator's
//!    clique with `ncclRemoteError`; later operations on the surviving ranks return
//!    `ncclRemoteError` and `ncclCommGetAsyncError` reports it. An operation whose copy had
//!    already started finishes first (its buffers are never touched after its call returns).
//! 3. Every wait ends after `NCCL_SAFE_HOST_TIMEOUT_MS` (default 300 000 ms, read once) with
//!    `ncclTimeout`; the clique is then aborted so no buffer is touched later.
//! 4. `ncclCommCuDevice` reports the `devlist` entry (or the index) for `ncclCommInitAll`;
//!    otherwise the calling thread's "current device" at init time, set with
//!    [`set_current_device`] (default 0, like CUDA's default device). Children inherit it.
//! 5. `ncclCommDestroy(NULL)` and `ncclCommAbort(NULL)` return `ncclSuccess` (as NCCL does)
//!    and count nothing. A failed *blocking* init writes NULL to `*comm` and counts nothing;
//!    a non-blocking (or grouped) init's handle is counted as created at once and must be
//!    destroyed or aborted even if it fails.
//! 6. A rank calling `ncclCommSplit` with `NCCL_SPLIT_NOCOLOR` gets `*newcomm = NULL` at once
//!    without waiting for the other ranks (it has nothing to wait for).
//! 7. `ncclScalarDevice` PreMulSum scalars are read when the collective is called (also
//!    inside a group); `ncclScalarHostImmediate` ones at creation.
//! 8. Ranks that disagree on a collective (kind, count, datatype, root, reduction) all get
//!    `ncclInvalidUsage` instead of undefined behaviour; a send/recv pair with different
//!    counts or datatypes likewise.
//! 9. Config validation: `magic` must be `NCCL_API_MAGIC`, `size` between the 2.17 layout
//!    (48 bytes) and this crate's 2.32 layout, `version` an NCCL 2.17+ code; only `blocking`
//!    (present in every layout) is read, other fields are accepted and ignored.
//! 10. `ncclMemAlloc` returns zeroed, 4096-aligned host memory. `ncclCommRegister` and
//!     `ncclCommWindowRegister` return tokens that their deregistration checks: deregistering
//!     one twice, or one the communicator never handed out, is `ncclInvalidUsage` (counted in
//!     [`HostStats::double_deregistered`] / [`HostStats::unknown_deregistered`] and as
//!     misuse); a NULL handle is a no-op, as in NCCL. A communicator torn down with
//!     registrations or windows live releases them ([`HostStats::live_at_teardown`]).
//!     Windows are not collective here (each rank registers on its own, no rank waits), any
//!     host memory may be registered, and `NCCL_WIN_COLL_SYMMETRIC` needs a range inside
//!     one `ncclMemAlloc` allocation, starting a multiple of `NCCL_WIN_REQUIRED_ALIGNMENT`
//!     (4096) bytes into it; it is refused in the call (NCCL refuses it in the job). A NULL
//!     buffer or a size of 0 is refused too (NCCL returns ncclSuccess and writes nothing).
//!     As NCCL, `NCCL_LOCAL_REGISTER=0` makes `ncclCommRegister` hand out a NULL handle, and
//!     with `NCCL_WIN_ENABLE=0` too (no symmetric support) `ncclCommWindowRegister` returns
//!     ncclSuccess and writes nothing (both read once per process). Other optional entry
//!     points (RMA, `*Config` collectives, ...) are not provided (`lookup` returns null).
//! 11. `ncclGetLastError` ignores its `comm` argument: the text is per thread, and the
//!     pointer stays valid until the same thread calls `ncclGetLastError` again.
//! 12. `ncclCommRevoke`, `ncclCommGetUniqueId` and `ncclCommGrow` follow NCCL 2.29.7 (see
//!     each function's docs); a revoke inside a user's group runs as on a blocking
//!     communicator; across processes the boundary ranks' grow does not wait for the
//!     root's id (every rank derives it), and an existing rank's id must be this grow's.
//! 13. `ncclCommSuspend`, `ncclCommResume` and `ncclCommMemStats` follow NCCL 2.30.7
//!     (mem_manager.cc): the suspend and resume meet every rank, in threads and across
//!     processes; the memory figures are fixed stand-ins (the provider has no device
//!     memory), and a collective on a suspended communicator is refused (NCCL's kernels
//!     would use unmapped memory).
//! 14. `ncclCommInitRankScalable` follows NCCL 2.30.7 (init.cc:2477-2560, 2693-2728): its
//!     ranks meet on the first id extended with a digest of every id, so ranks must pass
//!     the same ids in the same order (others wait until their timeout, as NCCL's roots
//!     would); one id is `ncclCommInitRankConfig`'s rendezvous. The `ncclParam*` calls
//!     follow param/c_api.cc of 2.30.7 over the parameters of its registry whose parsers
//!     are a boolean, a string or the timestamp-levels set (not `NCCL_DEBUG` or
//!     `NCCL_DEBUG_SUBSYS`: the provider has no debug log).

#![deny(missing_docs)]
// NCCL constants (ncclSum, ncclInt8, ...) keep their C names in match patterns.
#![allow(non_upper_case_globals)]

use core::ffi::{c_int, c_void, CStr};

mod api;
mod defs;
mod dtype;
mod exec;
pub mod fault;
mod params;
mod registry;
mod shm;
mod state;

use nccl_sys::bindings::{ncclComm_t, ncclUniqueId};

/// The smallest `ncclConfig_t` accepted: the NCCL 2.17-2.26 layout (`splitShare` last).
const MIN_CONFIG_SIZE: usize = 48;

/// Counters of communicator handles, to prove every handle was torn down exactly once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Handles handed to the user (init, init-all, split, shrink).
    pub created: u64,
    /// Successful `ncclCommDestroy` calls.
    pub destroyed: u64,
    /// Successful `ncclCommAbort` calls.
    pub aborted: u64,
    /// Successful `ncclCommFinalize` calls.
    pub finalized: u64,
    /// Calls rejected as misuse (bad or dead handle, NULL pointer, out-of-range argument, ...).
    pub misused: u64,
    /// `created - destroyed - aborted`: handles still alive.
    pub live: u64,
    /// Successful `ncclMemAlloc` calls (process totals only: memory belongs to no id).
    pub mem_allocated: u64,
    /// Successful `ncclMemFree` calls (process totals only).
    pub mem_freed: u64,
    /// Buffers `ncclCommRegister` registered (not those `NCCL_LOCAL_REGISTER=0` skipped).
    pub registered: u64,
    /// Successful `ncclCommDeregister` calls (of a live registration).
    pub deregistered: u64,
    /// Windows `ncclCommWindowRegister` registered (at the group's end for a call inside a
    /// group; not those skipped without symmetric support or local registration).
    pub windows_registered: u64,
    /// Successful `ncclCommWindowDeregister` calls (of a live window).
    pub windows_deregistered: u64,
    /// Deregistrations (buffer or window) of a handle already deregistered; each is also
    /// counted in `misused`.
    pub double_deregistered: u64,
    /// Deregistrations of a handle that the communicator never handed out; each is also
    /// counted in `misused`.
    pub unknown_deregistered: u64,
    /// Registrations and windows still live when their communicator was destroyed or
    /// aborted (released then, as NCCL does).
    pub live_at_teardown: u64,
}

impl HostStats {
    fn with_live(mut self) -> Self {
        self.live = self.created.saturating_sub(self.destroyed + self.aborted);
        self
    }
}

std::thread_local! {
    /// The user's line behind the NCCL call this thread is making, when the crate's safe
    /// layer makes it (see [`with_caller`]).
    static CALLER: std::cell::Cell<Option<&'static std::panic::Location<'static>>> =
        const { std::cell::Cell::new(None) };
}

/// Runs `f` (one NCCL call into this provider) with `caller` as the line behind it: the
/// provider keeps it with the operation, so that a mismatch across processes names the
/// line each rank called from. Calls made outside it (through the raw table) have none.
/// For nccl-safe only (its checked operations call it).
#[doc(hidden)]
#[inline(always)]
pub fn with_caller<R>(caller: &'static std::panic::Location<'static>, f: impl FnOnce() -> R) -> R {
    CALLER.with(|c| c.set(Some(caller)));
    let r = f();
    CALLER.with(|c| c.set(None));
    r
}

std::thread_local! {
    /// The window a wait of nccl-safe's holds mutably (see [`with_landing`]).
    static LANDING: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` (one `ncclWaitSignal` into this provider) with `win` as the only window the
/// wait may write into: nccl-safe's `Window::wait_signal` holds that window mutably, so no
/// reference of the caller's sees it change; data of counted puts into another window is
/// kept until a wait names that one. Raw calls without it land every counted put, as NCCL.
/// For nccl-safe only.
#[doc(hidden)]
pub fn with_landing<R>(win: nccl_sys::bindings::ncclWindow_t, f: impl FnOnce() -> R) -> R {
    LANDING.with(|c| c.set(Some(win as usize)));
    let r = f();
    LANDING.with(|c| c.set(None));
    r
}

/// The window [`with_landing`] named for this thread's call, if any.
pub(crate) fn current_landing() -> Option<usize> {
    LANDING.with(|c| c.get())
}

#[doc(hidden)]
pub use defs::{with_deadline, CallCancel};

/// The line behind the call this thread is making into the provider, if known.
pub(crate) fn current_caller() -> Option<&'static std::panic::Location<'static>> {
    CALLER.with(|c| c.get())
}

/// Counters for the whole process.
pub fn stats() -> HostStats {
    state::lock().total.with_live()
}

/// Counters for the communicators born from `id` (including their split/shrink children);
/// misuse is attributed here when the handle involved belongs to that family (or when an
/// init with this id had a bad argument). All zero for an id never used.
pub fn stats_for(id: &ncclUniqueId) -> HostStats {
    let g = state::lock();
    g.find_root(&api::id_bytes(id))
        .and_then(|r| g.root_stats.get(r).copied())
        .unwrap_or_default()
        .with_live()
}

/// The root unique id of a live host communicator (for `ncclCommInitAll` cliques, whose
/// id is made internally), so [`stats_for`] can be used with them. `None` for anything else.
pub fn root_id_of(comm: ncclComm_t) -> Option<ncclUniqueId> {
    let g = state::lock();
    let root = g.comms.get(&(comm as usize))?.root;
    g.root_id(root)
}

/// The path in `/dev/shm` of the shared memory segment `id`'s communicator meets in
/// (see [`shared_unique_id`]), for a shared id; `None` for any other. The segment's name
/// is removed once every rank joined, and when an init fails or is torn down meanwhile.
#[doc(hidden)]
pub fn shared_segment_path(id: &ncclUniqueId) -> Option<String> {
    let b = api::id_bytes(id);
    shm::is_shared(&b).then(|| shm::name_of(&b))
}

/// A unique id for a host communicator whose ranks may be in several processes of this
/// machine (and threads of each): `ncclCommInitRank` with it meets the other ranks in a
/// shared memory segment named from the id instead of inside this process. Hand it to
/// every rank as any unique id (the process launchers do). Collectives of every kind, type
/// and reduction, send/recv (up to 64 ranks), split and shrink run across processes, alone
/// or in groups. A rank whose process is gone, or that destroyed or aborted its
/// communicator while others wait for it, fails the waiting collective on every rank with
/// an error naming it.
pub fn shared_unique_id() -> ncclUniqueId {
    shm::shared_id()
}

/// The most recent misuse messages (at most 64, oldest first), process wide.
pub fn recent_misuse() -> Vec<String> {
    state::lock().misuse_log.iter().cloned().collect()
}

/// The rank whose process the live host communicator `comm`'s clique (across processes)
/// saw gone, it died or was killed, and that process's pid, when that is why the clique
/// failed; `None` otherwise, and for an unknown handle. For nccl-safe only (its
/// diagnostics name the rank a SIGKILLed process held, which posted nothing).
#[doc(hidden)]
pub fn dead_peer(comm: ncclComm_t) -> Option<(usize, u32)> {
    api::dead_peer(comm)
}

/// Every rank of the live host communicator `comm`'s clique (across processes) that it
/// knows gone, and its pid: a peer whose process died or was killed, or that destroyed or
/// aborted its communicator; empty for a clique within one process and an unknown handle.
/// For nccl-safe only (a recovery excludes every rank lost, not only the first).
#[doc(hidden)]
pub fn dead_peers(comm: ncclComm_t) -> Vec<(usize, u32)> {
    api::dead_peers(comm)
}

/// The ranks of the live host communicator `comm`'s clique (across processes) that have
/// not reached the collective `comm`'s rank waits in, else the ones a peer's revoke or
/// abort found behind; empty for a clique within one process and an unknown handle. For
/// nccl-safe only (a timeout report with no desync board, or one that cannot be read,
/// names a stuck rank of another process from it).
#[doc(hidden)]
pub fn behind_peers(comm: ncclComm_t) -> Vec<usize> {
    api::behind_peers(comm)
}

/// Operations of the host handle `comm` not seen complete: accepted and never completing
/// ([`fault::Fault::StuckWork`]) or held back until released ([`fault::Fault::StalledWork`]);
/// 0 for an unknown handle. For nccl-safe only (its
/// watchdog asks whether host work is still running).
#[doc(hidden)]
pub fn stuck_ops(comm: usize) -> u64 {
    fault::stuck_ops(comm)
}

/// The `commName` of the live host communicator `comm` (its config's, or its parent's for a
/// split or shrink child made without a config), read now through the pointer the provider
/// kept, as NVIDIA's NCCL keeps it (2.28.9 reads it after the init call returned: init.cc:1251).
/// `None` for an unknown handle or no name.
///
/// # Safety
///
/// As NCCL requires: the string given as `commName` is still alive (its owner keeps it as
/// long as the communicator and its children).
pub unsafe fn comm_name(comm: ncclComm_t) -> Option<String> {
    let name = state::lock().comms.get(&(comm as usize))?.name;
    if name == 0 {
        return None;
    }
    // SAFETY: the caller's contract: the kept pointer is a live NUL-terminated string.
    let s = unsafe { std::ffi::CStr::from_ptr(name as *const core::ffi::c_char) };
    Some(s.to_string_lossy().into_owned())
}

/// Sets the calling thread's "current device", recorded by later `ncclCommInitRank(Config)`
/// calls on this thread and reported by `ncclCommCuDevice` (the host analogue of
/// `cudaSetDevice`; default 0).
pub fn set_current_device(device: c_int) {
    api::DEVICE.with(|d| d.set(device));
}

/// Whether the provider answers a non-blocking group end or collective of two ranks or more
/// as NCCL does (on, the default): ncclInProgress, every call that checks readiness refused
/// until the caller reads the state with `ncclCommGetAsyncError` (see
/// `state::AsyncJob::Launching`); off returns ncclSuccess, kinder than NCCL (a rank then never
/// sees its step fail while it waits for NCCL's launch of it, as it can on NCCL when a peer
/// leaves). Process-wide; off also with `NCCL_SAFE_HOST_LAUNCH_IN_PROGRESS=0`.
pub fn set_launch_in_progress(on: bool) {
    defs::set_launch_in_progress(on);
}

/// The version `ncclGetVersion` reports from [`lookup`]: 2.32.3.
pub const HOST_VERSION: (u32, u32, u32) = (2, 32, 3);

/// Looks up a host-provider entry point by its C name (e.g. `c"ncclAllReduce"`); null if
/// not provided. Pass it to `nccl_sys::FunctionTable::load`.
pub fn lookup(name: &CStr) -> *const c_void {
    api::table().get(name)
}

macro_rules! versioned {
    ($(($minor:literal, $patch:literal) => $f:ident),* $(,)?) => {
        $(
            unsafe extern "C" fn $f(version: *mut c_int) -> nccl_sys::ncclResult_t {
                api::get_version(version, nccl_sys::nccl_version_code(2, $minor, $patch))
            }
        )*
        /// `ncclGetVersion` reporting the release of minor version `minor` (2.18 to 2.32).
        fn versioned_get_version(minor: u32) -> *const c_void {
            match minor {
                $( $minor => $f as *const c_void, )*
                _ => core::ptr::null(),
            }
        }
    };
}

versioned! {
    (18, 3) => v2_18, (19, 3) => v2_19, (20, 5) => v2_20, (21, 5) => v2_21, (22, 3) => v2_22,
    (23, 4) => v2_23, (24, 3) => v2_24, (25, 1) => v2_25, (26, 2) => v2_26, (27, 3) => v2_27,
    (28, 3) => v2_28, (29, 2) => v2_29, (30, 3) => v2_30, (31, 2) => v2_31, (32, 3) => v2_32,
}

/// Like [`lookup`], but emulating NCCL `major.minor` (2.18 to 2.32): optional symbols newer
/// than that release are hidden and `ncclGetVersion` reports that release (with the patch
/// level of the headers this crate was checked against, e.g. 2.18.3). For a version outside
/// 2.18..=2.32 every lookup returns null, so loading a table fails.
pub fn lookup_as_version(major: u32, minor: u32) -> impl FnMut(&CStr) -> *const c_void {
    let supported = major == 2 && (18..=32).contains(&minor);
    move |name: &CStr| {
        if !supported {
            return core::ptr::null();
        }
        if name.to_bytes() == b"ncclGetVersion" {
            return versioned_get_version(minor);
        }
        let hidden = name
            .to_str()
            .ok()
            .and_then(nccl_sys::optional_since)
            .is_some_and(|since| since > (major, minor));
        if hidden {
            core::ptr::null()
        } else {
            lookup(name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The by-name lookup serves exactly the table: every required entry point, the
    /// optional ones the table has (and only those), nothing for an unknown name.
    #[test]
    fn lookup_serves_the_table_by_name() {
        let t = api::table();
        for name in nccl_sys::REQUIRED_SYMBOLS {
            let c = std::ffi::CString::new(*name).unwrap();
            assert!(!lookup(&c).is_null(), "{name}");
        }
        let present = t.present_optional();
        for s in nccl_sys::OPTIONAL_SYMBOLS {
            let c = std::ffi::CString::new(s.name).unwrap();
            assert_eq!(
                !lookup(&c).is_null(),
                present.contains(&s.name),
                "{}",
                s.name
            );
        }
        assert!(lookup(c"ncclNoSuchCall").is_null());
        assert_eq!(lookup(c"ncclAllReduce"), t.ncclAllReduce as *const c_void);
        // SAFETY: `lookup` returns the host provider's own functions, with NCCL's signatures.
        let again = unsafe { nccl_sys::FunctionTable::load(lookup) }.unwrap();
        assert_eq!(again.present_optional(), present);
    }

    /// A collective in `nccl_sys::Collective` that the host provider does not serve fails
    /// here: each row needs its entry point in `api::table()` and its execution.
    #[test]
    fn every_collective_has_a_host_entry_point() {
        for &c in nccl_sys::Collective::ALL {
            let name = std::ffi::CString::new(c.name()).unwrap();
            assert!(!lookup(&name).is_null(), "the host provider lacks {c}");
        }
    }
}
