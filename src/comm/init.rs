//! Making communicators: one rank at a time (blocking, bounded, or non-blocking as a
//! [`PendingCommunicator`]) or all of a process's ranks at once.

use super::*;
use nccl_sys::{ncclUniqueId, EntryPoint};

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
        device: &CommDevice,
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
        device: &CommDevice,
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
        device: &CommDevice,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<PendingCommunicator> {
        let lib = device.library()?;
        Communicator::init_rank_nonblocking_in(&lib, device, world_size, rank, id, config)
    }

    /// [`init_rank_nonblocking`](Self::init_rank_nonblocking) with an explicit library.
    #[track_caller]
    pub fn init_rank_nonblocking_in(
        lib: &Arc<Library>,
        device: &CommDevice,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<PendingCommunicator> {
        let config = config.clone().blocking(false);
        Communicator::start_init(lib, device, world_size, rank, id, &config)
    }

    #[track_caller]
    fn start_init(
        lib: &Arc<Library>,
        device: &CommDevice,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<PendingCommunicator> {
        const OP: &str = "ncclCommInitRankConfig";
        start_new(
            OP,
            lib,
            device,
            world_size,
            rank,
            id,
            config,
            |raw_config| {
                let mut raw: ncclComm_t = std::ptr::null_mut();
                // SAFETY: `raw` is writable; `raw_config` is a valid ncclConfig_t for this
                // library (see `start_new`); ranks checked.
                let r = unsafe {
                    (lib.table().ncclCommInitRankConfig)(
                        &mut raw,
                        world_size as c_int,
                        id.to_raw(),
                        rank as c_int,
                        raw_config,
                    )
                };
                (r, raw)
            },
        )
    }

    /// Joins rank `rank` of a `world_size`-rank communicator with several unique ids
    /// (`ncclCommInitRankScalable`, NCCL 2.23+), so that no single root serves every rank:
    /// NCCL splits the ranks into `ids.len()` contiguous blocks, rank `r` checking in with
    /// the root of `ids[r * ids.len() / world_size]`, roughly (`rootIdFromRank`,
    /// bootstrap.cc:59-69 of 2.30.7); the communicator is named by `ids[0]`. Every rank
    /// passes the same ids in the same order; each id is best made by a rank of its own
    /// block ([`scalable_roots`](crate::scalable_roots) says how many,
    /// [`scalable_root_rank`](crate::scalable_root_rank) which rank makes which). Bounded
    /// like [`init_rank`](Self::init_rank).
    ///
    /// Errors, before NCCL is called: [`Error::Unsupported`] before NCCL 2.23;
    /// [`Error::InvalidArgument`] for no ids, more ids than ranks (NCCL refuses them too,
    /// init.cc:2479), or an id given twice (two blocks on one root, which NCCL's root
    /// cannot tell apart: the init would wait until its timeout).
    ///
    /// ```
    /// use nccl_safe::{CommDevice, Communicator, Config, UniqueId};
    /// let ids = [CommDevice::Host.unique_id()?, CommDevice::Host.unique_id()?];
    /// let comms = std::thread::scope(|s| {
    ///     let joins: Vec<_> = (0..4)
    ///         .map(|r| {
    ///             let ids = &ids;
    ///             s.spawn(move || {
    ///                 Communicator::init_rank_scalable(&CommDevice::Host, 4, r, ids, &Config::new())
    ///             })
    ///         })
    ///         .collect();
    ///     joins.into_iter().map(|j| j.join().unwrap()).collect::<Result<Vec<_>, _>>()
    /// })?;
    /// assert_eq!(comms[3].rank(), 3);
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn init_rank_scalable(
        device: &CommDevice,
        world_size: usize,
        rank: usize,
        ids: &[UniqueId],
        config: &Config,
    ) -> Result<Communicator> {
        let lib = device.library()?;
        Communicator::init_rank_scalable_in(&lib, device, world_size, rank, ids, config)
    }

    /// [`init_rank_scalable`](Self::init_rank_scalable) with an explicit library.
    #[track_caller]
    pub fn init_rank_scalable_in(
        lib: &Arc<Library>,
        device: &CommDevice,
        world_size: usize,
        rank: usize,
        ids: &[UniqueId],
        config: &Config,
    ) -> Result<Communicator> {
        const OP: &str = EntryPoint::ncclCommInitRankScalable.name();
        let init = lib.optional(lib.table().ncclCommInitRankScalable, OP)?;
        check_scalable_ids(OP, ids, world_size)?;
        let mut raw_ids: Vec<ncclUniqueId> = ids.iter().map(UniqueId::to_raw).collect();
        let pending = start_new(
            OP,
            lib,
            device,
            world_size,
            rank,
            &ids[0],
            config,
            |raw_config| {
                let mut raw: ncclComm_t = std::ptr::null_mut();
                // SAFETY: `raw` is writable; `raw_ids` holds `ids.len()` ids (checked to be
                // in 1..=world_size) that NCCL copies during the call (init.cc:2531);
                // `raw_config` is a valid ncclConfig_t for this library; ranks checked.
                let r = unsafe {
                    init(
                        &mut raw,
                        world_size as c_int,
                        rank as c_int,
                        raw_ids.len() as c_int,
                        raw_ids.as_mut_ptr(),
                        raw_config,
                    )
                };
                (r, raw)
            },
        )?;
        let timeout = pending.timeout();
        pending.wait_as(OP, Location::caller(), timeout)
    }

    /// Creates one communicator per device in this process (`ncclCommInitAll`): rank `i`
    /// runs on `devices[i]`. For the host provider pass [`CommDevice::Host`] once per rank.
    #[track_caller]
    pub fn init_all(devices: &[CommDevice]) -> Result<Vec<Communicator>> {
        const OP: &str = "ncclCommInitAll";
        let caller = Location::caller();
        let first = devices.first().ok_or(invalid(OP, "no devices given"))?;
        let lib = first.library()?;
        check_world(OP, devices.len(), 0)?;
        let mut ordinals = Vec::with_capacity(devices.len());
        for d in devices {
            check_device(OP, &lib, d)?;
            // The host provider's "devices" are the ranks.
            ordinals.push(d.cuda_ordinal().unwrap_or(ordinals.len()) as c_int);
        }
        let mut raws: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        let diag = crate::diag::CommDiag::for_init_all();
        let ctx = CallContext::at(None, caller);
        // SAFETY: `raws` has room for `devices.len()` handles and `ordinals` that many ints.
        let r = unsafe {
            (lib.table().ncclCommInitAll)(
                raws.as_mut_ptr(),
                devices.len() as c_int,
                ordinals.as_ptr(),
            )
        };
        // NCCL_COMM_BLOCKING=0 makes the communicators non-blocking (NCCL passes its default
        // config, which the variable overrides: init.cc:2068, 1646-1649): the call then
        // returns ncclInProgress, every handle written, and each is waited for as a
        // non-blocking init is.
        let in_progress = r == ncclInProgress;
        if !in_progress {
            lib.check(OP, r, ctx)?;
        }
        let comms = raws
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (raw, d))| {
                Communicator::new(
                    RawComm::owned(raw, Arc::clone(&lib)),
                    d.clone(),
                    rank,
                    devices.len(),
                    diag(),
                )
            });
        if !in_progress {
            return Ok(comms.collect());
        }
        // Every handle is owned first, so that a failure aborts the rest on the way out.
        let pending: Vec<_> = comms.map(PendingCommunicator::pending).collect();
        pending
            .into_iter()
            .map(|p| {
                let timeout = p.timeout();
                p.wait_as(OP, caller, timeout)
            })
            .collect()
    }
}

/// What every new communicator (an init, a new rank of a grown one) does around its NCCL
/// call: checks the ranks, the device against the provider, the diagnostics settings and a
/// free teardown lane on the device, binds the device's context, and makes the call with
/// `make` in NCCL's non-blocking mode, so that no init can wait for ever (see
/// `init_rank`). `make` gets the raw config, whose name pointers point into strings the
/// communicator keeps (NCCL reads `commName` after the call), and returns NCCL's result
/// and the handle it gave out. The communicator counts as failed until its init completes.
#[allow(clippy::too_many_arguments)]
#[track_caller]
pub(super) fn start_new(
    call: &'static str,
    lib: &Arc<Library>,
    device: &CommDevice,
    world_size: usize,
    rank: usize,
    id: &UniqueId,
    config: &Config,
    make: impl FnOnce(&mut nccl_sys::bindings::ncclConfig_t) -> (ncclResult_t, ncclComm_t),
) -> Result<PendingCommunicator> {
    check_world(call, world_size, rank)?;
    check_device(call, lib, device)?;
    super::params::refuse_blocking(call)?;
    crate::diag::check_settings(call, &config.diag, lib.provider())?;
    let diag = crate::diag::CommDiag::for_id(&config.diag, id, rank, world_size);
    crate::teardown::check_lane(call, diag.lane(device.cuda_ordinal()))?;
    bind(device)?;
    let config = config.clone().blocking(false);
    let mut raw_config = config.to_raw(lib)?;
    let (r, raw) = make(&mut raw_config);
    // A handle NCCL gave out is ours from here on: if the init failed, dropping it aborts
    // it, once.
    let handle = RawComm::owned(raw, Arc::clone(lib));
    if r != ncclInProgress {
        lib.check(call, r, CallContext::at(Some(rank), Location::caller()))?;
    }
    if raw.is_null() {
        return Err(invalid(call, "NCCL returned success but no communicator"));
    }
    diag.arrive(rank, world_size);
    let comm =
        Communicator::new(handle, device.clone(), rank, world_size, diag).keeping(config.names());
    Ok(PendingCommunicator::pending(comm))
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
        self.wait_as("ncclCommInitRankConfig", Location::caller(), timeout)
    }

    /// `comm`, whose init (or grow) was just issued: failed until it completes (dropped,
    /// it aborts).
    pub(super) fn pending(comm: Communicator) -> PendingCommunicator {
        let _ = comm.failure.set(PENDING.to_string());
        PendingCommunicator { comm }
    }

    /// [`wait`](Self::wait) for the call `call` made at `caller`.
    pub(super) fn wait_as(
        self,
        call: &'static str,
        caller: &'static Location<'static>,
        timeout: Duration,
    ) -> Result<Communicator> {
        let mut comm = self.comm;
        let ready = comm
            .wait_ready(call, caller, timeout)
            .and_then(|()| comm.read_shape(caller));
        if let Err(e) = ready {
            // This rank never joins: no collective of its clique can complete (the peers
            // whose init did complete see `is_failed()` at once). Dropped, it aborts.
            comm.diag
                .init_failed(comm.rank, comm.world_size, &e.to_string());
            return Err(e);
        }
        // Healthy again, unless something else failed it meanwhile.
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
    pub(super) fn timeout(&self) -> Duration {
        self.comm.diag.timeout()
    }
}

/// The ids of a scalable init: at least one, at most one per rank, none twice.
fn check_scalable_ids(call: &'static str, ids: &[UniqueId], world_size: usize) -> Result<()> {
    if ids.is_empty() {
        return Err(invalid(call, "no unique ids given: pass at least one"));
    }
    if ids.len() > world_size {
        let m = format!(
            "{} unique ids for {world_size} ranks: at most one id per rank",
            ids.len()
        );
        return Err(invalid(call, m));
    }
    let mut seen = std::collections::HashMap::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        if let Some(j) = seen.insert(id, i) {
            let m = format!("ids[{j}] and ids[{i}] are the same unique id: each block of ranks needs a root of its own");
            return Err(invalid(call, m));
        }
    }
    Ok(())
}
