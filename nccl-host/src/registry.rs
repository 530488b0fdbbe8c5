//! Registration bookkeeping of the host provider: what `ncclCommRegister` and
//! `ncclCommWindowRegister` handed out, what was deregistered, and the misuse that shows.
//!
//! Live buffer registrations are the global state's `regs` (token -> communicator); this
//! registry adds the tokens already deregistered (to tell a double deregistration from a
//! handle that was never one) and the windows. It is locked only while the global lock is
//! held (global first), so it never deadlocks with it.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use core::ffi::c_void;
use nccl_sys::bindings::ncclInvalidUsage;

use super::state::{Fail, Global, Handle, RootIdx};

/// First window token (distinct from communicator handles and registration tokens).
const WINDOW_BASE: usize = 0x71d0_0000;

/// A window handed out by `ncclCommWindowRegister`.
#[derive(Debug, Clone, Copy)]
struct Win {
    comm: Handle,
    live: bool,
}

#[derive(Debug, Default)]
struct Registry {
    /// Buffer registrations deregistered (or released at teardown): token -> communicator.
    retired: HashMap<usize, Handle>,
    /// Every window ever handed out, by token.
    windows: HashMap<usize, Win>,
    next_window: usize,
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A deregistration entry point and what it deregisters, for the messages.
type What = (&'static str, &'static str);
const REGISTRATION: What = ("ncclCommDeregister", "registration");
const WINDOW: What = ("ncclCommWindowDeregister", "window");

/// A deregistration of a handle that was deregistered before: misuse, counted.
fn double(g: &mut Global, root: RootIdx, (call, _): What, token: usize) -> Fail {
    g.count(Some(root), |s| s.double_deregistered += 1);
    let m = format!("{token:#x} was already deregistered");
    g.misuse(Some(root), ncclInvalidUsage, call, m)
}

/// A deregistration of a handle this communicator never handed out: misuse, counted.
fn unknown(g: &mut Global, root: RootIdx, (call, kind): What, token: usize) -> Fail {
    g.count(Some(root), |s| s.unknown_deregistered += 1);
    let m = format!("{token:#x} is not a {kind} of this communicator");
    g.misuse(Some(root), ncclInvalidUsage, call, m)
}

/// `ncclCommDeregister(comm = h, handle = token)`: removes a live registration of `h`, or
/// reports the misuse (a double deregistration, or a handle `h` never handed out).
pub(crate) fn deregister(
    g: &mut Global,
    h: Handle,
    root: RootIdx,
    token: usize,
) -> Result<(), Fail> {
    if g.regs.get(&token) == Some(&h) {
        g.regs.remove(&token);
        registry().retired.insert(token, h);
        g.count(Some(root), |s| s.deregistered += 1);
        return Ok(());
    }
    let retired = registry().retired.get(&token) == Some(&h);
    Err(if retired {
        double(g, root, REGISTRATION, token)
    } else {
        unknown(g, root, REGISTRATION, token)
    })
}

/// `ncclCommWindowRegister`: a new window of `h`.
pub(crate) fn register_window(g: &mut Global, h: Handle, root: RootIdx) -> usize {
    let mut r = registry();
    r.next_window += 1;
    let token = WINDOW_BASE + 16 * r.next_window;
    r.windows.insert(
        token,
        Win {
            comm: h,
            live: true,
        },
    );
    drop(r);
    g.count(Some(root), |s| s.windows_registered += 1);
    token
}

/// `ncclCommWindowDeregister(comm = h, win = token)`.
pub(crate) fn deregister_window(
    g: &mut Global,
    h: Handle,
    root: RootIdx,
    token: usize,
) -> Result<(), Fail> {
    // Whether the window of `h` was live, now that it is not; `None`: not a window of `h`.
    let was_live = registry()
        .windows
        .get_mut(&token)
        .filter(|w| w.comm == h)
        .map(|w| std::mem::replace(&mut w.live, false));
    match was_live {
        Some(true) => {
            g.count(Some(root), |s| s.windows_deregistered += 1);
            Ok(())
        }
        Some(false) => Err(double(g, root, WINDOW, token)),
        None => Err(unknown(g, root, WINDOW, token)),
    }
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
    let mut r = registry();
    let mut n = 0u64;
    g.regs.retain(|&t, &mut c| {
        if c == h {
            r.retired.insert(t, h);
            n += 1;
        }
        c != h
    });
    for w in r.windows.values_mut().filter(|w| w.comm == h && w.live) {
        w.live = false;
        n += 1;
    }
    drop(r);
    if n > 0 {
        g.count(Some(root), |s| s.live_at_teardown += n);
    }
}
