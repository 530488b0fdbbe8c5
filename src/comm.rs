//! [`Communicator`]: the RAII owner of an `ncclComm_t`.

use std::cell::OnceCell;
use std::ffi::c_int;
use std::panic::Location;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use nccl_sys::{ncclComm_t, ncclResult_t, FunctionTable};

use crate::config::Config;
use crate::error::{Error, Result, ResultCode};
use crate::id::UniqueId;
use crate::library::{CallContext, Library, Provider};
use crate::nccl_call;

/// Where a communicator's rank runs: a CUDA device (NVIDIA's NCCL) or the host provider.
#[derive(Debug, Clone)]
pub enum Device {
    /// A CUDA device, through cudarc's context for it.
    Cuda(Arc<CudaContext>),
    /// The in-process host provider (CPU memory, ranks as threads).
    Host,
}

impl Device {
    /// The library this kind of device is served by: the default NCCL for CUDA
    /// ([`Library::load`]), the host provider for [`Device::Host`].
    pub fn library(&self) -> Result<Arc<Library>> {
        match self {
            Device::Cuda(_) => Library::load(),
            #[cfg(feature = "host")]
            Device::Host => Ok(Library::host()),
            #[cfg(not(feature = "host"))]
            Device::Host => Err(Error::InvalidArgument {
                op: "Device::library",
                reason: "nccl-safe was built without its `host` feature (the host provider)".into(),
            }),
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

/// Default bound on waits for non-blocking init, split and finalize.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(600);

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
/// use nccl_safe::{Communicator, Config, Device, HostStream, ReduceOp};
/// // Two ranks in threads, on the host provider.
/// let id = Device::Host.unique_id()?;
/// std::thread::scope(|s| {
///     for rank in 0..2 {
///         s.spawn(move || -> nccl_safe::Result<()> {
///             let comm = Communicator::init_rank(&Device::Host, 2, rank, &id, &Config::new())?;
///             let mut grads = vec![rank as f32 + 1.0; 4];
///             comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, &HostStream)?;
///             assert_eq!(grads, vec![3.0; 4]);
///             comm.destroy().map_err(|(_, e)| e)
///         });
///     }
/// });
/// # Ok::<(), nccl_safe::Error>(())
/// ```
pub struct Communicator {
    raw: ncclComm_t,
    lib: Arc<Library>,
    device: Device,
    rank: usize,
    world_size: usize,
    cuda_device: Option<usize>,
    /// The first error this communicator saw; set means "abort on drop". `OnceCell` also
    /// makes the type `!Sync`.
    failure: OnceCell<String>,
    /// Watchdog, flight recorder and fingerprint state (`crate::diag`).
    pub(crate) diag: crate::diag::CommDiag,
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
            .field("provider", &self.lib.provider())
            .field("failed", &self.failure.get().is_some())
            .finish()
    }
}

fn check_world(op: &'static str, world_size: usize, rank: usize) -> Result<()> {
    if world_size == 0 || world_size > c_int::MAX as usize {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "world size {world_size} must be between 1 and {}",
                c_int::MAX
            ),
        });
    }
    if rank >= world_size {
        return Err(Error::RankOutOfRange {
            op,
            what: "rank",
            rank,
            world_size,
        });
    }
    Ok(())
}

fn check_device(op: &'static str, lib: &Library, device: &Device) -> Result<()> {
    match (lib.provider(), device) {
        (Provider::Host, Device::Host) | (Provider::Nccl, Device::Cuda(_)) => Ok(()),
        (p, d) => Err(Error::InvalidArgument {
            op,
            reason: format!(
                "a {} device cannot use the {p:?} provider",
                match d {
                    Device::Cuda(_) => "CUDA",
                    Device::Host => "host",
                }
            ),
        }),
    }
}

#[inline(always)]
fn bind(device: &Device) -> Result<()> {
    match device {
        Device::Cuda(ctx) => bind_cuda(ctx),
        Device::Host => Ok(()),
    }
}

#[inline(never)]
fn bind_cuda(ctx: &CudaContext) -> Result<()> {
    Ok(ctx.bind_to_thread()?)
}

impl Communicator {
    /// Joins rank `rank` of a `world_size`-rank communicator (`ncclCommInitRankConfig`),
    /// blocking until every rank has joined with the same `id`.
    ///
    /// **Bounded.** The wait ends after the communicator's timeout ([`Config::timeout`], else
    /// `NCCL_SAFE_TIMEOUT_MS`, else 10 minutes) with [`Error::Timeout`] naming the ranks
    /// never seen: NCCL's own blocking init waits for a missing peer for ever, so the
    /// communicator is always created in NCCL's non-blocking mode and waited for here. Its
    /// later calls behave as a blocking communicator's (an `ncclInProgress` is waited out).
    /// Use [`init_rank_nonblocking`](Self::init_rank_nonblocking) to do other work
    /// meanwhile.
    #[track_caller]
    pub fn init_rank(
        device: &Device,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<Communicator> {
        let lib = device.library()?;
        Communicator::init_rank_in(&lib, device, world_size, rank, id, config)
    }

    /// [`init_rank`](Self::init_rank) with an explicit library.
    #[track_caller]
    pub fn init_rank_in(
        lib: &Arc<Library>,
        device: &Device,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<Communicator> {
        let pending = Communicator::start_init(lib, device, world_size, rank, id, config)?;
        let timeout = pending.timeout();
        pending.wait(timeout)
    }

    /// Starts a non-blocking init (`ncclCommInitRankConfig` with `blocking = 0`): returns at
    /// once; [`PendingCommunicator::wait`] yields the communicator.
    #[track_caller]
    pub fn init_rank_nonblocking(
        device: &Device,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<PendingCommunicator> {
        let lib = device.library()?;
        let config = config.clone().blocking(false);
        Communicator::start_init(&lib, device, world_size, rank, id, &config)
    }

    #[track_caller]
    fn start_init(
        lib: &Arc<Library>,
        device: &Device,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<PendingCommunicator> {
        const OP: &str = "ncclCommInitRankConfig";
        check_world(OP, world_size, rank)?;
        check_device(OP, lib, device)?;
        if let Some(reason) = crate::diag::invalid_settings(&config.diag) {
            return Err(Error::InvalidArgument { op: OP, reason });
        }
        let diag = crate::diag::CommDiag::for_id(&config.diag, id);
        crate::diag::check_lane(
            OP,
            match device {
                Device::Cuda(c) => crate::diag::Lane::Device(c.ordinal()),
                Device::Host => diag.host_lane(),
            },
        )?;
        bind(device)?;
        // Always NCCL's non-blocking mode, so that no init can wait for ever (see init_rank).
        let mut raw_config = config.clone().blocking(false).to_raw(lib)?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` is writable; `raw_config` is a valid ncclConfig_t for this library
        // whose name pointers borrow `config`, alive for the call; ranks checked above.
        let r = unsafe {
            (lib.table().ncclCommInitRankConfig)(
                &mut raw,
                world_size as c_int,
                id.to_raw(),
                rank as c_int,
                &mut raw_config,
            )
        };
        let ctx = CallContext {
            comm: std::ptr::null_mut(),
            rank: Some(rank),
            caller: Some(Location::caller()),
        };
        let in_progress = r == nccl_sys::bindings::ncclInProgress;
        if !in_progress {
            if let Err(e) = lib.check(OP, r, ctx) {
                if !raw.is_null() {
                    // NCCL handed out a handle before failing: it is ours to tear down, once.
                    // SAFETY: `raw` came from this init and is not used again.
                    let _ = unsafe { (lib.table().ncclCommAbort)(raw) };
                }
                return Err(e);
            }
        }
        if raw.is_null() {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "NCCL returned success but no communicator".into(),
            });
        }
        // Until its init completes, the communicator counts as failed: dropped, it is aborted.
        let failure = OnceCell::new();
        let _ = failure.set(PENDING.to_string());
        Ok(PendingCommunicator {
            comm: Communicator {
                raw,
                lib: Arc::clone(lib),
                device: device.clone(),
                rank,
                world_size,
                cuda_device: match device {
                    Device::Cuda(c) => Some(c.ordinal()),
                    Device::Host => None,
                },
                failure,
                diag: {
                    diag.arrive(rank, world_size);
                    diag
                },
            },
        })
    }

    /// Creates one communicator per device in this process (`ncclCommInitAll`): rank `i`
    /// runs on `devices[i]`. For the host provider pass [`Device::Host`] once per rank.
    #[track_caller]
    pub fn init_all(devices: &[Device]) -> Result<Vec<Communicator>> {
        const OP: &str = "ncclCommInitAll";
        let first = devices.first().ok_or(Error::InvalidArgument {
            op: OP,
            reason: "no devices given".into(),
        })?;
        let lib = first.library()?;
        check_world(OP, devices.len(), 0)?;
        let mut ordinals = Vec::with_capacity(devices.len());
        for d in devices {
            check_device(OP, &lib, d)?;
            ordinals.push(match d {
                Device::Cuda(c) => c.ordinal() as c_int,
                Device::Host => ordinals.len() as c_int,
            });
        }
        let mut raws: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        let clique = crate::diag::CommDiag::init_all_key();
        let ctx = CallContext {
            comm: std::ptr::null_mut(),
            rank: None,
            caller: Some(Location::caller()),
        };
        // SAFETY: `raws` has room for `devices.len()` handles and `ordinals` that many ints.
        unsafe {
            nccl_call!(
                &lib,
                ncclCommInitAll(raws.as_mut_ptr(), devices.len() as c_int, ordinals.as_ptr()),
                ctx
            )
        }?;
        Ok(raws
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (raw, d))| Communicator {
                raw,
                lib: Arc::clone(&lib),
                device: d.clone(),
                rank,
                world_size: devices.len(),
                cuda_device: match d {
                    Device::Cuda(c) => Some(c.ordinal()),
                    Device::Host => None,
                },
                failure: OnceCell::new(),
                diag: crate::diag::CommDiag::for_init_all(clique),
            })
            .collect())
    }

    /// This rank (`ncclCommUserRank`, cached at init).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks (`ncclCommCount`, cached at init).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The device this rank runs on (as [`crate::launch::Rank::device`]).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The CUDA device ordinal (`None` on the host provider).
    pub fn cuda_ordinal(&self) -> Option<usize> {
        self.cuda_device
    }

    /// The library serving this communicator.
    pub fn library(&self) -> &Arc<Library> {
        &self.lib
    }

    /// The raw handle, for NCCL features this crate does not wrap. It stays owned by
    /// `self`: do not destroy or abort it.
    pub fn as_raw(&self) -> ncclComm_t {
        self.raw
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
        let mut state = nccl_sys::bindings::ncclSuccess;
        self.pinned(|| {
            // SAFETY: `state` is writable; the handle is live (not torn down: pinned, so the
            // watchdog cannot take it during the call).
            let r = unsafe { (self.lib.table().ncclCommGetAsyncError)(self.raw, &mut state) };
            self.checked("ncclCommGetAsyncError", r, caller)
        })?;
        match ResultCode::from_raw(state) {
            None => Ok(false),
            Some(ResultCode::InProgress) => Ok(true),
            Some(_) => Err(self.fail("ncclCommGetAsyncError", state, caller)),
        }
    }

    /// Marks the communicator failed (drop will abort) and returns the error for `raw`.
    #[cold]
    fn fail(
        &self,
        call: &'static str,
        raw: ncclResult_t,
        caller: &'static Location<'static>,
    ) -> Error {
        let e = self.lib.error_for(call, raw, self.context(caller));
        self.failure.get_or_init(|| e.to_string());
        e.into()
    }

    /// This rank is done with the communicator (its launcher closure returned): peers that
    /// wait for a collective it never issued fail at once with [`Error::RankLeft`].
    #[cfg_attr(not(feature = "launch"), allow(dead_code))]
    pub(crate) fn leave(&self, how: &str) {
        self.diag.leave(how);
    }

    /// Marks the communicator failed with `e` (drop will abort), keeping the first cause.
    pub(crate) fn mark_failed(&self, e: &Error) {
        self.failure.get_or_init(|| e.to_string());
    }

    fn context(&self, caller: &'static Location<'static>) -> CallContext {
        CallContext {
            comm: self.raw,
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
        if r == nccl_sys::bindings::ncclSuccess {
            Ok(())
        } else {
            Err(self.fail(call, r, caller))
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
        self.issue_then(op, caller, f, || Ok(()))
    }

    /// [`issue`](Self::issue), with `then` run after a successful call while the
    /// operation is still open (watched by the watchdog): split and shrink wait for their
    /// child there.
    #[inline(always)]
    pub(crate) fn issue_then<'a>(
        &self,
        op: impl Into<crate::diag::OpInfo<'a>>,
        caller: &'static Location<'static>,
        f: impl FnOnce(&FunctionTable, ncclComm_t) -> ncclResult_t,
        then: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let op = op.into();
        let call = op.name();
        if self.failure.get().is_some() {
            // The error for a failed communicator (a watchdog abort takes precedence).
            self.ensure_usable(call)?;
        }
        // No CUDA context bind here: NCCL makes the communicator's device current itself
        // for every operation (each is an implicit group, and one thread may drive several
        // devices inside an explicit one), so the per-operation path makes no driver call
        // of ours. Init and teardown bind.
        let ticket = match self.diag.begin(self.handle(), op, caller) {
            Ok(t) => t,
            Err(e) => return Err(self.failed_with(e)),
        };
        let r = f(self.lib.table(), self.raw);
        // NCCL's communicator is always non-blocking (see init_rank): wait out progress.
        let r = if r == nccl_sys::bindings::ncclInProgress {
            self.wait_ready(call, caller, self.diag.timeout())
        } else {
            self.checked(call, r, caller)
        };
        let r = r.and_then(|()| then());
        match self.diag.end(ticket, r) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.failed_with(e)),
        }
    }

    /// Runs `f`, an NCCL call on the handle that is not an operation (a poll, a
    /// registration, a destroy), with the handle claimed: the watchdog cannot abort it
    /// meanwhile. Fails without calling `f` when the watchdog aborts it.
    #[inline]
    pub(crate) fn pinned<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let pinned = self.diag.pin()?;
        let r = f();
        if pinned {
            self.diag.unpin();
        }
        r
    }

    /// Marks the communicator failed with `e` (the first cause is kept) and returns it.
    #[cold]
    fn failed_with(&self, e: Error) -> Error {
        self.mark_failed(&e);
        e
    }

    /// What the diagnostics need to attach this communicator.
    #[inline(always)]
    pub(crate) fn handle(&self) -> crate::diag::Handle<'_> {
        crate::diag::Handle {
            raw: self.raw,
            rank: self.rank,
            world_size: self.world_size,
            lib: &self.lib,
            lane: self.lane(),
        }
    }

    /// A copy of the flight recorder: the last operations on this communicator, oldest
    /// first (no NCCL call).
    #[cfg(feature = "diag")]
    pub fn flight_record(&self) -> crate::diag::FlightRecord {
        self.diag.flight_record(self.handle())
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
        self.diag.diagnostics(self.handle())
    }

    /// The first check of every operation, before its buffers or the CUDA driver are
    /// touched: a failed communicator (an NCCL error, or a timeout the watchdog declared)
    /// fails at once. A few loads.
    #[inline(always)]
    pub(crate) fn admit(&self, op: &'static str) -> Result<()> {
        if self.failure.get().is_some() || self.diag.failed() {
            return self.ensure_usable(op);
        }
        Ok(())
    }

    /// Fails when the communicator failed: with the watchdog's timeout when its clique
    /// timed out, else with its own first error (one it saw before a peer left, too), else
    /// with the report of a peer that left.
    #[inline]
    pub(crate) fn ensure_usable(&self, op: &'static str) -> Result<()> {
        match (self.failure.get(), self.diag.check_alive()) {
            (None, alive) => alive,
            (Some(cause), Err(Error::RankLeft { .. }) | Ok(())) => {
                Err(self.failed_error(op, cause))
            }
            (Some(_), Err(e)) => Err(e),
        }
    }

    #[cold]
    fn failed_error(&self, op: &'static str, cause: &str) -> Error {
        Error::CommunicatorFailed {
            op,
            rank: self.rank,
            cause: cause.to_string(),
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator leaves `ncclInProgress`.
    pub(crate) fn wait_ready(
        &self,
        op: &'static str,
        caller: &'static Location<'static>,
        timeout: Duration,
    ) -> Result<()> {
        self.wait_ready_for(op, caller, timeout, &self.diag)
    }

    /// [`wait_ready`](Self::wait_ready) that also ends when the watchdog fails `watched`
    /// (a child's wait watches its parent).
    fn wait_ready_for(
        &self,
        op: &'static str,
        caller: &'static Location<'static>,
        timeout: Duration,
        watched: &crate::diag::CommDiag,
    ) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        loop {
            // The watchdog may have failed it (and taken the handle) meanwhile.
            self.diag.check_alive()?;
            watched.check_alive()?;
            let mut state = nccl_sys::bindings::ncclSuccess;
            self.pinned(|| {
                // SAFETY: `state` is writable; the handle is live: inside an operation, or
                // pinned, so the watchdog cannot take it during the call.
                let r = unsafe { (self.lib.table().ncclCommGetAsyncError)(self.raw, &mut state) };
                self.checked("ncclCommGetAsyncError", r, caller)
            })?;
            match ResultCode::from_raw(state) {
                None => return Ok(()),
                Some(ResultCode::InProgress) => {}
                Some(_) => return Err(self.fail(op, state, caller)),
            }
            if start.elapsed() >= timeout {
                let e = Error::Timeout {
                    what: self
                        .diag
                        .wait_timeout_report(op, self.rank, self.world_size),
                    timeout,
                };
                self.mark_failed(&e);
                return Err(e);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    /// Splits this communicator (`ncclCommSplit`); collective over all its ranks.
    ///
    /// Ranks passing the same `color` form a new communicator, ordered by `key` (ties by
    /// rank here). `None` (`NCCL_SPLIT_NOCOLOR`) joins none and gets `Ok(None)`. The child
    /// inherits this communicator's configuration.
    ///
    /// ```
    /// use nccl_safe::launch::Launcher;
    /// Launcher::host(4).run(|rank| {
    ///     let r = rank.rank();
    ///     // Even and odd ranks form two communicators of 2, ordered by descending rank.
    ///     let sub = rank.comm().split(Some(r as u32 % 2), -(r as i32))?.expect("has a color");
    ///     assert_eq!((sub.world_size(), sub.rank()), (2, 1 - r / 2));
    ///     assert!(rank.comm().split(None, 0)?.is_none());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Communicator>> {
        const OP: &str = "ncclCommSplit";
        let caller = Location::caller();
        let color = match color {
            None => nccl_sys::bindings::NCCL_SPLIT_NOCOLOR,
            Some(c) if c <= c_int::MAX as u32 => c as c_int,
            Some(c) => {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: format!("color {c} does not fit NCCL's int (max {})", c_int::MAX),
                })
            }
        };
        crate::diag::check_lane(OP, self.lane())?;
        let mut child: ncclComm_t = std::ptr::null_mut();
        let mut adopted = None;
        let child_ptr: *mut ncclComm_t = &mut child;
        self.issue_then(
            &OP,
            caller,
            |t, comm| {
                // SAFETY: `child_ptr` points to `child`, writable and alive for the call; a
                // null config means "inherit the parent's".
                unsafe { (t.ncclCommSplit)(comm, color, key, child_ptr, std::ptr::null_mut()) }
            },
            || {
                // SAFETY: the call above has returned; `child` is read once, here.
                let raw = unsafe { *child_ptr };
                adopted = self.adopt_child(OP, raw, caller, color as u64)?;
                Ok(())
            },
        )?;
        Ok(adopted)
    }

    /// Removes `exclude` ranks (`ncclCommShrink`, NCCL 2.27+); collective over the ranks
    /// that stay. The calling rank must not be in `exclude`.
    #[track_caller]
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        const OP: &str = "ncclCommShrink";
        let caller = Location::caller();
        let shrink = self.lib.optional(self.lib.table().ncclCommShrink, OP)?;
        let mut list = Vec::with_capacity(exclude.len());
        for &r in exclude {
            if r >= self.world_size {
                return Err(Error::RankOutOfRange {
                    op: OP,
                    what: "excluded rank",
                    rank: r,
                    world_size: self.world_size,
                });
            }
            if r == self.rank {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: format!("rank {r} is excluded, so it must not call shrink"),
                });
            }
            if list.contains(&(r as c_int)) {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: format!("rank {r} is listed twice"),
                });
            }
            list.push(r as c_int);
        }
        if list.len() >= self.world_size {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "every rank is excluded".into(),
            });
        }
        crate::diag::check_lane(OP, self.lane())?;
        let tag = crate::diag::shrink_tag(&list);
        let mut child: ncclComm_t = std::ptr::null_mut();
        let child_ptr: *mut ncclComm_t = &mut child;
        let mut adopted = None;
        self.issue_then(
            &OP,
            caller,
            |_, comm| {
                // SAFETY: `list` holds `list.len()` in-range ranks; `child_ptr` points to
                // `child`, writable and alive for the call; null config inherits the
                // parent's; flags 0 = NCCL_SHRINK_DEFAULT.
                unsafe {
                    shrink(
                        comm,
                        list.as_mut_ptr(),
                        list.len() as c_int,
                        child_ptr,
                        std::ptr::null_mut(),
                        nccl_sys::bindings::NCCL_SHRINK_DEFAULT as c_int,
                    )
                }
            },
            || {
                // SAFETY: the call above has returned; `child` is read once, here.
                let raw = unsafe { *child_ptr };
                adopted = self.adopt_child(OP, raw, caller, tag)?;
                Ok(())
            },
        )?;
        adopted.ok_or(Error::InvalidArgument {
            op: OP,
            reason: "NCCL returned no communicator".into(),
        })
    }

    /// Wraps a child handle from split/shrink, reading its rank and size from NCCL.
    fn adopt_child(
        &self,
        op: &'static str,
        child: ncclComm_t,
        caller: &'static Location<'static>,
        tag: u64,
    ) -> Result<Option<Communicator>> {
        if child.is_null() {
            return Ok(None);
        }
        let mut comm = Communicator {
            raw: child,
            lib: Arc::clone(&self.lib),
            device: self.device.clone(),
            rank: 0,
            world_size: 0,
            cuda_device: self.cuda_device,
            failure: OnceCell::new(),
            diag: self.diag.child(tag),
        };
        // The child inherits the parent's non-blocking mode: wait (bounded) until it is ready.
        // This runs inside the parent's operation, so the watchdog's timeout of the
        // parent's clique (with its report of who is behind) normally ends a wait for a
        // missing rank; the wait's own limit is a margin later.
        comm.wait_ready_for(
            op,
            caller,
            self.diag.timeout() + CHILD_WAIT_MARGIN,
            &self.diag,
        )?;
        comm.read_shape(caller)?;
        Ok(Some(comm))
    }

    /// Reads rank and size from NCCL (`ncclCommUserRank`, `ncclCommCount`).
    fn read_shape(&mut self, caller: &'static Location<'static>) -> Result<()> {
        let (mut rank, mut count): (c_int, c_int) = (0, 0);
        // SAFETY: `rank` is writable and the handle live.
        let r = unsafe { (self.lib.table().ncclCommUserRank)(self.raw, &mut rank) };
        self.checked("ncclCommUserRank", r, caller)?;
        // SAFETY: `count` is writable and the handle live.
        let r = unsafe { (self.lib.table().ncclCommCount)(self.raw, &mut count) };
        self.checked("ncclCommCount", r, caller)?;
        self.rank = rank.max(0) as usize;
        self.world_size = count.max(0) as usize;
        self.diag
            .attach(self.raw, self.rank, self.world_size, &self.lib, self.lane());
        Ok(())
    }

    /// Takes the handle out, so that exactly one teardown call uses it; `how` says how the
    /// rank leaves its clique (for peers that wait for it), `broken` whether it leaves by
    /// a panic: then the whole clique fails. An explicit `abort()` may be a normal ending,
    /// and a failed communicator's failure may be its peers' too (a fingerprint mismatch
    /// every rank reports), so those fail only the peers that wait for the rank.
    fn take(&mut self, how: &str, broken: bool) -> ncclComm_t {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        // Null when the watchdog already aborted it (its one teardown).
        if self.diag.release(Some((how, broken))) {
            raw
        } else {
            std::ptr::null_mut()
        }
    }

    /// Destroys the communicator (`ncclCommDestroy`). On failure the communicator comes
    /// back with the error (marked failed, so dropping it aborts), as rusqlite's
    /// `Connection::close` does. A communicator that already failed is not destroyed but
    /// handed back with [`Error::CommunicatorFailed`].
    #[track_caller]
    #[allow(clippy::result_large_err)] // the shape of rusqlite's `Connection::close`
    pub fn destroy(mut self) -> std::result::Result<(), (Communicator, Error)> {
        const OP: &str = "ncclCommDestroy";
        let caller = Location::caller();
        if let Err(e) = self.ensure_usable(OP) {
            return Err((self, e));
        }
        if let Err(e) = self.diag.before_teardown() {
            self.mark_failed(&e);
            return Err((self, e));
        }
        if let Err(e) = bind(&self.device) {
            return Err((self, e));
        }
        // Pinned from before the call until the handle is out of its slot: a watchdog
        // claim can never fall between the destroy and the take.
        let pinned = match self.diag.pin() {
            Ok(p) => p,
            Err(e) => return Err((self, e)),
        };
        // SAFETY: the handle is live (pinned: the watchdog cannot take it during the call);
        // on success it is never used again (taken below, still pinned).
        let r = unsafe { (self.lib.table().ncclCommDestroy)(self.raw) };
        // The communicator is non-blocking (see init_rank): progress means it is under way.
        let r = if r == nccl_sys::bindings::ncclInProgress {
            nccl_sys::bindings::ncclSuccess
        } else {
            r
        };
        let destroyed = self.checked(OP, r, caller);
        if destroyed.is_ok() {
            self.take("it destroyed its communicator", false);
        }
        if pinned {
            self.diag.unpin();
        }
        match destroyed {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    /// Aborts the communicator (`ncclCommAbort`): pending operations on every rank end
    /// with an error. Never blocks on peers, on this communicator's work or on a stalled
    /// stream for longer than [`Config::abort_timeout`]: the abort runs on the device's
    /// teardown lane (NVIDIA's blocks behind a stalled stream), and past the bound this
    /// returns [`Error::Timeout`] while [`Config::on_abort_timeout`] applies. When the
    /// watchdog already took the handle, this waits (with the same bound) for the
    /// watchdog's abort and returns its outcome.
    #[track_caller]
    pub fn abort(mut self) -> Result<()> {
        let ctx = self.context(Location::caller());
        let until = Instant::now() + self.diag.abort_timeout();
        let raw = self.take("it aborted its communicator", false);
        let ctx = CallContext {
            comm: std::ptr::null_mut(),
            ..ctx
        };
        let (bound, r) = if raw.is_null() {
            match self.diag.watchdog_abort(until) {
                Some(outcome) => outcome,
                None => return Ok(()), // nothing left to tear down
            }
        } else {
            self.teardown(raw, true, "abort", until)
        };
        let r = r.ok_or_else(|| self.abort_overdue(bound))?;
        self.lib.check("ncclCommAbort", r, ctx)
    }

    /// The lane this communicator's teardowns run on: its CUDA device, or on the host
    /// provider the unique id its family was born from.
    pub(crate) fn lane(&self) -> crate::diag::Lane {
        match self.cuda_device {
            Some(d) => crate::diag::Lane::Device(d),
            None => self.diag.host_lane(),
        }
    }

    /// Tears the taken handle `raw` down on the teardown lane (abort, or destroy), waiting
    /// until `until`: the bound, and the call's result when it returned in time.
    fn teardown(
        &self,
        raw: ncclComm_t,
        abort: bool,
        why: &str,
        until: Instant,
    ) -> (Duration, Option<ncclResult_t>) {
        let what = format!("rank {} of {} ({why})", self.rank, self.world_size);
        let ctx = match &self.device {
            Device::Cuda(c) => Some(Arc::clone(c)),
            Device::Host => None,
        };
        let b = self.diag.bound();
        let (_, r) =
            crate::diag::teardown_bounded(self.lane(), b, &self.lib, raw, abort, ctx, what, until);
        (b.bound, r)
    }

    #[cold]
    fn abort_overdue(&self, bound: Duration) -> Error {
        Error::Timeout {
            what: format!(
                "ncclCommAbort on rank {} did not return within the abort bound (Config::abort_timeout): it goes on in the background",
                self.rank
            ),
            timeout: bound,
        }
    }

    /// Flushes pending work everywhere (`ncclCommFinalize`), waits for it, then destroys.
    /// On a failure or timeout the communicator is aborted (once) and the error returned.
    #[track_caller]
    pub fn finalize(self, timeout: Duration) -> Result<()> {
        const OP: &str = "ncclCommFinalize";
        let caller = Location::caller();
        self.ensure_usable(OP)?;
        bind(&self.device)?;
        self.pinned(|| {
            // SAFETY: the handle is live (pinned: the watchdog cannot take it meanwhile).
            let r = unsafe { (self.lib.table().ncclCommFinalize)(self.raw) };
            if r != nccl_sys::bindings::ncclInProgress {
                self.checked(OP, r, caller)?;
            }
            Ok(())
        })?;
        self.wait_ready(OP, caller, timeout)?;
        self.destroy().map_err(|(_, e)| e)
    }
}

impl Drop for Communicator {
    /// Bounded by [`Config::abort_timeout`] from the start of the drop, whatever the state:
    /// a healthy communicator waits for its own work (on its own streams only) and is
    /// destroyed; one that failed, that is dropped during a panic, or whose work did not
    /// complete in time is aborted. The call runs on the teardown lane; what does not
    /// return in time is left there and reported once.
    fn drop(&mut self) {
        if self.raw.is_null() {
            return; // `abort`, `destroy` or `into_raw` took it
        }
        let until = Instant::now() + self.diag.abort_timeout();
        // Dropped during a panic: this rank will not reach the collectives its peers may be
        // waiting in, so abort (which wakes them) rather than destroy.
        let failed = std::thread::panicking() || self.is_failed();
        let drained = !failed && self.diag.drain(until);
        let how = if std::thread::panicking() {
            "it panicked"
        } else if drained {
            "its communicator was dropped"
        } else {
            "its failed communicator was dropped (aborted)"
        };
        let raw = self.take(how, std::thread::panicking());
        if raw.is_null() {
            return; // the watchdog took it: its one teardown
        }
        let why = if drained {
            "dropped"
        } else if failed {
            "dropped after a failure"
        } else {
            "dropped with work that did not complete in time"
        };
        let _ = self.teardown(raw, !drained, why, until);
    }
}

// Raw-handle interop (`Communicator::from_raw` / `into_raw`, `CommRef`: src/comm_ref.rs).
impl Communicator {
    /// A communicator around a handle made outside this crate, its rank and size known.
    /// Its diagnostics are not attached yet (the caller attaches them).
    pub(crate) fn from_foreign(
        raw: ncclComm_t,
        lib: Arc<Library>,
        device: Device,
        rank: usize,
        world_size: usize,
        diag: crate::diag::CommDiag,
    ) -> Communicator {
        Communicator {
            raw,
            lib,
            cuda_device: match &device {
                Device::Cuda(c) => Some(c.ordinal()),
                Device::Host => None,
            },
            device,
            rank,
            world_size,
            failure: OnceCell::new(),
            diag,
        }
    }

    /// Gives the handle up with no teardown: detaches the diagnostics (clique and watchdog)
    /// and drops everything else. Null when the handle was not this communicator's to give:
    /// the watchdog took it (and aborted it), or it was borrowed.
    pub(crate) fn release_handle(mut self) -> ncclComm_t {
        self.give_up_handle()
        // `self` drops here with a null handle, which `Drop` leaves alone.
    }

    /// [`Self::release_handle`] in place: afterwards the handle is null, so the
    /// communicator's `Drop` tears nothing down and only drops its other fields.
    pub(crate) fn give_up_handle(&mut self) -> ncclComm_t {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        if self.diag.release(None) {
            raw
        } else {
            std::ptr::null_mut()
        }
    }

    /// [`check_device`] for src/comm_ref.rs.
    pub(crate) fn check_foreign_device(
        op: &'static str,
        lib: &Library,
        device: &Device,
    ) -> Result<()> {
        check_device(op, lib, device)
    }
}

/// The failure a communicator carries until its init completes (so dropping it aborts).
const PENDING: &str = "its initialization did not complete";

/// A communicator whose non-blocking init is under way. Dropping it aborts the handle
/// (the communicator counts as failed until [`wait`](Self::wait) succeeds).
#[derive(Debug)]
pub struct PendingCommunicator {
    comm: Communicator,
}

impl PendingCommunicator {
    /// Waits until init completes (polling `ncclCommGetAsyncError`), up to `timeout`.
    /// On an error or timeout the handle is aborted (once) and the error returned.
    #[track_caller]
    pub fn wait(self, timeout: Duration) -> Result<Communicator> {
        let caller = Location::caller();
        let mut comm = self.comm;
        comm.wait_ready("ncclCommInitRankConfig", caller, timeout)?;
        comm.read_shape(caller)?;
        if comm.failure.get().map(String::as_str) == Some(PENDING) {
            comm.failure.take();
        }
        Ok(comm)
    }

    /// Whether init has finished (successfully or not) without waiting.
    pub fn is_ready(&self) -> Result<bool> {
        Ok(!self.comm.async_error()?)
    }

    /// The communicator's timeout ([`Config::timeout`]), which `init_rank` waits.
    fn timeout(&self) -> Duration {
        self.comm.diag.timeout()
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
    }
}
