//! An operation's path (`Communicator::issue`): the check before it, its begin and end,
//! and the pin of a call on the handle that is not an operation.

use std::panic::Location;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{bump, RECENT_QUEUES};
use crate::diag::hooks::{CommDiag, CommView, InFlight};
use crate::diag::observe::fingerprint::{self, Agreement};
use crate::diag::observe::flight;
use crate::diag::op::OpInfo;
use crate::diag::supervise::claim::UNCLAIMED;
use crate::diag::supervise::clique::TimeoutReport;
use crate::diag::supervise::fence;
use crate::diag::supervise::journal::Entry;
use crate::diag::supervise::record::{OpRecord, OpState};
use crate::diag::supervise::shared::{QueueWatch, Shared, IDLE, PINNED};
use crate::diag::supervise::tracker::Queue;
use crate::error::{Error, Result};
use crate::stream::StreamRef;
#[cfg(feature = "host")]
use {crate::library::Provider, nccl_sys::ncclComm_t};

impl CommDiag {
    /// Fails when the watchdog aborted this communicator (its handle is gone).
    #[inline]
    pub(crate) fn check_alive(&self) -> Result<()> {
        if let Some(s) = self.attached() {
            if s.aborted_by_watchdog.load(Ordering::Acquire)
                || (s.clique.any_timeout() && !self.watched.recovering.get())
            {
                return Err(self.aborted_error(s));
            }
        }
        Ok(())
    }

    /// Whether the watchdog failed this communicator: its clique timed out (set before any
    /// abort starts) or it was aborted. Two loads; no NCCL call.
    #[inline]
    pub(crate) fn failed(&self) -> bool {
        if let Some(s) = self.attached() {
            return s.clique.any_timeout() || s.aborted_by_watchdog.load(Ordering::Acquire);
        }
        false
    }

    /// Claims the handle for an NCCL call that is not an operation (a poll, a
    /// registration, a destroy, a group's end): the watchdog never aborts it until
    /// [`unpin`](Self::unpin). `Ok(false)` when nothing was pinned here (not attached yet,
    /// or already pinned); an error when the watchdog aborts it.
    ///
    /// Inside an operation it pins too: `wait_ready`'s polls of an operation that left
    /// NCCL asynchronous work are calls of their own, and an old operation may be claimed
    /// between two of them, so each poll stands in for the operation (and `unpin` gives it
    /// back). Without that, a poll past its `check_alive` reached an aborted handle
    /// (`tests/claim_model.rs`, `mutant_pin_inside_an_operation_pins_nothing_is_caught`).
    pub(crate) fn pin(&self) -> Result<bool> {
        if let Some(s) = self.attached() {
            if s.aborted_by_watchdog.load(Ordering::Acquire) {
                return Err(self.aborted_error(s));
            }
            let cur = s.current.load(Ordering::Relaxed);
            if cur == PINNED {
                return Ok(false);
            }
            s.current.store(PINNED, Ordering::Release);
            fence::light(s.asym);
            if s.claim.load(Ordering::Acquire) != UNCLAIMED && !s.await_decision() {
                s.current.store(cur, Ordering::Release);
                return Err(self.aborted_error(s));
            }
            self.watched.pinned_from.set(cur);
            return Ok(true);
        }
        Ok(false)
    }

    /// Ends a [`pin`](Self::pin) that returned `Ok(true)`: `current` is again what it was
    /// (idle, or the operation the pin stood in for).
    pub(crate) fn unpin(&self) {
        if let Some(s) = self.attached() {
            if s.current.load(Ordering::Relaxed) == PINNED {
                s.current
                    .store(self.watched.pinned_from.replace(IDLE), Ordering::Release);
            }
        }
    }

    /// A stream not among the recent ones: noted in the shared list, cached here.
    #[cold]
    #[inline(never)]
    fn note_stream(&self, s: &Shared, stream: &Arc<cudarc::driver::CudaStream>) -> Arc<QueueWatch> {
        let q = s.note_queue(Queue::Cuda(Arc::clone(stream)));
        let mut recent = self.watched.recent_queues.borrow_mut();
        if let Some(old) = recent[RECENT_QUEUES - 1].take() {
            // Leaving the cache: the events its retired ranges kept are spare again (else
            // every stream used once would keep them).
            s.reclaim_parked(&old);
            // Work staged on it and not yet published (a group's, being ended) is
            // published by the walk over every queue, not over the recent ones.
            if old.staged.load(Ordering::Acquire) > old.published.load(Ordering::Acquire) {
                self.watched.staged_evicted.set(true);
            }
        }
        recent.rotate_right(1);
        recent[0] = Some(Arc::clone(&q));
        q
    }

    /// The watch of `stream`'s queue: one of the recent ones, or noted now.
    #[inline(always)]
    fn publish_on(
        &self,
        s: &Shared,
        stream: &Arc<cudarc::driver::CudaStream>,
        upto: u64,
        grouped: bool,
    ) {
        let key = stream.cu_stream() as usize;
        {
            let recent = self.watched.recent_queues.borrow();
            if let Some(q) = recent.iter().flatten().find(|q| q.key == key) {
                mark_then_publish(s, q, upto, grouped);
                return;
            }
        }
        let q = self.note_stream(s, stream);
        mark_then_publish(s, &q, upto, grouped);
    }

    /// Before the NCCL call of `op`: fails when the watchdog aborted the communicator,
    /// records the operation, runs the fingerprint check (when on) and registers it with
    /// the watchdog. No lock and no allocation unless it fails.
    #[inline(always)]
    pub(crate) fn begin<'a, 'c>(
        &self,
        h: impl FnOnce() -> CommView<'c>,
        op: OpInfo<'a>,
        caller: &'static Location<'static>,
    ) -> Result<InFlight<'a>> {
        // The view only attaches a communicator met for the first time: not built per call.
        let s = match self.attached() {
            Some(s) => s,
            None => self.attach_late(h()),
        };
        if s.aborted_by_watchdog.load(Ordering::Acquire) {
            return Err(self.aborted_error(s));
        }
        let seq = if op.collective {
            bump(&s.seq, 1)
        } else {
            s.seq.load(Ordering::Relaxed)
        };
        let start = s.now();
        let pos = s.journal.push(&Entry {
            seq,
            name: op.name,
            dtype: op.dtype,
            count: op.count,
            root: op.root.map(|r| r as usize),
            caller,
            enqueued: start,
            queue: match op.stream {
                StreamRef::Cuda(stream) => stream.cu_stream() as usize,
                StreamRef::Host => s.host_queue.as_ref().map_or(0, |q| q.key),
            },
        });
        if s.clique.any_timeout() && !self.watched.recovering.get() {
            return Err(self.begin_timed_out(s, pos, start));
        }
        if s.settings.check && op.collective && !op.grouped {
            self.fingerprint(s, pos, start)?;
        }
        // Inside an open group the communicator is pinned (claimed) until the group ends.
        if s.current.load(Ordering::Relaxed) != PINNED {
            s.current.store(pos + 1, Ordering::Release);
            fence::light(s.asym);
            if s.claim.load(Ordering::Acquire) != UNCLAIMED {
                self.begin_claimed(s, pos, start)?;
            }
        }
        Ok(InFlight {
            pos,
            start,
            stream: op.stream,
            grouped: op.grouped,
        })
    }

    /// The clique timed out before this operation reached NCCL.
    #[cold]
    fn begin_timed_out(&self, s: &Shared, pos: u64, start: u64) -> Error {
        let first = s
            .timed_out()
            .unwrap_or_else(|| TimeoutReport::text("a timeout"));
        let rec = s.journal.get(pos);
        let e = match &rec {
            Some(r) => s.peer_timeout(r, &first),
            None => s.timeout_error(&first),
        };
        self.fail(s, pos, start, e)
    }

    /// The watchdog claimed this communicator as the operation began: waits for its
    /// decision. `Ok` when it let the communicator be.
    #[cold]
    fn begin_claimed(&self, s: &Shared, pos: u64, start: u64) -> Result<()> {
        if s.await_decision() {
            return Ok(());
        }
        s.current.store(IDLE, Ordering::Release);
        let e = self.aborted_error(s);
        Err(self.fail(s, pos, start, e))
    }

    /// The opt-in fingerprint check: waits for every rank of the clique in this process to
    /// post the same collective.
    #[inline(never)]
    fn fingerprint(&self, s: &Shared, pos: u64, start: u64) -> Result<()> {
        let Some(rec) = s.journal.get(pos) else {
            return Ok(());
        };
        bump(&s.checks, 1);
        let deadline = rec.enqueued + s.settings.timeout;
        let e = match fingerprint::agree(&s.clique, s.rank, rec, deadline) {
            Agreement::Agree => return Ok(()),
            Agreement::Mismatch(table) => Error::CollectiveMismatch {
                call: rec.op.name(),
                rank: s.rank,
                seq: rec.seq,
                table,
            },
            Agreement::TimedOut(Some(first)) => s.peer_timeout(&rec, &first),
            Agreement::TimedOut(None) => {
                let what = "waited for the other ranks in the fingerprint check";
                s.timeout_error(&s.time_out(&rec, what, true))
            }
        };
        Err(self.fail(s, pos, start, e))
    }

    /// Marks the operation and the communicator failed, dumps the record, returns `e`.
    #[cold]
    fn fail(&self, s: &Shared, pos: u64, start: u64, e: Error) -> Error {
        let took = s.now().saturating_sub(start);
        s.journal.finish(pos, OpState::Failed, took);
        bump(&s.wait_ns, took);
        flight::dump(s);
        e
    }

    /// After the NCCL call: deregisters the operation from the watchdog (CUDA: hands it
    /// over as an event), records its outcome and time, and turns an error caused by a
    /// watchdog abort into [`Error::Timeout`] with the report.
    #[inline(always)]
    pub(crate) fn end(&self, t: InFlight<'_>, r: Result<()>) -> Result<()> {
        if let Some(s) = self.watched.shared.get() {
            let now = s.now();
            // Leaving the call needs no fence: a claim made meanwhile is seen by the next
            // operation's check (and teardown takes the handle with a swap). A pinned
            // communicator (an open group) stays pinned.
            if s.current.load(Ordering::Relaxed) != PINNED {
                s.current.store(IDLE, Ordering::Release);
            }
            let took = now.saturating_sub(t.start);
            // Hand the work to the watchdog, on its own queue: plain stores, no call into CUDA.
            let state = match (&r, t.stream) {
                (Err(_), _) => OpState::Failed,
                (Ok(()), StreamRef::Cuda(stream)) => {
                    self.publish_on(s, stream, t.pos + 1, t.grouped);
                    OpState::Enqueued
                }
                (Ok(()), StreamRef::Host) => {
                    if let Some(q) = &s.host_queue {
                        publish(q, t.pos + 1, t.grouped);
                    }
                    // Inside an open group the operation is only queued: the group's end
                    // runs it, and marks it (`publish_group`, `group_end_failed`).
                    if t.grouped {
                        OpState::Enqueued
                    } else {
                        OpState::Completed
                    }
                }
            };
            // The record was pushed enqueued, and an enqueued record shows no time taken:
            // only a state that changed is written (a CUDA operation's, or a grouped one's,
            // is not: no seqlock write on their path).
            if state != OpState::Enqueued {
                s.journal.finish(t.pos, state, took);
            }
            if took != 0 {
                bump(&s.wait_ns, took);
            }
            return r.map_err(|e| self.end_error(s, t.pos, e));
        }
        r
    }

    #[cold]
    fn end_error(&self, s: &Shared, pos: u64, e: Error) -> Error {
        let e = match s.journal.get(pos) {
            Some(rec) => explain(s, &rec, e),
            None => e,
        };
        flight::dump(s);
        e
    }
}

/// The error of `rec`, this rank's operation that NCCL failed with `e`: the watchdog's
/// report when it aborted the communicator or its clique timed out, else `e`, having failed
/// the clique for a departure the failure shows.
#[cold]
fn explain(s: &Shared, rec: &OpRecord, e: Error) -> Error {
    if s.aborted_by_watchdog.load(Ordering::Acquire) {
        let r = s.abort_report();
        if r.is_about(s.rank, rec.op, rec.seq) {
            return s.timeout_error(&r);
        }
        return s.peer_timeout(rec, &r);
    }
    if let Some(first) = s.clique.timed_out() {
        return s.peer_timeout(rec, &first);
    }
    // A collective that a departed rank never issued failed at once (a provider that breaks
    // the clique with a peer's abort, as the host provider does): no collective of the
    // clique can complete any more, as when the departure finds a rank already waiting.
    // Fail the clique so that every rank sees it (`is_failed()`); the caller keeps the
    // provider's own error. The same for a call the departed rank did issue that NCCL
    // failed with its remote error (a peer's abort, say, while this rank's part of it was
    // still in flight): a communicator that returned an error can run no collective any
    // more.
    let remote = e.code() == Some(crate::error::ResultCode::RemoteError);
    let departed = s.clique.waits_for_departed(s.rank, rec).or_else(|| {
        remote
            .then(|| s.clique.departed_other_than(s.rank))
            .flatten()
    });
    if let Some(d) = departed {
        s.clique.fail_for_departure(d, Some(s.rank), Some(rec));
        return e;
    }
    if !remote {
        return e;
    }
    let died = died_rank(s);
    // A peer's remote error with no departure known here: a rank of another process that
    // left (say, it panicked) posted why to the job's desync board before its teardown woke
    // this rank. Then the error names it and how it left, as for a rank of this process.
    if let Some(d) = s.clique.remote_departure(s.rank) {
        let first = s.clique.fail_for_departure(d, Some(s.rank), Some(rec));
        return s.peer_timeout(rec, &first);
    }
    // No departure on the board, but the provider names a rank whose process is gone (a
    // SIGKILLed process posts nothing): that rank is the clique's departure, so that every
    // survivor knows which rank it lost (`lost_rank()`); the provider's words stand.
    if let Some((r, how)) = died {
        let d = s.clique.depart_elsewhere(r, rec.seq, how);
        s.clique.fail_for_departure(d, Some(s.rank), Some(rec));
        return e;
    }
    // No departure on the board either, but ranks of other processes posted that they wait
    // in this collective: one of them aborted the clique, its watchdog timed out (say) a
    // moment before this rank's would have. The board tells whom they waited for: this
    // rank's report names the rank behind, as theirs do, rather than "rank N called
    // ncclCommAbort". (With no such post, the provider's error stands: "rank N died", say.)
    if s.clique.remote_waiting(rec.seq) {
        let first = s.time_out(rec, "failed with a peer's remote error", false);
        return s.peer_timeout(rec, &first);
    }
    e
}

/// The rank whose process the host provider saw gone while this communicator's clique
/// waited for it (a SIGKILLed process posts nothing on the desync board), and how it left.
/// NVIDIA's NCCL names no rank in its remote errors: `None` there, and for a handle the
/// watchdog already took.
fn died_rank(s: &Shared) -> Option<(usize, String)> {
    #[cfg(feature = "host")]
    if s.lib.provider() == Provider::Host {
        let raw = s.handle.load(Ordering::Acquire) as ncclComm_t;
        let (rank, pid) = (!raw.is_null())
            .then(|| crate::host::dead_peer(raw))
            .flatten()?;
        return (rank < s.world_size && rank != s.rank).then(|| {
            let how = format!("its process (pid {pid}) is gone (it died or was killed)");
            (rank, how)
        });
    }
    #[cfg(not(feature = "host"))]
    let _ = s;
    None
}

/// [`publish`] of a CUDA operation's work: marked first, at enqueue, when completion is
/// exact and no group is open (a group's work is marked when it ends).
#[inline(always)]
fn mark_then_publish(s: &Shared, q: &QueueWatch, upto: u64, grouped: bool) {
    if s.settings.exact && !grouped {
        s.mark_at_enqueue(q, upto);
    }
    publish(q, upto, grouped);
}

/// Publishes an operation's work on its queue (staged until the end of an open group).
#[inline(always)]
fn publish(q: &QueueWatch, upto: u64, grouped: bool) {
    if grouped {
        q.staged.store(upto, Ordering::Release);
    } else {
        q.published.store(upto, Ordering::Release);
    }
}
