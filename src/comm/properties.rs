//! [`Communicator::properties`]: what NCCL says a communicator supports
//! (`ncclCommQueryProperties`, NCCL 2.29+), as typed values.

use super::*;
use crate::version::Version;
use nccl_sys::device::{self, ncclCommProperties_t};
use nccl_sys::EntryPoint;

/// The kind of GPU-initiated networking (GIN) a communicator has (`ncclGinType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GinType {
    /// None (`NCCL_GIN_TYPE_NONE`).
    None,
    /// Through NCCL's proxy thread (`NCCL_GIN_TYPE_PROXY`).
    Proxy,
    /// GPUDirect Async Kernel-Initiated (`NCCL_GIN_TYPE_GDAKI`).
    Gdaki,
    /// GPI (`NCCL_GIN_TYPE_GPI`).
    Gpi,
    /// A value this crate does not know.
    Other(u32),
}

impl GinType {
    fn of(raw: device::ncclGinType_t) -> GinType {
        match raw {
            device::NCCL_GIN_TYPE_NONE => GinType::None,
            device::NCCL_GIN_TYPE_PROXY => GinType::Proxy,
            device::NCCL_GIN_TYPE_GDAKI => GinType::Gdaki,
            device::NCCL_GIN_TYPE_GPI => GinType::Gpi,
            other => GinType::Other(other),
        }
    }
}

/// What NCCL says a communicator supports ([`Communicator::properties`]).
///
/// The fields NCCL added after 2.29.3 are `None` on 2.29.2 and 2.29.3, which do not write
/// them (dev_runtime.cc:1483-1492 of v2.30.7-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Properties {
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The CUDA device (on the host provider, its device number).
    pub cuda_device: i32,
    /// The NVML device.
    pub nvml_device: i32,
    /// Whether NCCL's device API (symmetric memory windows) is available.
    pub device_api: bool,
    /// Whether NVLS multicast (multimem) is available.
    pub multimem: bool,
    /// The GPU-initiated networking available.
    pub gin: Option<GinType>,
    /// The railed GPU-initiated networking available.
    pub railed_gin: Option<GinType>,
    /// The number of load/store-accessible (LSA) teams.
    pub lsa_teams: Option<usize>,
    /// Whether host-initiated RMA is available.
    pub host_rma: Option<bool>,
}

/// The newest NCCL whose `ncclCommProperties_t` layout this crate has: the version it
/// hands NCCL, so that a newer NCCL writes no field past the struct.
const LAYOUT: Version = Version::new(2, 30, 7);

impl Communicator {
    /// What NCCL says this communicator supports (`ncclCommQueryProperties`, NCCL 2.29+):
    /// whether the device API, multicast and GPU-initiated networking are available,
    /// before choosing an algorithm. Local to this rank; no NCCL call on a failed
    /// communicator.
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.29; [`Error::CommunicatorFailed`] for a
    /// failed one; NCCL's error when it refuses the query (a refusal changes nothing).
    ///
    /// ```
    /// use nccl_safe::{Communicator, Config, CommDevice};
    /// let id = CommDevice::Host.unique_id()?;
    /// let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    /// let p = comm.properties()?;
    /// assert_eq!((p.rank, p.world_size, p.multimem), (0, 1, false));
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn properties(&self) -> Result<Properties> {
        const OP: &str = EntryPoint::ncclCommQueryProperties.name();
        let caller = Location::caller();
        let query = self.optional(|t| t.ncclCommQueryProperties, OP)?;
        self.ensure_usable(OP)?;
        // NCCL picks the layout it writes by the version it is handed (a caller's
        // compiled version, at most its own): the library's, capped at the layout known.
        let version = self.library().version().min(LAYOUT);
        let mut p = ncclCommProperties_t::initializer(version.code() as u32);
        let r = self.pinned(|| {
            // SAFETY: the handle is live (pinned); `p` is an initialized properties struct
            // of the layout `version` names, which NCCL writes before it returns.
            Ok(unsafe { query(self.handle.get(), &mut p) })
        })?;
        if r != ncclSuccess {
            return Err(self.nccl_error(OP, r, caller));
        }
        let full = version > Version::new(2, 29, 3);
        Ok(Properties {
            rank: p.rank.max(0) as usize,
            world_size: p.nRanks.max(0) as usize,
            cuda_device: p.cudaDev,
            nvml_device: p.nvmlDev,
            device_api: p.deviceApiSupport,
            multimem: p.multimemSupport,
            gin: full.then(|| GinType::of(p.ginType)),
            railed_gin: full.then(|| GinType::of(p.railedGinType)),
            lsa_teams: full.then_some(p.nLsaTeams.max(0) as usize),
            host_rma: full.then_some(p.hostRmaSupport),
        })
    }
}
