//! The host provider's base types, shared by its registry (`state`), its execution
//! (`exec`), its entry points (`api`) and its shared-memory communicators (`shm`): unique
//! ids, the error it reports, a collective's description, and the wait limit. A leaf of the
//! provider: it imports none of its siblings but `dtype`.

use core::ffi::c_char;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nccl_sys::bindings::*;

use super::dtype::RedKind;
pub(crate) use nccl_sys::Collective;

/// The bytes of a unique id.
pub(crate) type IdBytes = [u8; 128];

/// Prefix of every unique id this provider makes.
pub(crate) const ID_MAGIC: &[u8; 16] = b"nccl-safe-host\0\x01";

/// A fresh unique id: [`ID_MAGIC`], then bytes unique per call in this process.
pub(crate) fn fresh_id() -> ncclUniqueId {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut b = [0u8; 128];
    b[..16].copy_from_slice(ID_MAGIC);
    b[16..20].copy_from_slice(&std::process::id().to_le_bytes());
    b[20..28].copy_from_slice(&n.to_le_bytes());
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    b[28..44].copy_from_slice(&t.to_le_bytes());
    let rs = std::collections::hash_map::RandomState::new();
    for (i, chunk) in b[44..].chunks_mut(8).enumerate() {
        let mut h = rs.build_hasher();
        h.write_u64(n);
        h.write_usize(i);
        let v = h.finish().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    unique_id_of(b)
}

pub(crate) fn id_bytes(id: &ncclUniqueId) -> IdBytes {
    id.internal.map(|x| x as u8)
}

pub(crate) fn unique_id_of(b: IdBytes) -> ncclUniqueId {
    ncclUniqueId {
        internal: b.map(|x| x as c_char),
    }
}

/// An error to report through the C ABI: a result code and the last-error text.
#[derive(Debug, Clone)]
pub(crate) struct Fail {
    pub code: ncclResult_t,
    pub msg: String,
}

impl Fail {
    /// A failure with `code` and the text "{what the code is}: {m}", as NCCL's messages
    /// start: "internal error: ...", "remote error: ...", "NCCL timeout: ...".
    pub(crate) fn new(code: ncclResult_t, m: impl std::fmt::Display) -> Self {
        let kind = match code {
            ncclInternalError => "internal error",
            ncclRemoteError => "remote error",
            ncclInvalidUsage => "invalid usage",
            ncclInvalidArgument => "invalid argument",
            ncclSystemError => "system error",
            ncclTimeout => "NCCL timeout",
            _ => return Fail::raw(code, m.to_string()),
        };
        Fail::raw(code, format!("{kind}: {m}"))
    }

    /// A failure with `code` and the text `msg` as it is.
    pub(crate) fn raw(code: ncclResult_t, msg: String) -> Self {
        Fail { code, msg }
    }
}

/// One rank's part of a collective, or one side of a send/recv pair (`Send` with its
/// buffer in `send`, `Recv` with it in `recv`).
#[derive(Debug, Clone)]
pub(crate) struct CollPost {
    pub kind: Collective,
    pub send: usize,
    pub recv: usize,
    pub count: usize,
    pub dtype: ncclDataType_t,
    pub red: RedKind,
    pub scalar: Vec<u8>,
    pub root: i32,
    /// The user's line that called it, when the safe layer made the call.
    pub caller: Option<&'static std::panic::Location<'static>>,
}

/// How long a wait may last before it fails with `ncclTimeout`.
pub(crate) fn wait_limit() -> Duration {
    static LIMIT: OnceLock<Duration> = OnceLock::new();
    *LIMIT.get_or_init(|| env_ms("NCCL_SAFE_HOST_TIMEOUT_MS", 300_000))
}

/// How long NCCL's asynchronous work (a split, shrink or window registration on a
/// non-blocking communicator) takes at least before it writes its out-pointer and the
/// communicator leaves ncclInProgress: 5 ms by default, or `NCCL_SAFE_HOST_JOB_LATENCY_MS`
/// (an H100's split took 36 ms). Enough that a caller that reads the slot before waiting
/// finds it empty, as on a GPU, and cheap enough for tests that split thousands of times.
pub(crate) fn job_latency() -> Duration {
    static LATENCY: OnceLock<Duration> = OnceLock::new();
    *LATENCY.get_or_init(|| env_ms("NCCL_SAFE_HOST_JOB_LATENCY_MS", 5))
}

/// `NCCL_CHECK_POINTERS=1`, read once per process as NCCL's parameter is (init.cc:55, 452
/// of 2.28.9; `nccl_sys::param`): each collective then checks its buffers' pointers (see
/// `api::coll`).
pub(crate) fn check_pointers() -> bool {
    static CHECK: OnceLock<bool> = OnceLock::new();
    *CHECK.get_or_init(|| nccl_sys::param("NCCL_CHECK_POINTERS") == Some(1))
}

/// `NCCL_LOCAL_REGISTER` (default 1, register/register.cc:15 of 2.28.9), read once per
/// process as NCCL's parameter is: with 0, `ncclCommRegister` registers nothing and hands
/// out a NULL handle (:118-121), and so does `ncclCommWindowRegister` without symmetric
/// support ([`win_enable`]; dev_runtime.cc:902).
pub(crate) fn local_register() -> bool {
    static LOCAL: OnceLock<bool> = OnceLock::new();
    *LOCAL.get_or_init(|| nccl_sys::param("NCCL_LOCAL_REGISTER").unwrap_or(1) != 0)
}

/// Whether a communicator has symmetric support: NCCL's `isAllCudaP2p && NCCL_WIN_ENABLE
/// && cuMem` (init.cc:1376 of 2.28.9), of which the provider has all but the parameter
/// (default 1, init.cc:58), read once per process.
pub(crate) fn win_enable() -> bool {
    static WIN: OnceLock<bool> = OnceLock::new();
    *WIN.get_or_init(|| nccl_sys::param("NCCL_WIN_ENABLE").unwrap_or(1) != 0)
}

/// `NCCL_DISABLE_MEM_MANAGER` (default 0, mem_manager.cc:28 of 2.30.7), read once per
/// process as NCCL's parameter is: set, `ncclCommSuspend(NCCL_SUSPEND_MEM)`,
/// `ncclCommResume` and `ncclCommMemStats` return ncclInvalidUsage (:939-943, :981-985,
/// :1017-1020).
pub(crate) fn mem_manager_disabled() -> bool {
    static DISABLED: OnceLock<bool> = OnceLock::new();
    *DISABLED.get_or_init(|| nccl_sys::param("NCCL_DISABLE_MEM_MANAGER").unwrap_or(0) != 0)
}

/// What `ncclCommMemStats` reports for one host communicator: NCCL's memory manager counts
/// the bytes of its own device allocations, persistent (`totalPersist`: never released)
/// and suspendable (`totalScratch + totalOffload`: released by a suspend, mem_manager.cc:
/// 1029-1040 of 2.30.7). The provider allocates no device memory; these are its stand-in
/// figures, fixed per communicator, so that a caller sees the shape NCCL reports.
pub(crate) const HOST_MEM_PERSIST: u64 = 64 << 10;
/// See [`HOST_MEM_PERSIST`]: the suspendable part.
pub(crate) const HOST_MEM_SUSPENDABLE: u64 = 4 << 20;

/// `NCCL_COMM_BLOCKING` when it is 0 or 1, read once per process as NCCL's parameter is
/// (init.cc:56 of 2.28.9). It overrides every new communicator's `blocking`, whether from
/// its config or its parent's (`envConfigOverride`, init.cc:1646-1649; a split's child
/// too, :1800).
pub(crate) fn comm_blocking() -> Option<bool> {
    static BLOCKING: OnceLock<Option<bool>> = OnceLock::new();
    *BLOCKING.get_or_init(|| match nccl_sys::param("NCCL_COMM_BLOCKING")? as i32 {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    })
}

/// [`crate::set_launch_in_progress`]: unset (0), off (1) or on (2).
static LAUNCH_IN_PROGRESS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

pub(crate) fn set_launch_in_progress(on: bool) {
    LAUNCH_IN_PROGRESS.store(1 + on as u8, std::sync::atomic::Ordering::Release);
}

/// Whether a launch of two ranks or more answers ncclInProgress (see
/// [`crate::set_launch_in_progress`]).
pub(crate) fn launch_in_progress() -> bool {
    match LAUNCH_IN_PROGRESS.load(std::sync::atomic::Ordering::Acquire) {
        0 => {
            // On unless the environment turns it off.
            let on = std::env::var("NCCL_SAFE_HOST_LAUNCH_IN_PROGRESS")
                .map_or(true, |v| v.trim() != "0");
            // A set_launch_in_progress racing this keeps its own value.
            let _ = LAUNCH_IN_PROGRESS.compare_exchange(
                0,
                1 + on as u8,
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
            );
            LAUNCH_IN_PROGRESS.load(std::sync::atomic::Ordering::Acquire) == 2
        }
        v => v == 2,
    }
}

/// The milliseconds in environment variable `name`, or `default` when unset or unparsable.
fn env_ms(name: &str, default: u64) -> Duration {
    let ms = std::env::var(name).ok().and_then(|v| v.trim().parse().ok());
    Duration::from_millis(ms.unwrap_or(default))
}

/// A check the caller's waits poll: `true` once the call can never complete (a peer it
/// needs has left), which ends them as their deadline would. For nccl-safe only (its
/// `Group::end` passes one to [`with_deadline`]). Borrowed, not boxed: a group's end passes
/// one on every call, and the per-operation path makes no heap allocation.
pub type CallCancel<'a> = &'a dyn Fn() -> bool;

/// [`CallCancel`] with its lifetime erased, for the thread-local: valid only while the
/// [`with_deadline`] call that stored it runs (its guard takes it back before returning).
type ErasedCancel = *const (dyn Fn() -> bool + 'static);

std::thread_local! {
    /// The deadline the caller gave the call this thread is making (see [`with_deadline`]).
    static CALL_DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
    /// The check the caller gave that call, if any (see [`with_deadline`]).
    static CALL_CANCEL: Cell<Option<ErasedCancel>> = const { Cell::new(None) };
}

/// How often a wait with a [`CallCancel`] polls it.
pub(crate) const CANCEL_POLL: Duration = Duration::from_millis(10);

/// Puts back the deadline and check of an enclosing [`with_deadline`], also when `f`
/// unwinds, so no erased check outlives its borrow.
struct Restore {
    deadline: Option<Instant>,
    cancel: Option<ErasedCancel>,
}

impl Drop for Restore {
    fn drop(&mut self) {
        CALL_DEADLINE.with(|c| c.set(self.deadline));
        CALL_CANCEL.with(|c| c.set(self.cancel));
    }
}

/// Runs `f` (one call into the provider) with its waits ending by `deadline` at the latest,
/// as a non-blocking NCCL communicator's caller bounds its wait for `ncclInProgress`: the
/// crate's `Group::end` passes its communicators' timeout, because a group's communicators
/// are claimed against the watchdog for the whole call, so no abort could end the wait.
/// `cancel`, when given, is polled (every `CANCEL_POLL`, without the provider's lock) and
/// ends the waits at once when it returns `true`: a group whose peer left fails then, not at
/// its deadline. For nccl-safe only.
pub fn with_deadline<R>(
    deadline: Instant,
    cancel: Option<CallCancel<'_>>,
    f: impl FnOnce() -> R,
) -> R {
    // SAFETY: only the lifetime changes (same fat pointer). The pointer is dereferenced
    // only by `call_cancelled` on this thread, inside `f`; `_restore` replaces it with the
    // enclosing call's value before this function returns or unwinds, so it is never used
    // after `cancel`'s borrow ends.
    let erased = cancel
        .map(|c| unsafe { std::mem::transmute::<*const (dyn Fn() -> bool + '_), ErasedCancel>(c) });
    let _restore = Restore {
        deadline: CALL_DEADLINE.with(|c| c.replace(Some(deadline))),
        cancel: CALL_CANCEL.with(|c| c.replace(erased)),
    };
    f()
}

/// Whether this thread's current call has a [`CallCancel`] to poll.
pub(crate) fn call_cancellable() -> bool {
    CALL_CANCEL.with(|c| c.get().is_some())
}

/// Whether this thread's current call's [`CallCancel`] says it can never complete. Call
/// it without the provider's lock: the check reads the caller's own state.
pub(crate) fn call_cancelled() -> bool {
    // SAFETY: a stored check is live while its `with_deadline` runs (see there), and this
    // runs inside it, on its thread.
    CALL_CANCEL
        .with(|c| c.get())
        .is_some_and(|f| unsafe { (*f)() })
}

/// When the waits of this thread's current call give up: [`wait_limit`] from now, or the
/// caller's deadline when it is sooner.
pub(crate) fn call_deadline() -> Instant {
    let limit = Instant::now() + wait_limit();
    CALL_DEADLINE
        .with(|c| c.get())
        .map_or(limit, |d| d.min(limit))
}
