//! Registration bookkeeping of the host provider: what `ncclCommRegister` and
//! `ncclCommWindowRegister` handed out, what was deregistered, and the misuse that shows.
//!
//! Every token ever handed out stays, marked live or not, to tell a double deregistration
//! from a handle that was never one. The registry is locked only while the global lock is
//! held (global first), so it never deadlocks with it.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use core::ffi::c_void;
use nccl_sys::bindings::ncclInvalidUsage;

use super::state::{Fail, Global, Handle, RootIdx};
use super::HostStats;

/// What is registered: a buffer (`ncclCommRegister`) or a window (`ncclCommWindowRegister`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Buffer,
    Window,
}

impl Kind {
    /// Its first token (distinct from communicator handles and the other kind's tokens),
    /// its deregistration's entry point and its name, for the messages.
    fn info(self) -> (usize, &'static str, &'static str) {
        match self {
            Kind::Buffer => (0x7e60_0000, "ncclCommDeregister", "registration"),
            Kind::Window => (0x71d0_0000, "ncclCommWindowDeregister", "window"),
        }
    }

    /// Its (registered, deregistered) counters.
    fn counters(self, s: &mut HostStats) -> (&mut u64, &mut u64) {
        match self {
            Kind::Buffer => (&mut s.registered, &mut s.deregistered),
            Kind::Window => (&mut s.windows_registered, &mut s.windows_deregistered),
        }
    }
}

/// A token handed out: its communicator, and whether it is still live.
#[derive(Debug, Default)]
struct Registry {
    tokens: HashMap<(Kind, usize), (Handle, bool)>,
    next: usize,
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A new live registration of `kind` of `h`: its token.
pub(crate) fn register(g: &mut Global, kind: Kind, h: Handle, root: RootIdx) -> usize {
    let mut r = registry();
    r.next += 1;
    let token = kind.info().0 + 16 * r.next;
    r.tokens.insert((kind, token), (h, true));
    drop(r);
    g.count(Some(root), |s| *kind.counters(s).0 += 1);
    token
}

/// The deregistration of `token` (of `kind`) on `h`: ends a live registration of `h`, or
/// reports the misuse, counted (a double deregistration, or a token `h` never handed out).
pub(crate) fn deregister(
    g: &mut Global,
    kind: Kind,
    h: Handle,
    root: RootIdx,
    token: usize,
) -> Result<(), Fail> {
    // Whether it was live, now that it is not; `None`: not one of `h`'s.
    let was_live = (registry().tokens.get_mut(&(kind, token)))
        .filter(|t| t.0 == h)
        .map(|t| std::mem::replace(&mut t.1, false));
    let (_, call, name) = kind.info();
    let m = match was_live {
        Some(true) => {
            g.count(Some(root), |s| *kind.counters(s).1 += 1);
            return Ok(());
        }
        Some(false) => {
            g.count(Some(root), |s| s.double_deregistered += 1);
            format!("{token:#x} was already deregistered")
        }
        None => {
            g.count(Some(root), |s| s.unknown_deregistered += 1);
            format!("{token:#x} is not a {name} of this communicator")
        }
    };
    Err(g.misuse(Some(root), ncclInvalidUsage, call, m))
}

/// Where `[buff, buff + size)` starts inside the one `ncclMemAlloc` allocation that holds it,
/// in bytes; `None` when no allocation holds it whole.
pub(crate) fn nccl_memory_offset(g: &Global, buff: *mut c_void, size: usize) -> Option<usize> {
    let start = buff as usize;
    let end = start.checked_add(size)?;
    (g.mem.iter())
        .find(|(&base, layout)| base <= start && end <= base + layout.size())
        .map(|(&base, _)| start - base)
}

/// Communicator `h` is being destroyed or aborted: releases its live registrations and
/// windows (as NCCL does) and counts them in `live_at_teardown`.
pub(crate) fn teardown(g: &mut Global, h: Handle, root: RootIdx) {
    let mut n = 0u64;
    for t in registry().tokens.values_mut().filter(|t| t.0 == h && t.1) {
        t.1 = false;
        n += 1;
    }
    if n > 0 {
        g.count(Some(root), |s| s.live_at_teardown += n);
    }
}
