//! The NCCL C ABI, implemented over host memory (one `extern "C"` function per entry point).
#![allow(non_snake_case)]

use core::ffi::{c_char, c_int, c_void, CStr};
use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::sync::MutexGuard;

use nccl_sys::bindings::*;
use nccl_sys::FunctionTable;

pub(crate) use super::defs::{fresh_id, id_bytes, unique_id_of};
use super::dtype::{self, RedKind};
use super::exec::{run_items, Item};
use super::params;
use super::registry;
use super::state::{
    lock, wait_until, AsyncJob, CollPost, Collective, CommState, Fail, Global, Handle, IdBytes,
    OpKey, PendingOn, PreMul, RootIdx,
};

/// A split, shrink or window registration queued for the outermost ncclGroupEnd (NCCL's
/// `ncclAsyncJob` queued by `ncclAsyncLaunch` inside a group): the call it makes there.
type QueuedAsyncJob = Box<dyn FnOnce() -> ncclResult_t>;

/// A [`QueuedAsyncJob`] with the communicator it was called on.
struct Queued {
    parent: Handle,
    /// A window registration (NCCL runs them after the group's other jobs, group.cc:537
    /// then 540-567 of 2.28.9), not a split or shrink.
    window: bool,
    /// A one-sided put, signal or wait: its communicator's launch is the group's, as a
    /// collective's.
    rma: bool,
    job: QueuedAsyncJob,
}

thread_local! {
    /// (latest error text, the copy last handed out by ncclGetLastError)
    static LAST: RefCell<(CString, CString)> = RefCell::new((CString::default(), CString::default()));
    /// (nesting depth, queued items, first error of a call inside the group)
    static GROUP: RefCell<(u32, Vec<Item>, Option<Fail>)> = const { RefCell::new((0, Vec::new(), None)) };
    /// Teardowns called inside a group (handle, abort): NCCL queues their reclaim job with the
    /// group's (`ncclAsyncLaunch` at depth > 0) and runs it at the outermost ncclGroupEnd,
    /// so a group level left open (a refused ncclCommDestroy leaves one: see `teardown`)
    /// means they never run.
    static DEFERRED: RefCell<Vec<(usize, bool)>> = const { RefCell::new(Vec::new()) };
    /// Splits, shrinks and window registrations called inside a group, as the calls they
    /// make at the outermost ncclGroupEnd (see `queue_for_group_end`, `queue_window`).
    static QUEUED: RefCell<Vec<Queued>> = const { RefCell::new(Vec::new()) };
    /// The "current device" recorded by ncclCommInitRank(Config) (see `set_current_device`).
    pub(crate) static DEVICE: Cell<c_int> = const { Cell::new(0) };
}

fn set_last(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| l.borrow_mut().0 = c);
}

/// Runs an entry point body: records the error text, turns a panic into `ncclInternalError`.
fn ffi(f: impl FnOnce() -> Result<ncclResult_t, Fail>) -> ncclResult_t {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(code)) => code,
        Ok(Err(fail)) => {
            set_last(&fail.msg);
            fail.code
        }
        Err(_) => {
            set_last("internal error: the host provider panicked (this is a bug in nccl-safe)");
            ncclInternalError
        }
    }
}

/// The failure of a handle looked up under the lock that was checked live before (a bug).
fn vanished() -> Fail {
    Fail::new(ncclInternalError, "handle vanished")
}

/// A split or shrink inside a group, as NCCL has it: `ncclAsyncLaunch` at a group depth
/// above 0 only queues the job (group.cc:37-66 of 2.28.9), after the call has written
/// `*newcomm = NULL` (init.cc:2571-2572) and copied its config and exclude list, so the
/// call returns ncclSuccess with the child still NULL, and the parent's asynchronous state
/// is unchanged. At the outermost ncclGroupEnd the job runs first (group.cc:537, before the
/// group's collectives), and it is the job that writes the child. Here `job` is the call
/// made again outside the group, on the copies.
fn queue_for_group_end(
    parent: Handle,
    out: *mut ncclComm_t,
    job: impl FnOnce() -> ncclResult_t + 'static,
) -> Result<ncclResult_t, Fail> {
    put(out, core::ptr::null_mut());
    let (window, job) = (false, Box::new(job));
    QUEUED.with(|q| {
        q.borrow_mut().push(Queued {
            parent,
            window,
            rma: false,
            job,
        })
    });
    Ok(ncclSuccess)
}

/// A copy of a config `parse_config` accepted (its `size` bytes), as NCCL copies it into
/// the child during the call; its `commName` pointer stays the caller's, as NCCL keeps it.
fn copy_config(cfg: *const ncclConfig_t) -> Option<Box<ncclConfig_t>> {
    if cfg.is_null() {
        return None;
    }
    // SAFETY: every field of ncclConfig_t is an integer or a pointer, for which zero is valid.
    let mut copy: Box<ncclConfig_t> = Box::new(unsafe { core::mem::zeroed() });
    // SAFETY: `parse_config` checked that the config's `size` (its first field) is at most
    // size_of::<ncclConfig_t>(), and NCCL's contract is that `size` bytes are readable.
    unsafe {
        let size = (cfg as *const usize).read_unaligned();
        let to = (&mut *copy as *mut ncclConfig_t).cast::<u8>();
        core::ptr::copy_nonoverlapping(cfg as *const u8, to, size);
    }
    Some(copy)
}

/// The pointer a queued job passes for a copied config.
fn config_ptr(copy: &mut Option<Box<ncclConfig_t>>) -> *mut ncclConfig_t {
    copy.as_deref_mut()
        .map_or(core::ptr::null_mut(), |c| c as *mut ncclConfig_t)
}

/// Writes `v` through an out-pointer that was checked non-null.
fn put<T>(p: *mut T, v: T) {
    // SAFETY: callers check `p` is non-null; NCCL's contract makes it a valid, writable,
    // aligned pointer to a `T`.
    unsafe { p.write(v) }
}

fn in_group() -> bool {
    GROUP.with(|g| g.borrow().0 > 0)
}

/// Queues an item in this thread's group, or runs it now; where a test staged
/// `Fault::StuckWork`, accepts it and never completes it.
fn submit(g: MutexGuard<'static, Global>, r: &Ready, item: Item) -> Result<ncclResult_t, Fail> {
    if super::fault::take_stuck(r.root, r.h) {
        return Ok(ncclSuccess);
    }
    if in_group() {
        drop(g);
        GROUP.with(|gr| gr.borrow_mut().1.push(item));
        Ok(ncclSuccess)
    } else {
        let h = r.h;
        run_items(g, vec![item])?;
        Ok(launched([h]))
    }
}

/// After the collectives of these communicators ran, outside a group or at its outermost
/// end: NCCL launches a non-blocking communicator's work of two or more ranks from its
/// group's thread and returns ncclInProgress (a single collective is an implicit group,
/// enqueue.cc:2633-2660 of 2.28.9; one rank launches inline, ncclSuccess). Marks each such
/// communicator [`AsyncJob::Launching`]; ncclInProgress when one was. Only with
/// [`crate::set_launch_in_progress`] on: off, ncclSuccess.
fn launched(handles: impl IntoIterator<Item = Handle>) -> ncclResult_t {
    if !super::defs::launch_in_progress() {
        return ncclSuccess;
    }
    let mut g = lock();
    let mut any = false;
    let mut linked = Vec::new();
    for h in handles {
        let many = match g.comms.get(&h).map(|c| (c.nonblocking, c.state.clone())) {
            Some((true, CommState::Ready { clique, .. })) => {
                g.cliques.get(&clique).is_some_and(|cl| cl.nranks > 1)
            }
            _ => false,
        };
        if let Some(c) = g
            .comms
            .get_mut(&h)
            .filter(|c| many && matches!(c.async_job, AsyncJob::Idle))
        {
            c.async_job = AsyncJob::Launching;
            any = true;
            linked.push(h);
        }
    }
    g.link_group_job(&linked);
    if any {
        ncclInProgress
    } else {
        ncclSuccess
    }
}

/// [`ffi`] of an entry point whose errors inside a group are kept for ncclGroupEnd to
/// report too.
fn ffi_grouped(f: impl FnOnce() -> Result<ncclResult_t, Fail>) -> ncclResult_t {
    ffi(|| {
        f().inspect_err(|f| {
            GROUP.with(|g| {
                let mut g = g.borrow_mut();
                if g.0 > 0 && g.2.is_none() {
                    g.2 = Some(f.clone());
                }
            })
        })
    })
}

/// NCCL's entry points that only hand their arguments to the function that checks and posts
/// them ([`coll`], [`p2p`], ...), its first argument the entry point's name: each pairs
/// NCCL's C signature with that call.
macro_rules! forward {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?) => $f:ident($($a:expr),* $(,)?);)*) => {
        $(pub(crate) unsafe extern "C" fn $name($($arg: $ty),*) -> ncclResult_t {
            $f(stringify!($name), $($a),*)
        })*
    };
}

/// A live handle's value, or the misuse it is.
fn known(g: &mut Global, comm: ncclComm_t, what: &str) -> Result<Handle, Fail> {
    let h = comm as usize;
    if comm.is_null() {
        return Err(g.invalid(None, what, "comm is NULL"));
    }
    if g.comms.contains_key(&h) {
        return Ok(h);
    }
    if let Some(&root) = g.dead.get(&h) {
        let m = format!("communicator {h:#x} was already destroyed or aborted");
        return Err(g.misuse(Some(root), ncclInvalidUsage, what, m));
    }
    Err(g.invalid(None, what, format!("{h:#x} is not a communicator handle")))
}

/// A usable communicator.
#[derive(Clone, Copy)]
struct Ready {
    /// The entry point that found it ready, for its messages.
    name: &'static str,
    h: Handle,
    clique: u64,
    rank: i32,
    nranks: i32,
    root: RootIdx,
}

impl Ready {
    /// An invalid-argument failure of its entry point on this communicator.
    fn invalid(&self, g: &mut Global, m: impl std::fmt::Display) -> Fail {
        g.invalid(Some(self.root), self.name, m)
    }

    /// An operation's argument error, which on a non-blocking communicator NCCL also stores
    /// as its asynchronous error (ncclEnqueueCheck's `fail:`, enqueue.cc:2660-2661 of
    /// 2.28.9): from then on ncclCommGetAsyncError reports it and every call that ensures
    /// readiness is refused.
    fn refuse(&self, g: &mut Global, m: impl std::fmt::Display) -> Fail {
        let f = self.invalid(g, m);
        set_async_error(g, self.h, &f);
        f
    }

    /// Takes this communicator's next collective sequence number, with its device.
    fn next_coll(&self, g: &mut Global) -> Result<(u64, c_int), Fail> {
        let c = g.comms.get_mut(&self.h).ok_or_else(vanished)?;
        c.coll_seq += 1;
        Ok((c.coll_seq - 1, c.device))
    }

    /// Whether a child of this communicator blocks: as `config` says, else as this parent.
    fn child_blocking(&self, g: &mut Global, config: *const ncclConfig_t) -> Result<bool, Fail> {
        let parent_nb = g.comms.get(&self.h).is_some_and(|c| c.nonblocking);
        Ok(parse_config(g, config, Some(self.root), self.name)?.unwrap_or(!parent_nb))
    }
}

/// `ready`, then NCCL's `ncclCommEnsureReady` (init.cc:373-389 of 2.28.9) in full: the
/// communicator's asynchronous error, as ncclCommGetAsyncError reads it, refuses the call.
/// The calls that make it their first check (ncclCommCount, CuDevice, UserRank, Finalize,
/// Split, ncclRedOpCreatePreMulSum) read the same state as ncclCommGetAsyncError.
fn ensure_ready(g: &mut Global, comm: ncclComm_t, what: &'static str) -> Result<Ready, Fail> {
    let r = ready(g, comm, what, false)?;
    async_failure(g, r.h).map_or(Ok(r), Err)
}

/// Checks `comm` is initialized (and, with `ops`, not finalized and its clique not aborted).
fn ready(g: &mut Global, comm: ncclComm_t, what: &'static str, ops: bool) -> Result<Ready, Fail> {
    let h = known(g, comm, what)?;
    let c = g.comms.get(&h).ok_or_else(vanished)?;
    let root = c.root;
    let finalized = c.finalized;
    // NCCL's ncclCommEnsureReady (init.cc:373): asynchronous work in flight refuses the
    // call with ncclInvalidArgument; a failed one is the communicator's error from then on.
    match c.async_job.clone() {
        AsyncJob::Busy { .. } => return Err(g.invalid(Some(root), what, "Attempt to use communicator before the previous operation returned ncclSuccess (an asynchronous split, shrink or window registration is in progress: poll ncclCommGetAsyncError until it is no longer ncclInProgress)")),
        AsyncJob::Launching => return Err(g.invalid(Some(root), what, "Attempt to use communicator before the previous operation returned ncclSuccess (its collectives' launch, which returned ncclInProgress, may still run: poll ncclCommGetAsyncError until it is no longer ncclInProgress)")),
        AsyncJob::Failed(f) if ops => return Err(f),
        _ => {}
    }
    match c.state.clone() {
        // ncclCommEnsureReady turns the init's ncclInProgress into ncclInvalidArgument.
        CommState::Pending => Err(g.invalid(Some(root), what, "Attempt to use communicator before the previous operation returned ncclSuccess (it is still initializing: poll ncclCommGetAsyncError)")),
        CommState::Failed(f) => Err(f),
        CommState::Ready { clique, rank } => {
            if ops && finalized {
                return Err(g.misuse(Some(root), ncclInvalidUsage, what, "communicator was finalized"));
            }
            let Some(cl) = g.cliques.get(&clique) else {
                return Err(Fail::new(ncclRemoteError, format!("{what}: communicator is gone")));
            };
            if ops {
                if let Some(f) = &cl.aborted {
                    return Err(Fail::raw(f.code, format!("{what}: communicator is in error: {}", f.msg)));
                }
            }
            Ok(Ready {
                name: what,
                h,
                clique,
                rank,
                nranks: cl.nranks,
                root,
            })
        }
    }
}

/// `blocking` from a config (`None` = not set), validated as NCCL does; then
/// `NCCL_COMM_BLOCKING` overrides it, and a missing config, as NCCL's `envConfigOverride`.
fn parse_config(
    g: &mut Global,
    cfg: *const ncclConfig_t,
    root: Option<RootIdx>,
    what: &str,
) -> Result<Option<bool>, Fail> {
    if cfg.is_null() {
        return Ok(super::defs::comm_blocking());
    }
    let base = cfg as *const u8;
    // SAFETY: a non-null config points at least at NCCL's common prefix (size, magic,
    // version: 16 bytes), which every layout since 2.17 starts with.
    let (size, magic, version) = unsafe {
        (
            (base as *const usize).read_unaligned(),
            (base.add(8) as *const u32).read_unaligned(),
            (base.add(12) as *const u32).read_unaligned(),
        )
    };
    if magic != NCCL_API_MAGIC {
        return Err(g.invalid(root, what, format!("config magic {magic:#x} is not NCCL_API_MAGIC (0xcafebeef): initialize it with NCCL_CONFIG_INITIALIZER")));
    }
    let known = super::MIN_CONFIG_SIZE..=core::mem::size_of::<ncclConfig_t>();
    if !known.contains(&size) {
        return Err(g.invalid(root, what, format!("config size {size} is not a known ncclConfig_t layout ({known:?} bytes, NCCL 2.17..2.32)")));
    }
    if !(21700..30000).contains(&version) {
        let m = format!("config version {version} is not an NCCL 2.17+ version code");
        return Err(g.invalid(root, what, m));
    }
    // SAFETY: `blocking` is at offset 16 in every layout, inside `size` (>= 48) bytes.
    let blocking = unsafe { (base.add(16) as *const c_int).read_unaligned() };
    let forced = super::defs::comm_blocking();
    match blocking {
        nccl_sys::NCCL_CONFIG_UNDEF_INT => Ok(forced),
        0 => Ok(forced.or(Some(false))),
        1 => Ok(forced.or(Some(true))),
        b => Err(g.invalid(
            root,
            what,
            format!("config.blocking = {b} (must be 0 or 1)"),
        )),
    }
}

/// The `commName` pointer of a config (0 when there is none or the layout predates it):
/// kept, not copied, as NCCL keeps it. `netName` NCCL copies during the call
/// (init.cc:1712-1714), so it is read here, during the call, and checked to be a string.
fn config_name(cfg: *const ncclConfig_t) -> usize {
    if cfg.is_null() {
        return 0;
    }
    let base = cfg as *const u8;
    // SAFETY: a config that passed `parse_config` has at least its `size` bytes; both
    // pointer fields are read only when inside them.
    unsafe {
        let size = (base as *const usize).read_unaligned();
        let net_at = core::mem::offset_of!(ncclConfig_t, netName);
        if size >= net_at + 8 {
            let net = (base.add(net_at) as *const *const c_char).read_unaligned();
            if !net.is_null() {
                // Read now, as NCCL's strdup of it.
                let _ = CStr::from_ptr(net).to_bytes().len();
            }
        }
        let name_at = core::mem::offset_of!(ncclConfig_t, commName);
        if size >= name_at + 8 {
            (base.add(name_at) as *const *const c_char).read_unaligned() as usize
        } else {
            0
        }
    }
}

/// The `commName` pointer a new handle keeps: its config's, else `inherit`'s.
fn name_of(g: &Global, cfg: *const ncclConfig_t, inherit: Option<Handle>) -> usize {
    match config_name(cfg) {
        0 => inherit.and_then(|p| g.comms.get(&p)).map_or(0, |c| c.name),
        own => own,
    }
}

/// Finishes a new handle `h` (init/split/shrink): queues it in a group, returns
/// ncclInProgress for a non-blocking one, or waits for it.
fn finish_new(
    mut g: std::sync::MutexGuard<'static, Global>,
    h: Handle,
    out: *mut ncclComm_t,
    nonblocking: bool,
) -> Result<ncclResult_t, Fail> {
    if in_group() || nonblocking {
        put(out, h as ncclComm_t);
        g.count_created(h);
        drop(g);
        // A blocking group waits for it at its end; a non-blocking one returns at once and
        // leaves it to ncclCommGetAsyncError (group.cc:706-738 of 2.28.9), so one thread may
        // init a rank in a group and its peer after it.
        if in_group() && !nonblocking {
            GROUP.with(|gr| gr.borrow_mut().1.push(Item::Handle(h)));
        }
        // As NCCL: a non-blocking init/split reports ncclInProgress even when this call
        // completed it; ncclCommGetAsyncError then says ncclSuccess. Inside a group the
        // call reads the state before the group's end sets it: ncclSuccess (init.cc:2163-2166).
        return Ok(if nonblocking && !in_group() {
            ncclInProgress
        } else {
            ncclSuccess
        });
    }
    match run_items(g, vec![Item::Handle(h)]) {
        Ok(()) => {
            put(out, h as ncclComm_t);
            lock().count_created(h);
            Ok(ncclSuccess)
        }
        Err(f) => {
            lock().forget_handle(h);
            put(out, core::ptr::null_mut());
            Err(f)
        }
    }
}

/// NCCL's asynchronous job on a non-blocking communicator (split and shrink, init.cc:
/// 2550-2642 of 2.28.9; window registration, dev_runtime.cc:891-922), whose call returns
/// ncclSuccess before the job writes the out-pointer (ARCHITECTURE.md, "NCCL's asynchronous
/// contract"). Here `parent` is marked busy (`ready` then refuses every call but
/// ncclCommGetAsyncError and ncclCommAbort, as `ncclCommEnsureReady` does) and a thread runs
/// `body`, waits until [`job_latency`](super::defs::job_latency) has passed since the call
/// (and while [`Fault::HeldJobs`](super::fault::Fault::HeldJobs) holds it), stores `body`'s
/// value into `out` (unless 0) with a release store, after a failure too, as NCCL's job
/// does (init.cc:1612-1614), and ends the job: a failure stays the communicator's error.
fn start_job(
    g: &mut Global,
    parent: Handle,
    child: Option<Handle>,
    what: &'static str,
    out: usize,
    body: impl FnOnce() -> (usize, Result<(), Fail>) + Send + 'static,
) -> Result<ncclResult_t, Fail> {
    let c = g.comms.get_mut(&parent).ok_or_else(vanished)?;
    c.async_job = AsyncJob::Busy { child };
    let root = c.root;
    // The job is NCCL's async job of `parent` (`job->comm`): its non-blocking group end
    // links the group job to it (group.cc:798-806 of v2.29.7-1).
    g.link_group_job(&[parent]);
    let start = std::time::Instant::now();
    let spawned = spawn(format!("nccl-host-{what}"), move || {
        let (value, r) = body();
        std::thread::sleep(super::defs::job_latency().saturating_sub(start.elapsed()));
        super::fault::wait_jobs_released(root);
        let mut g = lock();
        if out != 0 {
            // SAFETY: NCCL's contract: the caller's out-pointer stays valid (and, as a
            // pointer, aligned) until the job ends, that is until the
            // communicator leaves ncclInProgress, which happens below, after the store.
            let cell = unsafe { core::sync::atomic::AtomicUsize::from_ptr(out as *mut usize) };
            cell.store(value, core::sync::atomic::Ordering::Release);
        }
        if let Some(c) = g.comms.get_mut(&parent) {
            c.async_job = match r {
                Ok(()) => AsyncJob::Idle,
                Err(f) => AsyncJob::Failed(f),
            };
        }
        drop(g);
        super::state::notify();
    });
    spawned.map(|()| ncclSuccess).inspect_err(|_| {
        if let Some(c) = g.comms.get_mut(&parent) {
            c.async_job = AsyncJob::Idle;
        }
    })
}

/// Runs `f` on a new thread named `name`; `ncclSystemError` when it cannot start.
fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<(), Fail> {
    match std::thread::Builder::new().name(name.clone()).spawn(f) {
        Ok(_) => Ok(()),
        Err(e) => Err(Fail::new(
            ncclSystemError,
            format!("cannot start thread {name}: {e}"),
        )),
    }
}

/// The end of a child job (split or shrink): waits until the child `h` leaves `Pending`
/// (its rendezvous completed or failed, or its deadline passed; for a split, a failure of
/// the parent's clique `split_of` fails it: a shrink only starts on a parent with no
/// error, or one whose revoke cleared it, and goes on if the parent fails later), counts it
/// as handed out, and returns what the job stores: the child, failed or not (NCCL stores it
/// either way).
fn end_child_job(h: Handle, split_of: Option<u64>) -> (usize, Result<(), Fail>) {
    let mut g = lock();
    let r = loop {
        g.check_pending_deadline(h);
        let Some(c) = g.comms.get(&h) else {
            break Err(Fail::new(ncclInternalError, "the child vanished"));
        };
        match &c.state {
            CommState::Ready { .. } => break Ok(()),
            CommState::Failed(f) => break Err(f.clone()),
            CommState::Pending => {}
        }
        let until = c.deadline;
        let parent_failed = split_of
            .and_then(|p| g.cliques.get(&p))
            .and_then(|cl| cl.aborted.clone());
        if let Some(f) = parent_failed {
            g.fail_handle(h, f);
            continue;
        }
        g = super::state::wait(g, until);
    };
    g.count_created(h);
    (h, r)
}

/// The end of a NOCOLOR rank's split job: waits until rendezvous `seq` of `clique` is over
/// (every rank of the parent takes part in NCCL's `bootstrapSplit`), failed, or past the
/// provider's wait limit; it stores NULL.
fn end_nocolor_job(clique: u64, seq: u64) -> (usize, Result<(), Fail>) {
    (0, end_rdv(clique, seq, "ncclCommSplit"))
}

/// Waits until rendezvous `seq` of `clique` is over (every rank posted to it), failed, or
/// past the provider's wait limit (then `ncclTimeout` for `name`, and the rendezvous fails
/// for every rank in it).
fn end_rdv(clique: u64, seq: u64, name: &str) -> Result<(), Fail> {
    let (mut g, end) = wait_until(lock(), |g| match g.cliques.get(&clique) {
        None => Some(Ok(())),
        Some(cl) if cl.aborted.is_some() => cl.aborted.clone().map(Err),
        Some(cl) => (!cl.rdv.contains_key(&seq)).then_some(Ok(())),
    });
    end.unwrap_or_else(|| {
        let limit = super::defs::wait_limit();
        let m =
            format!("{name}: not every rank joined within {limit:?} (NCCL_SAFE_HOST_TIMEOUT_MS)");
        let f = Fail::new(ncclTimeout, m);
        g.fail_pending(PendingOn::Rdv { clique, seq }, f.clone());
        Err(f)
    })
}

/// Whether a split/shrink/window registration on `h` runs as NCCL's asynchronous job: on a
/// non-blocking communicator outside a group (NCCL's group mode is the parent's:
/// `ncclAsyncLaunch(job, .., comm)`, group.cc:52-58; inside a user's group the job waits
/// for the user's ncclGroupEnd).
fn asynchronous(g: &Global, h: Handle) -> bool {
    !in_group() && g.comms.get(&h).is_some_and(|c| c.nonblocking)
}

pub(crate) unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    get_version(version, 23203)
}

pub(crate) fn get_version(version: *mut c_int, code: c_int) -> ncclResult_t {
    ffi(|| {
        if version.is_null() {
            return Err(lock().invalid(None, "ncclGetVersion", "version is NULL"));
        }
        put(version, code);
        Ok(ncclSuccess)
    })
}

pub(crate) unsafe extern "C" fn ncclGetUniqueId(unique_id: *mut ncclUniqueId) -> ncclResult_t {
    ffi(|| {
        if unique_id.is_null() {
            return Err(lock().invalid(None, "ncclGetUniqueId", "uniqueId is NULL"));
        }
        put(
            unique_id,
            match nccl_sys::param_str("NCCL_COMM_ID") {
                Some(at) => fixed_id(&at)?,
                None => fresh_id(),
            },
        );
        Ok(ncclSuccess)
    })
}

/// The unique id NCCL makes under `NCCL_COMM_ID=<host>:<port>` (`bootstrapGetUniqueId`,
/// bootstrap.cc:414-425 of 2.28.9): `NCCL_MAGIC`, then the address, so the same id in every
/// call and every process of the job; an address that does not resolve is
/// ncclInvalidArgument. Its ranks meet in this process (ranks in threads).
fn fixed_id(at: &str) -> Result<ncclUniqueId, Fail> {
    use std::net::ToSocketAddrs;
    let addr = (at.to_socket_addrs().ok().and_then(|mut a| a.next())).ok_or_else(|| {
        Fail::new(
            ncclInvalidArgument,
            format!("Invalid NCCL_COMM_ID {at:?}, please use format: <ipv4>:<port> or [<ipv6>]:<port> or <hostname>:<port>"),
        )
    })?;
    let mut b = [0u8; 128];
    let text = addr.to_string();
    let bytes = nccl_sys::NCCL_MAGIC.to_ne_bytes().into_iter();
    for (slot, byte) in b.iter_mut().zip(bytes.chain(text.bytes())) {
        *slot = byte;
    }
    Ok(unique_id_of(b))
}

/// NCCL's text for a result code (the same strings as libnccl).
pub(crate) fn error_cstr(result: ncclResult_t) -> &'static CStr {
    match result {
        ncclSuccess => c"no error",
        ncclUnhandledCudaError => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        ncclSystemError => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        ncclInternalError => c"internal error - please report this issue to the NCCL developers",
        ncclInvalidArgument => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        ncclInvalidUsage => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        ncclRemoteError => c"remote process exited or there was a network error",
        ncclInProgress => c"NCCL operation in progress",
        ncclTimeout => c"NCCL timeout",
        _ => c"unknown result code",
    }
}

pub(crate) unsafe extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    error_cstr(result).as_ptr()
}

pub(crate) unsafe extern "C" fn ncclGetLastError(_comm: ncclComm_t) -> *const c_char {
    // The text is per thread; `comm` (NULL allowed) is not used. The returned pointer stays
    // valid until this thread's next ncclGetLastError call.
    std::panic::catch_unwind(|| {
        LAST.with(|l| {
            let mut l = l.borrow_mut();
            l.1 = l.0.clone();
            l.1.as_ptr()
        })
    })
    .unwrap_or(c"".as_ptr())
}

fn init_rank(
    what: &str,
    comm: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *const ncclConfig_t,
) -> ncclResult_t {
    let r = init_rank_on(what, comm, nranks, id_bytes(&id), rank, config);
    // ncclCommInitRank's NCCLCHECK lets ncclInProgress through and it returns ncclSuccess
    // (init.cc:2055, checks.h:124): made non-blocking by NCCL_COMM_BLOCKING=0, its init
    // goes on after the call.
    if config.is_null() {
        in_progress_as_success(r)
    } else {
        r
    }
}

/// `ncclCommInitRankScalable` as NCCL 2.30.7 has it (init.cc:2693-2728, 2477-2481): `nId`
/// outside `1..=nranks` is ncclInvalidArgument before anything is checked or written; else
/// it is `ncclCommInitRankConfig` (a NULL config is NCCL's default one, and a non-blocking
/// init returns ncclInProgress) with `nId` ids, rank `r` checking in with root
/// `rootIdFromRank(r)` (bootstrap.cc:59-69) and the communicator named by the first id's
/// hash (init.cc:1905). Here the ranks meet on the first id extended with a digest of all
/// of them ([`scalable_key`]): ranks must pass the same ids in the same order (NCCL's
/// roots need that too), one that passes others waits, as on NCCL, until its timeout. One
/// id is exactly `ncclCommInitRankConfig`'s rendezvous.
pub(crate) unsafe extern "C" fn ncclCommInitRankScalable(
    comm: *mut ncclComm_t,
    nranks: c_int,
    rank: c_int,
    n_id: c_int,
    comm_ids: *mut ncclUniqueId,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    const WHAT: &str = "ncclCommInitRankScalable";
    if n_id <= 0 || n_id > nranks {
        let m = format!("improper usage of ncclCommInitRank: nId = {n_id}, nranks={nranks}");
        return ffi_grouped(|| Err(lock().invalid(None, WHAT, m)));
    }
    if comm_ids.is_null() {
        // NCCL copies from it (init.cc:2531): a crash there.
        return ffi_grouped(|| Err(lock().invalid(None, WHAT, "commId is NULL")));
    }
    // SAFETY: NCCL's contract: `comm_ids` points to `n_id` (> 0) unique ids.
    let ids = unsafe { core::slice::from_raw_parts(comm_ids, n_id as usize) };
    let key = scalable_key(ids);
    // Counted under the first id, which names the communicator.
    let mut g = lock();
    let first = g.root_of(&id_bytes(&ids[0]));
    g.alias_root(&key, first);
    drop(g);
    init_rank_on(WHAT, comm, nranks, key, rank, config)
}

/// Where the ranks of a scalable init meet: the first id, its last 32 bytes replaced by a
/// SHA-256 of every id, so a shared (cross-process) first id stays one, named after its
/// maker's process; the first id itself when there is one.
fn scalable_key(ids: &[ncclUniqueId]) -> IdBytes {
    use sha2::Digest;
    let mut key = id_bytes(&ids[0]);
    if ids.len() > 1 {
        let mut h = sha2::Sha256::new();
        for id in ids {
            h.update(id_bytes(id));
        }
        let tail = key.len() - 32;
        key[tail..].copy_from_slice(&h.finalize());
    }
    key
}

/// The body of an init by unique id: checks, then joins the rendezvous of `idb`.
fn init_rank_on(
    what: &str,
    comm: *mut ncclComm_t,
    nranks: c_int,
    idb: IdBytes,
    rank: c_int,
    config: *const ncclConfig_t,
) -> ncclResult_t {
    ffi_grouped(|| {
        super::fault::ensure_runtime();
        let mut g = lock();
        let root = g.root_of(&idb);
        if comm.is_null() {
            return Err(g.invalid(Some(root), what, "comm is NULL"));
        }
        if nranks < 1 || rank < 0 || rank >= nranks {
            let m = format!("rank {rank} / nranks {nranks} out of range (need 0 <= rank < nranks)");
            return Err(g.invalid(Some(root), what, m));
        }
        new_rank(g, idb, nranks, rank, root, None, config, what, comm)
    })
}

/// A rank that joins with a unique id (init, or grow): its handle, blocking and named as
/// `config` says, else as `parent` (a grow's existing rank), on `parent`'s device or else
/// this thread's, joined (through shared memory when the id is a shared one) and written
/// to `out`.
#[allow(clippy::too_many_arguments)]
fn new_rank(
    mut g: MutexGuard<'static, Global>,
    idb: IdBytes,
    nranks: c_int,
    rank: c_int,
    root: RootIdx,
    parent: Option<Handle>,
    config: *const ncclConfig_t,
    what: &str,
    out: *mut ncclComm_t,
) -> Result<ncclResult_t, Fail> {
    let (parent_blocking, dev) = match parent.and_then(|p| g.comms.get(&p)) {
        Some(c) => (!c.nonblocking, c.device),
        None => (true, DEVICE.with(|d| d.get())),
    };
    let blocking = parse_config(&mut g, config, Some(root), what)?.unwrap_or(parent_blocking);
    let name = name_of(&g, config, parent);
    let h = g.new_handle(root, dev, !blocking, name);
    if let Some(c) = g.comms.get_mut(&h) {
        c.grow_parent = parent;
    }
    if super::shm::is_shared(&idb) {
        join_shared(&mut g, idb, nranks, rank, h, root, None)?;
    } else {
        g.post_init(idb, nranks, rank, h);
    }
    finish_new(g, h, out, !blocking)
}

/// Joins a communicator whose ranks may be in other processes: the shared segment's
/// rendezvous runs on a thread of its own, and the handle stays `Pending` until it ends
/// (so blocking, non-blocking and grouped inits all wait the usual way).
///
/// `watch`: a parent's segment and the parent ranks the new communicator needs (a shrink's
/// kept ranks): one whose process is gone fails the join at once, naming it, as NCCL's
/// bootstrap fails its connection to a dead rank, rather than at the deadline.
fn join_shared(
    g: &mut Global,
    idb: IdBytes,
    nranks: c_int,
    rank: c_int,
    h: Handle,
    root: RootIdx,
    watch: Option<(std::sync::Arc<super::shm::Segment>, Vec<usize>)>,
) -> Result<(), Fail> {
    let deadline = std::time::Instant::now() + super::defs::wait_limit();
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(c) = g.comms.get_mut(&h) {
        // The segment's own deadline reports first, naming the missing ranks.
        c.deadline = deadline + std::time::Duration::from_secs(1);
        c.shared_join = Some((cancel.clone(), super::shm::name_of(&idb)));
    }
    let silent = super::fault::silent_peers(root);
    spawn("nccl-safe-shm-init".into(), move || {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let why = std::sync::Arc::new(std::sync::Mutex::new(None::<Fail>));
        if let Some((parent, members)) = watch {
            let (done, why, cancel) = (done.clone(), why.clone(), cancel.clone());
            // Without the watch (no thread to spare) the join waits for its deadline.
            let _ = spawn("nccl-safe-shm-watch".into(), move || {
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    let gone = members.iter().find_map(|&r| parent.died(r).map(|p| (r, p)));
                    if let Some((r, pid)) = gone {
                        let m = format!("rank {r} (pid {pid}) of the parent died: its process is gone, so the communicator it was to join can never be complete (exclude it too)");
                        *why.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(Fail::new(ncclRemoteError, m));
                        cancel.store(true, std::sync::atomic::Ordering::Release);
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            });
        }
        let r = super::shm::Segment::join(&idb, nranks as usize, rank as usize, deadline, &cancel);
        done.store(true, std::sync::atomic::Ordering::Release);
        let r = match (r, why.lock().unwrap_or_else(|e| e.into_inner()).take()) {
            (Err(_), Some(why)) => Err(why),
            (r, _) => r,
        };
        let mut g = lock();
        let pending = matches!(g.comms.get(&h).map(|c| &c.state), Some(CommState::Pending));
        match r {
            Ok(mut seg) if pending => {
                seg.silent = silent;
                g.new_shared_clique(root, h, std::sync::Arc::new(seg), nranks);
            }
            // Destroyed or failed meanwhile: the peers must not wait for this rank.
            Ok(seg) => seg.abort(),
            Err(f) => {
                if let Some(c) = g.comms.get_mut(&h) {
                    if pending {
                        c.state = CommState::Failed(f);
                    }
                }
            }
        }
        drop(g);
        super::state::notify();
    })
    .inspect_err(|_| g.forget_handle(h))
}

/// The shared segment of a communicator across processes, if `clique` is one.
/// [`crate::dead_peer`]: the shared segment of `comm`'s clique, asked why it failed.
pub(crate) fn dead_peer(comm: ncclComm_t) -> Option<(usize, u32)> {
    let g = lock();
    let CommState::Ready { clique, .. } = g.comms.get(&(comm as usize))?.state else {
        return None;
    };
    shared_of(&g, clique)?.dead_peer()
}

/// [`crate::dead_peers`]: the shared segment of `comm`'s clique, asked for every peer gone.
pub(crate) fn dead_peers(comm: ncclComm_t) -> Vec<(usize, u32)> {
    let g = lock();
    let Some(CommState::Ready { clique, .. }) = g.comms.get(&(comm as usize)).map(|c| &c.state)
    else {
        return Vec::new();
    };
    shared_of(&g, *clique).map_or_else(Vec::new, |s| s.dead_peers())
}

/// [`crate::behind_peers`]: the shared segment of `comm`'s clique, asked which ranks have
/// not reached the collective `comm`'s rank waits in.
pub(crate) fn behind_peers(comm: ncclComm_t) -> Vec<usize> {
    let g = lock();
    let Some(CommState::Ready { clique, .. }) = g.comms.get(&(comm as usize)).map(|c| &c.state)
    else {
        return Vec::new();
    };
    shared_of(&g, *clique).map_or_else(Vec::new, |s| s.behind_now())
}

fn shared_of(g: &Global, clique: u64) -> Option<std::sync::Arc<super::shm::Segment>> {
    g.cliques.get(&clique).and_then(|c| c.shared.clone())
}

forward! {
    ncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId,
        rank: c_int, config: *mut ncclConfig_t)
        => init_rank(comm, nranks, comm_id, rank, config);
    ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId, rank: c_int)
        => init_rank(comm, nranks, comm_id, rank, core::ptr::null());
}

pub(crate) unsafe extern "C" fn ncclCommInitAll(
    comm: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    super::fault::ensure_runtime();
    ffi(|| {
        let mut g = lock();
        if comm.is_null() || ndev < 1 {
            let m = format!("comms is NULL or ndev ({ndev}) < 1");
            return Err(g.invalid(None, "ncclCommInitAll", m));
        }
        let idb = id_bytes(&fresh_id());
        let root = g.root_of(&idb);
        // NCCL passes its default config, which NCCL_COMM_BLOCKING overrides (init.cc:2068,
        // 1646-1649): with 0 the group's end returns ncclInProgress. Kinder than NCCL only
        // in that the communicators are ready at once.
        let nonblocking = super::defs::comm_blocking() == Some(false);
        let mut handles = Vec::new();
        for i in 0..ndev as usize {
            let dev = if devlist.is_null() {
                i as c_int
            } else {
                // SAFETY: a non-null devlist has ndev entries (NCCL's contract).
                unsafe { devlist.add(i).read() }
            };
            handles.push(g.new_handle(root, dev, nonblocking, 0));
        }
        g.new_clique(root, &handles);
        for (i, &h) in handles.iter().enumerate() {
            // SAFETY: `comm` is non-null and holds ndev entries (NCCL's contract).
            put(unsafe { comm.add(i) }, h as ncclComm_t);
            g.count_created(h);
        }
        Ok(if nonblocking {
            ncclInProgress
        } else {
            ncclSuccess
        })
    })
}

pub(crate) unsafe extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    ffi(|| {
        if comm.is_null() {
            return Ok(ncclSuccess); // as NCCL (init.cc:2271)
        }
        let mut g = lock();
        let r = ensure_ready(&mut g, comm, "ncclCommFinalize")?;
        // A second finalize, or one after a revoke (which finalizes): init.cc:2274-2278,
        // whose `fail:` (:2298-2299) also makes the refusal a non-blocking communicator's
        // asynchronous error, so that its destroy is refused from then on.
        let finalized = g.comms.get(&r.h).is_some_and(|c| c.finalized);
        if finalized {
            let m = "already finalized (or revoked)";
            return Err(r.refuse(&mut g, m));
        }
        let nonblocking = match g.comms.get_mut(&r.h) {
            Some(c) => {
                c.finalized = true;
                c.nonblocking
            }
            None => false,
        };
        g.count(Some(r.root), |s| s.finalized += 1);
        if !nonblocking {
            return Ok(ncclSuccess);
        }
        // Non-blocking: NCCL's flush (`commDestroySync`) is an asynchronous job (:2286),
        // the call returns the state read after its launch, ncclInProgress (:2291-2292).
        start_job(&mut g, r.h, None, "finalize", 0, || (0, Ok(())))?;
        Ok(ncclInProgress)
    })
}

/// The failure that `rank`'s ncclCommAbort gives its clique.
fn aborted_by(rank: i32) -> Fail {
    Fail::new(ncclRemoteError, format!("rank {rank} called ncclCommAbort"))
}

fn teardown(comm: ncclComm_t, abort: bool) -> Result<ncclResult_t, Fail> {
    if comm.is_null() {
        return Ok(ncclSuccess); // as NCCL: destroying/aborting NULL is a no-op
    }
    let what = if abort {
        "ncclCommAbort"
    } else {
        "ncclCommDestroy"
    };
    let mut g = lock();
    let mut h = known(&mut g, comm, what)?;
    grow_in_flight(&mut g, h, what);
    if g.blocked_in_grow.contains(&h) {
        // Another thread is inside this communicator's ncclCommGrow, waiting for the id:
        // NCCL's teardown frees the communicator that call reads when its wait ends.
        let root = g.comms.get(&h).map(|c| c.root);
        let m = "a communicator whose ncclCommGrow waits for the grow id in another thread (init.cc:2913-2924 of v2.29.7-1: the call uses the communicator after its wait, a use after free in NCCL); revoke it instead, which ends the wait";
        g.misuse(root, ncclInvalidUsage, what, m);
    }
    if !abort {
        // NCCL's ncclCommDestroy sets `destroyFlag` first (init.cc:2379), and nothing clears
        // it: a later revoke is refused (:2457).
        if let Some(c) = g.comms.get_mut(&h) {
            c.destroy_called = true;
        }
        if let Some(f) = destroy_refusal(&mut g, h) {
            // NCCL's ncclCommDestroy (init.cc:2358-2391) enters a group level
            // (ncclGroupStartInternal), then returns ncclCommEnsureReady's error through
            // `NCCLCHECK`, before the `exit:` that would leave it: the communicator is not
            // torn down, and this thread stays one group level deep, so its later calls are
            // queued for a ncclGroupEnd that never comes. Inside a group too: the check
            // runs in the call, before the reclaim job is queued (:2381-2384).
            GROUP.with(|gr| gr.borrow_mut().0 += 1);
            return Err(f);
        }
        // Its ncclCommEnsureReady read ncclSuccess (init.cc:2578 of v2.29.7-1).
        g.complete_group_job(h, what);
    }
    if in_group() {
        // NCCL queues the reclaim job with the caller's group (ncclAsyncLaunch at depth > 0,
        // group.cc:37-66): it runs at the outermost ncclGroupEnd, or never.
        DEFERRED.with(|d| d.borrow_mut().push((h, abort)));
        return Ok(ncclSuccess);
    }
    if abort {
        // NCCL's abort sets the abort flags (the child of a split in flight sees them too)
        // and joins the job in flight (ncclCommEnsureReady -> ncclGroupJobAbort,
        // init.cc:2503-2520) before it tears down.
        g = end_job_for_abort(g, h);
        h = known(&mut g, comm, what)?;
        // ncclCommEnsureReady under the abort flags aborts the linked job (init.cc:2713 ->
        // 404 of v2.29.7-1); the communicator is freed after.
        g.abort_group_job(h, what, true);
        // As NVIDIA's abort: it first sets the abort flag, which ends the operations that
        // wait for peers in this clique (here: wakes them with the abort's error), then
        // frees its resources through the driver, which waits behind a stalled stream. So
        // an injected blocking abort blocks after waking the clique and *before* the rest
        // of its work: its stuck work is not released, and the handle is not counted as
        // torn down, while it blocks.
        if let Some(c) = g.comms.get(&h) {
            let root = c.root;
            if let CommState::Ready { clique, rank } = c.state {
                if shared_of(&g, clique).is_none() {
                    g.abort_clique(clique, aborted_by(rank));
                }
            }
            drop(g);
            super::fault::block_abort(root);
            g = lock();
            h = known(&mut g, comm, what)?;
        }
    }
    let c = g.comms.remove(&h).ok_or_else(vanished)?;
    g.dead.insert(h, c.root);
    registry::teardown(&mut g, h, c.root);
    if let CommState::Ready { clique, rank } = c.state {
        registry::drop_signals(clique, rank);
    }
    g.count(Some(c.root), |s| {
        if abort {
            s.aborted += 1
        } else {
            s.destroyed += 1
        }
    });
    match c.state {
        CommState::Ready { clique, rank } => {
            if let Some(seg) = shared_of(&g, clique) {
                if abort {
                    seg.abort();
                } else {
                    seg.leave();
                }
            }
            if abort {
                g.abort_clique(clique, aborted_by(rank));
            }
            g.leave_clique(clique);
        }
        CommState::Pending => {
            let m = format!("a rank called {what} during initialization");
            g.fail_pending(c.pending_on, Fail::new(ncclRemoteError, m));
            if let Some((cancel, path)) = &c.shared_join {
                // The join's thread tells the peers and gives up; the name goes now, so
                // that a process that exits at once leaves nothing in /dev/shm.
                cancel.store(true, std::sync::atomic::Ordering::Release);
                let _ = std::fs::remove_file(path);
            }
        }
        CommState::Failed(_) => {}
    }
    super::state::notify();
    drop(g);
    super::fault::torn_down(h);
    Ok(ncclSuccess)
}

/// A teardown of `h` while a grow of it is still pending on this rank: NCCL's grow job
/// keeps using its parent (bootstrap.cc:713-714, 777-779; init.cc:1707, 1716 of
/// v2.29.7-1) and is linked to the new communicator only, so the parent's teardown neither
/// stops nor joins it, and the job then touches freed memory. Counted as misuse (the
/// teardown goes on: here nothing is freed that the grow reads); the new communicator's
/// abort, which joins its job, must come first.
fn grow_in_flight(g: &mut Global, h: Handle, what: &str) {
    let pending = g
        .comms
        .iter()
        .any(|(_, c)| c.grow_parent == Some(h) && matches!(c.state, CommState::Pending));
    if pending {
        let root = g.comms.get(&h).map(|c| c.root);
        let m = "the parent of a grow whose job still runs (the job uses the parent until it ends: a use after free in NCCL); tear the new communicator down first";
        g.misuse(root, ncclInvalidUsage, what, m);
    }
}

/// What `ncclCommEnsureReady` (init.cc:373-389) says of `h` before a destroy: ncclInvalidArgument
/// while work is in flight (an init, split, shrink or window registration), the
/// communicator's asynchronous error once it has one (a failed init or job, or a failed
/// clique, unless a revoke stored its own result since); `None` when it is ready.
fn destroy_refusal(g: &mut Global, h: Handle) -> Option<Fail> {
    let c = g.comms.get(&h)?;
    let root = c.root;
    let in_flight = matches!(c.async_job, AsyncJob::Busy { .. } | AsyncJob::Launching)
        || matches!(c.state, CommState::Pending);
    if in_flight {
        let m = "Attempt to use communicator before the previous operation returned ncclSuccess";
        return Some(g.invalid(Some(root), "ncclCommDestroy", m));
    }
    // The state ncclCommGetAsyncError reads: a revoke's result replaces a failed clique's.
    match &c.state {
        CommState::Failed(f) if !matches!(c.async_job, AsyncJob::Failed(_)) => Some(f.clone()),
        _ => async_failure(g, h),
    }
}

/// An abort of `h` while asynchronous work is in flight: fails the child the job waits for
/// (NCCL's `childAbortFlag`), or the parent's clique for a NOCOLOR rank, and waits (within
/// the provider's wait limit) until the job has ended and stored its result.
fn end_job_for_abort(g: MutexGuard<'static, Global>, h: Handle) -> MutexGuard<'static, Global> {
    let m = "the parent communicator was aborted during the split/shrink";
    let why = Fail::new(ncclRemoteError, m);
    wait_until(g, |g| {
        // Until the job ended (or the handle is gone).
        let job = g
            .comms
            .get(&h)
            .map(|c| (c.async_job.clone(), c.state.clone()));
        let Some((AsyncJob::Busy { child }, state)) = job else {
            return Some(());
        };
        match (child.filter(|k| g.comms.contains_key(k)), state) {
            (Some(k), state) => {
                g.fail_handle(k, why.clone());
                // A split across processes waits for the peers' colors in the parent's
                // segment before its child joins anything: the abort ends that wait.
                if let CommState::Ready { clique, .. } = state {
                    if let Some(seg) = shared_of(g, clique) {
                        seg.abort();
                    }
                }
            }
            (None, CommState::Ready { clique, .. }) => {
                if let Some(seg) = shared_of(g, clique) {
                    seg.abort();
                }
                g.abort_clique(clique, why.clone());
            }
            (None, _) => {}
        }
        None
    })
    .0
}

pub(crate) unsafe extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    ffi(|| teardown(comm, false))
}

pub(crate) unsafe extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    ffi(|| teardown(comm, true))
}

/// A split across processes: every rank's (color, key) through the parent, then the
/// child's id derived alike on every rank and joined as any shared init. The child's
/// pending handle, or `None` for NOCOLOR.
///
/// `made`: the child's handle when the call already made it (a non-blocking split, whose
/// job stores the child failed or not, as NCCL's), else made here.
fn shared_split(
    seg: std::sync::Arc<super::shm::Segment>,
    r: Ready,
    seq: u64,
    (color, key): (c_int, c_int),
    (dev, blocking, name): (c_int, bool, usize),
    made: Option<Handle>,
) -> Result<Option<Handle>, Fail> {
    let all = seg.exchange_split(seq, color, key).inspect_err(|f| {
        lock().abort_clique(r.clique, f.clone());
    })?;
    let id = seg.child_id(&format!("split {color}"));
    if color == NCCL_SPLIT_NOCOLOR {
        return Ok(None);
    }
    let mut members: Vec<(i32, usize)> = (all.iter().enumerate())
        .filter(|(_, &(c, _))| c == color)
        .map(|(q, &(_, k))| (k, q))
        .collect();
    members.sort_unstable();
    let me = members.iter().position(|&(_, q)| q == r.rank as usize);
    let (n, me) = (members.len() as c_int, me.unwrap_or(0) as c_int);
    let mut g = lock();
    let h = made.unwrap_or_else(|| g.new_handle(r.root, dev, !blocking, name));
    join_shared(&mut g, id, n, me, h, r.root, None)?;
    Ok(Some(h))
}

pub(crate) unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    ffi_grouped(|| {
        let mut g = lock();
        // NCCL checks no more than this before the split (init.cc:2557-2568): a finalized
        // or revoked parent may be split (2.29.7 only shares no resources with a revoked one).
        let r = ensure_ready(&mut g, comm, "ncclCommSplit")?;
        if newcomm.is_null() || color < NCCL_SPLIT_NOCOLOR {
            let m = format!("newcomm is NULL or color {color} < 0 (and not NCCL_SPLIT_NOCOLOR)");
            return Err(r.invalid(&mut g, m));
        }
        let blocking = r.child_blocking(&mut g, config)?;
        if in_group() {
            let (parent, out, mut cfg) = (comm as usize, newcomm as usize, copy_config(config));
            return queue_for_group_end(r.h, newcomm, move || {
                // SAFETY: the caller keeps `comm` and `newcomm` valid until the group's end
                // (NCCL's job uses both then); the config is this call's copy.
                unsafe { ncclCommSplit(parent as _, color, key, out as _, config_ptr(&mut cfg)) }
            });
        }
        let (seq, dev) = r.next_coll(&mut g)?;
        // As NCCL (init.cc:2571-2572): NULL until the split is complete.
        put(newcomm, core::ptr::null_mut());
        let out = newcomm as usize;
        let clique = r.clique;
        if let Some(seg) = shared_of(&g, r.clique) {
            let child = (dev, blocking, name_of(&g, config, Some(r.h)));
            if asynchronous(&g, r.h) {
                // As NCCL's (init.cc:2571-2590 of 2.28.9): the child exists from the call
                // on, and the job stores it whether the split succeeds or fails (an abort
                // of the parent while a peer never splits, say).
                let made = (color != NCCL_SPLIT_NOCOLOR)
                    .then(|| g.new_handle(r.root, dev, !blocking, child.2));
                let split = move || shared_split(seg, r, seq, (color, key), child, made);
                return start_job(&mut g, r.h, made, "split", out, move || match split() {
                    Ok(Some(h)) => end_child_job(h, Some(clique)),
                    Ok(None) => (0, Ok(())),
                    Err(f) => match made {
                        Some(h) => {
                            let mut g = lock();
                            g.fail_handle(h, f.clone());
                            g.count_created(h);
                            (h, Err(f))
                        }
                        None => (0, Err(f)),
                    },
                });
            }
            drop(g);
            let split = move || shared_split(seg, r, seq, (color, key), child, None);
            return match split()? {
                Some(h) => finish_new(lock(), h, newcomm, !blocking),
                None => Ok(ncclSuccess),
            };
        }
        if color == NCCL_SPLIT_NOCOLOR {
            g.post_rdv(r.clique, seq, None, (r.rank, color, key, None))?;
            if asynchronous(&g, r.h) {
                return start_job(&mut g, r.h, None, "split", out, move || {
                    end_nocolor_job(clique, seq)
                });
            }
            return Ok(ncclSuccess);
        }
        let name = name_of(&g, config, Some(r.h));
        let h = g.new_handle(r.root, dev, !blocking, name);
        g.post_rdv(r.clique, seq, None, (r.rank, color, key, Some(h)))?;
        if asynchronous(&g, r.h) {
            return start_job(&mut g, r.h, Some(h), "split", out, move || {
                end_child_job(h, Some(clique))
            });
        }
        finish_new(g, h, newcomm, !blocking)
    })
}

pub(crate) unsafe extern "C" fn ncclCommShrink(
    comm: ncclComm_t,
    exclude_ranks_list: *mut c_int,
    exclude_ranks_count: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
    shrink_flags: c_int,
) -> ncclResult_t {
    ffi_grouped(|| {
        const NAME: &str = "ncclCommShrink";
        let mut g = lock();
        let r = ready(&mut g, comm, NAME, false)?;
        if newcomm.is_null() {
            return Err(r.invalid(&mut g, "newcomm is NULL"));
        }
        let abort_mode = shrink_flags == NCCL_SHRINK_ABORT as c_int;
        if shrink_flags != NCCL_SHRINK_DEFAULT as c_int && !abort_mode {
            return Err(r.invalid(&mut g, format!("unknown shrinkFlags {shrink_flags}")));
        }
        // As NCCL (init.cc:2561-2562 of 2.28.9): a list, and at least one rank in it.
        if exclude_ranks_count <= 0 || exclude_ranks_list.is_null() {
            let m = "excludeRanksList is NULL or excludeRanksCount < 1";
            return Err(r.invalid(&mut g, m));
        }
        let n = exclude_ranks_count as usize;
        // SAFETY: the list is non-null and holds excludeRanksCount entries (NCCL's contract).
        let mut excl = unsafe { core::slice::from_raw_parts(exclude_ranks_list, n) }.to_vec();
        excl.sort_unstable();
        excl.dedup();
        if excl.len() != n || excl.iter().any(|&x| x < 0 || x >= r.nranks || x == r.rank) {
            let (nranks, rank) = (r.nranks, r.rank);
            let m = format!("exclude list {excl:?} has duplicates, ranks outside 0..{nranks}, or the calling rank {rank}");
            return Err(r.invalid(&mut g, m));
        }
        let blocking = r.child_blocking(&mut g, config)?;
        if abort_mode {
            // NCCL sets the abort flags, waits for the parent's device stream and clears
            // the flags (init.cc:2844-2848 of 2.29.7), in the call: its kernels end on the
            // flags, but work stalled behind other work on the stream is waited for (NCCL
            // waits for ever; here the provider's wait limit).
            super::fault::end_stuck(r.h);
            drop(g);
            super::fault::wait_stalled(r.h, super::defs::wait_limit());
            g = lock();
            known(&mut g, comm, NAME)?;
            super::fault::torn_down(r.h);
        }
        // Then `ncclCommInitChildComm`'s `ncclCommEnsureReady` (init.cc:2762, 400-416):
        // a parent whose asynchronous error is set is refused with that error, in both
        // modes, unless a revoke's job has since cleared it (init.cc:2635).
        if let Some(f) = async_failure(&mut g, r.h) {
            return Err(f);
        }
        if in_group() {
            let (parent, out, mut cfg) = (comm as usize, newcomm as usize, copy_config(config));
            let mut list = excl.clone();
            return queue_for_group_end(r.h, newcomm, move || {
                let (n, cfg, list) = (list.len() as c_int, config_ptr(&mut cfg), list.as_mut_ptr());
                // SAFETY: the caller keeps `comm` and `newcomm` valid until the group's end
                // (NCCL's job uses both then); the list and the config are this call's copies.
                unsafe { ncclCommShrink(parent as _, list, n, out as _, cfg, shrink_flags) }
            });
        }
        // NCCL's abort flags are this rank's and cleared again before the child is made
        // (init.cc:2846): the parent's other ranks are not told, and its state is not
        // set (so the other survivors' own shrinks are not refused for it).
        // A default shrink is a collective of the parent (numbered as one). One in
        // abort mode is not: NCCL's ranks meet through the bootstrap, whatever each had
        // in flight on the parent when it failed (some never issued the collective the
        // others waited in), so it gets a number of its own, the same on every rank
        // left: the how-many-th abort shrink of this parent.
        let (seq, dev) = if abort_mode {
            let c = g.comms.get_mut(&r.h).ok_or_else(vanished)?;
            c.abort_shrinks += 1;
            ((1u64 << 62) + c.abort_shrinks - 1, c.device)
        } else {
            r.next_coll(&mut g)?
        };
        let name = name_of(&g, config, Some(r.h));
        let h = g.new_handle(r.root, dev, !blocking, name);
        // As NCCL (init.cc:2571-2572): NULL until the shrink is complete.
        put(newcomm, core::ptr::null_mut());
        if let Some(seg) = shared_of(&g, r.clique) {
            // Across processes: the survivors need not talk through the (possibly failed)
            // parent: each derives the child's id and its rank from the exclude list.
            let id = seg.child_id(&format!("shrink {excl:?}"));
            let new_rank = (0..r.nranks)
                .filter(|q| !excl.contains(q))
                .position(|q| q == r.rank);
            let n = r.nranks - excl.len() as c_int;
            let kept = (0..r.nranks as usize)
                .filter(|&q| q != r.rank as usize && !excl.contains(&(q as c_int)))
                .collect();
            let watch = Some((seg, kept));
            join_shared(
                &mut g,
                id,
                n,
                new_rank.unwrap_or(0) as c_int,
                h,
                r.root,
                watch,
            )?;
        } else {
            g.post_rdv(r.clique, seq, Some(excl), (r.rank, 0, r.rank, Some(h)))?;
        }
        if asynchronous(&g, r.h) {
            let job = move || end_child_job(h, None);
            return start_job(&mut g, r.h, Some(h), "shrink", newcomm as usize, job);
        }
        finish_new(g, h, newcomm, !blocking)
    })
}

/// The error `ncclCommGetAsyncError` reports for the ready communicator `h`, if any: a
/// failed job, or its clique's failure (across processes too), unless a revoke cleared it.
fn async_failure(g: &mut Global, h: Handle) -> Option<Fail> {
    let c = g.comms.get(&h)?;
    if let AsyncJob::Failed(f) = &c.async_job {
        return Some(f.clone());
    }
    let cleared = c.error_cleared;
    let CommState::Ready { clique, .. } = c.state else {
        return None;
    };
    if let Some(f) = shared_of(g, clique).and_then(|s| s.failure()) {
        g.abort_clique(clique, f);
    }
    if cleared {
        return None;
    }
    g.cliques.get(&clique).and_then(|c| c.aborted.clone())
}

/// `ncclCommRevoke` as NCCL 2.29.7 has it (init.cc:2602-2693; ARCHITECTURE.md's table has
/// the whole contract): a refusal changes nothing (:2647-2658), the job stores its own
/// result as the asynchronous state (:2635), and the call returns the state read after
/// launching it (:2686-2688).
pub(crate) unsafe extern "C" fn ncclCommRevoke(
    comm: ncclComm_t,
    revoke_flags: c_int,
) -> ncclResult_t {
    ffi(|| {
        if comm.is_null() {
            return Ok(ncclSuccess);
        }
        // `Fault::BlockingRevoke`: NCCL's revoke joins the group job first (group.cc:875-877
        // of v2.29.7-1), outside any lock of the provider; the handle is looked up again
        // after it (a teardown meanwhile is a use after teardown, counted as misuse).
        let root = {
            let mut g = lock();
            let h = known(&mut g, comm, "ncclCommRevoke")?;
            g.comms.get(&h).ok_or_else(vanished)?.root
        };
        super::fault::block_revoke(root);
        let mut g = lock();
        let h = known(&mut g, comm, "ncclCommRevoke")?;
        let c = g.comms.get(&h).ok_or_else(vanished)?;
        let root = c.root;
        let refusal = if revoke_flags != NCCL_REVOKE_DEFAULT as c_int {
            Some(format!(
                "revokeFlags {revoke_flags} (must be NCCL_REVOKE_DEFAULT)"
            ))
        } else if c.destroy_called {
            // NCCL's `destroyFlag` (init.cc:2457 of 2.28.9, :2651 of 2.29.7), which a
            // refused destroy leaves set (init.cc:2379).
            Some("ncclCommDestroy was called on the communicator".to_string())
        } else if c.revoked {
            Some("the communicator was already revoked".to_string())
        } else if c.finalized {
            Some("the communicator was finalized".to_string())
        } else {
            None
        };
        if let Some(m) = refusal {
            return Err(g.invalid(Some(root), "ncclCommRevoke", m));
        }
        g = end_job_for_abort(g, h);
        let h = known(&mut g, comm, "ncclCommRevoke")?;
        // ncclCommEnsureReady under the abort flags aborts the linked job and leaves it
        // linked (init.cc:2664 -> 404 of v2.29.7-1).
        g.abort_group_job(h, "ncclCommRevoke", false);
        if let Some(c) = g.comms.get_mut(&h) {
            c.revoked = true;
            c.finalized = true;
        }
        // The abort flag ends the kernels of this rank that wait for peers, and only
        // those (NCCL's revoke sets this rank's abort flags, init.cc:2662 of v2.29.7-1): a
        // collective of this process's clique in which this rank waits (called from
        // another thread, the watchdog's) ends with an error for this rank, which
        // withdraws from it; the peers that posted to it wait on (their own revoke, abort
        // or deadline ends them), and the collective never runs.
        if let Some(CommState::Ready { clique, rank }) = g.comms.get(&h).map(|c| c.state.clone()) {
            if let Some(cl) = g.cliques.get_mut(&clique) {
                for (key, op) in cl.ops.iter_mut() {
                    let posted = matches!(key, OpKey::Coll(_))
                        && op.posts.get(rank as usize).is_some_and(|p| p.is_some());
                    if posted && matches!(op.state, super::state::OpState::Waiting) {
                        if let Some(w) = op.withdrawn.get_mut(rank as usize) {
                            *w = true;
                        }
                    }
                }
                super::state::notify();
            }
            // Across processes: this rank's wait in shared memory ends; its peers' go on.
            if let Some(seg) = shared_of(&g, clique) {
                seg.revoke();
            }
        }
        // The abort flag ends this rank's kernels: its work in flight. Work stalled behind
        // other work on the stream stays: the job's stream synchronize waits for it
        // (init.cc:2616-2617 of v2.29.7-1).
        super::fault::end_stuck(h);
        let clear = move || {
            super::fault::wait_stalled(h, super::defs::wait_limit());
            super::fault::torn_down(h);
            if let Some(c) = lock().comms.get_mut(&h) {
                c.error_cleared = true;
            }
        };
        if asynchronous(&g, h) {
            start_job(&mut g, h, None, "revoke", 0, move || {
                clear();
                (0, Ok(()))
            })?;
            // As NCCL: the call returns the state it reads after launching the job.
            return Ok(ncclInProgress);
        }
        drop(g);
        clear();
        Ok(ncclSuccess)
    })
}

/// The in-process id of grow `n` of `clique` (no shared segment): unique in the process,
/// the same on every rank of the clique.
fn grow_id_in_process(clique: u64, n: u64) -> IdBytes {
    let mut b = [0u8; 128];
    b[..16].copy_from_slice(super::defs::ID_MAGIC);
    b[16..20].copy_from_slice(&std::process::id().to_le_bytes());
    b[20..24].copy_from_slice(b"grow");
    b[24..32].copy_from_slice(&clique.to_le_bytes());
    b[32..40].copy_from_slice(&n.to_le_bytes());
    b
}

/// The id of the next grow of the ready communicator `r` (its `grows + 1`-th).
fn next_grow_id(g: &Global, r: &Ready) -> IdBytes {
    let n = g.comms.get(&r.h).map_or(0, |c| c.grows) + 1;
    match shared_of(g, r.clique) {
        Some(seg) => seg.grow_id(n),
        None => grow_id_in_process(r.clique, n),
    }
}

/// `ncclCommGetUniqueId` as NCCL 2.29.7 has it (init.cc:2860-2875): on the grow's root,
/// after `ncclCommEnsureReady`, the id of the communicator's next grow (bootstrap.cc:438-467,
/// `hashCombine(comm->magic, comm->childCount + 1)`), sent to ranks 0 and n-1 during the call
/// (`bcastGrowHandle`, :470-486; here through the clique's mailbox, in-process only: across
/// processes every rank derives it) and written to `*uniqueId` on success only.
pub(crate) unsafe extern "C" fn ncclCommGetUniqueId(
    comm: ncclComm_t,
    unique_id: *mut ncclUniqueId,
) -> ncclResult_t {
    ffi(|| {
        let mut g = lock();
        let r = ensure_ready(&mut g, comm, "ncclCommGetUniqueId")?;
        if unique_id.is_null() {
            return Err(r.invalid(&mut g, "uniqueId is NULL"));
        }
        let id = next_grow_id(&g, &r);
        g.alias_root(&id, r.root);
        if shared_of(&g, r.clique).is_none() && r.nranks > 1 {
            for to in [0, r.nranks - 1] {
                g.grow_mail.entry((r.clique, to)).or_default().push_back(id);
            }
            super::state::notify();
        }
        put(unique_id, unique_id_of(id));
        Ok(ncclSuccess)
    })
}

/// A boundary rank's receipt of the grow id (`bcastGrowHandle(.., isRoot=false)`,
/// init.cc:2913-2923): blocks until the root's `ncclCommGetUniqueId` sent it, the clique
/// fails, or the provider's wait limit.
fn receive_grow_id(
    mut g: MutexGuard<'static, Global>,
    h: Handle,
    clique: u64,
    rank: i32,
) -> (MutexGuard<'static, Global>, Result<IdBytes, Fail>) {
    g.blocked_in_grow.insert(h);
    let (mut g, got) = wait_until(g, |g| {
        let mail = g
            .grow_mail
            .get_mut(&(clique, rank))
            .and_then(|q| q.pop_front());
        // A revoke (from another thread) sets the abort flags, which end the bootstrap's
        // receive (bootstrap.cc:481 of v2.29.7-1) without freeing anything.
        let revoked = || {
            g.comms.get(&h).is_some_and(|c| c.revoked).then(|| {
                let m = "ncclCommGrow: the communicator was revoked while this rank waited for the grow id (its abort flags end the wait)";
                Fail::new(ncclInternalError, m)
            })
        };
        (mail.map(Ok))
            .or_else(|| g.cliques.get(&clique)?.aborted.clone().map(Err))
            .or_else(|| revoked().map(Err))
    });
    g.blocked_in_grow.remove(&h);
    let limit = super::defs::wait_limit();
    let m = format!("ncclCommGrow: rank {rank} did not receive the grow id (no rank called ncclCommGetUniqueId) within {limit:?} (NCCL_SAFE_HOST_TIMEOUT_MS)");
    (g, got.unwrap_or_else(|| Err(Fail::new(ncclTimeout, m))))
}

/// `ncclCommGrow` as NCCL 2.29.7 has it (init.cc:2877-3038; ARCHITECTURE.md's table has the
/// whole contract). Refused with nothing written: a NULL `newcomm`, `nRanks <= 0`, or (an
/// existing rank) `nRanks` not above the size; then `*newcomm = NULL` (:2895). Existing
/// ranks (`comm` set) pass `rank = -1`, and ranks 0 and n-1 wait for the root's id
/// (:2911-2924); new ranks (`comm` NULL) pass the id and their rank. Every rank's new
/// communicator is written during the call (:2997) and reads ncclInProgress until its job
/// (an init over the id) ends; the call returns ncclSuccess (:3016), and a later failure
/// writes NULL again (:3027-3036). Stricter in one point: an id passed by an existing rank
/// must be this grow's.
pub(crate) unsafe extern "C" fn ncclCommGrow(
    comm: ncclComm_t,
    n_ranks: c_int,
    unique_id: *const ncclUniqueId,
    rank: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    super::fault::ensure_runtime();
    ffi_grouped(|| {
        const NAME: &str = "ncclCommGrow";
        let mut g = lock();
        if newcomm.is_null() || n_ranks <= 0 {
            let m = format!("newcomm is NULL or nRanks {n_ranks} <= 0");
            return Err(g.invalid(None, NAME, m));
        }
        let given = (!unique_id.is_null()).then(|| {
            // SAFETY: non-null, so a readable ncclUniqueId (NCCL's contract).
            id_bytes(unsafe { &*unique_id })
        });
        if !comm.is_null() {
            let r = ready(&mut g, comm, NAME, false)?;
            if n_ranks <= r.nranks {
                let m = format!(
                    "total ranks {n_ranks} is not above the current {}",
                    r.nranks
                );
                return Err(r.invalid(&mut g, m));
            }
            put(newcomm, core::ptr::null_mut());
            if let Some(f) = async_failure(&mut g, r.h) {
                return Err(f);
            }
            if rank != -1 {
                let m = format!("existing ranks must pass rank = -1, got {rank}");
                return Err(r.invalid(&mut g, m));
            }
            let id = next_grow_id(&g, &r);
            if let Some(c) = g.comms.get_mut(&r.h) {
                c.grows += 1;
            }
            g.alias_root(&id, r.root);
            let shared = shared_of(&g, r.clique);
            if shared.is_none() && r.nranks > 1 && (r.rank == 0 || r.rank == r.nranks - 1) {
                let (g2, got) = receive_grow_id(g, r.h, r.clique, r.rank);
                g = g2;
                if got? != id {
                    let m =
                        "the grow id received from the root is not this grow's (magic mismatch)";
                    return Err(r.invalid(&mut g, m));
                }
            }
            if given.is_some_and(|x| x != id) {
                let m =
                    "uniqueId is not this communicator's next grow id (from ncclCommGetUniqueId)";
                return Err(r.invalid(&mut g, m));
            }
            let (root, parent) = (r.root, Some(r.h));
            return new_rank(g, id, n_ranks, r.rank, root, parent, config, NAME, newcomm)
                .map(in_progress_as_success);
        }
        let Some(id) = given else {
            return Err(g.invalid(None, NAME, "new ranks must pass a uniqueId"));
        };
        let root = g.root_of(&id);
        if rank < 0 || rank >= n_ranks {
            let m = format!("new rank {rank} is not in 0..{n_ranks}");
            return Err(g.invalid(Some(root), NAME, m));
        }
        put(newcomm, core::ptr::null_mut());
        new_rank(g, id, n_ranks, rank, root, None, config, NAME, newcomm)
            .map(in_progress_as_success)
    })
}

/// ncclSuccess for ncclInProgress, as NCCL's `NCCLCHECK` lets it through: what
/// `ncclCommGrow` (init.cc:3016) and `ncclCommInitRank` return where `finish_new` says
/// ncclInProgress, the new communicator's state reading ncclInProgress.
fn in_progress_as_success(r: ncclResult_t) -> ncclResult_t {
    if r == ncclInProgress {
        ncclSuccess
    } else {
        r
    }
}

pub(crate) unsafe extern "C" fn ncclCommGetAsyncError(
    comm: ncclComm_t,
    async_error: *mut ncclResult_t,
) -> ncclResult_t {
    super::fault::slow_call(comm as Handle);
    ffi(|| {
        let mut g = lock();
        let h = known(&mut g, comm, "ncclCommGetAsyncError")?;
        let root = g.comms.get(&h).map(|c| c.root);
        if async_error.is_null() {
            return Err(g.invalid(root, "ncclCommGetAsyncError", "asyncError is NULL"));
        }
        g.check_pending_deadline(h);
        // A launch the caller learns of now has ended (NCCL's thread joined), with the
        // launch's own result: its work ran in the call that returned ncclInProgress. A
        // failure of the clique since (a peer's abort) is not this launch's: NCCL's state
        // shows it only once this rank's next work meets it, and so does the provider's.
        if let Some(c) = g.comms.get_mut(&h) {
            if matches!(c.async_job, AsyncJob::Launching) {
                c.async_job = AsyncJob::Idle;
                put(async_error, ncclSuccess);
                g.complete_group_job(h, "ncclCommGetAsyncError");
                return Ok(ncclSuccess);
            }
        }
        // Asynchronous work in flight, or its sticky failure, first (see `start_job`); then
        // the communicator's own state.
        let report = |f: Fail| {
            set_last(&f.msg);
            f.code
        };
        let code = match g
            .comms
            .get(&h)
            .map(|c| (c.async_job.clone(), c.state.clone()))
        {
            None => ncclInternalError,
            Some(
                (AsyncJob::Busy { .. } | AsyncJob::Launching, _)
                | (AsyncJob::Idle, CommState::Pending),
            ) => ncclInProgress,
            Some((AsyncJob::Failed(f), _) | (AsyncJob::Idle, CommState::Failed(f))) => report(f),
            Some((AsyncJob::Idle, CommState::Ready { .. })) => {
                async_failure(&mut g, h).map_or(ncclSuccess, report)
            }
        };
        if code == ncclSuccess {
            g.complete_group_job(h, "ncclCommGetAsyncError");
        }
        put(async_error, code);
        Ok(ncclSuccess)
    })
}

fn comm_query(
    what: &'static str,
    comm: ncclComm_t,
    out: *mut c_int,
    f: impl FnOnce(&Global, &Ready) -> c_int,
) -> ncclResult_t {
    ffi(|| {
        let mut g = lock();
        let r = ensure_ready(&mut g, comm, what)?;
        if out.is_null() {
            return Err(r.invalid(&mut g, "output pointer is NULL"));
        }
        put(out, f(&g, &r));
        Ok(ncclSuccess)
    })
}

forward! {
    ncclCommCount(comm: ncclComm_t, count: *mut c_int) => comm_query(comm, count, |_, r| r.nranks);
    ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int)
        => comm_query(comm, device, |g, r| g.comms.get(&r.h).map_or(-1, |c| c.device));
    ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) => comm_query(comm, rank, |_, r| r.rank);
}

pub(crate) unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut ncclRedOp_t,
    scalar: *mut c_void,
    datatype: ncclDataType_t,
    residence: ncclScalarResidence_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    ffi(|| {
        let mut g = lock();
        let r = ensure_ready(&mut g, comm, "ncclRedOpCreatePreMulSum")?;
        let Some(es) = dtype::size_of(datatype) else {
            let m = format!("unknown datatype {datatype}");
            return Err(r.invalid(&mut g, m));
        };
        if op.is_null()
            || scalar.is_null()
            || (residence != ncclScalarDevice && residence != ncclScalarHostImmediate)
        {
            let m = format!("op or scalar is NULL, or unknown residence {residence}");
            return Err(r.invalid(&mut g, m));
        }
        let scalar = if residence == ncclScalarHostImmediate {
            // SAFETY: a host-immediate scalar points at one element of `datatype` (NCCL's contract).
            Ok(unsafe { core::slice::from_raw_parts(scalar as *const u8, es) }.to_vec())
        } else {
            Err(scalar as usize)
        };
        let c = g.comms.get_mut(&r.h).ok_or_else(vanished)?;
        let id = c.next_redop;
        c.next_redop += 1;
        c.redops.insert(
            id,
            PreMul {
                dtype: datatype,
                scalar,
            },
        );
        put(op, id);
        Ok(ncclSuccess)
    })
}

pub(crate) unsafe extern "C" fn ncclRedOpDestroy(
    op: ncclRedOp_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    ffi(|| {
        let mut g = lock();
        let r = ready(&mut g, comm, "ncclRedOpDestroy", false)?;
        if g.comms
            .get_mut(&r.h)
            .and_then(|c| c.redops.remove(&op))
            .is_none()
        {
            let m = format!("op {op} is not a PreMulSum op created on this communicator");
            return Err(r.invalid(&mut g, m));
        }
        Ok(ncclSuccess)
    })
}

/// An operation's entry point `name` on `comm`: on a ready communicator and a known
/// datatype `dt`, `post` checks the rest and queues the work, given the lock, the
/// communicator and `dt`'s element size. A failure inside a group is kept for its end.
fn operation(
    name: &'static str,
    comm: ncclComm_t,
    dt: ncclDataType_t,
    post: impl FnOnce(MutexGuard<'static, Global>, Ready, usize) -> Result<ncclResult_t, Fail>,
) -> ncclResult_t {
    ffi_grouped(|| {
        let mut g = lock();
        let r = ready(&mut g, comm, name, true)?;
        let (revoked, suspended) = g
            .comms
            .get(&r.h)
            .map_or((false, false), |c| (c.revoked, c.suspended));
        if revoked {
            // As NCCL's ncclEnqueueCheck (enqueue.cc:2983-2986 of 2.29.7).
            let m = "communicator was revoked";
            return Err(g.misuse(Some(r.root), ncclInvalidUsage, name, m));
        }
        if suspended {
            // NCCL 2.30 checks nothing here: its kernels would use memory the suspend
            // unmapped (mem_manager.cc:493-496 of 2.30.7). Refused instead of emulating that fault.
            let m = "communicator is suspended (ncclCommSuspend): resume it first";
            return Err(g.misuse(Some(r.root), ncclInvalidUsage, name, m));
        }
        let Some(es) = dtype::size_of(dt) else {
            return Err(r.refuse(&mut g, format!("unknown datatype {dt}")));
        };
        post(g, r, es)
    })
}

/// NCCL's `ncclCommSetAsyncError` on a non-blocking communicator `h`: `f` becomes its
/// asynchronous error, unless a job already owns that state (in flight, or failed first).
fn set_async_error(g: &mut Global, h: Handle, f: &Fail) {
    if let Some(c) = g.comms.get_mut(&h) {
        if c.nonblocking && matches!(c.async_job, AsyncJob::Idle) {
            c.async_job = AsyncJob::Failed(f.clone());
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn coll(
    name: &'static str,
    kind: Collective,
    comm: ncclComm_t,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: ncclDataType_t,
    op: Option<ncclRedOp_t>,
    root: Option<c_int>,
) -> ncclResult_t {
    operation(name, comm, dt, |mut g, r, es| {
        let rt = root.unwrap_or(0);
        if rt < 0 || rt >= r.nranks {
            let m = format!("root {rt} out of range 0..{}", r.nranks);
            return Err(r.refuse(&mut g, m));
        }
        // NCCL_CHECK_POINTERS=1 checks both buffers whatever the count, but a broadcast's
        // send and a reduce's recv only on the root (ArgsCheck, misc/argcheck.cc:71-83 of
        // 2.28.9). CudaPtrCheck refuses a pointer CUDA does not know; here, a null one.
        if super::defs::check_pointers() {
            let root_only = |k| kind == k && root != Some(r.rank);
            for (ptr, arg, exempt) in [
                (send.is_null(), "sendbuff", root_only(Collective::Broadcast)),
                (recv.is_null(), "recvbuff", root_only(Collective::Reduce)),
            ] {
                if ptr && !exempt {
                    return Err(r.refuse(&mut g, format!("{arg} (nil) is not a valid pointer")));
                }
            }
        }
        let op = op.unwrap_or(ncclSum);
        let made = g.comms.get(&r.h).and_then(|c| c.redops.get(&op)).cloned();
        let unknown = |g: &mut Global| r.refuse(g, format!("unknown reduction op {op}"));
        if count == 0 {
            // After NCCL's ArgsCheck (the root, and an op that exists: argcheck.cc), an
            // empty collective is discarded (taskAppend, enqueue.cc:2554-2555 of 2.28.9):
            // no sequence number, no peer, nothing else checked.
            return match (RedKind::of(op), made) {
                (None, None) => Err(unknown(&mut g)),
                _ => Ok(ncclSuccess),
            };
        }
        let (red, scalar) = match (RedKind::of(op), made) {
            (Some(k), _) => (k, Vec::new()),
            (None, None) => return Err(unknown(&mut g)),
            (None, Some(p)) if p.dtype != dt => {
                let made_for = p.dtype;
                let m = format!(
                    "PreMulSum op {op} was created for datatype {made_for} but used with {dt}"
                );
                return Err(r.refuse(&mut g, m));
            }
            (None, Some(p)) => {
                // SAFETY: a "device" scalar (its address) is read at op time; the caller keeps
                // it valid for the life of the op (NCCL's contract for ncclScalarDevice).
                let read = |a| unsafe { core::slice::from_raw_parts(a as *const u8, es) }.to_vec();
                (RedKind::PreMulSum, p.scalar.unwrap_or_else(read))
            }
        };
        let is_root = root.is_none_or(|x| x == r.rank);
        let Some((ns, nr)) = kind.elements(count, r.nranks as usize, is_root) else {
            return Err(r.refuse(&mut g, format!("count {count} too large")));
        };
        if ns.checked_mul(es).is_none() || nr.checked_mul(es).is_none() {
            return Err(r.refuse(&mut g, format!("count {count} too large")));
        }
        if ns > 0 && send.is_null() {
            return Err(r.refuse(&mut g, "sendbuff is NULL"));
        }
        if nr > 0 && recv.is_null() {
            return Err(r.refuse(&mut g, "recvbuff is NULL"));
        }
        let post = CollPost {
            kind,
            send: if ns > 0 { send as usize } else { 0 },
            recv: if nr > 0 { recv as usize } else { 0 },
            count,
            dtype: dt,
            red,
            scalar,
            root: rt,
            caller: super::current_caller(),
        };
        let (seq, _) = r.next_coll(&mut g)?;
        let item = Item::Op {
            h: r.h,
            clique: r.clique,
            rank: r.rank,
            key: OpKey::Coll(seq),
            post,
        };
        submit(g, &r, item)
    })
}

fn p2p(
    name: &'static str,
    is_send: bool,
    ptr: usize,
    count: usize,
    dt: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
) -> ncclResult_t {
    operation(name, comm, dt, |mut g, r, es| {
        if peer < 0 || peer >= r.nranks {
            let m = format!("peer {peer} out of range 0..{}", r.nranks);
            return Err(r.refuse(&mut g, m));
        }
        if count.checked_mul(es).is_none() {
            return Err(r.refuse(&mut g, format!("count {count} too large")));
        }
        if count > 0 && ptr == 0 {
            return Err(r.refuse(&mut g, "buffer is NULL"));
        }
        let c = g.comms.get_mut(&r.h).ok_or_else(vanished)?;
        let ctr = c.p2p_seq.entry((is_send, peer)).or_insert(0);
        let seq = *ctr;
        *ctr += 1;
        // A send is rank (source, destination) of its pair and has its buffer in `send`.
        let (kind, (src, dst), (send, recv)) = if is_send {
            (Collective::Send, (r.rank, peer), (ptr, 0))
        } else {
            (Collective::Recv, (peer, r.rank), (0, ptr))
        };
        let post = CollPost {
            kind,
            send,
            recv,
            count,
            dtype: dt,
            red: RedKind::Sum,
            scalar: Vec::new(),
            root: peer,
            caller: super::current_caller(),
        };
        let item = Item::Op {
            h: r.h,
            clique: r.clique,
            rank: r.rank,
            key: OpKey::P2p(src, dst, seq),
            post,
        };
        submit(g, &r, item)
    })
}

forward! {
    ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t,
        _stream: cudaStream_t)
        => coll(Collective::Reduce, comm, sendbuff, recvbuff, count, datatype, Some(op), Some(root));
    ncclBcast(buff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int,
        comm: ncclComm_t, _stream: cudaStream_t)
        => coll(Collective::Broadcast, comm, buff, buff, count, datatype, None, Some(root));
    ncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, _stream: cudaStream_t)
        => coll(Collective::Broadcast, comm, sendbuff, recvbuff, count, datatype, None, Some(root));
    ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, _stream: cudaStream_t)
        => coll(Collective::AllReduce, comm, sendbuff, recvbuff, count, datatype, Some(op), None);
    ncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize,
        datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, _stream: cudaStream_t)
        => coll(Collective::ReduceScatter, comm, sendbuff, recvbuff, recvcount, datatype, Some(op), None);
    ncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize,
        datatype: ncclDataType_t, comm: ncclComm_t, _stream: cudaStream_t)
        => coll(Collective::AllGather, comm, sendbuff, recvbuff, sendcount, datatype, None, None);
    ncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, comm: ncclComm_t, _stream: cudaStream_t)
        => coll(Collective::AllToAll, comm, sendbuff, recvbuff, count, datatype, None, None);
    ncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, _stream: cudaStream_t)
        => coll(Collective::Gather, comm, sendbuff, recvbuff, count, datatype, None, Some(root));
    ncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, _stream: cudaStream_t)
        => coll(Collective::Scatter, comm, sendbuff, recvbuff, count, datatype, None, Some(root));
    ncclSend(sendbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int,
        comm: ncclComm_t, _stream: cudaStream_t)
        => p2p(true, sendbuff as usize, count, datatype, peer, comm);
    ncclRecv(recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, peer: c_int,
        comm: ncclComm_t, _stream: cudaStream_t)
        => p2p(false, recvbuff as usize, count, datatype, peer, comm);
}

/// The outermost ncclGroupEnd of a group in which a call failed, as NCCL's
/// (`ncclGroupError`, group.cc:671, then `groupCleanup`, 340-394 of 2.28.9): nothing runs.
/// The operations are discarded (their peers wait for them in vain, as on a GPU), the queued
/// splits and shrinks and the teardowns called in the group are dropped unrun (NCCL destroys
/// their jobs), the queued window registrations are left stale (see [`stale_window`]), and
/// every non-blocking communicator of the group, and the parent of each dropped split, gets
/// the error as its asynchronous state. Returns the error.
fn group_failed(f: Fail, queued: Vec<Queued>, items: &[Item]) -> Fail {
    let mut g = lock();
    let posted = items.iter().map(|item| match *item {
        Item::Op { h, .. } | Item::Handle(h) => h,
    });
    for q in queued.iter().filter(|q| q.window) {
        stale_window(&mut g, q.parent);
    }
    for h in queued.iter().map(|q| q.parent).chain(posted) {
        set_async_error(&mut g, h, &f);
    }
    f
}

/// A window registration of `h` that a failed group left queued, unrun: NCCL leaves its task
/// on the communicator (`groupCleanup`, group.cc:340-397 of 2.28.9, does not empty
/// `devrState.regTaskQueue`; only the teardown frees it, dev_runtime.cc:114-117) and runs
/// it first, writing through its out-pointer, at the next group end that registers a window
/// there. The provider refuses that next registration instead (stricter: no stale write).
fn stale_window(g: &mut Global, h: Handle) {
    if let Some(c) = g.comms.get_mut(&h) {
        c.stale_windows += 1;
    }
}

pub(crate) unsafe extern "C" fn ncclGroupStart() -> ncclResult_t {
    ffi(|| {
        GROUP.with(|g| g.borrow_mut().0 += 1);
        Ok(ncclSuccess)
    })
}

pub(crate) unsafe extern "C" fn ncclGroupEnd() -> ncclResult_t {
    ffi(|| {
        // `None` without a group; `Some(None)` for an inner level; else the group's work.
        let ended = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            g.0 = g.0.checked_sub(1)?;
            Some((g.0 == 0).then(|| (std::mem::take(&mut g.1), g.2.take())))
        });
        let Some(ended) = ended else {
            let m = "without a matching ncclGroupStart";
            return Err(lock().misuse(None, ncclInvalidUsage, "ncclGroupEnd", m));
        };
        let Some((items, err)) = ended else {
            return Ok(ncclSuccess);
        };
        // The queued jobs first, as NCCL's groupLaunch (group.cc:537), then the group's
        // operations. A job of a non-blocking parent runs on, as outside a group (its
        // ncclInProgress is its start, not a failure).
        let queued = QUEUED.with(|q| std::mem::take(&mut *q.borrow_mut()));
        let deferred = DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut()));
        if let Some(f) = err {
            drop(deferred); // NCCL destroys the reclaim jobs unrun
            return Err(group_failed(f, queued, &items));
        }
        // Splits and shrinks first, then the window registrations (group.cc:537, 540-567);
        // after a failure NCCL's group goes to its cleanup, leaving the registrations not yet
        // run queued (see `stale_window`).
        let (windows, jobs): (Vec<_>, Vec<_>) = queued.into_iter().partition(|q| q.window);
        // One-sided calls' communicators launch with the group, as a collective's.
        let rma: Vec<Handle> = jobs.iter().filter(|q| q.rma).map(|q| q.parent).collect();
        let mut failed = None;
        for q in jobs.into_iter().chain(windows) {
            if q.window && failed.is_some() {
                stale_window(&mut lock(), q.parent);
                continue;
            }
            let code = (q.job)();
            if code != ncclSuccess && code != ncclInProgress && failed.is_none() {
                let msg = LAST.with(|l| l.borrow().0.to_string_lossy().into_owned());
                failed = Some(Fail::raw(code, msg));
            }
        }
        let ops: Vec<Handle> = items
            .iter()
            .filter_map(|it| match it {
                Item::Op { h, .. } => Some(*h),
                Item::Handle(_) => None,
            })
            .collect();
        let r = run_items(lock(), items);
        for (h, abort) in deferred {
            let _ = teardown(h as ncclComm_t, abort);
        }
        match failed {
            Some(f) => Err(f),
            None => r.map(|()| launched(ops.into_iter().chain(rma))),
        }
    })
}

pub(crate) unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    ffi(|| {
        let mut g = lock();
        if ptr.is_null() {
            return Err(g.invalid(None, "ncclMemAlloc", "ptr is NULL"));
        }
        let Ok(layout) = std::alloc::Layout::from_size_align(size.max(1), 4096) else {
            return Err(g.invalid(None, "ncclMemAlloc", format!("size {size} too large")));
        };
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            let m = format!("ncclMemAlloc: out of host memory ({size} bytes)");
            return Err(Fail::new(ncclSystemError, m));
        }
        g.mem.insert(p as usize, layout);
        g.count(None, |s| s.mem_allocated += 1);
        put(ptr, p as *mut c_void);
        Ok(ncclSuccess)
    })
}

pub(crate) unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    ffi(|| {
        if ptr.is_null() {
            return Ok(ncclSuccess);
        }
        let mut g = lock();
        let Some(layout) = g.mem.remove(&(ptr as usize)) else {
            let m = format!("{ptr:p} was not returned by ncclMemAlloc (or was freed already)");
            return Err(g.invalid(None, "ncclMemFree", m));
        };
        // SAFETY: `ptr` came from `alloc_zeroed` with this layout and was not freed (it was
        // still in the table, which we just removed it from).
        unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        g.count(None, |s| s.mem_freed += 1);
        Ok(ncclSuccess)
    })
}

pub(crate) unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    super::fault::slow_call(comm as Handle);
    ffi(|| {
        let mut g = lock();
        let r = ready(&mut g, comm, "ncclCommRegister", false)?;
        if handle.is_null() || (buff.is_null() && size > 0) {
            return Err(r.invalid(&mut g, "buff or handle is NULL"));
        }
        if !super::defs::local_register() {
            // As NCCL under NCCL_LOCAL_REGISTER=0 (register/register.cc:118-121 of 2.28.9).
            put(handle, core::ptr::null_mut());
            return Ok(ncclSuccess);
        }
        let token = registry::register(&mut g, registry::Kind::Buffer, r.h, r.root);
        put(handle, token as *mut c_void);
        Ok(ncclSuccess)
    })
}

pub(crate) unsafe extern "C" fn ncclCommDeregister(
    comm: ncclComm_t,
    handle: *mut c_void,
) -> ncclResult_t {
    super::fault::slow_call(comm as Handle);
    ffi(|| {
        let mut g = lock();
        let r = ready(&mut g, comm, "ncclCommDeregister", false)?;
        if handle.is_null() {
            return Ok(ncclSuccess); // as NCCL: a registration NCCL skipped is NULL
        }
        let token = handle as usize;
        registry::deregister(&mut g, registry::Kind::Buffer, r.h, r.root, token)?;
        Ok(ncclSuccess)
    })
}

/// Window flags this provider knows (`NCCL_WIN_*` of the 2.32 header).
const KNOWN_WIN_FLAGS: c_int =
    (NCCL_WIN_COLL_SYMMETRIC | NCCL_WIN_STRICT_ORDERING | NCCL_WIN_GIN_ONLY | NCCL_WIN_CFT_COUNTED)
        as c_int;

pub(crate) unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    win_flags: c_int,
) -> ncclResult_t {
    // Grouped: a refusal inside a group fails the group's end too, as NCCL's
    // `ncclGroupErrCheck` (dev_runtime.cc:918 of 2.28.9).
    ffi_grouped(|| {
        let mut g = lock();
        const NAME: &str = "ncclCommWindowRegister";
        // NCCL's `ncclCommEnsureReady` (dev_runtime.cc:904): refused while in progress,
        // and with the communicator's asynchronous error once it has one.
        let r = ensure_ready(&mut g, comm, NAME)?;
        let stale = g
            .comms
            .get_mut(&r.h)
            .map_or(0, |c| std::mem::take(&mut c.stale_windows));
        if stale > 0 {
            let m = format!("{stale} window registration(s) queued in a group that failed are still queued on this communicator: NCCL would run them first, at this registration's group end, writing through their out-pointers (group.cc:340-397 of 2.28.9 leaves them queued)");
            return Err(g.misuse(Some(r.root), ncclInvalidUsage, NAME, m));
        }
        if win.is_null() {
            return Err(r.invalid(&mut g, "win is NULL"));
        }
        if buff.is_null() || size == 0 {
            let m = format!("invalid pointer {buff:p} / size {size}");
            return Err(r.invalid(&mut g, m));
        }
        if win_flags & !KNOWN_WIN_FLAGS != 0 {
            return Err(r.invalid(&mut g, format!("unknown flags {win_flags:#x}")));
        }
        if !(super::defs::win_enable() || super::defs::local_register()) {
            // As NCCL without symmetric support or local registration: ncclSuccess at
            // once, inside a group too, writing nothing (dev_runtime.cc:902 of 2.28.9).
            return Ok(ncclSuccess);
        }
        if win_flags & NCCL_WIN_COLL_SYMMETRIC as c_int != 0 {
            let refusal = match registry::nccl_memory_offset(&g, buff, size) {
                None => Some(format!("NCCL_WIN_COLL_SYMMETRIC needs memory from ncclMemAlloc, and {buff:p} is not in such an allocation")),
                // As NCCL (dev_runtime.cc:605-611 of 2.28.9), which refuses it in its job.
                Some(at) if at % NCCL_WIN_REQUIRED_ALIGNMENT as usize != 0 => Some(format!("Window address must be suitably aligned ({at} bytes into its allocation, not a multiple of {NCCL_WIN_REQUIRED_ALIGNMENT})")),
                Some(_) => None,
            };
            if let Some(m) = refusal {
                return Err(r.invalid(&mut g, m));
            }
        }
        if in_group() {
            return Ok(queue_window(r.h, comm, buff, size, win, win_flags));
        }
        if asynchronous(&g, r.h) {
            // As NCCL (dev_runtime.cc:900-921): the registration is a task of the group that
            // ends the call, run by its thread, which writes the window later.
            let (h, root, at) = (r.h, r.root, buff as usize);
            return start_job(&mut g, r.h, None, "window", win as usize, move || {
                let mut g = lock();
                if !g.comms.contains_key(&h) {
                    return (0, Err(vanished()));
                }
                (
                    registry::register_window(&mut g, h, root, at, size, win_flags),
                    Ok(()),
                )
            });
        }
        let token = registry::register_window(&mut g, r.h, r.root, buff as usize, size, win_flags);
        put(win, token as ncclWindow_t);
        Ok(ncclSuccess)
    })
}

/// A window registration inside a group, as NCCL 2.28.9 has it: the call queues the task
/// with the caller's out-pointer (dev_runtime.cc:909-915) and returns ncclSuccess, writing
/// nothing and leaving the communicator's state alone; the group's job registers it at the
/// outermost ncclGroupEnd (group.cc:540-567 -> `ncclCommGroupRegisterSymmetric`, :223-236)
/// and writes `*win` there (dev_runtime.cc:596, or :533 with symmetric support), or NULL if
/// it fails (:646). Here the job is the call made again outside the group: on a blocking
/// communicator it writes `*win` in the group's end, on a non-blocking one it starts the
/// asynchronous registration, which a thread of the provider's writes later, the
/// communicator reading ncclInProgress until then (NCCL's group thread, group.cc:706-738).
/// Stricter than NCCL in one point: the queued calls run one after the other (splits and
/// shrinks first, as NCCL's), so a registration queued with a split or shrink of the same
/// non-blocking communicator is refused at the group's end (its communicator is then busy
/// with the other job), where NCCL runs both on its group thread. A group that fails runs none of them and writes nothing, and the
/// next registration on their communicator is refused ([`stale_window`]).
fn queue_window(
    h: Handle,
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    win_flags: c_int,
) -> ncclResult_t {
    let (comm, buff, out) = (comm as usize, buff as usize, win as usize);
    let job = move || {
        // SAFETY: NCCL's contract: the caller keeps the communicator, the buffer and the
        // out-pointer valid until the group's job has written it.
        let rc = unsafe { ncclCommWindowRegister(comm as _, buff as _, size, out as _, win_flags) };
        if rc != ncclSuccess && rc != ncclInProgress {
            put(out as *mut ncclWindow_t, core::ptr::null_mut());
        }
        rc
    };
    let (parent, window, job) = (h, true, Box::new(job));
    QUEUED.with(|q| {
        q.borrow_mut().push(Queued {
            parent,
            window,
            rma: false,
            job,
        })
    });
    ncclSuccess
}

pub(crate) unsafe extern "C" fn ncclCommWindowDeregister(
    comm: ncclComm_t,
    win: ncclWindow_t,
) -> ncclResult_t {
    ffi(|| {
        // As NCCL's, which unmaps through the driver: it waits behind the communicator's
        // work that has not completed (stuck or stalled), holding no lock, until that work
        // is released, the communicator is aborted (from another thread: a clean error,
        // not a use after teardown), or the provider's deadline.
        let waited = super::fault::wait_for_work(comm as Handle, super::defs::wait_limit());
        let mut g = lock();
        if waited && g.dead.contains_key(&(comm as Handle)) {
            let m = "ncclCommWindowDeregister: the communicator was aborted while the deregistration waited behind its work";
            return Err(Fail::new(ncclRemoteError, m));
        }
        let r = ready(&mut g, comm, "ncclCommWindowDeregister", false)?;
        if win.is_null() {
            return Ok(ncclSuccess); // as NCCL: nothing was registered
        }
        registry::deregister(&mut g, registry::Kind::Window, r.h, r.root, win as usize)?;
        Ok(ncclSuccess)
    })
}

/// The checks NCCL 2.30.7's one-sided calls share after `ArgsCheck` (`rmaTaskAppend`,
/// enqueue.cc:2807-2845): host RMA support (here: windows enabled), then the context, the
/// signal index and the flags, each refused with ncclInvalidArgument. Every refusal is the
/// communicator's asynchronous error too (ncclEnqueueCheck's `fail:`, enqueue.cc:3170).
fn rma_checks(
    g: &mut Global,
    r: &Ready,
    sig_idx: c_int,
    ctx: c_int,
    flags: u32,
) -> Result<(), Fail> {
    if !super::defs::win_enable() {
        return Err(r.refuse(
            g,
            "One sided RMA: host RMA is not supported in this communicator.",
        ));
    }
    if ctx != 0 {
        return Err(r.refuse(g, format!("Context {ctx} is invalid (must be 0)")));
    }
    if sig_idx != 0 {
        return Err(r.refuse(g, format!("Signal index {sig_idx} is invalid (must be 0)")));
    }
    if flags != 0 {
        return Err(r.refuse(g, format!("Flags {flags} is invalid (must be 0)")));
    }
    Ok(())
}

/// `ArgsCheck`'s root check (misc/argcheck.cc:203-206 of 2.30.7), the peer of a put or
/// signal.
fn rma_peer(g: &mut Global, r: &Ready, peer: c_int) -> Result<(), Fail> {
    if peer < 0 || peer >= r.nranks {
        let m = format!(
            "invalid root {peer} (root should be in the 0..{} range)",
            r.nranks
        );
        return Err(r.refuse(g, m));
    }
    Ok(())
}

/// The handle of rank `rank` of `clique` in this process.
fn rank_handle(g: &Global, clique: u64, rank: i32) -> Option<Handle> {
    (g.comms.iter())
        .find(|(_, c)| matches!(c.state, CommState::Ready { clique: k, rank: q } if k == clique && q == rank))
        .map(|(h, _)| *h)
}

/// The work of a one-sided call whose checks passed: run now, or at the outermost
/// ncclGroupEnd.
type RmaAct = Box<dyn FnOnce() -> Result<(), Fail>>;

/// Runs a one-sided call's work: inside a group, queued for the outermost ncclGroupEnd, as
/// NCCL does (`ncclGroupCommJoin`, enqueue.cc:2920 of 2.30.7: the task is planned and
/// launched by the group's end, which then reads as after a collective); else now, then
/// the launch as a collective's.
fn run_rma(h: Handle, act: RmaAct) -> Result<ncclResult_t, Fail> {
    if in_group() {
        let q = Queued {
            parent: h,
            window: false,
            rma: true,
            job: Box::new(move || ffi(|| act().map(|()| ncclSuccess))),
        };
        QUEUED.with(|x| x.borrow_mut().push(q));
        return Ok(ncclSuccess);
    }
    act()?;
    Ok(launched([h]))
}

/// The clique's abort, or its absence, as a wait sees it.
fn clique_gone(g: &Global, clique: u64) -> Option<Fail> {
    g.cliques.get(&clique).map_or_else(
        || {
            let m = "every rank of this communicator was destroyed or aborted";
            Some(Fail::new(ncclRemoteError, m))
        },
        |c| c.aborted.clone(),
    )
}

/// `ncclPutSignal` as NCCL 2.30.7 has it (collectives.cc:315-344 -> ncclEnqueueCheck ->
/// `rmaTaskAppend`, enqueue.cc:2807-3008): the peer in range, then [`rma_checks`], then
/// `peerWin` not null, `localbuff` not null and inside a `NCCL_WIN_COLL_SYMMETRIC` window
/// of this communicator. Here the stream reaches the put when it runs (in the call, or at
/// the group's end): the source is read then and the data travels with the signal to the
/// peer, whose `ncclWaitSignal` lands it (across processes, through a file beside the
/// shared segment). Stricter than NCCL, which checks neither: a put past the end of the
/// peer's window (its counterpart of the same registration order; across processes, this
/// rank's own, of the same size), or to a peer that has no such window, is refused and
/// fails the communicator, where NCCL would write past it.
pub(crate) unsafe extern "C" fn ncclPutSignal(
    localbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    peer_win: ncclWindow_t,
    peer_win_offset: usize,
    sig_idx: c_int,
    ctx: c_int,
    flags: u32,
    comm: ncclComm_t,
    _stream: cudaStream_t,
) -> ncclResult_t {
    operation("ncclPutSignal", comm, datatype, |mut g, r, es| {
        rma_peer(&mut g, &r, peer)?;
        rma_checks(&mut g, &r, sig_idx, ctx, flags)?;
        if peer_win.is_null() {
            return Err(r.refuse(&mut g, "ncclPutSignal: peerWin is NULL"));
        }
        let Some(win) = registry::window(r.h, peer_win as usize) else {
            let m = format!("{peer_win:p} is not a live window of this communicator");
            return Err(r.refuse(&mut g, m));
        };
        if localbuff.is_null() {
            return Err(r.refuse(&mut g, "ncclPutSignal: srcBuff is NULL"));
        }
        let Some(bytes) = count.checked_mul(es) else {
            return Err(r.refuse(&mut g, format!("count {count} too large")));
        };
        let sym = NCCL_WIN_COLL_SYMMETRIC as c_int;
        if registry::window_holding(r.h, localbuff as usize, bytes)
            .is_none_or(|w| w.flags & sym == 0)
        {
            let m = "ncclPutSignal: srcWinHost is not in a valid symmetric window";
            return Err(r.refuse(&mut g, m));
        }
        let (src, off, order) = (localbuff as usize, peer_win_offset, win.order);
        // SAFETY (both reads below): `[src, src + bytes)` lies in a live window of this
        // communicator (checked), readable by NCCL's contract until the work ran.
        let read = move || unsafe { core::slice::from_raw_parts(src as *const u8, bytes) };
        if let Some(seg) = shared_of(&g, r.clique) {
            // Across processes the peer's window is out of sight: its counterpart has this
            // window's size (symmetric windows), and the peer's wait lands nothing past it.
            if off.checked_add(bytes).is_none_or(|end| end > win.size) {
                let m = format!(
                    "the put of {bytes} bytes at offset {off} ends past the window's {} bytes (NCCL does not check: it would write past the peer's window)",
                    win.size
                );
                return Err(r.refuse(&mut g, m));
            }
            drop(g);
            let to = peer as usize;
            return run_rma(
                r.h,
                Box::new(move || seg.rma_post(to, Some((order, off, read())))),
            );
        }
        // NCCL's window registration is collective (its allgather returns once every rank
        // registered); the provider's is not, so the peer's counterpart may still be on its
        // way: waited for, up to the call's deadline.
        let (clique, deadline) = (r.clique, super::defs::call_deadline());
        let (mut g, target) = wait_until(g, |g| {
            let found =
                rank_handle(g, clique, peer).and_then(|ph| registry::window_of_order(ph, order));
            match found {
                Some((_, w)) => Some(Some(w)),
                None if std::time::Instant::now() >= deadline => Some(None),
                None => clique_gone(g, clique).map(|_| None),
            }
        });
        let Some(target) = target.flatten() else {
            let m = format!("peer {peer} has no window of this window's registration order");
            return Err(r.refuse(&mut g, m));
        };
        if off.checked_add(bytes).is_none_or(|end| end > target.size) {
            let m = format!(
                "the put of {bytes} bytes at offset {off} ends past peer {peer}'s window of {} bytes (NCCL does not check: it would write past the window)",
                target.size
            );
            return Err(r.refuse(&mut g, m));
        }
        drop(g);
        let from = r.rank;
        run_rma(
            r.h,
            Box::new(move || {
                let data = Some((order, off, read().to_vec()));
                let _g = lock();
                registry::post_signal(clique, peer, registry::Arrival { from, data });
                super::state::notify();
                Ok(())
            }),
        )
    })
}

/// `ncclSignal` as NCCL 2.30.7 has it (collectives.cc:346-371, `rmaTaskAppend`): the peer
/// in range, then [`rma_checks`]; a signal with no data, counted by the peer's
/// `ncclWaitSignal`.
pub(crate) unsafe extern "C" fn ncclSignal(
    peer: c_int,
    sig_idx: c_int,
    ctx: c_int,
    flags: u32,
    comm: ncclComm_t,
    _stream: cudaStream_t,
) -> ncclResult_t {
    operation("ncclSignal", comm, ncclInt8, |mut g, r, _| {
        rma_peer(&mut g, &r, peer)?;
        rma_checks(&mut g, &r, sig_idx, ctx, flags)?;
        let shared = shared_of(&g, r.clique);
        drop(g);
        let (clique, from) = (r.clique, r.rank);
        run_rma(
            r.h,
            Box::new(move || match shared {
                Some(seg) => seg.rma_post(peer as usize, None),
                None => {
                    let _g = lock();
                    let a = registry::Arrival { from, data: None };
                    registry::post_signal(clique, peer, a);
                    super::state::notify();
                    Ok(())
                }
            }),
        )
    })
}

/// `ncclWaitSignal` as NCCL 2.30.7 has it (collectives.cc:373-398, `rmaTaskAppend`,
/// enqueue.cc:2888-2908 and 2925-2953): [`rma_checks`], then the descriptors: not null,
/// `nDesc` not 0, each `opCnt` above 0, `sigIdx` and `ctx` 0; NCCL copies them at the call.
/// Stricter than NCCL, which does not check it: a descriptor's peer outside the
/// communicator is refused. Here the stream reaches the wait when it runs (in the call, or
/// at the group's end): it returns once `opCnt` signals from each peer arrived (taking
/// them, and landing their puts' data), the clique is aborted, or the call's deadline
/// passed (then the clique is aborted, as a collective's wait).
pub(crate) unsafe extern "C" fn ncclWaitSignal(
    n_desc: c_int,
    signal_descs: *mut ncclWaitSignalDesc_t,
    comm: ncclComm_t,
    _stream: cudaStream_t,
) -> ncclResult_t {
    operation("ncclWaitSignal", comm, ncclInt32, |mut g, r, _| {
        rma_checks(&mut g, &r, 0, 0, 0)?;
        if signal_descs.is_null() || n_desc <= 0 {
            return Err(r.refuse(&mut g, "ncclWaitSignal: invalid arguments"));
        }
        // SAFETY: NCCL's contract: `n_desc` readable descriptors (checked not null).
        let descs = unsafe { core::slice::from_raw_parts(signal_descs, n_desc as usize) };
        for (i, d) in descs.iter().enumerate() {
            let m = if d.opCnt <= 0 {
                format!(
                    "ncclWaitSignal: descriptor {i} has invalid opCnt {}",
                    d.opCnt
                )
            } else if d.sigIdx != 0 {
                format!(
                    "ncclWaitSignal: descriptor {i} has invalid sigIdx {} (must be 0)",
                    d.sigIdx
                )
            } else if d.ctx != 0 {
                format!(
                    "ncclWaitSignal: descriptor {i} has invalid context {} (must be 0)",
                    d.ctx
                )
            } else if d.peer < 0 || d.peer >= r.nranks {
                format!("ncclWaitSignal: descriptor {i} has peer {} outside 0..{} (NCCL does not check it)", d.peer, r.nranks)
            } else {
                continue;
            };
            return Err(r.refuse(&mut g, m));
        }
        let wants: Vec<(i32, usize)> = descs.iter().map(|d| (d.peer, d.opCnt as usize)).collect();
        let landing = super::current_landing();
        let shared = shared_of(&g, r.clique);
        drop(g);
        let (h, clique, me) = (r.h, r.clique, r.rank);
        run_rma(
            h,
            Box::new(move || wait_signals(h, clique, me, wants, landing, shared)),
        )
    })
}

/// The work of `ncclWaitSignal` (see there), from the moment the stream reaches it.
fn wait_signals(
    h: Handle,
    clique: u64,
    me: i32,
    wants: Vec<(i32, usize)>,
    landing: Option<usize>,
    shared: Option<std::sync::Arc<super::shm::Segment>>,
) -> Result<(), Fail> {
    let deadline = super::defs::call_deadline();
    let data = if let Some(seg) = shared {
        let wants: Vec<(usize, usize)> = wants.iter().map(|&(p, n)| (p as usize, n)).collect();
        seg.rma_take(&wants, deadline, || clique_gone(&lock(), clique))?
    } else {
        let (mut g, got) = wait_until(lock(), |g| {
            if let Some(f) = clique_gone(g, clique) {
                return Some(Err(f));
            }
            if let Some(data) = registry::take_signals(clique, me, &wants) {
                return Some(Ok(data));
            }
            if std::time::Instant::now() >= deadline {
                let m = format!("ncclWaitSignal: the signals waited for did not arrive by the call's deadline (at most {:?}: NCCL_SAFE_HOST_TIMEOUT_MS); the communicator was aborted", super::defs::wait_limit());
                let f = Fail::new(ncclTimeout, m);
                g.abort_clique(clique, f.clone());
                return Some(Err(f));
            }
            None
        });
        match got {
            Some(r) => r?,
            None => {
                let f = Fail::new(ncclTimeout, "ncclWaitSignal: the signals waited for did not arrive within the provider's wait limit; the communicator was aborted");
                g.abort_clique(clique, f.clone());
                return Err(f);
            }
        }
    };
    let _g = lock();
    // SAFETY: the windows of this communicator are writable memory of their size by
    // NCCL's contract; with a landing window, only it is written, which nccl-safe holds
    // mutably during the call.
    unsafe { registry::land(h, data, landing) };
    Ok(())
}

/// `ncclCommSuspend` as NCCL 2.30.7 has it (mem_manager.cc:925-966; ARCHITECTURE.md's
/// table has the whole contract): the communicator must be ready (:929-930); flags without
/// `NCCL_SUSPEND_MEM` do nothing (:938); with it, a disabled memory manager is refused
/// (:939-943) and the suspend runs as a task of the call's group (:950-954, run at its end,
/// group.cc:289-294): a second suspend is refused there (`ncclCommMemSuspend`,
/// mem_manager.cc:404-407), else every rank meets in a barrier (:418) and the memory is
/// released (:505). On a non-blocking communicator the call returns the asynchronous
/// state read after its group end (:960): ncclInProgress while the task runs.
pub(crate) unsafe extern "C" fn ncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
    mem_task(
        comm,
        "ncclCommSuspend",
        flags & NCCL_SUSPEND_MEM as c_int != 0,
        true,
    )
}

/// `ncclCommResume` as NCCL 2.30.7 has it (mem_manager.cc:968-1007): as
/// [`ncclCommSuspend`] with the flag set, its task (`ncclCommMemResume`, :527-905) refusing a
/// communicator that is not suspended (:536-539), and meeting every rank (its exchange of
/// handles and final barrier, :687, :896) before the memory is back (:890).
pub(crate) unsafe extern "C" fn ncclCommResume(comm: ncclComm_t) -> ncclResult_t {
    mem_task(comm, "ncclCommResume", true, false)
}

/// The body of [`ncclCommSuspend`] (`suspend`) and [`ncclCommResume`]; `act` false: a
/// suspend without `NCCL_SUSPEND_MEM`, which checks readiness and does nothing.
fn mem_task(comm: ncclComm_t, name: &'static str, act: bool, suspend: bool) -> ncclResult_t {
    ffi_grouped(|| {
        let mut g = lock();
        let r = ensure_ready(&mut g, comm, name)?;
        if !act {
            return Ok(ncclSuccess);
        }
        if super::defs::mem_manager_disabled() {
            let m = "the memory manager is disabled (NCCL_DISABLE_MEM_MANAGER)";
            return Err(g.misuse(Some(r.root), ncclInvalidUsage, name, m));
        }
        if in_group() {
            // The task waits for the outermost group end (ncclGroupCommJoin, :954).
            let h = comm as usize;
            let job: QueuedAsyncJob =
                Box::new(move || mem_task(h as ncclComm_t, name, true, suspend));
            QUEUED.with(|q| {
                q.borrow_mut().push(Queued {
                    parent: r.h,
                    window: false,
                    rma: false,
                    job,
                })
            });
            return Ok(ncclSuccess);
        }
        let (seq, _) = r.next_coll(&mut g)?;
        let task = move || mem_task_run(r, seq, name, suspend);
        if asynchronous(&g, r.h) {
            start_job(&mut g, r.h, None, "suspend", 0, move || (0, task()))?;
            return Ok(ncclInProgress);
        }
        drop(g);
        task().map(|()| ncclSuccess)
    })
}

/// `ncclCommMemSuspend` / `ncclCommMemResume` (mem_manager.cc:395-525, 527-905 of 2.30.7):
/// the state check, then every rank's barrier, then the flip of `released`.
fn mem_task_run(r: Ready, seq: u64, name: &'static str, suspend: bool) -> Result<(), Fail> {
    let mut g = lock();
    let suspended = g.comms.get(&r.h).ok_or_else(vanished)?.suspended;
    if suspended == suspend {
        let m = if suspend {
            "MemManager: Already suspended"
        } else {
            "MemManager: Not in suspended state"
        };
        return Err(g.misuse(Some(r.root), ncclInvalidUsage, name, m));
    }
    if let Some(seg) = shared_of(&g, r.clique) {
        drop(g);
        // Across processes: the exchange of a split in which no rank takes a color is a
        // barrier of every rank.
        seg.exchange_split(seq, NCCL_SPLIT_NOCOLOR, 0)
            .inspect_err(|f| lock().abort_clique(r.clique, f.clone()))?;
    } else {
        g.post_rdv(r.clique, seq, None, (r.rank, NCCL_SPLIT_NOCOLOR, 0, None))?;
        drop(g);
        end_rdv(r.clique, seq, name)?;
    }
    let mut g = lock();
    let c = g.comms.get_mut(&r.h).ok_or_else(vanished)?;
    c.suspended = suspend;
    Ok(())
}

/// `ncclCommMemStats` as NCCL 2.30.7 has it (mem_manager.cc:1009-1047): a ready
/// communicator (:1013-1014), a non-NULL `value` (:1015, ncclInvalidArgument without a
/// message), an enabled memory manager (:1017-1020), a known `stat` (:1046); the figures
/// are [`HOST_MEM_PERSIST`](super::defs::HOST_MEM_PERSIST) and
/// [`HOST_MEM_SUSPENDABLE`](super::defs::HOST_MEM_SUSPENDABLE), which, as NCCL's counters,
/// a suspend leaves as they are: only `ncclStatGpuMemSuspended` says it happened.
pub(crate) unsafe extern "C" fn ncclCommMemStats(
    comm: ncclComm_t,
    stat: ncclCommMemStat_t,
    value: *mut u64,
) -> ncclResult_t {
    ffi(|| {
        const NAME: &str = "ncclCommMemStats";
        let mut g = lock();
        let r = ensure_ready(&mut g, comm, NAME)?;
        if value.is_null() {
            return Err(Fail::raw(ncclInvalidArgument, String::new()));
        }
        if super::defs::mem_manager_disabled() {
            let m = "the memory manager is disabled (NCCL_DISABLE_MEM_MANAGER)";
            return Err(g.misuse(Some(r.root), ncclInvalidUsage, NAME, m));
        }
        let suspended = g.comms.get(&r.h).ok_or_else(vanished)?.suspended;
        use super::defs::{HOST_MEM_PERSIST as P, HOST_MEM_SUSPENDABLE as S};
        let v = match stat {
            ncclStatGpuMemTotal => P + S,
            ncclStatGpuMemPersist => P,
            ncclStatGpuMemSuspend => S,
            ncclStatGpuMemSuspended => suspended as u64,
            _ => return Err(Fail::raw(ncclInvalidArgument, String::new())),
        };
        put(value, v);
        Ok(ncclSuccess)
    })
}

/// `ncclCommQueryProperties` as NCCL 2.30.7 has it (dev_runtime.cc:1459-1498): NULL comm
/// or props: ncclInvalidArgument (:1461-1462); `ncclCommEnsureReady` (:1464); a magic
/// other than `NCCL_API_MAGIC`: ncclInvalidUsage (:1466-1470); a caller's `version` newer
/// than the library, or older than the device API (2.29.2): ncclInvalidUsage
/// (`getNcclVersionCompat`, :1423-1453); then the fields, those after `ginType` only for a
/// version after 2.29.3 (:1483-1492). The provider's communicator: symmetric support as
/// `NCCL_WIN_ENABLE` says (its windows), no multicast, no GIN, no host RMA, one LSA team
/// (every rank can reach every other's memory).
pub(crate) unsafe extern "C" fn ncclCommQueryProperties(
    comm: ncclComm_t,
    props: *mut nccl_sys::device::ncclCommProperties_t,
) -> ncclResult_t {
    ffi(|| {
        const NAME: &str = "ncclCommQueryProperties";
        let mut g = lock();
        let r = ensure_ready(&mut g, comm, NAME)?;
        if props.is_null() {
            return Err(r.invalid(&mut g, "props argument is NULL"));
        }
        // SAFETY: NCCL's contract: `props` points to an initialized ncclCommProperties_t.
        let p = unsafe { &mut *props };
        if p.magic != NCCL_API_MAGIC {
            let m = "ncclCommProperties_t argument must be initialized via NCCL_COMM_PROPERTIES_INITIALIZER";
            return Err(g.misuse(Some(r.root), ncclInvalidUsage, NAME, m));
        }
        let version = p.version as c_int;
        if version > NCCL_VERSION_CODE as c_int || version < nccl_sys::nccl_version_code(2, 29, 2) {
            let m = format!("no compatibility with a caller of NCCL version code {version}");
            return Err(g.misuse(Some(r.root), ncclInvalidUsage, NAME, m));
        }
        let dev = g.comms.get(&r.h).ok_or_else(vanished)?.device;
        p.rank = r.rank;
        p.nRanks = r.nranks;
        p.cudaDev = dev;
        p.nvmlDev = dev;
        p.deviceApiSupport = super::defs::win_enable();
        p.multimemSupport = false;
        if version > nccl_sys::nccl_version_code(2, 29, 3) {
            // The one-sided calls run where windows do.
            p.hostRmaSupport = super::defs::win_enable();
            p.ginType = nccl_sys::device::NCCL_GIN_TYPE_NONE;
            p.railedGinType = nccl_sys::device::NCCL_GIN_TYPE_NONE;
            p.nLsaTeams = 1;
        }
        Ok(ncclSuccess)
    })
}

/// The table of host entry points (each defined above: a new entry point is one function
/// and its row here), built as a struct literal so the compiler checks every
/// signature against `nccl-sys`.
pub(crate) fn table() -> FunctionTable {
    FunctionTable {
        ncclGetVersion,
        ncclGetUniqueId,
        ncclCommInitRankConfig,
        ncclCommInitRank,
        ncclCommInitAll,
        ncclCommFinalize,
        ncclCommDestroy,
        ncclCommAbort,
        ncclCommSplit,
        ncclGetErrorString,
        ncclGetLastError,
        ncclCommGetAsyncError,
        ncclCommCount,
        ncclCommCuDevice,
        ncclCommUserRank,
        ncclRedOpCreatePreMulSum,
        ncclRedOpDestroy,
        ncclReduce,
        ncclBcast,
        ncclBroadcast,
        ncclAllReduce,
        ncclReduceScatter,
        ncclAllGather,
        ncclSend,
        ncclRecv,
        ncclGroupStart,
        ncclGroupEnd,
        ncclMemAlloc: Some(ncclMemAlloc),
        ncclMemFree: Some(ncclMemFree),
        ncclCommRegister: Some(ncclCommRegister),
        ncclCommDeregister: Some(ncclCommDeregister),
        ncclGroupSimulateEnd: None,
        ncclCommInitRankScalable: Some(ncclCommInitRankScalable),
        ncclCommShrink: Some(ncclCommShrink),
        ncclCommWindowRegister: Some(ncclCommWindowRegister),
        ncclCommWindowDeregister: Some(ncclCommWindowDeregister),
        ncclAlltoAll: Some(ncclAlltoAll),
        ncclGather: Some(ncclGather),
        ncclScatter: Some(ncclScatter),
        ncclCommRevoke: Some(ncclCommRevoke),
        ncclCommSuspend: Some(ncclCommSuspend),
        ncclCommResume: Some(ncclCommResume),
        ncclCommMemStats: Some(ncclCommMemStats),
        ncclWinGetUserPtr: None,
        ncclCommGetUniqueId: Some(ncclCommGetUniqueId),
        ncclCommGrow: Some(ncclCommGrow),
        ncclPutSignal: Some(ncclPutSignal),
        ncclSignal: Some(ncclSignal),
        ncclWaitSignal: Some(ncclWaitSignal),
        ncclAllReduceConfig: None,
        ncclBroadcastConfig: None,
        ncclReduceConfig: None,
        ncclAllGatherConfig: None,
        ncclReduceScatterConfig: None,
        ncclAlltoAllConfig: None,
        ncclGatherConfig: None,
        ncclScatterConfig: None,
        ncclSetEncryption: None,
        ncclCommQueryProperties: Some(ncclCommQueryProperties),
        ncclParamBind: Some(params::ncclParamBind),
        ncclParamGetI8: Some(params::ncclParamGetI8),
        ncclParamGetI16: Some(params::ncclParamGetI16),
        ncclParamGetI32: Some(params::ncclParamGetI32),
        ncclParamGetI64: Some(params::ncclParamGetI64),
        ncclParamGetU8: Some(params::ncclParamGetU8),
        ncclParamGetU16: Some(params::ncclParamGetU16),
        ncclParamGetU32: Some(params::ncclParamGetU32),
        ncclParamGetU64: Some(params::ncclParamGetU64),
        ncclParamGetStr: Some(params::ncclParamGetStr),
        ncclParamGet: Some(params::ncclParamGet),
        ncclParamGetParameter: Some(params::ncclParamGetParameter),
        ncclParamGetAllParameterKeys: Some(params::ncclParamGetAllParameterKeys),
        ncclParamDumpAll: Some(params::ncclParamDumpAll),
    }
}
