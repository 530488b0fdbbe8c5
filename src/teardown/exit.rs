//! The process-exit guard: a process that ends (by returning from `main` or with
//! `std::process::exit`) while one of the crate's background threads is inside NCCL or
//! CUDA (a teardown on its lane, a watchdog query) waits for that call, and ends early
//! only when the call is blocked past its bound.
//!
//! Without it, `exit` runs the CUDA runtime's teardown while that thread is still inside
//! the runtime, and the process dies with `SIGSEGV`. The guard is an `on_exit` handler
//! registered after NCCL (and so the CUDA runtime) was initialized, so it runs before the
//! runtime's teardown. It stops background threads from starting new calls, then waits
//! for the calls in flight: each until it returns or has run for its own bound
//! ([`Config::abort_timeout`](crate::Config::abort_timeout) for a teardown). When every call
//! returned, the exit goes on normally and every earlier exit handler runs (C stdio,
//! profilers, coverage, Python's hooks). Only when a call is still running past its bound
//! does the guard report it on stderr and end the process with `_exit(status)`, skipping
//! the handlers that would crash. Rust has flushed `stdout` by then. Network I/O (the
//! desync board) never counts as a call in flight: a departure being posted to the board
//! (so that peers in other processes learn that this rank left) is waited for until its
//! own deadline, and is never a reason to end early. Where `on_exit` is not available
//! (other C libraries than glibc) the guard only waits.

use super::lock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

static EXITING: AtomicBool = AtomicBool::new(false);

/// What is in flight: (id, when it began, its bound, whether it is a call into NCCL or
/// CUDA rather than a post to the desync board).
static IN_FLIGHT: Mutex<Vec<(u64, Instant, Duration, bool)>> = Mutex::new(Vec::new());

/// A background thread's permission to be inside NCCL or CUDA ([`busy`]), or to post to
/// the desync board ([`posting`]); dropping it ends the call or the post.
#[derive(Debug)]
pub(crate) struct Busy(u64);

impl Drop for Busy {
    fn drop(&mut self) {
        lock(&IN_FLIGHT).retain(|b| b.0 != self.0);
    }
}

/// Enters a background NCCL/CUDA call that should return within `bound`: `None` once the
/// process is exiting (then the call must not be made).
pub(crate) fn busy(bound: Duration) -> Option<Busy> {
    enter(bound, true)
}

/// Enters a post that exit waits for until `deadline`: `None` once the process is exiting.
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(crate) fn posting(deadline: Instant) -> Option<Busy> {
    enter(deadline.saturating_duration_since(Instant::now()), false)
}

/// Adds a call or a post under a fresh id, unless the process is exiting: checked under
/// the list's lock, which the exit takes to set [`EXITING`].
fn enter(bound: Duration, call: bool) -> Option<Busy> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut list = lock(&IN_FLIGHT);
    if EXITING.load(Ordering::SeqCst) {
        return None;
    }
    list.push((id, Instant::now(), bound, call));
    Some(Busy(id))
}

/// Registers the guard, once. Call it after the library was initialized (its runtime's own
/// exit handlers must be registered first, so that the guard runs before them).
pub(crate) fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(register);
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn register() {
    extern "C" {
        fn on_exit(
            function: extern "C" fn(std::ffi::c_int, *mut std::ffi::c_void),
            arg: *mut std::ffi::c_void,
        ) -> std::ffi::c_int;
    }
    extern "C" fn handler(status: std::ffi::c_int, _arg: *mut std::ffi::c_void) {
        if !settle() {
            eprintln!(
                "nccl-safe: the process is exiting (status {status}) while a background NCCL or CUDA call is blocked past its bound (Config::abort_timeout): ending it now, without the later exit handlers and the CUDA runtime's teardown"
            );
            // SAFETY: `_exit` ends the process at once; nothing runs after it.
            unsafe { libc::_exit(status) }
        }
    }
    // SAFETY: registers a handler with the signature glibc's `on_exit` expects; the
    // argument is unused.
    unsafe {
        on_exit(handler, std::ptr::null_mut());
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn register() {
    extern "C" fn handler() {
        let _ = settle();
    }
    // SAFETY: registers a plain `extern "C" fn()`.
    unsafe {
        libc::atexit(handler);
    }
}

/// Stops new background calls and waits for those in flight, each until it returns or
/// runs past its bound: `true` when none is left, `false` when one is blocked past it.
fn settle() -> bool {
    {
        // Under the list's lock: a call or post entering after this sees EXITING.
        let _list = lock(&IN_FLIGHT);
        EXITING.store(true, Ordering::SeqCst);
    }
    loop {
        let now = Instant::now();
        let (mut left, mut overdue) = (false, false);
        for &(_, start, bound, call) in lock(&IN_FLIGHT).iter() {
            let late = now >= start + bound;
            // Posts are waited for until their deadline, and never end the process early.
            left |= call || !late;
            overdue |= call && late;
        }
        if !left {
            return true;
        }
        if overdue {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
