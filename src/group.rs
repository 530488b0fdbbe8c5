//! [`Group`]: `ncclGroupStart` / `ncclGroupEnd` as a guard.

use std::marker::PhantomData;

use smallvec::SmallVec;
use std::panic::Location;
use std::sync::Arc;

use crate::buffer::BufferGuard;
use crate::comm::Communicator;
use crate::error::invalid;
use crate::error::Result;
use crate::library::{CallContext, Library};
use crate::nccl_call;
use crate::ops::{Guards, Op};

/// Operations fused between `ncclGroupStart` and `ncclGroupEnd`: send/receive pairs that
/// must progress together, or one thread driving several communicators (one per device).
///
/// Any operation goes in, in place or not: describe it with its `*_op` method (such as
/// [`Communicator::all_reduce_op`]) and [`push`](Self::push) the [`Op`].
///
/// * `ncclGroupEnd` runs on every path out: [`end`](Self::end), an early `?`, an error or a
///   panic (in `Drop`).
/// * Every buffer passed to the group stays borrowed until the group ends, so none can be
///   freed, moved or read while NCCL may still use it; cudarc's event guards are released
///   only after `ncclGroupEnd`.
/// * `!Send`: NCCL's group state belongs to the calling thread.
/// * Only operations: once the group has started (at its first `push`), creating a
///   communicator on this thread (`init_rank`, `split`, `shrink`, `grow`, ...) or revoking
///   one is refused with [`Error::InvalidArgument`](crate::Error::InvalidArgument), since
///   NCCL would only queue it until the group's end.
///
/// ```
/// use nccl_safe::{Communicator, CommDevice, Group, Stream};
/// // One thread drives two ranks: their send/recv pairs must be in one group.
/// let comms = Communicator::init_all(&[CommDevice::Host, CommDevice::Host])?;
/// let (a, b) = (vec![1i32; 3], vec![2i32; 3]);
/// let (mut at_a, mut at_b) = (vec![0i32; 3], vec![0i32; 3]);
/// let mut g = Group::new();
/// g.push(comms[0].send_op(&a, 1, &Stream::Host)?)?;
/// g.push(comms[1].recv_op(&mut at_b, 0, &Stream::Host)?)?;
/// g.push(comms[1].send_op(&b, 0, &Stream::Host)?)?;
/// g.push(comms[0].recv_op(&mut at_a, 1, &Stream::Host)?)?;
/// g.end()?;
/// assert_eq!((at_a, at_b), (vec![2; 3], vec![1; 3]));
/// # Ok::<(), nccl_safe::Error>(())
/// ```
pub struct Group<'a> {
    /// The library of the started group, borrowed from its first communicator (no
    /// reference count traffic per group).
    lib: Option<&'a Arc<Library>>,
    /// The distinct communicators of its operations (inline for up to 8), each pinned
    /// (claimed against the watchdog) from its first operation until the group's end, so
    /// no handle is aborted under `ncclGroupEnd`.
    comms: SmallVec<[&'a Communicator; 8]>,
    /// cudarc guards, released after `ncclGroupEnd` (host buffers have none).
    guards: SmallVec<[BufferGuard<'a>; 8]>,
    operations: usize,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("started", &self.lib.is_some())
            .field("operations", &self.operations)
            .finish()
    }
}

impl Default for Group<'_> {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether dropping `g` does anything (records cudarc's event on a tracked buffer): only
/// those guards are kept until `ncclGroupEnd`; an untracked buffer's is dropped at once.
#[inline(always)]
fn acts(g: &BufferGuard<'_>) -> bool {
    use cudarc::driver::SyncOnDrop;
    matches!(
        g,
        BufferGuard::Cuda(SyncOnDrop::Record(Some(_)) | SyncOnDrop::Sync(Some(_)))
    )
}

impl<'a> Group<'a> {
    /// An empty group. `ncclGroupStart` is called with the first operation (on that
    /// communicator's library).
    pub fn new() -> Group<'a> {
        Group {
            lib: None,
            comms: SmallVec::new(),
            guards: SmallVec::new(),
            operations: 0,
            _not_send: PhantomData,
        }
    }

    /// Runs `f` inside a group and ends it, whatever `f` returns.
    pub fn run<R>(f: impl FnOnce(&mut Group<'a>) -> Result<R>) -> Result<R> {
        let mut g = Group::new();
        let out = f(&mut g);
        let end = g.end();
        let out = out?;
        end?;
        Ok(out)
    }

    /// Starts the group on `comm`'s library if needed; all operations of a group must use
    /// one library. (A failed communicator is refused by the operation's description, and
    /// again in `issue`.)
    #[inline(always)]
    fn enter(&mut self, comm: &'a Communicator, call: &'static str) -> Result<()> {
        match self.lib {
            Some(lib) if Arc::ptr_eq(lib, comm.library()) => Ok(()),
            _ => self.start(comm, call),
        }
    }

    #[inline(never)]
    fn start(&mut self, comm: &'a Communicator, call: &'static str) -> Result<()> {
        if self.lib.is_some() {
            return Err(invalid(
                call,
                "all communicators of a group must come from one NCCL library",
            ));
        }
        let lib = comm.library();
        // SAFETY: ncclGroupStart takes no arguments; it is paired with the ncclGroupEnd of
        // `end` or `Drop`.
        unsafe { nccl_call!(lib, ncclGroupStart(), CallContext::NONE) }?;
        crate::diag::group_started();
        self.lib = Some(lib);
        Ok(())
    }

    /// Notes (and pins) the communicator of an operation about to be enqueued.
    #[inline(never)]
    fn note(&mut self, comm: &'a Communicator) -> Result<()> {
        if !self.comms.iter().any(|c| std::ptr::eq(*c, comm)) {
            // Inside the group the communicator is never between operations, so the pin
            // always takes (or fails because the watchdog aborts it).
            comm.diag.pin()?;
            self.comms.push(comm);
        }
        Ok(())
    }

    #[inline(never)]
    fn keep_guards(&mut self, guards: Guards<'a>) {
        for g in guards {
            if acts(&g) {
                self.guards.push(g);
            }
        }
    }

    /// Ends the group (`ncclGroupEnd`): the operations are launched (host provider: run)
    /// now. An error marks every communicator of the group failed; NCCL's remote error
    /// after a rank of a communicator's clique left fails that clique too (every rank's
    /// `is_failed()`), as for a single call.
    #[track_caller]
    pub fn end(mut self) -> Result<()> {
        self.finish(Location::caller())
    }

    fn finish(&mut self, caller: &'static Location<'static>) -> Result<()> {
        let Some(lib) = self.lib.take() else {
            return Ok(());
        };
        let ctx = CallContext::at(None, caller);
        // The group's communicators stay pinned through the call, so the watchdog cannot
        // abort them to end it: its waits end by their tightest timeout instead. NVIDIA's
        // NCCL returns `ncclInProgress` at once (its communicators are non-blocking) and
        // `settle` bounds the wait; the host provider runs the group inside the call, so it
        // is given that deadline.
        let timeout = self.comms.iter().map(|c| c.diag.timeout()).min();
        // SAFETY: closes the ncclGroupStart of `enter`; every buffer of the group is still
        // borrowed by `self`.
        let end = || unsafe { nccl_call!(lib, ncclGroupEnd(), ctx) };
        let r = match timeout {
            #[cfg(feature = "host")]
            Some(t) if lib.provider() == crate::Provider::Host => {
                // A peer that leaves while the group waits for it ends the wait at once
                // (the watchdog would abort an unpinned communicator for it). The check
                // reads each communicator's diagnostics in place: nothing is allocated.
                let cancel = || self.comms.iter().any(|c| c.diag.peer_departed());
                crate::host::with_deadline(std::time::Instant::now() + t, Some(&cancel), end)
            }
            _ => end(),
        };
        let r = match r {
            // Timed out inside the call (host provider): as the watchdog would, time out
            // the cliques of the group's communicators, so that every rank fails fast.
            Err(e) if e.code() == Some(crate::ResultCode::Timeout) => {
                let mut first = None;
                for c in &self.comms {
                    let what = format!(
                        "the group ended at {caller} did not complete within {:?} on rank {} \
                         of {}: a peer never joined it (it skipped the group, left, or is \
                         late) ({e})",
                        c.diag.timeout(),
                        c.rank(),
                        c.world_size()
                    );
                    let err = c.diag.group_timed_out(what);
                    first.get_or_insert(err);
                }
                Err(first.unwrap_or(e))
            }
            r => r,
        };
        crate::diag::group_ended();
        let r = self.settle(r, caller);
        // Only now may cudarc record its events: the work is enqueued. On non-blocking
        // communicators NCCL's ncclGroupEnd returns ncclInProgress and its group thread
        // launches the kernels afterwards (group.cc:706-738), so an event recorded before
        // `settle` saw them launched would come before them on the stream.
        self.guards.clear();
        for c in &self.comms {
            c.diag.unpin();
        }
        r
    }

    /// Waits for the group's launch and publishes its work, with its communicators still
    /// pinned.
    fn settle(&self, r: Result<()>, caller: &'static Location<'static>) -> Result<()> {
        match r {
            Err(e) if e.code() == Some(crate::ResultCode::InProgress) => {
                // Non-blocking communicators: wait (bounded) until each has launched its part.
                for c in self.comms.iter() {
                    if let Err(e) = c.wait_ready("ncclGroupEnd", caller, c.diag.timeout()) {
                        // As below: a peer's remote error fails the clique too.
                        c.diag.group_failed(&e);
                        return Err(e);
                    }
                    c.diag.publish_group();
                }
                Ok(())
            }
            Err(e) => {
                for c in &self.comms {
                    c.diag.group_failed(&e);
                    c.mark_failed(&e);
                }
                Err(e)
            }
            Ok(()) => {
                // The operations are on their streams now: the watchdog may track them.
                for c in &self.comms {
                    c.diag.publish_group();
                }
                Ok(())
            }
        }
    }

    /// Enqueues `op` inside this group (starting the group with the first operation). Its
    /// buffers stay borrowed, and cudarc's guards held, until the group ends; an operation
    /// on a communicator of another NCCL library than the group's is refused.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, Group, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, n, comm, s) = (rank.rank(), rank.world_size(), rank.comm(), rank.stream());
    ///     let (send, mut got) = (vec![r as u8; 2], vec![0u8; 2]);
    ///     let mut gathered = vec![0u8; 3];
    ///     let mut g = Group::new();
    ///     g.push(comm.send_op(&send, (r + 1) % n, s)?)?;
    ///     g.push(comm.recv_op(&mut got, (r + n - 1) % n, s)?)?;
    ///     gathered[r] = 10 + r as u8;
    ///     g.push(comm.all_gather_in_place_op(&mut gathered, s)?)?;
    ///     g.end()?;
    ///     assert_eq!(got, vec![((r + n - 1) % n) as u8; 2]);
    ///     assert_eq!(gathered, vec![10, 11, 12]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[inline(always)]
    pub fn push(&mut self, op: Op<'a>) -> Result<()> {
        let comm = op.comm();
        self.enter(comm, op.name())?;
        // Consecutive operations usually share their communicator.
        if !self.comms.last().is_some_and(|c| std::ptr::eq(*c, comm)) {
            self.note(comm)?;
        }
        let guards = op.enqueue()?;
        self.operations += 1;
        if guards.iter().any(acts) {
            self.keep_guards(guards);
        }
        Ok(())
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        // On `?`, an error or a panic: still close the group, exactly once.
        let _ = self.finish(Location::caller());
    }
}
