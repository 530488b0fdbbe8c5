//! The communicator's end (`comm/teardown.rs`, and the wrapper's ends of a rank: its init
//! failed, its launcher closure returned): the drain before a destroy, the handle's
//! release, the rank's departure from its clique, the watchdog's own abort, and the
//! teardown's bound.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::diag::hooks::CommDiag;
use crate::diag::observe;
use crate::diag::supervise::clique::{self, LiveRank, RankView, TimeoutReport};
use crate::diag::supervise::clock;
use crate::diag::supervise::shared::{QueueWatch, IDLE};
use crate::error::Result;
use crate::teardown::{self, lock, Bound, Task};

impl CommDiag {
    /// Before teardown: the owner's wait for its own work, until `limit`, an abort, or a
    /// timeout of the clique. On each queue with work in flight (only those: another
    /// stream's backlog is not this communicator's) it marks what is not marked yet
    /// (nothing, with exact completion) and polls the markers; a queue capturing into a
    /// graph is not waited for. `false` when the communicator must be aborted rather than
    /// destroyed (its work did not complete, a driver error, its clique timed out, or the
    /// watchdog took it).
    pub(crate) fn drain(&self, limit: Instant) -> bool {
        if let Some(s) = self.attached() {
            if s.current.load(Ordering::Acquire) != IDLE {
                return false; // left inside a call (an unwinding panic): abort
            }
            let busy: Vec<(Arc<QueueWatch>, u64)> = (s.queue_list().iter())
                .filter(|q| q.in_flight())
                .map(|q| (Arc::clone(q), q.published.load(Ordering::Acquire)))
                .collect();
            loop {
                let mut all = true;
                for (q, upto) in &busy {
                    s.track_queue(q);
                    let capturing = q.watch().capturing;
                    all &= capturing || q.retired.load(Ordering::Acquire) >= *upto;
                }
                let failed = s.cuda_fault.get().is_some()
                    || s.aborted_by_watchdog.load(Ordering::Acquire)
                    || s.clique.any_timeout();
                if all || failed || Instant::now() >= limit {
                    return all && !failed;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        true
    }

    /// Before `destroy`: drains, and refuses (marking the communicator failed, so dropping
    /// it aborts) when its clique timed out.
    pub(crate) fn before_teardown(&self) -> Result<()> {
        if let Some(s) = self.attached() {
            let limit =
                Instant::now() + self.settings.timeout + clock::TICK + Duration::from_secs(1);
            if self.drain(limit) {
                return Ok(());
            }
            let first = s
                .timed_out()
                .unwrap_or_else(|| TimeoutReport::text("work did not complete"));
            return Err(s.timeout_error(&format!(
                "ncclCommDestroy on rank {}: refused (drop the communicator to abort it) because its clique timed out:\n{first}\n=> the communicator's work",
                s.rank
            )));
        }
        Ok(())
    }

    /// Takes the right to tear the handle down: `false` when the watchdog already aborted
    /// it (then nobody may use it again).
    ///
    /// `departing`: how the rank leaves its clique (a teardown; `None` for `into_raw`), so
    /// peers that wait for a collective it never issued fail at once, and whether by an
    /// abort (then the clique fails at once: no collective of it can complete again).
    pub(crate) fn release(&self, departing: Option<(&str, bool)>) -> bool {
        if let Some(s) = self.attached() {
            // Under `in_place`: a watchdog's revoke in place never meets a handle taken here.
            // A revoke that blocks in NCCL holds it: waited for at most the abort bound,
            // then the handle is the watchdog's worker's to abort once the revoke returns
            // (`Shared::lock_in_place`), and `abort()` waits for that as for any it took.
            let mine = match s.lock_in_place(self.settings.abort_timeout) {
                Some(held) => {
                    s.gone.store(true, Ordering::Release);
                    let mine = s.handle.swap(0, Ordering::AcqRel) != 0;
                    drop(held);
                    mine
                }
                None => false,
            };
            let view = s.view();
            s.clique.detach(s.rank, view);
            if let Some((how, broken)) = departing {
                s.clique
                    .depart(s.rank, view, s.recent_collectives(), how, broken);
            }
            return mine;
        }
        true
    }

    /// The communicator's init failed (`why`): this rank never joins its clique, so no
    /// collective of it can complete, and the clique fails at once (every rank's
    /// `is_failed()`), as for a rank that left by a panic. Its drop then aborts it.
    pub(crate) fn init_failed(&self, rank: usize, world_size: usize, why: &str) {
        // Not attached yet (that follows a complete init): the clique of the ranks whose
        // init completed, found by its key.
        let clique = match self.attached() {
            Some(s) => Arc::clone(&s.clique),
            None => clique::join(self.key, world_size.max(1), &observe::OBSERVERS),
        };
        let how = format!("its init failed ({why})");
        clique.depart(rank, RankView::default(), Vec::new(), &how, true);
    }

    /// The rank's code is done with its communicator (its launcher closure returned): a
    /// peer that waits for a collective it never issued fails at once, naming it.
    pub(crate) fn leave(&self, how: &str) {
        if let Some(s) = self.attached() {
            s.clique
                .depart(s.rank, s.view(), s.recent_collectives(), how, false);
        }
    }

    /// Whether the watchdog aborted the handle (it took it: only its abort tears it down).
    pub(crate) fn aborted_by_watchdog(&self) -> bool {
        if let Some(s) = self.attached() {
            return s.aborted_by_watchdog.load(Ordering::Acquire);
        }
        false
    }

    /// Whether work of this communicator was seen captured into a CUDA graph (a capturing
    /// stream, or a marker that read back as a captured event: `Shared::captured`). One
    /// load; no driver call.
    pub(crate) fn captured(&self) -> bool {
        if let Some(s) = self.attached() {
            return s.captured.load(Ordering::Relaxed);
        }
        false
    }

    /// The bound and the policy past it (extended for the other ranks of its clique in
    /// this process, with NVIDIA's NCCL: see `Shared::teardown_bound`).
    pub(crate) fn bound(&self) -> Bound {
        if let Some(s) = self.attached() {
            return s.teardown_bound();
        }
        self.settings.bound()
    }

    /// When the watchdog took this communicator's handle: waits until `until` for its
    /// abort. `None` when the watchdog did not take it; `Some(None)` when its abort is
    /// still running at `until`.
    pub(crate) fn watchdog_abort(
        &self,
        until: Instant,
    ) -> Option<(Duration, Option<nccl_sys::ncclResult_t>)> {
        let s = (self.attached()).filter(|s| s.aborted_by_watchdog.load(Ordering::Acquire))?;
        // The watchdog queues the job right after it takes the handle.
        let job: Arc<Task> = loop {
            let job = lock(&s.abort_task).clone();
            match job {
                Some(j) => break j,
                None if Instant::now() >= until => {
                    return Some((self.settings.abort_timeout, None));
                }
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        };
        let done = job.wait(until.max(Instant::now() + teardown::MIN_WAIT));
        Some((job.bound, done.then(|| job.result())))
    }
}
