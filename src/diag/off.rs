//! The hooks without the `diag` feature: nothing is recorded or watched, and every hook is
//! a no-op the compiler removes. What stays: the settings (the timeout still bounds init
//! and every wait for `ncclInProgress`), and aborts on their own bounded thread with the
//! guarded exit (`crate::teardown`).

use std::panic::Location;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys::ncclComm_t;

use super::op::OpInfo;
use super::settings::{DiagConfig, Settings};
use crate::error::Result;
use crate::id::UniqueId;
use crate::library::Library;
use crate::teardown::{Bound, TeardownLane};

/// What the hooks would need to attach a communicator (unused without the feature).
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)]
pub(crate) struct CommView<'a> {
    pub raw: ncclComm_t,
    pub rank: usize,
    pub world_size: usize,
    pub lib: &'a Arc<Library>,
    pub lane: TeardownLane,
}

/// A communicator's diagnostics without the `diag` feature: its settings only.
#[derive(Debug)]
pub(crate) struct CommDiag {
    settings: Settings,
    /// The unique id the communicator's family was born from, hashed: its teardown lane
    /// on the host provider.
    root: u64,
}

/// What `begin` hands to `end`: nothing.
#[derive(Debug)]
pub(crate) struct InFlight<'a>(std::marker::PhantomData<&'a ()>);

/// The tag of a shrink's child (unused without the watchdog's cliques).
pub(crate) fn shrink_tag(_exclude: &[std::ffi::c_int]) -> u64 {
    u64::MAX
}

impl CommDiag {
    pub(crate) fn for_id(config: &DiagConfig, id: &UniqueId) -> CommDiag {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        id.as_bytes().hash(&mut h);
        CommDiag {
            settings: Settings::resolve(config),
            root: h.finish(),
        }
    }

    pub(crate) fn for_init_all(key: u64) -> CommDiag {
        CommDiag {
            settings: Settings::resolve(&DiagConfig::default()),
            root: key,
        }
    }

    pub(crate) fn init_all_key() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn child(&self, _tag: u64) -> CommDiag {
        CommDiag {
            settings: self.settings.clone(),
            root: self.root,
        }
    }

    pub(crate) fn attach(
        &self,
        _raw: ncclComm_t,
        _rank: usize,
        _world: usize,
        _lib: &Arc<Library>,
        _lane: TeardownLane,
    ) {
    }

    #[inline(always)]
    pub(crate) fn check_alive(&self) -> Result<()> {
        Ok(())
    }

    #[inline(always)]
    pub(crate) fn failed(&self) -> bool {
        false
    }

    pub(crate) fn set_recovering(&self, _on: bool) {}

    pub(crate) fn revoked_by_watchdog(&self) -> bool {
        false
    }

    pub(crate) fn lost_rank(&self) -> Option<usize> {
        None
    }

    #[inline(always)]
    pub(crate) fn publish_group(&self) {}

    /// No clique is watched, so no departure is known.
    #[allow(dead_code)]
    pub(crate) fn peer_departed(&self) -> bool {
        false
    }

    /// The timeout of this communicator's operations (and of its init).
    pub(crate) fn timeout(&self) -> Duration {
        self.settings.timeout
    }

    pub(crate) fn pin(&self) -> Result<bool> {
        Ok(false)
    }

    pub(crate) fn unpin(&self) {}

    pub(crate) fn host_lane(&self) -> TeardownLane {
        TeardownLane::Host(self.root)
    }

    pub(crate) fn abort_timeout(&self) -> Duration {
        self.settings.abort_timeout
    }

    pub(crate) fn bound(&self) -> Bound {
        self.settings.bound()
    }

    /// Without the watchdog, nothing takes a handle from its owner.
    pub(crate) fn watchdog_abort(
        &self,
        _until: Instant,
    ) -> Option<(Duration, Option<nccl_sys::ncclResult_t>)> {
        None
    }

    pub(crate) fn arrive(&self, _rank: usize, _world_size: usize) {}

    pub(crate) fn group_timed_out(&self, what: String) -> crate::Error {
        crate::Error::Timeout {
            what,
            timeout: self.timeout(),
        }
    }

    pub(crate) fn wait_timeout_report(&self, call: &str, rank: usize, world_size: usize) -> String {
        format!("{call} on rank {rank} of {world_size} did not complete")
    }

    #[inline(always)]
    pub(crate) fn begin<'a>(
        &self,
        _h: CommView<'_>,
        _op: OpInfo<'a>,
        _caller: &'static Location<'static>,
    ) -> Result<InFlight<'a>> {
        Ok(InFlight(std::marker::PhantomData))
    }

    #[inline(always)]
    pub(crate) fn end(&self, _t: InFlight<'_>, r: Result<()>) -> Result<()> {
        r
    }

    pub(crate) fn drain(&self, _until: Instant) -> bool {
        true
    }

    pub(crate) fn before_teardown(&self) -> Result<()> {
        Ok(())
    }

    pub(crate) fn release(&self, _departing: Option<(&str, bool)>) -> bool {
        true
    }

    pub(crate) fn init_failed(&self, _rank: usize, _world_size: usize, _why: &str) {}

    #[cfg_attr(not(feature = "launch"), allow(dead_code))]
    pub(crate) fn leave(&self, _how: &str) {}
}
