//! The hooks without the `diag` feature: nothing is recorded or watched, and every hook is
//! a no-op the compiler removes. What stays: the settings (the timeout still bounds init
//! and every wait for `ncclInProgress`), and aborts on their own bounded thread with the
//! guarded exit (`aborter`, `exit`).

use std::panic::Location;
use std::sync::Arc;
use std::time::Duration;

use nccl_sys::ncclComm_t;

use super::aborter;
use super::op::OpInfo;
use super::settings::{DiagConfig, Settings};
use crate::error::Result;
use crate::id::UniqueId;
use crate::library::Library;

/// What the hooks would need to attach a communicator (unused without the feature).
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)]
pub(crate) struct Handle<'a> {
    pub raw: ncclComm_t,
    pub rank: usize,
    pub world_size: usize,
    pub lib: &'a Arc<Library>,
}

/// A communicator's diagnostics without the `diag` feature: its settings only.
#[derive(Debug)]
pub(crate) struct CommDiag {
    settings: Settings,
}

/// What `begin` hands to `end`: nothing.
#[derive(Debug)]
pub(crate) struct Ticket<'a>(std::marker::PhantomData<&'a ()>);

impl CommDiag {
    pub(crate) fn for_id(config: &DiagConfig, _id: &UniqueId) -> CommDiag {
        CommDiag {
            settings: Settings::resolve(config),
        }
    }

    pub(crate) fn for_init_all(_key: u64) -> CommDiag {
        CommDiag {
            settings: Settings::resolve(&DiagConfig::default()),
        }
    }

    pub(crate) fn init_all_key() -> u64 {
        0
    }

    pub(crate) fn child(&self, _tag: u64) -> CommDiag {
        CommDiag {
            settings: self.settings.clone(),
        }
    }

    pub(crate) fn attach(
        &self,
        _raw: ncclComm_t,
        _rank: usize,
        _world: usize,
        _lib: &Arc<Library>,
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

    #[inline(always)]
    pub(crate) fn publish_group(&self) {}

    /// The timeout of this communicator's operations (and of its init).
    pub(crate) fn timeout(&self) -> Duration {
        self.settings.timeout
    }

    /// Aborts the handle `raw` (taken out of its communicator) on an abort thread and waits
    /// at most the abort bound: the bound, and `ncclCommAbort`'s result if it returned.
    pub(crate) fn abort_off_thread(
        &self,
        lib: &Arc<Library>,
        raw: ncclComm_t,
        what: String,
    ) -> (Duration, Option<nccl_sys::ncclResult_t>) {
        aborter::abort_bounded(&self.settings, lib, raw, what)
    }

    pub(crate) fn arrive(&self, _rank: usize, _world_size: usize) {}

    pub(crate) fn wait_timeout_report(&self, op: &str, rank: usize, world_size: usize) -> String {
        format!("{op} on rank {rank} of {world_size} did not complete")
    }

    #[inline(always)]
    pub(crate) fn begin<'a>(
        &self,
        _h: Handle<'_>,
        _op: OpInfo<'a>,
        _caller: &'static Location<'static>,
    ) -> Result<Ticket<'a>> {
        Ok(Ticket(std::marker::PhantomData))
    }

    #[inline(always)]
    pub(crate) fn end(&self, _t: Ticket<'_>, r: Result<()>) -> Result<()> {
        r
    }

    pub(crate) fn drain(&self) -> bool {
        true
    }

    pub(crate) fn before_teardown(&self) -> Result<()> {
        Ok(())
    }

    pub(crate) fn release(&self) -> bool {
        true
    }
}
