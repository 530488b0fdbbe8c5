//! A `Group`'s end (`src/group.rs`): its communicators pinned through the call, the
//! group's operations published or marked failed after it, and the error of an end that
//! failed or ran out of time.

use std::sync::atomic::Ordering;

use crate::diag::hooks::CommDiag;
use crate::diag::supervise::clique::TimeoutReport;
use crate::diag::supervise::record::OpState;
use crate::diag::supervise::shared::Shared;
use crate::error::Error;

impl CommDiag {
    /// A group's end begins with this communicator pinned: until
    /// [`group_end_done`](Self::group_end_done), the watchdog's notice looks at the
    /// group's operations (staged, not yet published) as at an operation inside its call.
    pub(crate) fn group_end_begins(&self) {
        if let Some(s) = self.attached() {
            s.group_ending.store(true, Ordering::Release);
        }
    }

    /// The group's end is over (launched, or failed).
    pub(crate) fn group_end_done(&self) {
        if let Some(s) = self.attached() {
            s.group_ending.store(false, Ordering::Release);
        }
    }

    /// After `ncclGroupEnd` enqueued a group's operations: they are now on their streams,
    /// published on every queue they used (marked first, with exact completion).
    /// On the host provider, whose group's end ran the work inside the call, the group's
    /// operations are marked completed.
    pub(crate) fn publish_group(&self) {
        if let Some(s) = self.attached() {
            let ran = s.host_queue.as_ref().map(|q| {
                let from = q.published.load(Ordering::Acquire);
                from..q.staged.load(Ordering::Acquire)
            });
            if self.watched.staged_evicted.replace(false) {
                // A queue with staged work left the owner's recent ones: all of them, under
                // the list's lock.
                s.publish_staged();
            } else {
                // Every queue with staged work is a recent one (or the host provider's):
                // no lock on the group's path.
                if let Some(q) = &s.host_queue {
                    s.publish_staged_on(q);
                }
                for q in self.watched.recent_queues.borrow().iter().flatten() {
                    s.publish_staged_on(q);
                }
            }
            if let Some(ran) = ran {
                finish_queued(s, ran, OpState::Completed);
            }
        }
    }

    /// A group's end failed (NCCL launched nothing of it, or its wait timed out or was
    /// broken): its operations still queued on this communicator are marked failed, so its
    /// flight record and reports never show them completed.
    pub(crate) fn group_end_failed(&self) {
        if let Some(s) = self.attached() {
            for q in s.queue_list().iter() {
                let from = q.published.load(Ordering::Acquire);
                finish_queued(s, from..q.staged.load(Ordering::Acquire), OpState::Failed);
            }
        }
    }

    /// A group's call ran out of time with its communicators pinned (so the watchdog could
    /// not time it out): the clique is timed out here as the watchdog would have (every rank
    /// fails fast with this report), and the caller gets the error.
    ///
    /// The report is the desync report of the group's first collective on this
    /// communicator, as the watchdog's for a single collective: it names the ranks behind
    /// (so [`lost_rank`](Self::lost_rank) names the one rank behind, for a shrink).
    #[cold]
    pub(crate) fn group_timed_out(&self, what: String) -> Error {
        if let Some(s) = self.attached() {
            let first = s.staged().into_iter().min_by_key(|r| (r.seq, r.enqueued));
            let report = match first {
                Some(rec) => s.time_out(&rec, &what, true),
                None => s.clique.set_timed_out(&TimeoutReport::text(&what)),
            };
            return s.timeout_error(&report.text);
        }
        self.group_timed_out_plain(what)
    }

    /// A group's end failed with `e`, not a timeout (its communicators were pinned through
    /// the call). NCCL's remote error (a peer's abort broke the clique while the group
    /// waited) after a rank left (here, or in a process that posted its departure to the
    /// board) fails the clique for that departure, as `end_error` does for a single call,
    /// so every rank, an idle one too, sees `is_failed()`: even if the departed rank issued
    /// the group's collectives, a communicator that returned NCCL's remote error can run no
    /// collective any more. The caller keeps its error.
    ///
    /// When the clique had already timed out (another rank's group or operation timed out,
    /// and its abort or revoke failed this group), returns the error the crate gives for
    /// such a peer timeout ([`Error::Timeout`] with the first report), as for a single
    /// call, in place of NCCL's remote error.
    #[cold]
    pub(crate) fn group_failed(&self, e: &Error) -> Option<Error> {
        let s = self.attached()?;
        if let Some(first) = s.clique.timed_out() {
            if e.code() == Some(crate::error::ResultCode::Timeout) {
                return None;
            }
            let rec = s.staged().into_iter().min_by_key(|r| (r.seq, r.enqueued))?;
            return Some(s.peer_timeout(&rec, &first));
        }
        if e.code() != Some(crate::error::ResultCode::RemoteError) {
            return None;
        }
        let c = &s.clique;
        let d = (c.departed_other_than(s.rank))
            .or_else(|| c.remote_departure(s.rank))
            .cloned()?;
        // The group's first operation on this communicator, still staged (the failed
        // end published nothing), for the report.
        let rec = s.staged().into_iter().next();
        c.fail_for_departure(&d, Some(s.rank), rec.as_ref());
        None
    }

    /// Polled during a host-provider group's end (run inside the call, its communicators
    /// pinned, so the watchdog cannot abort them): `true` once an operation of the group
    /// (staged on a queue, not yet published) needs a rank that left, the clique failed
    /// for that departure, once, naming the rank. Reads only the diagnostics' own state
    /// (never the provider's), so a provider's wait may poll it.
    #[cfg_attr(not(feature = "host"), allow(dead_code))]
    pub(crate) fn peer_departed(&self) -> bool {
        if let Some(s) = self.attached().filter(|s| s.clique.has_departure()) {
            if s.clique.any_timeout() {
                return true;
            }
            for rec in s.staged() {
                if let Some(d) = s.clique.waits_for_departed(s.rank, &rec) {
                    let d = d.clone();
                    s.clique.fail_for_departure(&d, Some(s.rank), Some(&rec));
                    return true;
                }
            }
        }
        false
    }
}

/// Marks the operations at journal positions `range` that are still enqueued (a group's,
/// whose end decided their fate) `state`, with the time since they were issued: one read
/// of the diagnostics clock for the whole group (coarse by default, as a single
/// operation's), none of the system clock.
#[inline]
fn finish_queued(s: &Shared, range: std::ops::Range<u64>, state: OpState) {
    if range.is_empty() {
        return;
    }
    let now = s.now();
    for pos in range {
        s.journal.finish_enqueued(pos, state, now);
    }
}
