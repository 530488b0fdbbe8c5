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
    /// What a window token covers, for the one-sided calls.
    windows: HashMap<usize, WinInfo>,
    /// Windows registered so far per communicator: a window's `order` (every rank
    /// registers windows collectively, so the same order names a window's counterparts).
    order: HashMap<Handle, u64>,
    /// Signals posted to a rank (clique, rank) and not yet waited for, in order: the
    /// sender, and the data of a put (its destination window's order, the byte offset,
    /// the bytes), read from the source when the put was called.
    signals: HashMap<(u64, i32), Vec<Arrival>>,
    /// Data of puts whose signals a wait counted, kept for a wait that names their window
    /// (see [`land`]), by window token.
    staged: HashMap<usize, Vec<(usize, Vec<u8>)>>,
}

/// A window's buffer, size, flags and registration order on its communicator.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WinInfo {
    pub h: Handle,
    pub buff: usize,
    pub size: usize,
    pub flags: core::ffi::c_int,
    pub order: u64,
}

/// One signal on its way: from rank `from`, with a put's data (the destination window's
/// order, the byte offset into it, the bytes) or none (`ncclSignal`).
#[derive(Debug)]
pub(crate) struct Arrival {
    pub from: i32,
    pub data: Option<(u64, usize, Vec<u8>)>,
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

/// [`register`] of a window over `[buff, buff + size)` with `flags`: its token, its
/// buffer recorded for the one-sided calls.
pub(crate) fn register_window(
    g: &mut Global,
    h: Handle,
    root: RootIdx,
    buff: usize,
    size: usize,
    flags: core::ffi::c_int,
) -> usize {
    let token = register(g, Kind::Window, h, root);
    let mut r = registry();
    let n = r.order.entry(h).or_insert(0);
    let order = *n;
    *n += 1;
    let info = WinInfo {
        h,
        buff,
        size,
        flags,
        order,
    };
    r.windows.insert(token, info);
    drop(r);
    // A peer's put may wait for this window (see `ncclPutSignal`).
    super::state::notify();
    token
}

/// The live window `token` of `h`.
pub(crate) fn window(h: Handle, token: usize) -> Option<WinInfo> {
    let r = registry();
    let live = r.tokens.get(&(Kind::Window, token)) == Some(&(h, true));
    r.windows.get(&token).copied().filter(|_| live)
}

/// The live window of `h` that holds `[ptr, ptr + bytes)` whole.
pub(crate) fn window_holding(h: Handle, ptr: usize, bytes: usize) -> Option<WinInfo> {
    let r = registry();
    let end = ptr.checked_add(bytes)?;
    (r.windows.iter())
        .filter(|(t, w)| w.h == h && r.tokens.get(&(Kind::Window, **t)) == Some(&(h, true)))
        .map(|(_, w)| *w)
        .find(|w| w.buff <= ptr && end <= w.buff + w.size)
}

/// The live window of `h` registered `order`-th, with its token.
pub(crate) fn window_of_order(h: Handle, order: u64) -> Option<(usize, WinInfo)> {
    let r = registry();
    (r.windows.iter())
        .filter(|(t, w)| w.h == h && r.tokens.get(&(Kind::Window, **t)) == Some(&(h, true)))
        .map(|(t, w)| (*t, *w))
        .find(|(_, w)| w.order == order)
}

/// Posts a signal (with a put's data) to rank `to` of `clique`.
pub(crate) fn post_signal(clique: u64, to: i32, a: Arrival) {
    registry().signals.entry((clique, to)).or_default().push(a);
}

/// Whether `(from, count)` signals each have reached rank `me` of `clique`; then takes
/// them (the first `count` from each `from`, in order) and hands their data back.
pub(crate) fn take_signals(
    clique: u64,
    me: i32,
    wants: &[(i32, usize)],
) -> Option<Vec<(u64, usize, Vec<u8>)>> {
    let mut r = registry();
    let q = r.signals.entry((clique, me)).or_default();
    let arrived = |p: i32| q.iter().filter(|a| a.from == p).count();
    // The same peer named twice waits for the sum, as NCCL's counters do.
    let mut need: HashMap<i32, usize> = HashMap::new();
    for &(p, n) in wants {
        *need.entry(p).or_insert(0) += n;
    }
    if need.iter().any(|(&p, &n)| arrived(p) < n) {
        return None;
    }
    let mut data = Vec::new();
    let mut kept = Vec::with_capacity(q.len());
    for a in q.drain(..) {
        match need.get_mut(&a.from) {
            Some(n) if *n > 0 => {
                *n -= 1;
                data.extend(a.data);
            }
            _ => kept.push(a),
        }
    }
    *q = kept;
    Some(data)
}

/// Rank `rank` of `clique` is torn down: the signals to it that no wait took go.
pub(crate) fn drop_signals(clique: u64, rank: i32) {
    registry().signals.remove(&(clique, rank));
}

/// Copies `bytes` into window `w` at byte offset `off`, when they fit inside it (a put
/// that does not fit was refused at its call; nothing is written past the window).
///
/// # Safety
/// `w` describes a live window: `w.size` bytes at `w.buff` are writable.
unsafe fn copy_into(w: &WinInfo, off: usize, bytes: &[u8]) {
    if off
        .checked_add(bytes.len())
        .is_some_and(|end| end <= w.size)
    {
        // SAFETY: in bounds of the live window (checked above; the caller's contract).
        unsafe {
            core::ptr::copy_nonoverlapping(bytes.as_ptr(), (w.buff + off) as *mut u8, bytes.len())
        };
    }
}

/// Lands data of counted puts on `h`: into `only`'s window (a token) when the caller named
/// one, else into each window of `h` they target; data for another window than `only` is
/// staged until a wait names it. A window deregistered since is skipped (NCCL would write
/// into memory that is no longer the window's).
///
/// # Safety
/// Every live window of `h` (or `only`'s) is writable memory of its registered size, not
/// referenced elsewhere during the call.
pub(crate) unsafe fn land(h: Handle, data: Vec<(u64, usize, Vec<u8>)>, only: Option<usize>) {
    let mut staged = Vec::new();
    for (order, off, bytes) in data {
        let Some((token, w)) = window_of_order(h, order) else {
            continue;
        };
        if only.is_some_and(|o| o != token) {
            staged.push((token, off, bytes));
            continue;
        }
        // SAFETY: the window is live; the caller's contract.
        unsafe { copy_into(&w, off, &bytes) };
    }
    let mut r = registry();
    for (token, off, bytes) in staged {
        r.staged.entry(token).or_default().push((off, bytes));
    }
    let Some(token) = only else { return };
    let earlier = r.staged.remove(&token).unwrap_or_default();
    let w = r.windows.get(&token).copied();
    drop(r);
    if let Some(w) = w.filter(|_| window(h, token).is_some()) {
        for (off, bytes) in earlier {
            // SAFETY: as above.
            unsafe { copy_into(&w, off, &bytes) };
        }
    }
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
    // Data of puts kept for a wait on this window has nowhere to land any more.
    registry().staged.remove(&token);
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
