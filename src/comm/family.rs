//! Children of a communicator: [`Communicator::split`] and [`Communicator::shrink`], and
//! the adoption of the handle NCCL returns.

use super::*;
use nccl_sys::EntryPoint;

impl Communicator {
    /// Splits this communicator (`ncclCommSplit`); collective over all its ranks.
    ///
    /// Ranks passing the same `color` form a new communicator, ordered by `key` (ties by
    /// rank here). `None` (`NCCL_SPLIT_NOCOLOR`) joins none and gets `Ok(None)`. The child
    /// inherits this communicator's configuration.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// Launcher::host(4).run(|rank| {
    ///     let r = rank.rank();
    ///     // Even and odd ranks form two communicators of 2, ordered by descending rank.
    ///     let sub = rank.comm().split(Some(r as u32 % 2), -(r as i32))?.expect("has a color");
    ///     assert_eq!((sub.world_size(), sub.rank()), (2, 1 - r / 2));
    ///     assert!(rank.comm().split(None, 0)?.is_none());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Communicator>> {
        const CALL: EntryPoint = EntryPoint::ncclCommSplit;
        const OP: &str = CALL.name();
        let caller = Location::caller();
        let color = match color {
            None => nccl_sys::bindings::NCCL_SPLIT_NOCOLOR,
            Some(c) if c <= c_int::MAX as u32 => c as c_int,
            Some(c) => {
                return Err(invalid(
                    OP,
                    format!("color {c} does not fit NCCL's int (max {})", c_int::MAX),
                ))
            }
        };
        super::params::refuse_blocking(OP)?;
        super::params::refuse_sharing(OP, self.names.share, false)?;
        crate::teardown::check_lane(OP, self.lane())?;
        self.issue_child(CALL, caller, color as u64, true, |t, comm, out| {
            // SAFETY: `out` is the heap out-pointer NCCL's job writes; it outlives the job (freed
            // only after the job ended, else leaked); a null config means "inherit the
            // parent's".
            unsafe { (t.ncclCommSplit)(comm, color, key, out, std::ptr::null_mut()) }
        })
    }

    /// Issues `f` (a split or shrink, given the out-pointer its NCCL job writes the child
    /// into) as an operation of this communicator (refused on a failed one when `gate`:
    /// see `issue_inner`), and adopts the child (clique tag `tag`) once the job ended,
    /// inside the operation. On an error the out-pointer is orphaned
    /// ([`orphan_child`](Self::orphan_child)). (A grow's job runs on the new communicator,
    /// which is waited for outside this one's operation: `Communicator::grow`.)
    pub(super) fn issue_child(
        &self,
        call: EntryPoint,
        caller: &'static Location<'static>,
        tag: u64,
        gate: bool,
        f: impl FnOnce(&FunctionTable, ncclComm_t, *mut ncclComm_t) -> ncclResult_t,
    ) -> Result<Option<Communicator>> {
        let dest = AsyncOut::new();
        let out = dest.out();
        let mut adopted = None;
        let then = || {
            adopted = self.adopt_child(call.name(), dest.take(), caller, tag)?;
            Ok(())
        };
        let r = self.issue_inner(call, caller, |t, comm| f(t, comm, out), true, then, gate);
        match r {
            Ok(()) => Ok(adopted),
            Err(e) => Err(self.orphan_child(dest, e)),
        }
    }

    /// Removes `exclude` ranks (`ncclCommShrink`, NCCL 2.27+); collective over the ranks
    /// that stay, which must all pass the same list. The calling rank must not be in
    /// `exclude`.
    ///
    /// NCCL compares no lists: before its call the ranks of this process that stay by
    /// this rank's list compare theirs (bounded by the timeout), and a difference fails
    /// each of them with [`Error::ExcludeMismatch`] naming every list, nothing called (a
    /// rank of this process that stays but never calls is an [`Error::Timeout`] naming
    /// it). Then, with a [`Config::desync_board`], the ranks of other processes that stay
    /// compare theirs through the board the same way (each waited for 2 s at most; a
    /// board that cannot be read compares nothing). With the `diag` feature only.
    #[track_caller]
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        const CALL: EntryPoint = EntryPoint::ncclCommShrink;
        const OP: &str = CALL.name();
        let caller = Location::caller();
        let shrink = self.optional(|t| t.ncclCommShrink, OP)?;
        super::params::refuse_blocking(OP)?;
        super::params::refuse_sharing(OP, self.names.share, true)?;
        let list = self.exclude_list(OP, exclude)?;
        crate::teardown::check_lane(OP, self.lane())?;
        self.shrink_call(
            shrink,
            list,
            nccl_sys::bindings::NCCL_SHRINK_DEFAULT,
            caller,
        )
    }

    /// The `ncclCommShrink` call of [`shrink`](Self::shrink) (`flags` NCCL_SHRINK_DEFAULT,
    /// refused on a failed communicator) and of
    /// [`shrink_after_failure`](Self::shrink_after_failure) (NCCL_SHRINK_ABORT, run on one):
    /// the child from NCCL's job, adopted, or the parent's error with the out-pointer orphaned.
    pub(super) fn shrink_call(
        &self,
        shrink: unsafe extern "C" fn(
            ncclComm_t,
            *mut c_int,
            c_int,
            *mut ncclComm_t,
            *mut nccl_sys::bindings::ncclConfig_t,
            c_int,
        ) -> ncclResult_t,
        mut list: Vec<c_int>,
        flags: u32,
        caller: &'static Location<'static>,
    ) -> Result<Communicator> {
        const CALL: EntryPoint = EntryPoint::ncclCommShrink;
        // NCCL compares no exclude lists (init.cc:2758, 1609-1622 of v2.29.7-1): ranks that
        // disagree would wait in the child's bootstrap until the timeout. The ranks of
        // this process compare theirs first.
        let excluded: Vec<usize> = list.iter().map(|&r| r as usize).collect();
        self.diag.agree_exclude(CALL.name(), &excluded)?;
        let tag = crate::diag::shrink_tag(&list);
        // A shrink in NCCL's abort mode is made for a communicator that failed (or was
        // revoked): it is not refused for that.
        let gate = flags != nccl_sys::bindings::NCCL_SHRINK_ABORT;
        let child = self.issue_child(CALL, caller, tag, gate, |_, comm, out| {
            // SAFETY: `list` holds `list.len()` in-range ranks (NCCL copies it for its job,
            // init.cc:2615-2618); `out` is the heap out-pointer NCCL's job writes, alive until the
            // job ended (else leaked); null config inherits the parent's; `flags` is
            // NCCL_SHRINK_DEFAULT or NCCL_SHRINK_ABORT.
            unsafe {
                shrink(
                    comm,
                    list.as_mut_ptr(),
                    list.len() as c_int,
                    out,
                    std::ptr::null_mut(),
                    flags as c_int,
                )
            }
        })?;
        child.ok_or_else(|| invalid(CALL.name(), "NCCL returned no communicator"))
    }

    /// After a split or shrink that failed (`e`): NCCL's job stores the child even after a
    /// failure (init.cc:1612-1614), so the out-pointer is read once the job has ended, and a child
    /// found there is aborted. When the parent already left ncclInProgress that is now;
    /// otherwise the job (waiting for a missing rank, say) ends only when the parent is
    /// aborted (NCCL's abort joins it first: `ncclCommEnsureReady` -> `ncclGroupJobAbort`,
    /// init.cc:2519), so the out-pointer stays with the parent until its teardown
    /// (`reap_orphans`). Returns `e`.
    #[cold]
    pub(super) fn orphan_child(
        &self,
        dest: AsyncOut<nccl_sys::bindings::ncclComm>,
        e: Error,
    ) -> Error {
        if self.job_ended() {
            self.abort_orphan(dest.take());
        } else {
            self.orphans.borrow_mut().push(dest);
        }
        e
    }

    /// After this communicator's teardown: `torn_down` (NCCL's teardown returned, so any
    /// job of it has ended) aborts the children its failed splits and shrinks left in their
    /// out-pointers; otherwise the out-pointers are leaked to jobs that may still write them.
    pub(super) fn reap_orphans(&self, torn_down: bool) {
        for dest in self.orphans.borrow_mut().drain(..) {
            if torn_down {
                self.abort_orphan(dest.take());
            } else {
                dest.leak();
            }
        }
    }

    /// Aborts `raw` (when not null), a child handle nobody else has, on the lane, bounded.
    fn abort_orphan(&self, raw: ncclComm_t) {
        if raw.is_null() {
            return;
        }
        let until = Instant::now() + self.diag.abort_timeout();
        let _ = self.teardown(raw, true, "the child of a failed split or shrink", until);
    }

    /// Wraps a child handle from split/shrink, reading its rank and size from NCCL.
    pub(super) fn adopt_child(
        &self,
        call: &'static str,
        child: ncclComm_t,
        caller: &'static Location<'static>,
        tag: u64,
    ) -> Result<Option<Communicator>> {
        if child.is_null() {
            return Ok(None);
        }
        let mut comm = Communicator::new(
            RawComm::owned(child, Arc::clone(self.handle.lib())),
            self.device.clone(),
            0,
            0,
            self.diag.child(tag),
        )
        .keeping(self.names.clone());
        // The child inherits the parent's non-blocking mode: wait (bounded) until it is ready.
        // This runs inside the parent's operation, so the watchdog's timeout of the
        // parent's clique (with its report of who is behind) normally ends a wait for a
        // missing rank; the wait's own limit is a margin later.
        comm.wait_ready_for(
            call,
            caller,
            self.diag.timeout() + CHILD_WAIT_MARGIN,
            &self.diag,
        )?;
        comm.read_shape(caller)?;
        Ok(Some(comm))
    }

    /// Reads rank and size from NCCL (`ncclCommUserRank`, `ncclCommCount`).
    pub(super) fn read_shape(&mut self, caller: &'static Location<'static>) -> Result<()> {
        let (mut rank, mut count): (c_int, c_int) = (0, 0);
        // SAFETY: `rank` is writable and the handle live.
        let r = unsafe { (self.handle.table().ncclCommUserRank)(self.handle.get(), &mut rank) };
        self.checked("ncclCommUserRank", r, caller)?;
        // SAFETY: `count` is writable and the handle live.
        let r = unsafe { (self.handle.table().ncclCommCount)(self.handle.get(), &mut count) };
        self.checked("ncclCommCount", r, caller)?;
        self.rank = rank.max(0) as usize;
        self.world_size = count.max(0) as usize;
        self.diag.attach(self.diag_view());
        Ok(())
    }
}
