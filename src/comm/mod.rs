//! [`Communicator`]: the RAII owner of an `ncclComm_t`, a file per concern (ARCHITECTURE.md,
//! "comm, comm_ref"): this one holds the type, its accessors and the one checked path of
//! its calls (`issue`, `pinned`, the failure state).

use std::cell::OnceCell;
use std::ffi::c_int;
use std::panic::Location;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use nccl_sys::bindings::{ncclInProgress, ncclSuccess};
use nccl_sys::{ncclComm_t, ncclResult_t, FunctionTable};

use crate::config::Config;
use crate::error::{invalid, Error, Result, ResultCode};
use crate::id::UniqueId;
use crate::library::{CallContext, Library, Provider};
use crate::nccl_call;

mod checks;
mod elastic;

pub(crate) use crate::error::UNREVOCABLE;
mod family;
mod init;
mod params;
mod properties;
mod raw;
mod suspend;
mod teardown;

pub(crate) use raw::RawComm;

pub use init::PendingCommunicator;
pub use properties::{GinType, Properties};
pub use suspend::{MemStats, SuspendedCommunicator};

/// An out-pointer that NCCL's async job (`ncclAsyncJob`: a split or shrink child, a
/// window) writes: on the heap, so that it outlives the call that handed it to NCCL. NCCL
/// stores into it from its own thread at the async job's end (`__atomic_store_n(job->newcomm,
/// comm, __ATOMIC_RELEASE)`, init.cc:1612-1614 of 2.28.9), so it is read with an acquire
/// load, and only once the communicator left ncclInProgress. One whose async job may still
/// be running (a wait that failed before the job ended) is leaked rather than freed, so a
/// late store never lands in freed memory.
pub(crate) struct AsyncOut<T>(Option<Box<std::sync::atomic::AtomicPtr<T>>>);

impl<T> AsyncOut<T> {
    pub(crate) fn new() -> AsyncOut<T> {
        AsyncOut(Some(Box::new(std::sync::atomic::AtomicPtr::new(
            std::ptr::null_mut(),
        ))))
    }

    /// The pointer to hand to NCCL: valid as long as `self` (or, leaked, for ever).
    pub(crate) fn out(&self) -> *mut *mut T {
        self.0.as_ref().map_or(std::ptr::null_mut(), |b| b.as_ptr())
    }

    /// What the async job stored, taken (null afterwards), with an acquire load.
    pub(crate) fn take(&self) -> *mut T {
        self.0.as_ref().map_or(std::ptr::null_mut(), |b| {
            b.swap(std::ptr::null_mut(), std::sync::atomic::Ordering::AcqRel)
        })
    }

    /// Leaves it to an async job that may still write it.
    pub(crate) fn leak(mut self) {
        if let Some(b) = self.0.take() {
            Box::leak(b);
        }
    }
}

/// Where a communicator's rank runs: a CUDA device (NVIDIA's NCCL) or the host provider.
#[derive(Debug, Clone)]
pub enum CommDevice {
    /// A CUDA device, through cudarc's context for it.
    Cuda(Arc<CudaContext>),
    /// The in-process host provider (CPU memory, ranks as threads).
    Host,
}

impl CommDevice {
    /// The library this kind of device is served by: the default NCCL for CUDA
    /// ([`Library::load`]), the host provider for [`CommDevice::Host`].
    pub fn library(&self) -> Result<Arc<Library>> {
        match self {
            CommDevice::Cuda(_) => Library::load(),
            #[cfg(feature = "host")]
            CommDevice::Host => Ok(Library::host()),
            #[cfg(not(feature = "host"))]
            CommDevice::Host => Err(invalid(
                "CommDevice::library",
                "nccl-safe was built without its `host` feature (the host provider)",
            )),
        }
    }

    /// Which provider serves this kind of device: [`Provider::Nccl`] for CUDA,
    /// [`Provider::Host`] for [`CommDevice::Host`].
    pub fn provider(&self) -> Provider {
        match self {
            CommDevice::Cuda(_) => Provider::Nccl,
            CommDevice::Host => Provider::Host,
        }
    }

    /// The CUDA device's ordinal (`None` for the host provider).
    pub(crate) fn cuda_ordinal(&self) -> Option<usize> {
        match self {
            CommDevice::Cuda(c) => Some(c.ordinal()),
            CommDevice::Host => None,
        }
    }

    /// A fresh unique id from this device's library.
    pub fn unique_id(&self) -> Result<UniqueId> {
        UniqueId::new_with(&*self.library()?)
    }
}

/// How much longer than the parent's timeout a split/shrink child's own wait lasts (the
/// watchdog's timeout of the parent's operation normally ends it first).
const CHILD_WAIT_MARGIN: Duration = Duration::from_millis(500);

/// One rank's handle on an NCCL communicator.
///
/// * **Exactly one teardown.** Dropping it calls `ncclCommDestroy` on a healthy communicator
///   and `ncclCommAbort` on one that saw an error; [`destroy`](Self::destroy),
///   [`abort`](Self::abort) and [`finalize`](Self::finalize) consume it, so no handle is
///   torn down twice or used afterwards: the compiler forbids it.
/// * **Not `Clone`**: a second owner would mean a second teardown.
/// * **`Send`, not `Sync`**: NCCL lets a communicator move between threads but forbids
///   concurrent calls on it, so `&Communicator` cannot cross threads.
/// * **Aborts on unwind.** Dropped while its thread panics, it aborts: the peers waiting
///   for this rank in a collective get an error instead of hanging.
/// * **Fails fast.** After an NCCL error, further operations return
///   [`Error::CommunicatorFailed`] without calling NCCL, and drop aborts.
///
/// ```
/// use nccl_safe::{Communicator, Config, CommDevice, Stream, ReduceOp};
/// // Two ranks in threads, on the host provider.
/// let id = CommDevice::Host.unique_id()?;
/// std::thread::scope(|s| {
///     for rank in 0..2 {
///         s.spawn(move || -> nccl_safe::Result<()> {
///             let comm = Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &Config::new())?;
///             let mut grads = vec![rank as f32 + 1.0; 4];
///             comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, &Stream::Host)?;
///             assert_eq!(grads, vec![3.0; 4]);
///             comm.destroy().map_err(|(_, e)| e)
///         });
///     }
/// });
/// # Ok::<(), nccl_safe::Error>(())
/// ```
pub struct Communicator {
    /// The handle and its library: the one owner of the handle (taken once for its
    /// teardown, never for a borrowed one).
    handle: RawComm,
    device: CommDevice,
    rank: usize,
    world_size: usize,
    cuda_device: Option<usize>,
    /// The first error this communicator saw; set means "abort on drop". `OnceCell` also
    /// makes the type `!Sync`.
    failure: OnceCell<String>,
    /// Watchdog, flight recorder and fingerprint state (`crate::diag`).
    pub(crate) diag: crate::diag::CommDiag,
    /// The config's name strings, which NCCL reads by pointer after the init call (and a
    /// split or shrink child inherits): alive as long as the communicator.
    names: crate::config::ConfigNames,
    /// Out-pointers of failed splits and shrinks whose job had not ended: read at teardown.
    orphans: std::cell::RefCell<Vec<AsyncOut<nccl_sys::bindings::ncclComm>>>,
    /// Collectives refused before NCCL saw them because the communicator had failed: with
    /// those issued, how far the rank's program got ([`Self::collectives_called`]).
    refused: std::cell::Cell<u64>,
    /// `ncclCommRevoke` was called: NCCL refuses its collectives, and a second revoke.
    revoked: std::cell::Cell<bool>,
    /// A call of this communicator may have linked an NCCL group job to it (a non-blocking
    /// group end links its job to each of its communicators, group.cc:802-818 of
    /// v2.29.7-1) that no `ncclCommGetAsyncError` reading ncclSuccess has completed and
    /// unlinked since (init.cc:3105-3110): its launch is in flight, or failed. NCCL's
    /// revoke would then leave `comm->groupJob` dangling (see [`Self::revocable`]).
    job_linked: std::cell::Cell<bool>,
    /// A revoke was not sound on it ([`Self::revocable`]), so it was aborted instead: its
    /// errors say it cannot be shrunk.
    unrevocable: std::cell::Cell<bool>,
    /// Its own revoke did not return within the abort bound and still runs on a thread of
    /// its own: no call reaches NCCL on the handle again (`Communicator::revoke_blocked`).
    revoke_blocked: std::cell::Cell<bool>,
    /// The stand-in for the per-thread stream (`crate::stream::Relay`), made at its first
    /// use; dropped after the handle's teardown.
    relay: OnceCell<crate::stream::Relay>,
}

// SAFETY: NCCL allows a communicator to be used from any thread, one at a time; `!Sync`
// (from the OnceCell) forbids concurrent use. The raw pointer is only an opaque handle.
unsafe impl Send for Communicator {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.cuda_device)
            .field("provider", &self.handle.lib().provider())
            .field("failed", &self.failure.get().is_some())
            .finish()
    }
}

fn check_world(call: &'static str, world_size: usize, rank: usize) -> Result<()> {
    if world_size == 0 || world_size > c_int::MAX as usize {
        return Err(invalid(
            call,
            format!(
                "world size {world_size} must be between 1 and {}",
                c_int::MAX
            ),
        ));
    }
    if rank >= world_size {
        return Err(Error::RankOutOfRange {
            call,
            what: "rank",
            rank,
            world_size,
        });
    }
    Ok(())
}

/// Refuses a device of a provider other than the library's.
pub(crate) fn check_device(call: &'static str, lib: &Library, device: &CommDevice) -> Result<()> {
    match (lib.provider(), device) {
        (p, d) if p == d.provider() => Ok(()),
        (p, d) => Err(invalid(
            call,
            format!(
                "a {} device cannot use the {p:?} provider",
                match d {
                    CommDevice::Cuda(_) => "CUDA",
                    CommDevice::Host => "host",
                }
            ),
        )),
    }
}

/// Makes the device's context current on the calling thread (the owner's, for init and
/// its teardown calls), without cudarc's `bind_to_thread`: that takes the error cudarc
/// recorded for the context (a failed asynchronous call of the user's), which is the
/// user's `check_err` to report, not this call's.
#[inline(always)]
fn bind(device: &CommDevice) -> Result<()> {
    match device {
        CommDevice::Cuda(ctx) => bind_cuda(ctx),
        CommDevice::Host => Ok(()),
    }
}

#[inline(never)]
fn bind_cuda(ctx: &CudaContext) -> Result<()> {
    Ok(crate::stream::make_current(ctx)?)
}

impl Communicator {
    /// This rank (`ncclCommUserRank`, cached at init).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks (`ncclCommCount`, cached at init).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The device this rank runs on (as nccl-launch's `Rank::device`).
    pub fn device(&self) -> &CommDevice {
        &self.device
    }

    /// The CUDA device ordinal (`None` on the host provider).
    pub fn cuda_ordinal(&self) -> Option<usize> {
        self.cuda_device
    }

    /// The library serving this communicator.
    pub fn library(&self) -> &Arc<Library> {
        self.handle.lib()
    }

    /// An optional entry point of the loaded NCCL, or [`Error::Unsupported`].
    #[inline(always)]
    pub(crate) fn optional<F: Copy>(
        &self,
        f: impl FnOnce(&FunctionTable) -> Option<F>,
        symbol: &'static str,
    ) -> Result<F> {
        self.library().optional(f(self.library().table()), symbol)
    }

    /// The raw handle, for NCCL features this crate does not wrap. It stays owned by
    /// `self`: do not destroy or abort it.
    pub fn as_raw(&self) -> ncclComm_t {
        self.handle.get()
    }

    /// Whether it was made with [`Config::elastic`] (inherited by its children): a failed
    /// clique's handle is revoked and kept for
    /// [`shrink_after_failure`](Self::shrink_after_failure) rather than aborted. No NCCL
    /// call.
    pub fn is_elastic(&self) -> bool {
        self.diag.elastic()
    }

    /// Whether an error was seen (drop will abort). True as soon as the watchdog timed
    /// out this communicator's clique, before any abort starts. No NCCL call.
    pub fn is_failed(&self) -> bool {
        self.failure.get().is_some() || self.diag.failed()
    }

    /// Asks NCCL for an asynchronous error (`ncclCommGetAsyncError`). An error marks the
    /// communicator failed. `Ok(true)` while a non-blocking operation is still in progress.
    /// A communicator the watchdog failed reports its [`Error::Timeout`] without calling
    /// NCCL (its handle may be under abort).
    #[track_caller]
    pub fn async_error(&self) -> Result<bool> {
        let caller = Location::caller();
        self.diag.check_alive()?;
        self.poll_async("ncclCommGetAsyncError", caller)
    }

    /// One `ncclCommGetAsyncError`, pinned: `Ok(true)` while in progress, `Ok(false)` when
    /// done; an error state marks the communicator failed with `call`.
    fn poll_async(&self, call: &'static str, caller: &'static Location<'static>) -> Result<bool> {
        let mut state = ncclSuccess;
        self.pinned(|| {
            // SAFETY: `state` is writable; the handle is live (not torn down: pinned, so the
            // watchdog cannot take it during the call).
            let r = unsafe {
                (self.handle.table().ncclCommGetAsyncError)(self.handle.get(), &mut state)
            };
            self.checked("ncclCommGetAsyncError", r, caller)
        })?;
        self.note_polled(state);
        match ResultCode::from_raw(state) {
            None => Ok(false),
            Some(ResultCode::InProgress) => Ok(true),
            Some(_) => Err(self.fail_nccl(call, state, caller)),
        }
    }

    /// Whether NCCL's asynchronous job on this communicator has ended (one
    /// `ncclCommGetAsyncError` that does not say ncclInProgress), so that what it writes is
    /// final. False when that cannot be known: the watchdog has the handle.
    pub(crate) fn job_ended(&self) -> bool {
        self.async_state()
            .is_some_and(|state| state != ncclInProgress)
    }

    /// What `ncclCommGetAsyncError` says, read once; `None` when it cannot be read (the
    /// watchdog has the handle, or the call failed).
    pub(crate) fn async_state(&self) -> Option<ncclResult_t> {
        let mut state = ncclInProgress;
        let polled = self.pinned(|| {
            // SAFETY: `state` is writable; the handle is live (pinned).
            Ok(unsafe {
                (self.handle.table().ncclCommGetAsyncError)(self.handle.get(), &mut state)
            })
        });
        let state = matches!(polled, Ok(r) if r == ncclSuccess).then_some(state)?;
        self.note_polled(state);
        Some(state)
    }

    /// After an `ncclCommGetAsyncError` that read `state`: one that read ncclSuccess
    /// completed and unlinked the group job linked to the communicator, if any
    /// (init.cc:3105-3110 of v2.29.7-1).
    #[inline]
    pub(crate) fn note_polled(&self, state: ncclResult_t) {
        if state == ncclSuccess && self.job_linked.get() {
            self.set_job_linked(false);
        }
    }

    /// Notes whether a group job may be linked to this communicator, for its owner and its
    /// watchdog ([`Self::revocable`]).
    #[inline]
    pub(crate) fn set_job_linked(&self, linked: bool) {
        self.job_linked.set(linked);
        self.diag.set_job_linked(linked);
    }

    /// Whether NCCL's `ncclCommRevoke` is sound on this communicator now, given `state`,
    /// what an `ncclCommGetAsyncError` made just before (on this thread, the handle
    /// pinned) read. A non-blocking group end links its group job to the communicator
    /// (group.cc:802-818 of v2.29.7-1; also in v2.30.7-1, :831-847) until a poll reads
    /// ncclSuccess (init.cc:3105-3110; :3477-3479). A revoke aborts the linked job
    /// (`ncclCommEnsureReady`, init.cc:2664 -> 403-404), which deletes it once no
    /// communicator holds it (group.cc:873-884), and leaves `comm->groupJob` pointing at
    /// it: the revoke's own job is then not linked (group.cc:802), and once it stored
    /// ncclSuccess (init.cc:2635) the next `ncclCommGetAsyncError` (the crate's poll for
    /// the revoke, the shrink's `ncclCommEnsureReady`, init.cc:2762) completes the freed
    /// job, and an abort's `ncclCommEnsureReady` aborts it again: a use after free. So a
    /// revoke is sound only when no job is linked: the poll just read ncclSuccess (it
    /// unlinked any), or it read an error with no launch left unpolled since the last
    /// ncclSuccess (an error of the communicator's own, its job long unlinked). Never while
    /// a launch is in flight (ncclInProgress), nor after a launch or job that failed.
    pub(crate) fn revocable(&self, state: ncclResult_t) -> bool {
        self.note_polled(state);
        state != ncclInProgress && !self.job_linked.get()
    }

    /// NCCL's error `raw` for `call`, which fails the communicator ([`fail`](Self::fail)).
    #[cold]
    fn fail_nccl(
        &self,
        call: &'static str,
        raw: ncclResult_t,
        caller: &'static Location<'static>,
    ) -> Error {
        self.fail(self.nccl_error(call, raw, caller))
    }

    /// NCCL's error `raw` for `call` on this communicator (its rank and the caller's
    /// line), leaving the communicator as it is: for a refusal that changed nothing.
    #[cold]
    pub(crate) fn nccl_error(
        &self,
        call: &'static str,
        raw: ncclResult_t,
        caller: &'static Location<'static>,
    ) -> Error {
        self.handle
            .lib()
            .error_for(call, raw, self.context(caller))
            .into()
    }

    /// This rank is done with the communicator (its launcher closure returned): peers that
    /// wait for a collective it never issued fail at once with [`Error::RankLeft`].
    pub(crate) fn leave(&self, how: &str) {
        self.diag.leave(how);
    }

    /// Marks the communicator failed with `e` (drop will abort), keeping the first cause.
    pub(crate) fn mark_failed(&self, e: &Error) {
        self.failure.get_or_init(|| e.to_string());
    }

    /// The context a checked call on this communicator reports: its handle, rank and caller.
    pub(crate) fn context(&self, caller: &'static Location<'static>) -> CallContext {
        CallContext {
            comm: self.handle.get(),
            rank: Some(self.rank),
            caller: Some(caller),
        }
    }

    /// Checks a result of a call on this communicator: errors mark it failed.
    #[inline]
    fn checked(
        &self,
        call: &'static str,
        r: ncclResult_t,
        caller: &'static Location<'static>,
    ) -> Result<()> {
        if r == ncclSuccess {
            Ok(())
        } else {
            Err(self.fail_nccl(call, r, caller))
        }
    }

    /// The single path of every operation on this communicator: fail fast if it already
    /// failed, make the call, check the result (an error marks the
    /// communicator failed), and wait out `ncclInProgress` on a non-blocking communicator.
    #[inline(always)]
    pub(crate) fn issue<'a>(
        &self,
        op: impl Into<crate::diag::OpInfo<'a>>,
        caller: &'static Location<'static>,
        f: impl FnOnce(&FunctionTable, ncclComm_t) -> ncclResult_t,
    ) -> Result<()> {
        self.issue_inner(op, caller, f, false, || Ok(()), true)
    }

    /// [`issue`](Self::issue) for a call that NCCL finishes in a job of its own (split,
    /// shrink, window registration), with `then` run after the job ended, while the
    /// operation is still open (watched by the watchdog): split and shrink adopt their
    /// child there, a window reads its handle.
    ///
    /// On a non-blocking communicator NCCL 2.28 returns **ncclSuccess** from these calls
    /// with the job still running (its group end's ncclInProgress is dropped by the entry
    /// point's `NCCLCHECK`: init.cc:2666-2679, dev_runtime.cc:891-922), and the job writes
    /// its out-pointer only at its end, from NCCL's thread. So the communicator is waited
    /// on whatever the call returned, until it leaves ncclInProgress, before anything reads
    /// what the job writes (ARCHITECTURE.md, "NCCL's asynchronous contract").
    #[inline(always)]
    pub(crate) fn issue_job<'a>(
        &self,
        op: impl Into<crate::diag::OpInfo<'a>>,
        caller: &'static Location<'static>,
        f: impl FnOnce(&FunctionTable, ncclComm_t) -> ncclResult_t,
        then: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.issue_inner(op, caller, f, true, then, true)
    }

    /// [`issue`](Self::issue), then `then` after a successful call: `job` waits the
    /// communicator out of ncclInProgress even when the call returned ncclSuccess; `gate`
    /// refuses a failed communicator first (still refused without it when the watchdog
    /// aborted it: its handle is gone).
    #[inline(always)]
    pub(crate) fn issue_inner<'a>(
        &self,
        op: impl Into<crate::diag::OpInfo<'a>>,
        caller: &'static Location<'static>,
        f: impl FnOnce(&FunctionTable, ncclComm_t) -> ncclResult_t,
        job: bool,
        then: impl FnOnce() -> Result<()>,
        gate: bool,
    ) -> Result<()> {
        let op = op.into();
        // Its name is looked up only where it is needed: a wait, or an error (a call into
        // a table per operation otherwise).
        let entry = op.entry_point();
        if (gate && self.failure.get().is_some()) || self.revoke_blocked.get() {
            // The error for a failed communicator (a watchdog abort takes precedence).
            self.ensure_usable(entry.name())?;
        }
        // No CUDA context bind here: NCCL makes the communicator's device current itself
        // for every operation (each is an implicit group, and one thread may drive several
        // devices inside an explicit one), so the per-operation path makes no driver call
        // of ours. Init and teardown bind.
        let ticket = match self.diag.begin(|| self.diag_view(), op, caller) {
            Ok(t) => t,
            Err(e) => return Err(self.fail(e)),
        };
        let r = f(self.handle.table(), self.handle.get());
        // A group end of this communicator that launches from NCCL's group thread (it
        // returned ncclInProgress) or runs a job of it (a split, shrink or registration)
        // linked its group job to it until a poll reads ncclSuccess. A grow's job is linked
        // to the new communicator (init.cc:3000-3008 of v2.29.7-1), not to this one.
        if (r == ncclInProgress || (job && r == ncclSuccess))
            && entry != nccl_sys::EntryPoint::ncclCommGrow
        {
            self.set_job_linked(true);
        }
        // NCCL's communicator is always non-blocking (see init_rank): wait out progress.
        let r = if job && r == ncclSuccess {
            let call = entry.name();
            // The watchdog's timeout of this operation (with its report of who is behind)
            // normally ends the wait for a job first; its own limit is a margin later.
            self.wait_ready(call, caller, self.diag.timeout() + CHILD_WAIT_MARGIN)
        } else if r == ncclInProgress {
            let call = entry.name();
            // The same margin: the watchdog's timeout comes first, with its report, and
            // with `Config::elastic` its revoke, which leaves the handle for a shrink.
            let waited = self.wait_ready(call, caller, self.diag.timeout() + CHILD_WAIT_MARGIN);
            waited.map_err(|e| {
                // The buffers stay borrowed until NCCL's launch has ended.
                Communicator::end_launches(&[self], call);
                Communicator::note_unrevocable(&[self], e)
            })
        } else if r == ncclSuccess {
            Ok(())
        } else {
            Err(self.fail_nccl(entry.name(), r, caller))
        };
        let r = r.and_then(|()| then());
        match self.diag.end(ticket, r) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Runs `f`, an NCCL call on the handle that is not an operation (a poll, a
    /// registration, a destroy), with the handle claimed: the watchdog cannot abort it
    /// meanwhile. Fails without calling `f` when the watchdog aborts it.
    #[inline]
    pub(crate) fn pinned<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if self.revoke_blocked.get() {
            // Its revoke still runs in NCCL on a thread of its own (`revoke_blocked`).
            return Err(self.revoke_still_runs());
        }
        let pinned = self.diag.pin()?;
        let r = f();
        if pinned {
            self.diag.unpin();
        }
        r
    }

    /// The error of a call on a communicator whose revoke still runs in NCCL.
    #[cold]
    fn revoke_still_runs(&self) -> Error {
        let cause = self.failure.get().cloned().unwrap_or_default();
        self.communicator_failed("ncclCommRevoke", &cause)
    }

    /// Marks the communicator failed with `e` (drop will abort; the first cause is kept)
    /// and returns it.
    #[cold]
    fn fail(&self, e: Error) -> Error {
        self.mark_failed(&e);
        e
    }

    /// The diagnostics view of this communicator: what they need to attach it (its raw
    /// handle, rank and size), not the handle itself.
    #[inline(always)]
    pub(crate) fn diag_view(&self) -> crate::diag::CommView<'_> {
        crate::diag::CommView {
            raw: self.handle.get(),
            rank: self.rank,
            world_size: self.world_size,
            lib: self.handle.lib(),
            lane: self.lane(),
        }
    }

    /// A copy of the flight recorder: the last operations on this communicator, oldest
    /// first (no NCCL call).
    #[cfg(feature = "diag")]
    pub fn flight_record(&self) -> crate::diag::FlightRecord {
        self.diag.flight_record(self.diag_view())
    }

    /// Writes the flight record as JSON into `dir`; returns the file's path.
    #[cfg(feature = "diag")]
    pub fn dump_flight_record(
        &self,
        dir: impl AsRef<std::path::Path>,
    ) -> std::io::Result<std::path::PathBuf> {
        self.flight_record().write_json(dir.as_ref())
    }

    /// The diagnostics counters of this rank (no NCCL call).
    #[cfg(feature = "diag")]
    pub fn diagnostics(&self) -> crate::diag::Diagnostics {
        self.diag.diagnostics(self.diag_view())
    }

    /// Collectives this rank's program called: those issued (each has a sequence number)
    /// and those refused because the communicator had failed. The launcher compares ranks
    /// by it to name the one that left early, ran an extra collective, or was behind.
    #[cfg(feature = "diag")]
    pub(crate) fn collectives_called(&self) -> u64 {
        self.diagnostics().collectives + self.refused.get()
    }

    /// Fails when the communicator failed: with the watchdog's timeout when its clique
    /// timed out, else with its own first error (one it saw before a peer left, too), else
    /// with the report of a peer that left.
    #[inline]
    pub(crate) fn ensure_usable(&self, call: &'static str) -> Result<()> {
        match (self.failure.get(), self.diag.check_alive()) {
            (None, alive) => alive,
            (Some(cause), Err(Error::RankLeft { .. }) | Ok(())) => {
                Err(self.communicator_failed(call, cause))
            }
            (Some(_), Err(e)) => Err(e),
        }
    }

    #[cold]
    fn communicator_failed(&self, call: &'static str, cause: &str) -> Error {
        Error::CommunicatorFailed {
            call,
            rank: self.rank,
            cause: cause.to_string(),
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator leaves `ncclInProgress`.
    pub(crate) fn wait_ready(
        &self,
        call: &'static str,
        caller: &'static Location<'static>,
        timeout: Duration,
    ) -> Result<()> {
        self.wait_ready_for(call, caller, timeout, &self.diag)
    }

    /// [`wait_ready`](Self::wait_ready) that also ends when the watchdog fails `watched`
    /// (a child's wait watches its parent).
    fn wait_ready_for(
        &self,
        call: &'static str,
        caller: &'static Location<'static>,
        timeout: Duration,
        watched: &crate::diag::CommDiag,
    ) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        // NCCL's non-blocking launch is a thread of its own (group.cc:705-738 of 2.28.9),
        // done within microseconds: yield to it first, and sleep only once it has taken
        // longer than `SPIN_WAIT` (the overhead bench's `--backend launch` measures it).
        const SPIN_WAIT: Duration = Duration::from_micros(200);
        loop {
            // The watchdog may have failed it (and taken the handle) meanwhile.
            self.diag.check_alive()?;
            watched.check_alive()?;
            if !self.poll_async(call, caller)? {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                let e = Error::Timeout {
                    what: self
                        .diag
                        .wait_timeout_report(call, self.rank, self.world_size),
                    timeout,
                };
                self.mark_failed(&e);
                return Err(e);
            }
            if start.elapsed() < SPIN_WAIT {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }
}

impl Communicator {
    /// The communicator's relay of the per-thread stream (`crate::stream::Relay`, made at
    /// its first use), entered: it waits for the caller's per-thread stream.
    #[cold]
    #[inline(never)]
    pub(crate) fn enter_relay(&self) -> Result<&crate::stream::Relay> {
        let relay = match self.relay.get() {
            Some(r) => r,
            None => {
                let CommDevice::Cuda(ctx) = &self.device else {
                    return Err(invalid(
                        "CU_STREAM_PER_THREAD",
                        "a CUDA stream on a host communicator",
                    ));
                };
                let r = crate::stream::Relay::new(ctx)?;
                self.relay.get_or_init(|| r)
            }
        };
        relay.enter()?;
        Ok(relay)
    }
}

impl Communicator {
    /// A communicator around `handle` on `device`, healthy, with `diag` (attached by the
    /// caller once rank and size are known).
    pub(crate) fn new(
        handle: RawComm,
        device: CommDevice,
        rank: usize,
        world_size: usize,
        diag: crate::diag::CommDiag,
    ) -> Communicator {
        Communicator {
            handle,
            cuda_device: device.cuda_ordinal(),
            device,
            rank,
            world_size,
            failure: OnceCell::new(),
            diag,
            names: Default::default(),
            orphans: Default::default(),
            refused: Default::default(),
            revoked: Default::default(),
            job_linked: Default::default(),
            unrevocable: Default::default(),
            revoke_blocked: Default::default(),
            relay: OnceCell::new(),
        }
    }

    /// Keeps `names` alive as long as this communicator.
    pub(crate) fn keeping(mut self, names: crate::config::ConfigNames) -> Communicator {
        self.names = names;
        self
    }

    /// Gives the handle up with no teardown (`into_raw`, and a wrap that failed): detaches
    /// the diagnostics (clique and watchdog) and drops everything else but the config's
    /// name strings, which NCCL may read as long as the handle (or a child of it) lives:
    /// those are leaked ([`ConfigNames::leak`](crate::config::ConfigNames::leak); a wrap
    /// has none). Null when the handle was not this communicator's to give: the watchdog
    /// took it (and aborted it), or it was borrowed.
    pub(crate) fn release_handle(mut self) -> ncclComm_t {
        std::mem::take(&mut self.names).leak();
        self.release_in_place()
        // `self` drops here with its handle taken, which `Drop` leaves alone.
    }

    /// [`release_handle`](Self::release_handle) in place (a view's drop, too).
    fn release_in_place(&mut self) -> ncclComm_t {
        self.reap_orphans(false);
        let raw = self.handle.take();
        let released = self.diag.release(None);
        match raw {
            Some(raw) if released => raw,
            _ => std::ptr::null_mut(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ensure_send<T: Send>() {}
    #[test]
    fn communicator_is_send() {
        ensure_send::<Communicator>();
        ensure_send::<PendingCommunicator>();
        ensure_send::<crate::CommRef<'static>>();
    }
}
