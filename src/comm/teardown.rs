//! The one teardown of a handle: [`Communicator::destroy`], [`Communicator::abort`],
//! [`Communicator::finalize`] and `Drop`, each bounded (see the crate's ARCHITECTURE.md),
//! and `RawComm`'s `Drop`, the abort of a handle no communicator was built around. The
//! calls run on a teardown lane (`crate::teardown`).

use super::*;

impl Communicator {
    /// Takes the handle out, so that exactly one teardown call uses it; `how` says how the
    /// rank leaves its clique (for peers that wait for it), `broken` whether it leaves by
    /// a panic: then the whole clique fails. An explicit `abort()` may be a normal ending,
    /// and a failed communicator's failure may be its peers' too (a fingerprint mismatch
    /// every rank reports), so those fail only the peers that wait for the rank.
    fn take(&self, how: &str, broken: bool) -> ncclComm_t {
        let raw = self.handle.take();
        // Null when the watchdog already aborted it (its one teardown).
        match raw {
            Some(raw) if self.diag.release(Some((how, broken))) => raw,
            _ => std::ptr::null_mut(),
        }
    }

    /// Destroys the communicator (`ncclCommDestroy`). On failure the communicator comes
    /// back with the error (marked failed, so dropping it aborts), as rusqlite's
    /// `Connection::close` does. A communicator that already failed is not destroyed but
    /// handed back with [`Error::CommunicatorFailed`].
    ///
    /// Bounded like every other teardown: its wait for the communicator's work by
    /// [`Config::timeout`], the call itself by [`Config::abort_timeout`] (it runs on the
    /// device's teardown lane, and past the bound [`Config::on_abort_timeout`] applies).
    /// NCCL's destroy blocks until every CUDA graph that captured work of the communicator
    /// is destroyed (`commDestroySync`, init.cc:2232-2234 of 2.28.9): destroy such graphs
    /// first. A destroy that did not return in time is [`Error::Timeout`], which names a
    /// graph as the likely cause when the communicator's work was seen captured; the call
    /// goes on in the background as the handle's one teardown, and the communicator that
    /// comes back no longer holds the handle (dropping it tears nothing down).
    #[track_caller]
    #[allow(clippy::result_large_err)] // the shape of rusqlite's `Connection::close`
    pub fn destroy(mut self) -> std::result::Result<(), (Communicator, Error)> {
        match self.try_destroy(Location::caller()) {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    /// [`destroy`](Self::destroy), with the communicator left in place on an error.
    fn try_destroy(&mut self, caller: &'static Location<'static>) -> Result<()> {
        const OP: &str = "ncclCommDestroy";
        self.ensure_usable(OP)?;
        if let Err(e) = self.diag.before_teardown() {
            return Err(self.fail(e));
        }
        // NCCL refuses to destroy a communicator with work in flight or an asynchronous
        // error, and then leaves the calling thread inside a group level (see
        // `teardown::destroy_or_abort`): such a one comes back failed (dropping it aborts).
        if self.poll_async(OP, caller)? {
            return Err(self.fail(invalid(OP, "NCCL still has work of this communicator in flight (ncclCommGetAsyncError says ncclInProgress): it cannot be destroyed now; drop it to abort it, or wait for the work")));
        }
        let until = Instant::now() + self.diag.abort_timeout();
        // Pinned from before the call until the handle is out of its holder: a watchdog
        // claim can never fall between the destroy and the take.
        let pinned = self.diag.pin()?;
        let raw = self.handle.get();
        // The lane's call is the only user of the handle until it returned (pinned, and
        // this thread waits for it), or, past the bound, until the handle is taken below.
        let (bound, r) = self.teardown_call(raw, Call::Destroy, "destroy", until);
        let destroyed = match r {
            Some(r) => self.checked(OP, r, caller),
            None => {
                // Still running on the lane: that call is the handle's one teardown, and
                // nothing here may use the handle again.
                self.take("its destroy did not return in time", false);
                // Its async jobs may still run while the destroy does: their out-pointers
                // are leaked.
                self.reap_orphans(false);
                let e = self.teardown_overdue(OP, bound);
                Err(self.fail(e))
            }
        };
        if destroyed.is_ok() {
            self.take("it destroyed its communicator", false);
            // NCCL destroyed it, so no job of it is running (a destroy needs it ready).
            self.reap_orphans(true);
        }
        if pinned {
            self.diag.unpin();
        }
        destroyed
    }

    /// Aborts the communicator (`ncclCommAbort`): pending operations on every rank end
    /// with an error. Never blocks on peers, on this communicator's work or on a stalled
    /// stream for longer than [`Config::abort_timeout`]: the abort runs on the device's
    /// teardown lane (NVIDIA's blocks behind a stalled stream), and past the bound this
    /// returns [`Error::Timeout`] while [`Config::on_abort_timeout`] applies. When the
    /// watchdog already took the handle, this waits (with the same bound) for the
    /// watchdog's abort and returns its outcome.
    #[track_caller]
    pub fn abort(self) -> Result<()> {
        let until = Instant::now() + self.diag.abort_timeout();
        let raw = self.take("it aborted its communicator", false);
        // Taken: the context names no handle.
        let ctx = self.context(Location::caller());
        let (bound, r) = if raw.is_null() {
            match self.diag.watchdog_abort(until) {
                Some(outcome) => outcome,
                None => {
                    self.reap_orphans(false);
                    return Ok(()); // nothing left to tear down
                }
            }
        } else {
            self.teardown(raw, true, "abort", until)
        };
        self.reap_orphans(r.is_some());
        let r = r.ok_or_else(|| self.teardown_overdue("ncclCommAbort", bound))?;
        self.handle.lib().check("ncclCommAbort", r, ctx)
    }

    /// Ends NCCL's launch of work on `comms` after a wait for it failed (it timed out, the
    /// watchdog failed the clique, a peer left): while a communicator's asynchronous state
    /// still reads ncclInProgress, NCCL's group thread may still launch the work that
    /// reads and writes the caller's buffers (group.cc:705-738; the state leaves
    /// ncclInProgress only once `doLaunches` returned, :604-630), so the buffers' borrows
    /// and cudarc's guards must not end yet. Those communicators are aborted in place,
    /// together (`ncclCommAbort` sets the abort flags and joins the job in flight,
    /// init.cc:2502-2541), and the caller waits for it, bounded by
    /// [`Config::abort_timeout`]; one the watchdog already took is waited for the same
    /// way. A `Config::elastic` one is revoked instead only where that is sound
    /// ([`Self::revocable`]: no group job linked, which a launch still in flight always
    /// has), keeping its handle for `shrink_after_failure` if its launch ends within one
    /// more such bound; it is aborted the same way otherwise. Past a bound the abort goes on on its lane under
    /// [`Config::on_abort_timeout`].
    ///
    /// A communicator whose state is final (an error, or ncclSuccess) is left alone: its
    /// launch has ended.
    #[cold]
    #[inline(never)]
    pub(crate) fn end_launches(comms: &[&Communicator], call: &'static str) {
        let Some(first) = comms.first() else {
            return;
        };
        let bound = first.diag.abort_timeout();
        // A `Config::elastic` communicator is revoked rather than aborted (the watchdog's
        // revoke may come after a peer's timeout ended this wait): its handle stays for a
        // shrink.
        let (mut revoked, others): (Vec<&Communicator>, Vec<&Communicator>) = comms
            .iter()
            .copied()
            .filter(|c| c.launch_may_run())
            .partition(|c| {
                c.diag.revoked_by_watchdog() || (c.diag.elastic() && c.revoke_for_launch())
            });
        Self::abort_launching(&others, call, Instant::now() + bound);
        // A revoked communicator stays its owner's for a shrink when its launch ends
        // within the bound (the revoke set its abort flags and joins the launch); aborted
        // otherwise.
        let until = Instant::now() + bound;
        // (One the watchdog took after all is left to its abort, waited for below.)
        while revoked.iter().any(|c| !c.diag.aborted_by_watchdog()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
            revoked.retain(|c| c.launch_may_run());
        }
        Self::abort_launching(&revoked, call, Instant::now() + bound);
    }

    /// `e`, the error of a failed wait of `comms`, with what it did to those of them that
    /// are `Config::elastic` but could not be revoked ([`Self::revocable`]): they were
    /// aborted, so they cannot be shrunk.
    pub(crate) fn note_unrevocable(comms: &[&Communicator], e: Error) -> Error {
        // The owner's own finding, or the watchdog's: its timeout fails the clique (which
        // can end this wait) before it tries the revoke and finds it unsound, and
        // `end_launches` waited for its abort since.
        let unrevocable = comms
            .iter()
            .any(|c| c.unrevocable.get() || c.diag.unrevocable());
        if !unrevocable {
            return e;
        }
        let note =
            |what: String| format!("{what}. This rank's communicator: {}", super::UNREVOCABLE);
        match e {
            Error::Timeout { what, timeout } if !what.contains(super::UNREVOCABLE) => {
                Error::Timeout {
                    what: note(what),
                    timeout,
                }
            }
            Error::RankLeft { rank, what } if !what.contains(super::UNREVOCABLE) => {
                Error::RankLeft {
                    rank,
                    what: note(what),
                }
            }
            e => e,
        }
    }

    /// A `Config::elastic` communicator whose group end failed with its clique timed out
    /// or a rank lost (the group pinned it, so the watchdog could not revoke it): revoked
    /// where it is, as the watchdog revokes one whose single collective failed so, and the
    /// revoke's job waited for (bounded by [`Config::abort_timeout`]), so that
    /// `shrink_after_failure` can follow at once. Left failed (its drop aborts it) when it
    /// cannot be revoked; aborted in place, as [`end_launches`](Self::end_launches) does,
    /// when the revoke's job does not end within the bound.
    ///
    /// [`Config::abort_timeout`]: crate::Config::abort_timeout
    #[cold]
    #[inline(never)]
    pub(crate) fn revoke_after_failed_group(&self, call: &'static str) {
        if !self.handle.is_live() || !self.revoke_for_launch() {
            return;
        }
        let until = Instant::now() + self.diag.abort_timeout();
        while self.launch_may_run() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.launch_may_run() {
            Self::abort_launching(&[self], call, Instant::now() + self.diag.abort_timeout());
        }
    }

    /// Aborts `comms` in place, together, and waits for it until `until` (one the watchdog
    /// took: for the watchdog's abort).
    pub(super) fn abort_launching(comms: &[&Communicator], call: &'static str, until: Instant) {
        let Some(first) = comms.first() else {
            return;
        };
        let how = "its operation's launch did not end after a failed wait (aborted)";
        let (mut taken, mut watched) = (Vec::new(), Vec::new());
        for c in comms {
            c.mark_failed(&invalid(call, how));
            match c.take(how, false) {
                raw if raw.is_null() => watched.push(*c),
                raw => taken.push(raw as usize),
            }
        }
        let aborted = (!taken.is_empty()).then(|| {
            let what = format!(
                "{} communicator(s) of rank {} whose launch of {call} did not end",
                taken.len(),
                first.rank
            );
            let lib = Arc::clone(first.handle.lib());
            crate::teardown::abort(first.lane(), lib, taken, first.diag.bound(), what)
                .outcome(until)
                .is_some()
        });
        for c in watched {
            let _ = c.diag.watchdog_abort(until);
        }
        for c in comms {
            c.reap_orphans(aborted.unwrap_or(true));
        }
    }

    /// Whether NCCL's launch of this communicator's work may still run: its asynchronous
    /// state reads ncclInProgress, or cannot be read (the watchdog has the handle).
    fn launch_may_run(&self) -> bool {
        self.handle.is_live() && self.async_state().is_none_or(|s| s == ncclInProgress)
    }

    /// The lane this communicator's teardowns run on (`CommDiag::lane`).
    pub(crate) fn lane(&self) -> crate::teardown::TeardownLane {
        self.diag.lane(self.cuda_device)
    }

    /// Tears the taken handle `raw` down on the teardown lane (`ncclCommAbort` when
    /// `abort`, else [`destroy_or_abort`](crate::teardown::destroy_or_abort), with the
    /// device's context current), waiting until `until` (at least `MIN_WAIT`): the bound,
    /// and the call's result when it returned in time (past that, the policy applied).
    /// `raw` must have been taken out of this communicator: this is its one teardown.
    pub(super) fn teardown(
        &self,
        raw: ncclComm_t,
        abort: bool,
        why: &str,
        until: Instant,
    ) -> (Duration, Option<ncclResult_t>) {
        let call = if abort {
            Call::Abort
        } else {
            Call::DestroyOrAbort
        };
        self.teardown_call(raw, call, why, until)
    }

    /// [`teardown`](Self::teardown) with `call`. For [`Call::Destroy`] `raw` may still be
    /// in its holder, pinned: the lane's call is its only user until it returned in time,
    /// and past the bound the caller takes it (the call left running is its teardown).
    fn teardown_call(
        &self,
        raw: ncclComm_t,
        call: Call,
        why: &str,
        until: Instant,
    ) -> (Duration, Option<ncclResult_t>) {
        let name = match call {
            Call::Abort => "ncclCommAbort",
            Call::DestroyOrAbort | Call::Destroy => "ncclCommDestroy",
        };
        let what = format!(
            "{name} of rank {} of {} ({why}{})",
            self.rank,
            self.world_size,
            self.graph_note()
        );
        let ctx = match &self.device {
            CommDevice::Cuda(c) => Some(Arc::clone(c)),
            CommDevice::Host => None,
        };
        let lib = Arc::clone(self.handle.lib());
        let raw = raw as usize;
        let work = Box::new(move || {
            if let Some(ctx) = ctx {
                // Not `bind_to_thread`: it would take the context's recorded error away
                // from the user's `check_err`.
                let _ = crate::stream::make_current(&ctx);
            }
            let t = lib.table();
            let raw = raw as ncclComm_t;
            // SAFETY: `raw` was taken out of its communicator's holder, or is pinned in it
            // with this call its only user (the caller's contract): this is its one
            // teardown (a refused destroy tears nothing down and closes the group level
            // it left on this thread), and no one uses it afterwards.
            unsafe {
                match call {
                    Call::Abort => (t.ncclCommAbort)(raw),
                    Call::DestroyOrAbort => crate::teardown::destroy_or_abort(t, raw),
                    Call::Destroy => crate::teardown::destroy_closing_level(t, raw),
                }
            }
        });
        let b = self.diag.bound();
        let r = crate::teardown::run_bounded(self.lane(), b, what, work, until);
        (b.bound, r)
    }

    /// The error of `call` (an abort or a destroy) still running on the lane at `bound`.
    #[cold]
    fn teardown_overdue(&self, call: &str, bound: Duration) -> Error {
        Error::Timeout {
            what: format!(
                "{call} on rank {} did not return within the abort bound (Config::abort_timeout): it goes on in the background{}",
                self.rank,
                self.graph_note()
            ),
            timeout: bound,
        }
    }

    /// What a teardown's report adds when work of this communicator was seen captured into
    /// a CUDA graph: NCCL's destroy and abort wait until every graph holding its work is
    /// destroyed, so a graph still alive is the likely cause of one that does not return.
    fn graph_note(&self) -> &'static str {
        if self.diag.captured() {
            ", and work of this communicator was captured into a CUDA graph: NCCL's destroy \
             and abort wait until every CUDA graph holding its work is destroyed \
             (commDestroySync, init.cc:2232-2234 of NCCL 2.28.9), so a graph still alive is \
             the likely cause: destroy the graph before the communicator"
        } else {
            ""
        }
    }

    /// Flushes pending work everywhere (`ncclCommFinalize`), waits for it, then destroys.
    /// On a failure or timeout the communicator is aborted (once) and the error returned.
    #[track_caller]
    pub fn finalize(self, timeout: Duration) -> Result<()> {
        const OP: &str = "ncclCommFinalize";
        let caller = Location::caller();
        self.ensure_usable(OP)?;
        bind(&self.device)?;
        self.pinned(|| {
            // SAFETY: the handle is live (pinned: the watchdog cannot take it meanwhile).
            let r = unsafe { (self.handle.table().ncclCommFinalize)(self.handle.get()) };
            if r != ncclInProgress {
                self.checked(OP, r, caller)?;
            }
            Ok(())
        })?;
        self.wait_ready(OP, caller, timeout)?;
        self.destroy().map_err(|(_, e)| e)
    }
}

/// Which NCCL call a teardown on the lane makes.
#[derive(Clone, Copy)]
enum Call {
    /// `ncclCommAbort`.
    Abort,
    /// [`destroy_or_abort`](crate::teardown::destroy_or_abort): a drop's.
    DestroyOrAbort,
    /// [`destroy_closing_level`](crate::teardown::destroy_closing_level): `destroy()`'s,
    /// whose refusal comes back to the caller.
    Destroy,
}

impl Drop for Communicator {
    /// Bounded by [`Config::abort_timeout`] from the start of the drop, whatever the state:
    /// a healthy communicator waits for its own work (on its own streams only) and is
    /// destroyed; one that failed, that is dropped during a panic, or whose work did not
    /// complete in time is aborted. The call runs on the teardown lane; what does not
    /// return in time is left there and reported once.
    fn drop(&mut self) {
        if !self.handle.is_live() {
            return; // `abort`, `destroy` or `into_raw` took it
        }
        if !self.handle.is_owned() {
            // A view (`CommRef`): its owner tears the handle down; only the diagnostics go.
            let _ = self.release_in_place();
            return;
        }
        let until = Instant::now() + self.diag.abort_timeout();
        // Dropped during a panic: this rank will not reach the collectives its peers may be
        // waiting in, so abort (which wakes them) rather than destroy.
        let failed = std::thread::panicking() || self.is_failed();
        let drained = !failed && self.diag.drain(until);
        let how = if std::thread::panicking() {
            "it panicked"
        } else if drained {
            "its communicator was dropped"
        } else {
            "its failed communicator was dropped (aborted)"
        };
        let raw = self.take(how, std::thread::panicking());
        if raw.is_null() {
            // The watchdog took it: its one teardown.
            if !self.orphans.borrow().is_empty() {
                let done = self.diag.watchdog_abort(until).and_then(|(_, r)| r);
                self.reap_orphans(done.is_some());
            }
            return;
        }
        let why = if drained {
            "dropped"
        } else if failed {
            "dropped after a failure"
        } else {
            "dropped with work that did not complete in time"
        };
        let (_, r) = self.teardown(raw, !drained, why, until);
        self.reap_orphans(r.is_some());
    }
}

impl Drop for RawComm {
    /// An owned handle still here was never handed to a teardown: one that NCCL gave out
    /// by an init that then failed, before any communicator existed around it. No
    /// operation ever ran on it, so there is no stream work to wait behind: it is aborted
    /// here, once, through the checked path.
    fn drop(&mut self) {
        if let Some(raw) = self.take() {
            // SAFETY: `raw` is an owned, live handle of `lib` that nothing else holds (it
            // was never taken); this is its one teardown.
            let _ = unsafe { nccl_call!(self.lib(), ncclCommAbort(raw), CallContext::NONE) };
        }
    }
}
