//! Elastic communicators: [`Communicator::revoke`] (NCCL 2.29), the shrink of a failed
//! communicator ([`Communicator::shrink_after_failure`], `NCCL_SHRINK_ABORT`, 2.27), and
//! growth ([`Communicator::grow_id`], [`Communicator::grow`] and
//! [`Communicator::join_grown`], 2.29).
//!
//! What NCCL does in each call, read from its source (`src/init.cc` at tag `v2.29.7-1`), is
//! in ARCHITECTURE.md's table ("NCCL's asynchronous contract"); each method below cites the
//! lines its own behaviour rests on.

use std::ffi::c_int;

use super::*;
use nccl_sys::EntryPoint;

/// What a revoked communicator says to every later operation.
const REVOKED: &str = "it was revoked (ncclCommRevoke): its work in flight was stopped and its operations are refused; shrink it with shrink_after_failure, or drop it";

impl Communicator {
    /// Stops this rank's work in flight on this communicator and refuses its later
    /// operations (`ncclCommRevoke`, NCCL 2.29+); local to this rank.
    ///
    /// Waits (bounded by the communicator's timeout) until NCCL says the communicator is
    /// quiescent. Afterwards every operation fails with [`Error::CommunicatorFailed`]
    /// (naming the revoke) without calling NCCL,
    /// [`shrink_after_failure`](Self::shrink_after_failure) makes a working communicator of the ranks that are
    /// left, and dropping it aborts it, once. Allowed on a communicator that failed (that
    /// is what it is for): on NCCL 2.29 a revoke clears the error NCCL recorded, so that
    /// a shrink can follow.
    ///
    /// Not sound, so not done, where NCCL's launch of the communicator's last operation
    /// has not completed (in flight, or a launch or split/shrink job that failed): NCCL
    /// 2.29-2.30's revoke would leave its group job dangling (a use after free); such a
    /// communicator is aborted instead and cannot be shrunk (ARCHITECTURE.md, the elastic
    /// path against NCCL's source).
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.29 (nothing is called);
    /// [`Error::InvalidArgument`] for a second revoke; NCCL's error for a communicator
    /// NCCL refuses (finalized); [`Error::CommunicatorFailed`] saying it "could not be
    /// revoked" when the revoke is not sound (it is aborted); [`Error::Timeout`] when the
    /// watchdog already aborted it, when NCCL's call does not return within
    /// [`Config::abort_timeout`](crate::Config::abort_timeout) (it goes on on a thread of
    /// its own; the communicator is failed, and its drop aborts it once the call
    /// returned), or when the revoke's job does not end within the timeout (it waits for
    /// the communicator's streams: the error names the stream and the work).
    #[track_caller]
    pub fn revoke(&self) -> Result<()> {
        const OP: &str = EntryPoint::ncclCommRevoke.name();
        let caller = Location::caller();
        let revoke = self.optional(|t| t.ncclCommRevoke, OP)?;
        if self.is_revoked() {
            return Err(invalid(OP, "the communicator was already revoked"));
        }
        crate::teardown::check_lane(OP, self.lane())?;
        self.diag.check_alive()?;
        if !self.handle.is_live() {
            // Aborted already (a revoke that was not sound, a launch that did not end).
            if self.unrevocable.get() {
                return Err(self.communicator_failed(OP, super::UNREVOCABLE));
            }
            self.ensure_usable(OP)?;
            return Err(invalid(OP, "the communicator was torn down"));
        }
        let Some(r) = self.revoke_if_sound(revoke)? else {
            // A group job is linked (its launch in flight, or failed): NCCL's revoke would
            // leave it dangling. Aborted instead, which joins the job and frees both.
            return Err(self.abort_unrevocable(OP));
        };
        if r != ncclSuccess && r != ncclInProgress {
            // Refused before anything changed (init.cc:2647-2658): the watchdog's again.
            self.diag.revoke_refused();
            return Err(self.nccl_error(OP, r, caller));
        }
        // From here NCCL counts it revoked: its collectives are refused, whatever follows.
        // Its own group end linked the revoke's job (none was linked) until a poll reads
        // its ncclSuccess.
        self.set_job_linked(r == ncclInProgress);
        self.revoked.set(true);
        self.failure.get_or_init(|| REVOKED.to_string());
        // The revoke's job stores its result as the state (init.cc:2635): wait for it. The
        // job waits for the communicator's streams (init.cc:2616-2617 of v2.29.7-1): work
        // stalled there keeps it in progress, and the error names what it waits for.
        let behind = self.diag.stream_behind();
        self.wait_ready(OP, caller, self.diag.timeout())
            .map_err(|e| match (e, behind) {
                (Error::Timeout { what, timeout }, Some(behind)) => {
                    let now = self.diag.stream_behind().unwrap_or(behind);
                    Error::Timeout {
                        what: format!("{what}: NCCL's revoke waits (ncclStrongStreamSynchronize, init.cc:2616-2617 of v2.29.7-1) for {now}, not complete; NCCL waits for it for ever. Complete or end that work (the communicator stays revoked; drop it to abort it)"),
                        timeout,
                    }
                }
                (e, _) => e,
            })
    }

    /// For a failed wait of a `Config::elastic` communicator (`end_launches`): revokes it
    /// where it is, from the owner's thread and whatever its clique's state, so that NCCL's
    /// revoke ends its launch (it sets the abort flags and joins the group's job,
    /// group.cc:875-877 of v2.29.7-1) while the handle stays for a shrink. `true` when it
    /// is revoked (now or before); `false` when it could not be (no `ncclCommRevoke`, the
    /// watchdog has the handle, or NCCL refused): then it is aborted.
    pub(crate) fn revoke_for_launch(&self) -> bool {
        if self.is_revoked() {
            return true;
        }
        let Some(revoke) = self.handle.table().ncclCommRevoke else {
            return false;
        };
        let r = match self.revoke_if_sound(revoke) {
            Ok(Some(r)) => r,
            Ok(None) => {
                // Not sound (a group job linked: the launch in flight or failed): the
                // caller aborts it; its errors say why it cannot be shrunk.
                self.mark_unrevocable();
                return false;
            }
            Err(_) => return false,
        };
        if r != ncclSuccess && r != ncclInProgress {
            return false;
        }
        // The revoke's own group end linked its job (none was linked) until a poll reads
        // its ncclSuccess.
        self.set_job_linked(r == ncclInProgress);
        self.revoked.set(true);
        self.failure.get_or_init(|| REVOKED.to_string());
        true
    }

    /// `ncclCommRevoke` on the pinned handle if it is sound there
    /// ([`revocable`](Self::revocable), judged by an `ncclCommGetAsyncError` just before,
    /// under the same pin); marked revoked for the watchdog first. `None` (nothing called
    /// but the poll) when it is not sound.
    fn revoke_if_sound(
        &self,
        revoke: unsafe extern "C" fn(ncclComm_t, c_int) -> ncclResult_t,
    ) -> Result<Option<ncclResult_t>> {
        self.pinned(|| {
            let mut state = ncclInProgress;
            // SAFETY: `state` is writable; the handle is live (pinned).
            let polled = unsafe {
                (self.handle.table().ncclCommGetAsyncError)(self.handle.get(), &mut state)
            };
            if polled != ncclSuccess || !self.revocable(state) {
                return Ok(None);
            }
            // Marked first, under the pin: the watchdog leaves a revoked handle be. NCCL
            // refuses a second revoke (init.cc:2655-2657 of v2.29.7-1): the watchdog's own,
            // for work it still saw in flight, would fail and it would abort the handle a
            // shrink needs.
            self.diag.revoked_in_place();
            let raw = self.handle.get();
            // On a thread of its own, waited for at most the abort bound: NCCL's revoke
            // joins the group job (group.cc:875-877), and may block.
            let called = self.diag.revoke_bounded(|| {
                // SAFETY: the handle is live (pinned: the watchdog cannot take it
                // meanwhile); flags 0 = NCCL_REVOKE_DEFAULT, the only value NCCL accepts;
                // no group job is linked to it (`revocable`).
                unsafe { revoke(raw, nccl_sys::bindings::NCCL_REVOKE_DEFAULT as c_int) }
            });
            match called {
                Ok(r) => Ok(r),
                Err(()) => Err(self.revoke_blocked()),
            }
        })
    }

    /// The owner's revoke did not return within [`Config::abort_timeout`]: it goes on on a
    /// thread of its own, and the communicator is failed and revoked for good; no later
    /// call of it reaches NCCL (its teardown hands the handle to that thread, which aborts
    /// it once the revoke returned).
    ///
    /// [`Config::abort_timeout`]: crate::Config::abort_timeout
    #[cold]
    fn revoke_blocked(&self) -> Error {
        let timeout = self.diag.abort_timeout();
        let what = format!("ncclCommRevoke on rank {} did not return within Config::abort_timeout (NCCL's revoke joins the communicator's group job, group.cc:875-877 of v2.29.7-1): it goes on on a thread of its own; the communicator is failed and can no longer be shrunk: drop it (it is aborted once the revoke returned) and make a new communicator over the ranks left", self.rank);
        self.revoke_blocked.set(true);
        self.revoked.set(true);
        self.failure.get_or_init(|| what.clone());
        Error::Timeout { what, timeout }
    }

    /// Notes that a revoke was not sound here ([`revocable`](Self::revocable)): the
    /// communicator is aborted instead and cannot be shrunk. Noted in the diagnostics too,
    /// since the watchdog may mark the handle aborted meanwhile (its claim finds the handle
    /// taken by this abort) and then its report, not the owner's error, is what the call
    /// returns: that report must say so as well.
    pub(crate) fn mark_unrevocable(&self) {
        self.unrevocable.set(true);
        self.diag.note_unrevocable();
        self.failure.get_or_init(|| super::UNREVOCABLE.to_string());
    }

    /// A revoke that was not sound ([`revocable`](Self::revocable)): the communicator is
    /// aborted in place (bounded by [`Config::abort_timeout`](crate::Config::abort_timeout):
    /// `ncclCommAbort` joins the job in flight and frees it with the communicator) and the
    /// error says why, and what to do instead.
    #[cold]
    fn abort_unrevocable(&self, call: &'static str) -> Error {
        let e = self.communicator_failed(call, super::UNREVOCABLE);
        self.mark_unrevocable();
        Self::abort_launching(&[self], call, Instant::now() + self.diag.abort_timeout());
        e
    }

    /// Whether [`revoke`](Self::revoke) was called on this communicator, or the watchdog
    /// revoked it ([`Config::elastic`]).
    pub fn is_revoked(&self) -> bool {
        self.revoked.get() || self.diag.revoked_by_watchdog()
    }

    /// The rank this communicator's clique lost, if the diagnostics know it: the rank to
    /// exclude in [`shrink_after_failure`](Self::shrink_after_failure). It is
    ///
    /// - a rank that left while its peers waited: dropped, panicked, returned from its
    ///   launcher closure, or left through the job's desync board;
    /// - a rank whose process the host provider saw gone (say SIGKILLed) while a
    ///   collective waited for it;
    /// - after the watchdog's timeout, the one rank its report found behind (it never
    ///   reached the collective the others waited in, or, in another process, posted
    ///   nothing on the desync board): a rank stuck past [`Config::timeout`] counts as
    ///   lost. With two or more ranks behind, none is named.
    ///
    /// Only the first is kept: [`lost_ranks`](Self::lost_ranks) has every rank known
    /// gone. `None` without the `diag` feature, on the rank that was itself behind, and
    /// after a failure of this rank's own GPU work.
    ///
    /// [`Config::timeout`]: crate::Config::timeout
    pub fn lost_rank(&self) -> Option<usize> {
        self.diag.lost_rank()
    }

    /// Every rank of this communicator known gone, sorted, this rank never among them:
    /// the exclude list of a [`shrink_after_failure`](Self::shrink_after_failure) that
    /// leaves none of them behind. It holds
    ///
    /// - [`lost_rank`](Self::lost_rank);
    /// - every rank of this process whose communicator of this clique was torn down
    ///   (dropped, destroyed or aborted: a thread that returned, failed or panicked);
    /// - every rank of another process that posted its departure on the job's desync
    ///   board (`launch::Launcher`; read once, bounded);
    /// - on the host provider across processes, every rank whose process it saw gone
    ///   (SIGKILLed, say) or that tore its communicator down.
    ///
    /// Read it after the failure, before the shrink: ranks that shrink together tear the
    /// parent down afterwards, and then count as gone here. Each rank reads its own view,
    /// at its own moment: two ranks may read different lists when a rank is lost while
    /// they read (agree on the list before or after the shrink; NCCL does not compare
    /// them, init.cc:2758 of 2.29.7: the ranks of one process compare theirs before the
    /// shrink, which fails with [`Error::ExcludeMismatch`] on a difference, and so do ranks
    /// of other processes through the desync board when there is one; without one they
    /// wait in it until the timeout). Empty without the
    /// `diag` feature; NVIDIA's NCCL names no rank itself.
    pub fn lost_ranks(&self) -> Vec<usize> {
        self.diag.lost_ranks()
    }

    /// [`lost_ranks`](Self::lost_ranks), agreed among the ranks that recover: this rank
    /// says which ranks it found gone, and waits (bounded by the communicator's timeout)
    /// until every other rank of this clique in this process has said so too or has torn
    /// its communicator down; it returns the union, with the ranks torn down meanwhile.
    /// Call it on every rank that stays, before
    /// [`shrink_after_failure`](Self::shrink_after_failure): the ranks of one process then
    /// exclude the same ranks, even when a further rank is lost while they begin (a rank
    /// that never says, and tears down, is excluded). Ranks of other processes are not
    /// waited for (each reads its own [`lost_ranks`](Self::lost_ranks)); when there are
    /// any, it returns only once no further rank was found lost for 50 ms, so that ranks
    /// lost within moments of each other (two processes killed at once, a rank dying as
    /// the recovery begins) are named by every survivor: NCCL cannot shrink a parent again
    /// after a shrink failed (it sets the parent's error, and a revoke happens once). A rank
    /// lost later than that may still be named by some only, and their shrink then fails.
    /// Call it once per communicator. Empty without the `diag` feature.
    pub fn agree_lost_ranks(&self) -> Vec<usize> {
        let deadline = std::time::Instant::now() + self.diag.timeout();
        self.diag.agree_lost_ranks(deadline)
    }

    /// Removes `exclude` ranks from a communicator that may have failed (`ncclCommShrink`
    /// with `NCCL_SHRINK_ABORT`, NCCL 2.27+): collective over the ranks that stay, which
    /// must all call it with the same list. The calling rank must not be in `exclude`.
    ///
    /// Unlike [`shrink`](Self::shrink) it runs on a communicator that
    /// [`is_failed`](Self::is_failed) or was revoked: NCCL first stops this rank's work in flight on it.
    /// NCCL refuses a parent whose own asynchronous error is set, in either mode
    /// (init.cc:2762): on NCCL 2.29+ such a communicator is [`revoke`](Self::revoke)d
    /// first (here, unless it already was), which clears that error; before 2.29 NCCL's
    /// error is returned, and only an abort and a new init remain.
    ///
    /// The parent stays as it was (failed or revoked: dropped, it aborts; healthy: it is
    /// destroyed), and the child is a new, healthy communicator with its own exactly-once
    /// teardown. On NCCL 2.29+ it also revokes first while work of the communicator is
    /// still on its streams: NCCL's shrink waits for that work in the call, unbounded, and
    /// the revoke's wait is bounded. Errors: [`Error::Unsupported`] before NCCL 2.27 (nothing is called); the
    /// exclude list's errors as [`shrink`](Self::shrink)'s ([`Error::ExcludeMismatch`]
    /// included); [`Error::Timeout`] when the
    /// watchdog already aborted the communicator (its handle is gone), a rank that
    /// stays never calls, or the revoke waits past the timeout for work on the
    /// communicator's streams (named; the shrink is not entered); [`revoke`](Self::revoke)'s
    /// errors, such as a communicator that "could not be revoked" (aborted: make a new
    /// communicator over the ranks left).
    #[track_caller]
    pub fn shrink_after_failure(&self, exclude: &[usize]) -> Result<Communicator> {
        const CALL: EntryPoint = EntryPoint::ncclCommShrink;
        const OP: &str = CALL.name();
        let caller = Location::caller();
        let shrink = self.optional(|t| t.ncclCommShrink, OP)?;
        super::params::refuse_blocking(OP)?;
        let list = self.exclude_list(OP, exclude)?;
        crate::teardown::check_lane(OP, self.lane())?;
        // A clique the watchdog failed (a rank left, an operation timed out) fails this
        // call only when the watchdog took the handle; one it revoked in place
        // (`Config::elastic`), or left alone, is shrunk.
        struct Recovering<'a>(&'a crate::diag::CommDiag);
        impl Drop for Recovering<'_> {
            fn drop(&mut self) {
                self.0.set_recovering(false);
            }
        }
        self.diag.set_recovering(true);
        let _recovering = Recovering(&self.diag);
        self.diag.check_alive()?;
        // A pin waits out a watchdog's decision in progress (a revoke in place of the
        // operation that just failed), so that the flag read next is final.
        self.pinned(|| Ok(()))?;
        if self.diag.revoked_by_watchdog() && !self.revoked.get() {
            // The watchdog's revoke: NCCL's job stores its result; wait for it.
            self.revoked.set(true);
            self.failure.get_or_init(|| REVOKED.to_string());
            self.wait_ready(OP, caller, self.diag.timeout())?;
        }
        // Revoked first when NCCL reports an error, or when this crate failed the
        // communicator (a rank left: the error that rank's abort sets may reach NCCL
        // only during the shrink, which would then refuse the parent). A revoke clears
        // NCCL's error for good.
        let nccl_reports_error = || {
            let no_error = [ncclSuccess, ncclInProgress];
            self.async_state()
                .is_some_and(|state| !no_error.contains(&state))
        };
        // Revoked first too while tracked work is not complete: NCCL's shrink in abort mode
        // waits in the call, unbounded, for the communicator's device stream
        // (init.cc:2844-2848 of v2.29.7-1), where work stalled behind the user's own work
        // never ends; the revoke's job waits for the same streams off this thread
        // (init.cc:2616-2617), its wait here bounded by the timeout, and once it ended the
        // shrink's wait has nothing left to wait for.
        let revoke_available = self.handle.table().ncclCommRevoke.is_some();
        if revoke_available
            && !self.revoked.get()
            && (self.is_failed() || nccl_reports_error() || self.diag.stream_behind().is_some())
        {
            self.revoke().map_err(|e| match e {
                Error::Timeout { what, timeout } => Error::Timeout {
                    what: format!("{what}. shrink_after_failure did not enter ncclCommShrink, which would wait for the same work in the call, for ever"),
                    timeout,
                },
                e => e,
            })?;
        }
        self.shrink_call(shrink, list, nccl_sys::bindings::NCCL_SHRINK_ABORT, caller)
    }

    /// A new id for growing this communicator (`ncclCommGetUniqueId`, NCCL 2.29+), called
    /// by one existing rank, the grow's root, before the other existing ranks'
    /// [`grow`](Self::grow): NCCL sends it to ranks 0 and n-1 during this call, and their
    /// `grow` waits for it. Hand it to the new ranks ([`join_grown`](Self::join_grown))
    /// and pass it to the root's own `grow`. One id at a time; each grows once.
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.29 (nothing is called); a failed
    /// communicator's error.
    #[track_caller]
    pub fn grow_id(&self) -> Result<UniqueId> {
        const OP: &str = EntryPoint::ncclCommGetUniqueId.name();
        let caller = Location::caller();
        let get = self.optional(|t| t.ncclCommGetUniqueId, OP)?;
        self.ensure_usable(OP)?;
        let mut raw = nccl_sys::bindings::ncclUniqueId {
            internal: [0; nccl_sys::bindings::NCCL_UNIQUE_ID_BYTES as usize],
        };
        self.pinned(|| {
            // SAFETY: `raw` is a writable ncclUniqueId; the handle is live (pinned).
            let r = unsafe { get(self.handle.get(), &mut raw) };
            self.checked(OP, r, caller)
        })?;
        Ok(UniqueId::from_raw(raw))
    }

    /// This rank's part of growing the communicator to `world_size` ranks
    /// (`ncclCommGrow`, NCCL 2.29+): every existing rank calls it, the root (the rank that
    /// called [`grow_id`](Self::grow_id)) with `Some(id)`, the others with `None`; the new
    /// ranks call [`join_grown`](Self::join_grown) with the id. Existing ranks keep their
    /// rank; new ranks take `self.world_size()..world_size`.
    ///
    /// Returns the grown communicator once every rank joined. This communicator is
    /// untouched and stays usable, whatever the grow does: only the call itself is an
    /// operation of it (ranks 0 and n-1 wait in it until the root's `grow_id` returned,
    /// bounded by its watchdog, which revokes it there rather than abort it under the
    /// call, init.cc:2913-2924 of v2.29.7-1: then this communicator is failed); the wait for the new ranks is
    /// the new communicator's, bounded by the timeout ([`Config::timeout`]), and on a
    /// failure the new communicator is aborted (which ends NCCL's grow job, that uses this
    /// communicator until it ends) before the call returns. So a new rank that dies
    /// before, or while, it joins costs the existing ranks at most the timeout, and they
    /// carry on at their size or grow again. Both communicators have their own
    /// exactly-once teardown.
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.29 (nothing is called);
    /// [`Error::InvalidArgument`] when `world_size` is not above the current size (or past
    /// NCCL's `int`); a failed communicator's error; [`Error::Timeout`] when a new rank
    /// never joins, or NCCL's error of the new communicator (another rank gave up on the
    /// grow), each saying this communicator stays usable.
    ///
    /// [`Config::timeout`]: crate::Config::timeout
    #[track_caller]
    pub fn grow(&self, world_size: usize, id: Option<&UniqueId>) -> Result<Communicator> {
        const CALL: EntryPoint = EntryPoint::ncclCommGrow;
        const OP: &str = CALL.name();
        let caller = Location::caller();
        let grow = self.optional(|t| t.ncclCommGrow, OP)?;
        super::params::refuse_blocking(OP)?;
        if world_size <= self.world_size || world_size > c_int::MAX as usize {
            let (now, max) = (self.world_size, c_int::MAX);
            return Err(invalid(OP, format!("a grown communicator has more than the current {now} ranks and at most {max}; got {world_size}")));
        }
        crate::teardown::check_lane(OP, self.lane())?;
        let tag = crate::diag::shrink_tag(&[-1, -(world_size as c_int)]);
        let raw_id = id.map(UniqueId::to_raw);
        // NCCL writes the new handle into the out-pointer during the call (init.cc:2997 of
        // v2.29.7-1) and its job stores it again at its end (:1747-1750): the out-pointer lives
        // until the new communicator left ncclInProgress, else it is leaked.
        let dest: AsyncOut<nccl_sys::bindings::ncclComm> = AsyncOut::new();
        let out = dest.out();
        // The call is an operation of this communicator: ranks 0 and n-1 wait in it for
        // the root's id (:2913-2924), through this communicator, and its watchdog's
        // timeout ends that wait as any other of its operations. NCCL's result is kept
        // apart: an error of the call leaves this communicator as it was (the grow's own
        // group holds nothing of it), so it does not fail it.
        let called = std::cell::Cell::new(ncclSuccess);
        let issued = self.issue_inner(
            CALL,
            caller,
            |_, comm| {
                // SAFETY: `out` is the heap out-pointer above (see there); `raw_id` lives across
                // the call (NCCL copies it); rank -1 = an existing rank; null config
                // inherits this one's.
                called.set(unsafe {
                    grow(
                        comm,
                        world_size as c_int,
                        raw_id.as_ref().map_or(std::ptr::null(), |r| r as *const _),
                        -1,
                        out,
                        std::ptr::null_mut(),
                    )
                });
                ncclSuccess
            },
            false,
            || Ok(()),
            true,
        );
        if let Err(e) = issued {
            // The watchdog failed this communicator while the call ran (a rank of it never
            // came, say): a job the call launched is ended by the new communicator's abort.
            let raw = dest.take();
            if !raw.is_null() {
                drop(self.grown(raw, tag));
            }
            dest.leak();
            return Err(e);
        }
        let raw = dest.take();
        let r = called.get();
        if r != ncclSuccess {
            if !raw.is_null() {
                drop(self.grown(raw, tag));
            }
            dest.leak();
            let e: Error = self.nccl_error(OP, r, caller);
            // NCCL's error of this communicator itself (ncclCommEnsureReady) fails it.
            let no_error = [ncclSuccess, ncclInProgress];
            if self.async_state().is_some_and(|s| !no_error.contains(&s)) {
                self.mark_failed(&e);
            }
            return Err(e);
        }
        if raw.is_null() {
            dest.leak();
            return Err(invalid(OP, "NCCL returned no communicator"));
        }
        // The wait for the new ranks is the new communicator's alone, bounded by the
        // timeout: a new rank that never comes costs this grow, not this communicator.
        // On a failure the new communicator's drop aborts it, which joins NCCL's job
        // (ncclCommAbort -> ncclCommEnsureReady -> ncclGroupJobAbort, init.cc:2713, 404)
        // before this returns: the job uses this communicator until it ends
        // (bootstrap.cc:777-779, init.cc:1716), and its abort runs on the same teardown
        // lane as this one's, ahead of it.
        let mut big = self.grown(raw, tag);
        let timeout = self.diag.timeout();
        let joined = big
            .wait_ready(OP, caller, timeout)
            .and_then(|()| big.read_shape(caller));
        match joined {
            Ok(()) => Ok(big),
            Err(e) => {
                drop(big);
                dest.leak();
                Err(self.grow_failed(e, world_size))
            }
        }
    }

    /// The new communicator of a grow, from NCCL's handle `raw` (its rank and size are
    /// read once it is ready).
    fn grown(&self, raw: ncclComm_t, tag: u64) -> Communicator {
        Communicator::new(
            RawComm::owned(raw, Arc::clone(self.handle.lib())),
            self.device.clone(),
            0,
            0,
            self.diag.child(tag),
        )
        .keeping(self.names.clone())
    }

    /// The error of a grow whose new communicator failed (`e`): a timeout says that a new
    /// rank never joined, and NCCL's error (say, another rank gave up and aborted its new
    /// communicator) is kept with that said; both say that this communicator is untouched.
    #[cold]
    fn grow_failed(&self, e: Error, world_size: usize) -> Error {
        let (rank, now) = (self.rank, self.world_size);
        let then = format!("this communicator of {now} ranks is untouched and stays usable: carry on at {now} ranks, or grow again with a new grow_id");
        match e {
            Error::Timeout { timeout, .. } => Error::Timeout {
                what: format!("ncclCommGrow on rank {rank}: the grown communicator of {world_size} ranks (a new rank never joined: it died or never got the id, or the grow's job is stuck; {then})"),
                timeout,
            },
            Error::Nccl(mut n) => {
                let said = n.last_error.take().map_or_else(String::new, |l| format!("{l}; "));
                n.last_error = Some(format!("{said}the grown communicator of {world_size} ranks failed (a new rank never joined, or a rank gave up on the grow); {then}"));
                Error::Nccl(n)
            }
            e => e,
        }
    }

    /// Joins a communicator that existing ranks [`grow`](Self::grow) as its rank `rank`
    /// of `world_size` (`ncclCommGrow` with no parent, NCCL 2.29+), with the id the
    /// grow's root got from [`grow_id`](Self::grow_id). Blocks (bounded by the
    /// configuration's timeout) until every rank joined.
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.29 (nothing is called);
    /// [`Error::RankOutOfRange`]; [`Error::Timeout`] when a rank never joins.
    #[track_caller]
    pub fn join_grown(
        device: &CommDevice,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<Communicator> {
        let lib = device.library()?;
        Communicator::join_grown_in(&lib, device, world_size, rank, id, config)
    }

    /// [`join_grown`](Self::join_grown) with an explicit library.
    #[track_caller]
    pub fn join_grown_in(
        lib: &Arc<Library>,
        device: &CommDevice,
        world_size: usize,
        rank: usize,
        id: &UniqueId,
        config: &Config,
    ) -> Result<Communicator> {
        const OP: &str = EntryPoint::ncclCommGrow.name();
        let caller = Location::caller();
        let grow = lib.optional(lib.table().ncclCommGrow, OP)?;
        let raw_id = id.to_raw();
        let dest: AsyncOut<nccl_sys::bindings::ncclComm> = AsyncOut::new();
        let called = std::cell::Cell::new(false);
        let new = super::init::start_new(OP, lib, device, world_size, rank, id, config, |c| {
            called.set(true);
            // SAFETY: `dest.out()` is a heap out-pointer that outlives NCCL's job (stored again at
            // its end), freed only after the communicator left ncclInProgress, else
            // leaked; `raw_id` and the config `c` live across the call (see `start_new`);
            // ranks checked.
            let r = unsafe {
                grow(
                    std::ptr::null_mut(),
                    world_size as c_int,
                    &raw_id,
                    rank as c_int,
                    dest.out(),
                    c,
                )
            };
            (r, dest.take())
        });
        let joined = new.and_then(|pending| {
            let timeout = pending.timeout();
            pending.wait_as(OP, caller, timeout)
        });
        // After the call, an error leaves the out-pointer to a job that may still store into it;
        // before it, the out-pointer is freed.
        joined.inspect_err(|_| {
            if called.get() {
                dest.leak()
            }
        })
    }

    /// The checked exclude list of a shrink: in range, not this rank, no duplicates, not
    /// every rank.
    pub(super) fn exclude_list(&self, call: &'static str, exclude: &[usize]) -> Result<Vec<c_int>> {
        let mut list = Vec::with_capacity(exclude.len());
        for &r in exclude {
            if r >= self.world_size {
                return Err(Error::RankOutOfRange {
                    call,
                    what: "excluded rank",
                    rank: r,
                    world_size: self.world_size,
                });
            }
            if r == self.rank {
                return Err(invalid(
                    call,
                    format!("rank {r} is excluded, so it must not call shrink"),
                ));
            }
            if list.contains(&(r as c_int)) {
                return Err(invalid(call, format!("rank {r} is listed twice")));
            }
            list.push(r as c_int);
        }
        if list.is_empty() {
            // As NCCL, which refuses an empty list (init.cc:2561-2562 of 2.28.9).
            return Err(invalid(
                call,
                "no rank is excluded: a shrink removes at least one",
            ));
        }
        if list.len() >= self.world_size {
            return Err(invalid(call, "every rank is excluded"));
        }
        Ok(list)
    }
}
