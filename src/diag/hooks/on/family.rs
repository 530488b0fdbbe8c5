//! Revoke, shrink and grow (`comm/elastic.rs`, `comm/family.rs`, and the group job's
//! link that decides whether a revoke is sound): who revoked the handle, which ranks were
//! lost, whether the ranks that stay agree on them, and what a failed wait waited for.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::diag::hooks::CommDiag;
use crate::diag::supervise::clique::ExcludeAgreement;
use crate::diag::supervise::shared::Shared;
use crate::error::{Error, Result};
#[cfg(feature = "host")]
use {crate::library::Provider, nccl_sys::ncclComm_t};

impl CommDiag {
    /// While `on`: a failed clique no longer fails this communicator's checks and calls,
    /// only a handle the watchdog took does (for `shrink_after_failure`, which runs on a
    /// communicator whose clique failed).
    pub(crate) fn set_recovering(&self, on: bool) {
        self.watched.recovering.set(on);
    }

    /// The owner revoked the handle where it is ([`Communicator::revoke`](crate::Communicator::revoke), or a failed wait
    /// of an elastic communicator): the watchdog leaves it be, as after a revoke of its own (NCCL would
    /// refuse the watchdog's second revoke, init.cc:2655-2657 of v2.29.7-1, and it would
    /// abort instead, taking the handle a shrink needs).
    pub(crate) fn revoked_in_place(&self) {
        if let Some(s) = self.attached() {
            s.revoked_by_watchdog.store(true, Ordering::Release);
        }
    }

    /// Notes whether an NCCL group job may be linked to the communicator
    /// (`Communicator::set_job_linked`): the watchdog then aborts it rather than revoke it.
    #[inline]
    pub(crate) fn set_job_linked(&self, linked: bool) {
        if let Some(s) = self.attached() {
            s.job_linked.store(linked, Ordering::Release);
        }
    }

    /// The stream whose tracked work is the oldest not known complete, and that work, in
    /// words (`None`: all of it is complete, or nothing is tracked without `diag`).
    pub(crate) fn stream_behind(&self) -> Option<String> {
        let s = self.attached()?;
        let (key, rec) = s.stream_behind()?;
        let what = if s.host_queue.as_ref().is_some_and(|q| q.key == key) {
            format!("the host communicator's queue ({key:#x})")
        } else {
            format!("stream {key:#x}")
        };
        Some(format!(
            "{what}: the work up to {} (seq {}, called at {})",
            rec.signature(),
            rec.seq,
            rec.caller
        ))
    }

    /// Runs the owner's `ncclCommRevoke` on a thread of its own, waiting at most the abort
    /// bound ([`Shared::revoke_for_owner`]); without the diagnostics, `call` here.
    /// `Err(())`: the revoke still runs past the bound (the owner must not call NCCL on
    /// the handle again; its teardown hands it over). `Ok(None)`: not called.
    pub(crate) fn revoke_bounded(
        &self,
        call: impl FnOnce() -> nccl_sys::ncclResult_t,
    ) -> std::result::Result<Option<nccl_sys::ncclResult_t>, ()> {
        if let Some(s) = self.attached() {
            return s.revoke_for_owner(self.abort_timeout());
        }
        Ok(Some(call()))
    }

    /// The owner's revoke, marked by [`revoked_in_place`](Self::revoked_in_place), was
    /// refused by NCCL (nothing changed): the handle is the watchdog's to act on again.
    pub(crate) fn revoke_refused(&self) {
        if let Some(s) = self.attached() {
            s.revoked_by_watchdog.store(false, Ordering::Release);
        }
    }

    /// The owner found the handle unsound to revoke (a group job linked) and aborts it
    /// instead: noted where the watchdog notes its own finding, so that every error built
    /// from the diagnostics afterwards (the watchdog's report included, which replaces the
    /// owner's error when the watchdog marked the handle aborted too) says so.
    pub(crate) fn note_unrevocable(&self) {
        if let Some(s) = self.attached() {
            s.unrevocable.store(true, Ordering::Release);
        }
    }

    /// Whether the handle was found unsound to revoke (a group job linked), by the
    /// watchdog or its owner, and aborted instead: it cannot be shrunk.
    pub(crate) fn unrevocable(&self) -> bool {
        if let Some(s) = self.attached() {
            return s.unrevocable.load(Ordering::Acquire);
        }
        false
    }

    /// Whether the watchdog revoked the handle in place (`Config::elastic`).
    pub(crate) fn revoked_by_watchdog(&self) -> bool {
        if let Some(s) = self.attached() {
            return s.revoked_by_watchdog.load(Ordering::Acquire);
        }
        false
    }

    /// The rank whose departure failed this communicator's clique, else the first rank
    /// of the clique that left (other than this one), if any.
    pub(crate) fn lost_rank(&self) -> Option<usize> {
        let s = self.attached()?;
        s.clique
            .timed_out()
            .and_then(|r| r.left.or(r.behind))
            .filter(|&r| r != s.rank)
            .or_else(|| s.clique.departed_other_than(s.rank).map(|d| d.rank))
    }

    /// Every rank of this communicator's clique known gone, other than this one, sorted:
    /// [`lost_rank`](Self::lost_rank), every rank of this process whose communicator of the
    /// clique was torn down, every rank of another process that posted its departure on
    /// the job's desync board (read once, bounded), and every rank the host provider saw
    /// gone (its process died, or it tore its communicator down).
    pub(crate) fn lost_ranks(&self) -> Vec<usize> {
        let Some(s) = self.attached() else {
            return Vec::new();
        };
        let mut v: Vec<usize> = self.lost_rank().into_iter().collect();
        v.extend(s.clique.torn_down());
        v.extend(s.clique.departed_on_board());
        v.extend(dead_ranks(s));
        v.retain(|&r| r != s.rank && r < s.world_size);
        v.sort_unstable();
        v.dedup();
        v
    }

    /// [`lost_ranks`](Self::lost_ranks), agreed with the ranks of this process that
    /// recover too (`Clique::agree_lost`), waiting for them until `deadline` at most.
    pub(crate) fn agree_lost_ranks(&self, deadline: Instant) -> Vec<usize> {
        let Some(s) = self.attached() else {
            return Vec::new();
        };
        let mut v = s.clique.agree_lost(s.rank, || self.lost_ranks(), deadline);
        v.retain(|&r| r < s.world_size);
        v
    }

    /// Before the NCCL call of a shrink (`call`) excluding `exclude` (checked, unsorted):
    /// `Ok` when every other rank of this process that stays by this list shrinks with the
    /// same list (`Clique::agree_exclude`, waiting until the timeout at most);
    /// [`Error::ExcludeMismatch`] naming each rank's list when two ranks disagree (NCCL
    /// does not compare them and its shrink would wait until a timeout); a timeout naming
    /// the ranks that never called their shrink. Then, with a desync board, with the ranks
    /// of other processes it keeps (`Clique::agree_exclude_remote`: a mismatch fails the
    /// same way; a board that cannot be read, or a rank that posts nothing within 2 s,
    /// leaves it to NCCL). Nothing to compare without the `diag` feature.
    pub(crate) fn agree_exclude(&self, call: &'static str, exclude: &[usize]) -> Result<()> {
        let Some(s) = self.attached() else {
            return Ok(());
        };
        let mut list = exclude.to_vec();
        list.sort_unstable();
        let deadline = Instant::now() + s.settings.timeout;
        let here = s.clique.agree_exclude(s.rank, &list, deadline);
        let agreed = match here {
            // Then with the ranks of other processes, through the desync board.
            ExcludeAgreement::Agree => s.clique.agree_exclude_remote(s.rank, &list, deadline),
            other => other,
        };
        match agreed {
            ExcludeAgreement::Agree => Ok(()),
            ExcludeAgreement::Mismatch(lists) => Err(Error::ExcludeMismatch {
                call,
                rank: s.rank,
                lists,
            }),
            ExcludeAgreement::Missing(ranks) => Err(Error::Timeout {
                what: format!("{call} on rank {}: {} of this process, staying by this rank's exclude list {list:?}, never called the shrink (stuck, or not told to recover); nothing was called, the communicator is as it was", s.rank, (ranks.iter().map(|r| format!("rank {r}"))).collect::<Vec<_>>().join(", ")),
                timeout: s.settings.timeout,
            }),
        }
    }
}

/// Every rank of this communicator's clique that the host provider knows gone (across
/// processes: a process that died, a communicator torn down). Empty for NVIDIA's NCCL,
/// which names no rank, and for a handle the watchdog already took.
fn dead_ranks(s: &Shared) -> Vec<usize> {
    #[cfg(feature = "host")]
    if s.lib.provider() == Provider::Host {
        let raw = s.handle.load(Ordering::Acquire) as ncclComm_t;
        if raw.is_null() {
            return Vec::new();
        }
        return crate::host::dead_peers(raw)
            .into_iter()
            .map(|(r, _)| r)
            .collect();
    }
    #[cfg(not(feature = "host"))]
    let _ = s;
    Vec::new()
}
