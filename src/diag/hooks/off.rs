//! The hooks without the diagnostics (no `diag` feature): `on/`'s methods, each doing
//! nothing and answering what a communicator nobody watches answers (never failed, never
//! aborted by a watchdog, no rank known lost). Each returns at once, so the compiler
//! removes it from the wrapper's paths. Their docs are `on/`'s, stage by stage.

use std::panic::Location;
use std::time::{Duration, Instant};

use super::{CommDiag, CommView, InFlight};
use crate::diag::key::CliqueKey;
use crate::diag::op::OpInfo;
use crate::diag::settings::DiagConfig;
use crate::error::{Error, Result};
use crate::teardown::Bound;

/// Nothing: without the diagnostics a communicator keeps only its settings and key.
#[derive(Debug)]
pub(in crate::diag::hooks) struct Watched;

impl Watched {
    pub(in crate::diag::hooks) fn unattached() -> Watched {
        Watched
    }

    pub(in crate::diag::hooks) fn for_config(_: &DiagConfig) -> Watched {
        Watched
    }
}

/// Joining (`on/mod.rs`).
impl CommDiag {
    /// A child shares its parent's key: no clique is keyed without the diagnostics.
    pub(super) fn child_key(&self, _tag: u64) -> CliqueKey {
        self.key
    }

    pub(crate) fn attach(&self, _h: CommView<'_>) {}

    pub(crate) fn arrive(&self, _rank: usize, _world_size: usize) {}

    pub(crate) fn wait_timeout_report(&self, call: &str, rank: usize, world_size: usize) -> String {
        super::wait_timeout_plain(call, rank, world_size)
    }
}

/// An operation's path (`on/op.rs`).
impl CommDiag {
    #[inline]
    pub(crate) fn check_alive(&self) -> Result<()> {
        Ok(())
    }

    #[inline]
    pub(crate) fn failed(&self) -> bool {
        false
    }

    pub(crate) fn pin(&self) -> Result<bool> {
        Ok(false)
    }

    pub(crate) fn unpin(&self) {}

    #[inline(always)]
    pub(crate) fn begin<'a, 'c>(
        &self,
        _h: impl FnOnce() -> CommView<'c>,
        op: OpInfo<'a>,
        _caller: &'static Location<'static>,
    ) -> Result<InFlight<'a>> {
        Ok(InFlight {
            pos: 0,
            start: 0,
            stream: op.stream,
            grouped: false,
        })
    }

    #[inline(always)]
    pub(crate) fn end(&self, _t: InFlight<'_>, r: Result<()>) -> Result<()> {
        r
    }
}

/// A `Group`'s end (`on/group.rs`).
impl CommDiag {
    pub(crate) fn group_end_begins(&self) {}

    pub(crate) fn group_end_done(&self) {}

    pub(crate) fn publish_group(&self) {}

    pub(crate) fn group_end_failed(&self) {}

    #[cold]
    pub(crate) fn group_timed_out(&self, what: String) -> Error {
        self.group_timed_out_plain(what)
    }

    #[cold]
    pub(crate) fn group_failed(&self, _e: &Error) -> Option<Error> {
        None
    }

    #[cfg_attr(not(feature = "host"), allow(dead_code))]
    pub(crate) fn peer_departed(&self) -> bool {
        false
    }
}

/// The communicator's end (`on/teardown.rs`).
impl CommDiag {
    pub(crate) fn drain(&self, _limit: Instant) -> bool {
        true
    }

    pub(crate) fn before_teardown(&self) -> Result<()> {
        Ok(())
    }

    pub(crate) fn release(&self, _departing: Option<(&str, bool)>) -> bool {
        true
    }

    pub(crate) fn init_failed(&self, _rank: usize, _world_size: usize, _why: &str) {}

    pub(crate) fn leave(&self, _how: &str) {}

    pub(crate) fn aborted_by_watchdog(&self) -> bool {
        false
    }

    pub(crate) fn captured(&self) -> bool {
        false
    }

    pub(crate) fn bound(&self) -> Bound {
        self.settings.bound()
    }

    pub(crate) fn watchdog_abort(
        &self,
        _until: Instant,
    ) -> Option<(Duration, Option<nccl_sys::ncclResult_t>)> {
        None
    }
}

/// Revoke, shrink and grow (`on/family.rs`).
impl CommDiag {
    pub(crate) fn set_recovering(&self, _on: bool) {}

    pub(crate) fn revoked_in_place(&self) {}

    #[inline]
    pub(crate) fn set_job_linked(&self, _linked: bool) {}

    pub(crate) fn stream_behind(&self) -> Option<String> {
        None
    }

    /// `call` here: nothing runs it on a thread of its own.
    pub(crate) fn revoke_bounded(
        &self,
        call: impl FnOnce() -> nccl_sys::ncclResult_t,
    ) -> std::result::Result<Option<nccl_sys::ncclResult_t>, ()> {
        Ok(Some(call()))
    }

    pub(crate) fn revoke_refused(&self) {}

    pub(crate) fn note_unrevocable(&self) {}

    pub(crate) fn unrevocable(&self) -> bool {
        false
    }

    pub(crate) fn revoked_by_watchdog(&self) -> bool {
        false
    }

    pub(crate) fn lost_rank(&self) -> Option<usize> {
        None
    }

    pub(crate) fn lost_ranks(&self) -> Vec<usize> {
        Vec::new()
    }

    pub(crate) fn agree_lost_ranks(&self, _deadline: Instant) -> Vec<usize> {
        Vec::new()
    }

    pub(crate) fn agree_exclude(&self, _call: &'static str, _exclude: &[usize]) -> Result<()> {
        Ok(())
    }
}
