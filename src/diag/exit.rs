//! The process-exit guard: a process that ends (by returning from `main` or with
//! `std::process::exit`) while one of the crate's background threads is inside NCCL or
//! CUDA (an abort blocked behind a stuck stream, a watchdog query) exits with its own
//! status instead of crashing.
//!
//! Without it, `exit` runs the CUDA runtime's teardown while that thread is still inside
//! the runtime, and the process dies with `SIGSEGV`. The guard is an `on_exit` handler
//! registered after NCCL (and so the CUDA runtime) was initialized, so it runs before the
//! runtime's teardown: it stops background threads from starting new calls, waits up to
//! [`EXIT_GRACE`] for the calls in flight, and if one is still running it reports that on
//! stderr and ends the process with `_exit(status)`, skipping the handlers that would
//! crash. Rust has flushed `stdout` by then. Where `on_exit` is not available (other C
//! libraries than glibc) the guard only waits.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// How long an exiting process waits for background NCCL/CUDA calls to return.
pub const EXIT_GRACE: Duration = Duration::from_secs(1);

static EXITING: AtomicBool = AtomicBool::new(false);
static BUSY: AtomicUsize = AtomicUsize::new(0);

/// A background thread's permission to be inside NCCL or CUDA; dropping it ends the call.
#[derive(Debug)]
pub(crate) struct Busy(());

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Enters a background NCCL/CUDA call: `None` once the process is exiting (then the call
/// must not be made).
pub(crate) fn busy() -> Option<Busy> {
    BUSY.fetch_add(1, Ordering::SeqCst);
    if EXITING.load(Ordering::SeqCst) {
        BUSY.fetch_sub(1, Ordering::SeqCst);
        return None;
    }
    Some(Busy(()))
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
                "nccl-safe: the process is exiting (status {status}) while an NCCL abort or CUDA call of the watchdog is still running: ending it now, without the CUDA runtime's teardown"
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

/// Stops new background calls and waits (bounded) for those in flight: `true` when none
/// is left.
fn settle() -> bool {
    EXITING.store(true, Ordering::SeqCst);
    let until = Instant::now() + EXIT_GRACE;
    while BUSY.load(Ordering::SeqCst) > 0 {
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}
