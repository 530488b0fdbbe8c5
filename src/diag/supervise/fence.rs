//! Asymmetric fences between a communicator's thread and the watchdog.
//!
//! The watchdog must never abort a handle that its owner is about to use for a new
//! operation. That is Dekker's problem: the owner stores "I am in operation X" and then
//! loads "has the watchdog claimed me?"; the watchdog stores its claim and then loads the
//! owner's operation. Each side needs a full fence between its store and its load, and on
//! the owner's side that fence (or a locked read-modify-write) would cost more than the
//! rest of the diagnostics together, on every operation.
//!
//! So the cost goes to the side that runs once per timeout: the owner issues only a
//! compiler fence ([`light`]), and the watchdog calls `membarrier(2)` with
//! `MEMBARRIER_CMD_PRIVATE_EXPEDITED` ([`heavy`]), which runs a full memory barrier on
//! every thread of this process that is running on a CPU at that moment (a thread that is
//! not running passes one when it is scheduled again). The pair orders like two full
//! fences: this is the pattern of the membarrier man page, and of userspace RCU.
//!
//! Where membarrier is unavailable (Linux before 4.14, or a seccomp filter that refuses
//! it) both sides use a full `fence(SeqCst)` instead.

use std::sync::atomic::{compiler_fence, fence, Ordering};
use std::sync::OnceLock;

/// `MEMBARRIER_CMD_PRIVATE_EXPEDITED` (linux/membarrier.h).
const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
/// `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED`.
const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

fn membarrier(cmd: libc::c_int) -> bool {
    // SAFETY: membarrier takes two integer arguments and touches no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            cmd,
            0 as libc::c_uint,
            0 as libc::c_int,
        ) == 0
    }
}

/// Whether the asymmetric form is in use: registers this process for expedited private
/// membarrier on the first call.
pub(crate) fn asymmetric() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var_os("NCCL_SAFE_NO_MEMBARRIER").is_none()
            && membarrier(REGISTER_PRIVATE_EXPEDITED)
            && membarrier(PRIVATE_EXPEDITED)
    })
}

/// The owner's side, between its store and its load (`asym`: [`asymmetric`]).
#[inline(always)]
pub(crate) fn light(asym: bool) {
    if asym {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The watchdog's side, between its store and its load. `false` when it could not be
/// issued (a membarrier failing after it was registered, which the kernel does not do):
/// then the watchdog must not act on its load.
#[must_use]
pub(crate) fn heavy(asym: bool) -> bool {
    if asym {
        membarrier(PRIVATE_EXPEDITED)
    } else {
        fence(Ordering::SeqCst);
        true
    }
}
