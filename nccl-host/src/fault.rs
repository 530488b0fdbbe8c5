//! Fault injection: the GPU's failure modes, reproduced on the host provider so that the
//! crate's failure handling runs in tests on any machine: the variants of [`Fault`], each
//! [`inject`]ed into the communicators of one unique id.
//!
//! A missing peer needs no fault: a rank that never calls init is one.
//!
//! **The runtime's exit.** Like the CUDA runtime, the host provider registers a process-exit
//! handler at its first use. When the process exits while an abort is blocked by
//! [`Fault::BlockingAbort`], that handler wakes it and the abort then crashes the process
//! with `SIGSEGV`, as a thread left inside `cudaFree` does while the CUDA runtime is torn
//! down. A process whose exit is guarded (the crate's diagnostics are) never reaches it.

use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

use nccl_sys::bindings::ncclUniqueId;

use super::state::{Handle, RootIdx};

/// A fault to inject into the communicators born from one unique id (their split and
/// shrink children included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Every collective and send/recv returns `ncclSuccess` at once but never completes, as
    /// work queued on a CUDA stream behind a kernel that never ends. The watchdog sees it as
    /// work in flight.
    StuckWork,
    /// Collectives and send/recv run as usual (they wait for their peers and move the data)
    /// but are seen complete only after [`release_stalls`], as work on a stream stalled
    /// behind other work that later drains. No peer waits for it.
    StalledWork,
    /// `ncclCommAbort` blocks *before* doing its work, as NVIDIA's abort does in `cudaFree`
    /// behind a stalled stream: for this long (a slow but finite abort), or until
    /// [`release_aborts`] when `None` (a stuck one). Meanwhile nothing of it has happened:
    /// its stuck work stays stuck, waiters in its clique stay waiting, and the handle is not
    /// yet counted as torn down. Then it does its work (the clique is aborted, waiters
    /// wake, stuck work is released, as NCCL's kernels end on the abort flag).
    BlockingAbort(Option<Duration>),
    /// `ncclCommRegister`, `ncclCommDeregister` and `ncclCommGetAsyncError` wait this long
    /// before their work, as a call the driver holds up. The wait holds no lock of the
    /// provider, and the handle is looked up after it, so a handle torn down meanwhile (an
    /// abort from another thread) is a use after teardown and counted as misuse.
    SlowCalls(Duration),
    /// Across processes, a rank whose process left its communicator or died is not seen by
    /// its peers, as with NVIDIA's NCCL: they learn of it only through the crate's
    /// diagnostics (the desync board), or at the provider's deadline. Inject it before the
    /// communicator's init.
    SilentPeers,
    /// NCCL's asynchronous jobs (a split, shrink or window registration on a non-blocking
    /// communicator) do their work but do not end (store their out-pointer, leave
    /// ncclInProgress) until [`release_jobs`]: what a slow GPU does, without a race.
    HeldJobs,
    /// `ncclCommRevoke` blocks *before* doing its work, as NCCL's revoke does while it
    /// joins the communicator's group job (`ncclGroupJobAbort`, group.cc:875-877 of
    /// v2.29.7-1, behind a launch that does not end): for this long, or until
    /// [`release_revokes`] when `None`. Meanwhile nothing of it has happened. A process
    /// that exits while one is blocked crashes as for [`Fault::BlockingAbort`].
    BlockingRevoke(Option<Duration>),
}

#[derive(Debug, Default)]
struct Faults {
    stuck: HashSet<RootIdx>,
    stalled: HashSet<RootIdx>,
    blocking_abort: HashMap<RootIdx, Option<Duration>>,
    slow_calls: HashMap<RootIdx, Duration>,
    silent: HashSet<RootIdx>,
    held_jobs: HashSet<RootIdx>,
    blocking_revoke: HashMap<RootIdx, Option<Duration>>,
    /// Per handle: operations that were accepted and will never complete.
    stuck_ops: HashMap<Handle, u64>,
    /// Per handle: operations that ran but are not yet seen complete, and their root.
    stalled_ops: HashMap<Handle, (RootIdx, u64)>,
    /// Aborts blocked right now, per root.
    blocked: HashMap<RootIdx, usize>,
    /// Revokes blocked right now, per root.
    blocked_revokes: HashMap<RootIdx, usize>,
    /// The process is exiting: blocked aborts crash (see the module docs).
    torn_down: bool,
}

fn faults() -> &'static (Mutex<Faults>, Condvar) {
    static F: OnceLock<(Mutex<Faults>, Condvar)> = OnceLock::new();
    F.get_or_init(|| (Mutex::new(Faults::default()), Condvar::new()))
}

fn lock() -> MutexGuard<'static, Faults> {
    faults().0.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits on the faults' condition variable for at most `d`, returning the re-acquired lock.
fn wait_on(f: MutexGuard<'static, Faults>, d: Duration) -> MutexGuard<'static, Faults> {
    faults()
        .1
        .wait_timeout(f, d)
        .map_or_else(|e| e.into_inner().0, |(g, _)| g)
}

fn root_of(id: &ncclUniqueId) -> RootIdx {
    super::state::lock().root_of(&super::defs::id_bytes(id))
}

/// Injects `fault` into every communicator born from `id` (now or later). Faults stay
/// until [`clear`].
pub fn inject(id: &ncclUniqueId, fault: Fault) {
    let root = root_of(id);
    let mut f = lock();
    match fault {
        Fault::StuckWork => {
            f.stuck.insert(root);
        }
        Fault::StalledWork => {
            f.stalled.insert(root);
        }
        Fault::BlockingAbort(d) => {
            f.blocking_abort.insert(root, d);
        }
        Fault::SlowCalls(d) => {
            f.slow_calls.insert(root, d);
        }
        Fault::SilentPeers => {
            f.silent.insert(root);
        }
        Fault::HeldJobs => {
            f.held_jobs.insert(root);
        }
        Fault::BlockingRevoke(d) => {
            f.blocking_revoke.insert(root, d);
        }
    }
}

/// Removes every fault of `id` and releases its blocked aborts and its stalled work. Work
/// that was already stuck stays stuck.
pub fn clear(id: &ncclUniqueId) {
    let root = root_of(id);
    let mut f = lock();
    f.stuck.remove(&root);
    f.stalled.remove(&root);
    f.stalled_ops.retain(|_, (r, _)| *r != root);
    f.blocking_abort.remove(&root);
    f.slow_calls.remove(&root);
    f.silent.remove(&root);
    f.held_jobs.remove(&root);
    f.blocking_revoke.remove(&root);
    faults().1.notify_all();
}

/// Lets the asynchronous jobs held by [`Fault::HeldJobs`] end.
pub fn release_jobs(id: &ncclUniqueId) {
    let root = root_of(id);
    lock().held_jobs.remove(&root);
    faults().1.notify_all();
}

/// Waits (at most the provider's wait limit) while `root`'s jobs are held.
pub(crate) fn wait_jobs_released(root: RootIdx) {
    let deadline = Instant::now() + super::defs::wait_limit();
    let mut f = lock();
    while f.held_jobs.contains(&root) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        f = wait_on(f, left.min(Duration::from_millis(100)));
    }
}

/// Lifts [`Fault::BlockingAbort`] from `id`'s communicators: the aborts it holds return,
/// and later ones do not block.
pub fn release_aborts(id: &ncclUniqueId) {
    let root = root_of(id);
    lock().blocking_abort.remove(&root);
    faults().1.notify_all();
}

/// Lifts [`Fault::BlockingRevoke`] from `id`'s communicators: the revokes it holds go on,
/// and later ones do not block.
pub fn release_revokes(id: &ncclUniqueId) {
    let root = root_of(id);
    lock().blocking_revoke.remove(&root);
    faults().1.notify_all();
}

/// How many revokes of `id`'s communicators are blocked right now.
pub fn blocked_revokes(id: &ncclUniqueId) -> usize {
    let root = root_of(id);
    lock().blocked_revokes.get(&root).copied().unwrap_or(0)
}

/// Lifts [`Fault::StalledWork`] from `id`'s communicators: the work it held back is seen
/// complete, and later work is not held back.
pub fn release_stalls(id: &ncclUniqueId) {
    let root = root_of(id);
    let mut f = lock();
    f.stalled.remove(&root);
    f.stalled_ops.retain(|_, (r, _)| *r != root);
}

/// How many aborts of `id`'s communicators are blocked right now.
pub fn blocked_aborts(id: &ncclUniqueId) -> usize {
    let root = root_of(id);
    lock().blocked.get(&root).copied().unwrap_or(0)
}

/// Whether [`Fault::SilentPeers`] holds for the communicators of `root`.
pub(crate) fn silent_peers(root: RootIdx) -> bool {
    lock().silent.contains(&root)
}

/// Called by an operation of `h` (root `root`) that passed its checks: `true` when it is
/// to be accepted and never completed (a stalled one runs: `false`, and it is counted).
pub(crate) fn take_stuck(root: RootIdx, h: Handle) -> bool {
    let mut f = lock();
    if f.stalled.contains(&root) {
        f.stalled_ops.entry(h).or_insert((root, 0)).1 += 1;
    }
    if !f.stuck.contains(&root) {
        return false;
    }
    *f.stuck_ops.entry(h).or_default() += 1;
    true
}

/// Operations of `h` not seen complete: stuck ones (never complete) and stalled ones.
pub(crate) fn stuck_ops(h: Handle) -> u64 {
    let f = lock();
    f.stuck_ops.get(&h).copied().unwrap_or(0) + f.stalled_ops.get(&h).map_or(0, |s| s.1)
}

/// Waits, holding no lock, while `h` has work that is not seen complete (stuck or
/// stalled), up to `limit`: as a call that frees through the driver waits behind the
/// device's work. `true` when it had to wait.
pub(crate) fn wait_for_work(h: Handle, limit: Duration) -> bool {
    if stuck_ops(h) == 0 {
        return false;
    }
    let until = Instant::now() + limit;
    while stuck_ops(h) > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// Called on entry to a call that [`Fault::SlowCalls`] delays, before any lookup of
/// `comm`: waits as configured for `comm`'s root, holding no lock.
pub(crate) fn slow_call(comm: Handle) {
    let root = match super::state::lock().comms.get(&comm) {
        Some(c) => c.root,
        None => return,
    };
    let delay = lock().slow_calls.get(&root).copied();
    if let Some(d) = delay {
        std::thread::sleep(d);
    }
}

/// Called by `ncclCommAbort` of a handle of `root` before its work: blocks as configured.
pub(crate) fn block_abort(root: RootIdx) {
    block(root, |f| &mut f.blocking_abort, |f| &mut f.blocked);
}

/// Called by `ncclCommRevoke` of a handle of `root` before its work (outside the
/// provider's lock): blocks as configured.
pub(crate) fn block_revoke(root: RootIdx) {
    block(root, |f| &mut f.blocking_revoke, |f| &mut f.blocked_revokes);
}

/// Blocks while `which` holds `root` (at most its duration), counted in `count`.
fn block(
    root: RootIdx,
    which: fn(&mut Faults) -> &mut HashMap<RootIdx, Option<Duration>>,
    count: fn(&mut Faults) -> &mut HashMap<RootIdx, usize>,
) {
    let mut f = lock();
    let Some(&limit) = which(&mut f).get(&root) else {
        return;
    };
    let until = limit.map(|d| Instant::now() + d);
    *count(&mut f).entry(root).or_default() += 1;
    loop {
        if f.torn_down {
            drop(f);
            crash();
        }
        if !which(&mut f).contains_key(&root) {
            break; // released
        }
        let wait = match until {
            Some(u) if Instant::now() >= u => break,
            Some(u) => u - Instant::now(),
            None => Duration::from_secs(3600),
        };
        f = wait_on(f, wait);
    }
    if let Some(n) = count(&mut f).get_mut(&root) {
        *n = n.saturating_sub(1);
    }
}

/// This rank's abort flags were set (a revoke's, a shrink's in abort mode): `h`'s stuck
/// work ends (NCCL's kernels end on the flags); its stalled work, queued behind other work
/// on the stream, stays until that drains.
pub(crate) fn end_stuck(h: Handle) {
    lock().stuck_ops.remove(&h);
}

/// Waits, holding no lock, until `h`'s stalled work drained ([`release_stalls`]), up to
/// `limit`: NCCL's `ncclStrongStreamSynchronize` of the communicator's streams (a revoke's
/// job, init.cc:2616-2617 of v2.29.7-1; a shrink in abort mode, in the call, :2844-2848),
/// which waits for the work queued before NCCL's kernels on the user's stream. `true` when
/// it drained.
pub(crate) fn wait_stalled(h: Handle, limit: Duration) -> bool {
    let stalled = |h| lock().stalled_ops.get(&h).map_or(0, |s| s.1);
    let until = Instant::now() + limit;
    while stalled(h) > 0 {
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// Called once the handle `h` was torn down: its stuck work goes with it (NCCL's kernels
/// end on the abort flag).
pub(crate) fn torn_down(h: Handle) {
    let mut f = lock();
    f.stuck_ops.remove(&h);
    f.stalled_ops.remove(&h);
}

/// What a thread left inside `cudaFree` does when the CUDA runtime is torn down under it.
fn crash() -> ! {
    eprintln!(
        "host provider: an ncclCommAbort blocked by Fault::BlockingAbort was still running when the process exited: crashing as the CUDA runtime does"
    );
    // SAFETY: raising a signal has no memory-safety preconditions; SIGSEGV's default
    // action ends the process.
    unsafe {
        libc::raise(libc::SIGSEGV);
    }
    std::process::abort()
}

/// Registers the provider's process-exit handler, once (at first use, as the CUDA runtime
/// does at its initialization).
pub(crate) fn ensure_runtime() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn()` with no arguments.
        unsafe {
            libc::atexit(runtime_teardown);
        }
    });
}

/// The runtime's exit handler: blocked aborts wake and crash (see the module docs).
extern "C" fn runtime_teardown() {
    let mut f = lock();
    f.torn_down = true;
    faults().1.notify_all();
    // Give a woken abort the time to crash the process, as it would on a GPU.
    let until = Instant::now() + Duration::from_secs(2);
    while f.blocked.values().any(|&n| n > 0) && Instant::now() < until {
        f = wait_on(f, Duration::from_millis(20));
    }
}
