//! Making communicators: one rank at a time (blocking, bounded, or non-blocking as a
//! [`PendingCommunicator`]) or all of a process's ranks at once.

use super::*;

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
