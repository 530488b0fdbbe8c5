//! [`Group`]: operations kept, then enqueued together between one `ncclGroupStart` and
//! its `ncclGroupEnd`.

use std::marker::PhantomData;

use smallvec::SmallVec;
use std::panic::Location;
use std::sync::Arc;

use crate::comm::Communicator;
use crate::error::invalid;
use crate::error::Result;
use crate::library::{CallContext, Library};
use crate::nccl_call;
use crate::ops::Op;

/// Operations fused between `ncclGroupStart` and `ncclGroupEnd`: send/receive pairs that
/// must progress together, or one thread driving several communicators (one per device).
///
/// Any operation goes in, in place or not: describe it with its `*_op` method (such as
/// [`Communicator::all_reduce_op`]) and [`push`](Self::push) the [`Op`].
///
/// * **NCCL sees the group only at its end.** [`push`](Self::push) keeps the checked
///   operation; [`end`](Self::end) makes `ncclGroupStart`, every operation's call and
///   `ncclGroupEnd` in one go. NCCL's group state belongs to the calling thread, and
///   inside it NCCL only queues every call (on any communicator) until the outermost end:
///   so no NCCL group is ever open while the caller's code runs. A collective, a
///   registration, a window, a new communicator or another `Group` made while this one is
///   being filled runs on its own, at once, as it would outside (it is not part of this
///   group); and a group leaked with `std::mem::forget` leaves nothing queued in NCCL.
/// * The group is enqueued on every path out: [`end`](Self::end), an early `?`, an error
///   or a panic (in `Drop`).
/// * Every buffer passed to the group stays borrowed until the group ends, so none can be
///   freed, moved or read while NCCL may still use it; cudarc's event guards are released
///   only after NCCL launched the group's work.
/// * `!Send`: NCCL's group state belongs to the calling thread.
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
    /// The operations, in the order they were pushed: described and checked, their
    /// buffers borrowed, and not yet seen by NCCL. They are enqueued together at the
    /// group's end. Their storage is the thread's spare (`Spare`), taken at the first push
    /// and given back when the group drops: no allocation once a thread's groups stop
    /// growing, and a `Group` small enough to move without a copy of its operations.
    ops: Vec<Op<'a>>,
    /// Where the group was made: the line its `Drop` (a `?` out of the caller's function)
    /// names, since a `Drop` has no caller of its own.
    made_at: &'static Location<'static>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("operations", &self.ops.len())
            .finish()
    }
}

impl Default for Group<'_> {
    #[track_caller]
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> Group<'a> {
    /// An empty group. Nothing reaches NCCL until it ends. An error of a group that is
    /// dropped unended (it is ended then) names this line.
    #[track_caller]
    #[inline(always)]
    pub fn new() -> Group<'a> {
        Group {
            ops: Vec::new(),
            made_at: Location::caller(),
            _not_send: PhantomData,
        }
    }

    /// Runs `f` inside a group and ends it, whatever `f` returns. The group's errors
    /// name the line of this call.
    #[track_caller]
    pub fn run<R>(f: impl FnOnce(&mut Group<'a>) -> Result<R>) -> Result<R> {
        let caller = Location::caller();
        let mut g = Group::new();
        g.made_at = caller;
        let out = f(&mut g);
        let end = g.finish(caller);
        let out = out?;
        end?;
        Ok(out)
    }

    /// Ends the group: `ncclGroupStart`, the operations in the order they were pushed, and
    /// `ncclGroupEnd`, which launches them (host provider: runs them) now. An error of one
    /// operation's NCCL call ends the group with nothing launched, as NCCL does, and marks
    /// every communicator of the group failed; an operation the crate refuses before NCCL
    /// sees it (its communicator failed meanwhile) stops the group there, and what was
    /// issued before it is launched and waited for; NCCL's remote error after a rank of a
    /// communicator's clique left fails that clique too (every rank's `is_failed()`), as
    /// for a single call.
    #[track_caller]
    #[inline(always)] // the group's inline operations are not copied into the call
    pub fn end(mut self) -> Result<()> {
        self.finish(Location::caller())
    }

    fn finish(&mut self, caller: &'static Location<'static>) -> Result<()> {
        // Cleared (the operations and their guards dropped) on every path out, an unwind
        // included, after the group's end (`open`, declared later, is dropped first): so a
        // `Group` dropped after a panic in here issues nothing again.
        let ops = Issued(&mut self.ops);
        let Some(first) = ops.0.first() else {
            return Ok(());
        };
        let lib = first.comm().library();
        // Every communicator of the group is pinned (claimed against the watchdog) from
        // before `ncclGroupStart` until its work is launched, so none is aborted under it.
        let mut comms = Pinned(SmallVec::new());
        for op in ops.0.iter() {
            let c = op.comm();
            // Consecutive operations usually share their communicator.
            if comms.0.last().is_some_and(|p| std::ptr::eq(*p, c)) {
                continue;
            }
            if !comms.0.iter().any(|p| std::ptr::eq(*p, c)) {
                c.diag.pin()?;
                c.diag.group_end_begins();
                comms.0.push(c);
            }
        }
        // The relays of operations on the per-thread stream (`Op::onto_relay`), left once
        // the group's work is launched.
        let mut relays: SmallVec<[&'a crate::stream::Relay; 2]> = SmallVec::new();
        let mut open = Open::start(lib)?;
        let mut first_error = None;
        // Issued where they are kept (no copy of an operation); they and their guards stay
        // until the launch.
        for op in ops.0.iter_mut() {
            if op.needs_relay() {
                if let Err(e) = Self::relayed(op, &mut relays) {
                    first_error = Some(e);
                    break;
                }
            }
            // The rest is not issued, and the group's end returns this error. NCCL
            // launches nothing after a failed call of its own (group.cc groupCleanup), but
            // what the crate refused before NCCL saw it leaves the operations issued so far
            // to be launched: they are waited for like any.
            if let Err(e) = op.issue(true) {
                first_error = Some(e);
                break;
            }
        }
        let r = open.end(&comms.0, caller);
        let r = Self::settle(&comms.0, r, caller);
        let mut r = match first_error {
            Some(e) => Err(e),
            None => r,
        };
        for relay in relays {
            r = Op::leave(relay, r);
        }
        // Only now may cudarc record its events (the operations' guards drop with them):
        // the work is enqueued, and the per-thread stream waits for the relays. On
        // non-blocking communicators NCCL's ncclGroupEnd returns ncclInProgress and its
        // group thread launches the kernels afterwards (group.cc:706-738), so an event
        // recorded before `settle` saw them launched would come before them on the stream.
        drop(ops);
        drop(comms);
        r
    }

    /// Moves `op` onto its communicator's relay, noted in `relays` to be left after the
    /// launch.
    #[cold]
    #[inline(never)]
    fn relayed(
        op: &mut Op<'a>,
        relays: &mut SmallVec<[&'a crate::stream::Relay; 2]>,
    ) -> Result<()> {
        let relay = op.onto_relay()?;
        if !relays.iter().any(|r| std::ptr::eq(*r, relay)) {
            relays.push(relay);
        }
        Ok(())
    }

    /// Waits for the group's launch and publishes its work, with its communicators still
    /// pinned.
    fn settle(
        comms: &[&'a Communicator],
        r: Result<bool>,
        caller: &'static Location<'static>,
    ) -> Result<()> {
        match r {
            Ok(true) => {
                // NCCL's group end linked its job to each communicator until a poll reads
                // ncclSuccess (group.cc:802-818 of v2.29.7-1): no revoke before that.
                for c in comms {
                    c.set_job_linked(true);
                }
                // Non-blocking communicators: wait (bounded) until each has launched its part.
                for c in comms {
                    if let Err(e) = c.wait_ready("ncclGroupEnd", caller, c.diag.timeout()) {
                        // As below: a peer's remote error fails the clique too.
                        let e = c.diag.group_failed(&e).unwrap_or(e);
                        // The group's buffers stay borrowed until NCCL's launch has ended.
                        Communicator::end_launches(comms, "ncclGroupEnd");
                        for c in comms {
                            c.diag.group_end_failed();
                        }
                        return Err(Communicator::note_unrevocable(comms, e));
                    }
                    c.diag.publish_group();
                }
                Ok(())
            }
            Err(mut e) => {
                let timed_out = e.code() == Some(crate::ResultCode::Timeout);
                let mut peer_timeout = None;
                for c in comms {
                    let mine = c.diag.group_failed(&e);
                    peer_timeout = peer_timeout.or(mine);
                    c.diag.group_end_failed();
                    c.mark_failed(&e);
                    // As the watchdog does for a single collective: a `Config::elastic`
                    // communicator whose clique timed out or lost a rank is revoked where it
                    // is (its handle stays for `shrink_after_failure`). Still pinned, and
                    // NCCL's group call has returned: nothing of the group is in flight
                    // that a revoke would not end.
                    if c.diag.elastic() && (timed_out || c.diag.failed()) {
                        c.revoke_after_failed_group("ncclGroupEnd");
                    }
                }
                if let Some(p) = peer_timeout {
                    e = p;
                }
                Err(e)
            }
            Ok(false) => {
                // The operations are on their streams now: the watchdog may track them.
                for c in comms {
                    c.diag.publish_group();
                }
                Ok(())
            }
        }
    }

    /// Adds `op` to this group. NCCL sees it only when the group ends, with the group's
    /// other operations between one `ncclGroupStart` and its `ncclGroupEnd`; until then
    /// its buffers stay borrowed, and after that until its work is launched. An operation
    /// on a communicator of another NCCL library than the group's is refused.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::{Group, ReduceOp};
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
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[inline(always)]
    pub fn push(&mut self, op: Op<'a>) -> Result<()> {
        if let Some(first) = self.ops.first() {
            let same = std::ptr::eq(first.comm(), op.comm())
                || Arc::ptr_eq(first.comm().library(), op.comm().library());
            if !same {
                return Err(invalid(
                    op.name(),
                    "all communicators of a group must come from one NCCL library",
                ));
            }
        }
        if self.ops.len() == self.ops.capacity() {
            self.grow();
        }
        // Moved word by word, with loads as wide as the stores that built `op` just before
        // (it is made on the caller's stack, then pushed): a wider load over two of them
        // waits until both reach the cache (a store-forwarding stall, where the compiler's
        // own 16-byte copy spent about a tenth of a group's time in `perf`). Volatile, so
        // the loads are not merged back. Fake driver, group of 8, tracking off: 1.6 ns less
        // per operation in alternating runs.
        let len = self.ops.len();
        let src = (&op as *const Op<'a>).cast::<std::mem::MaybeUninit<u64>>();
        // SAFETY: room for one more (above), in storage aligned for `Op`; `op` is copied
        // whole as `MaybeUninit` words (its padding included, its pointers' provenance
        // kept: its size is a multiple of 8 and its alignment 8, asserted below), then
        // forgotten, so it is moved, not duplicated.
        unsafe {
            let dst = self
                .ops
                .as_mut_ptr()
                .add(len)
                .cast::<std::mem::MaybeUninit<u64>>();
            for i in 0..std::mem::size_of::<Op<'a>>() / 8 {
                dst.add(i).write(std::ptr::read_volatile(src.add(i)));
            }
            self.ops.set_len(len + 1);
        }
        std::mem::forget(op);
        Ok(())
    }

    /// Room for one more operation: the thread's spare storage at the first push, else
    /// more of it.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        if self.ops.capacity() == 0 {
            self.ops = Spare::take();
        }
        self.ops.reserve(8);
    }
}

/// Each thread's storage for a group's operations, kept between its groups: a group
/// allocates only when its thread's groups grow, and the `Group` value stays small (its
/// operations inline, 1 KiB, were copied whole into its end: about 25 instructions per
/// operation in a group of 8, callgrind over the overhead bench). A `Group` leaked with
/// `mem::forget` leaks its storage, and the thread's next group makes a new one.
struct Spare;

/// The most operations whose storage a thread keeps between its groups (8 KiB at 128
/// bytes an operation).
const SPARE_KEPT: usize = 64;

impl Spare {
    /// The thread's spare storage (empty), or a new one.
    fn take<'a>() -> Vec<Op<'a>> {
        Spare::relabel(SPARE.try_with(|s| s.take()).unwrap_or_default())
    }

    /// Keeps `ops`' storage for the thread's next group, its operations dropped first
    /// (storage for more than [`SPARE_KEPT`] operations is freed instead).
    fn give_back(ops: &mut Vec<Op<'_>>) {
        if ops.capacity() == 0 || ops.capacity() > SPARE_KEPT {
            *ops = Vec::new();
            return;
        }
        let v: Vec<Op<'static>> = Spare::relabel(std::mem::take(ops));
        // A thread whose locals are being destroyed frees it instead.
        let _ = SPARE.try_with(|s| s.replace(v));
    }

    /// `v`'s allocation as an empty vector of operations of another lifetime: its
    /// operations are dropped first.
    fn relabel<'x, 'y>(mut v: Vec<Op<'x>>) -> Vec<Op<'y>> {
        v.clear();
        let mut v = std::mem::ManuallyDrop::new(v);
        // SAFETY: the vector is empty (cleared above), so it holds no value of either
        // lifetime; `Op<'x>` and `Op<'y>` have one layout, so its allocation (not freed:
        // `v` is not dropped) is valid for `Op<'y>` with the same capacity.
        unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<Op<'y>>(), 0, v.capacity()) }
    }
}

const _: () = assert!(
    std::mem::size_of::<Op<'static>>().is_multiple_of(8)
        && std::mem::align_of::<Op<'static>>() == 8
);

std::thread_local! {
    /// The spare storage of this thread's groups (see [`Spare`]).
    static SPARE: std::cell::Cell<Vec<Op<'static>>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A group's operations while it ends; cleared when dropped.
struct Issued<'x, 'a>(&'x mut Vec<Op<'a>>);

impl Drop for Issued<'_, '_> {
    fn drop(&mut self) {
        self.0.clear();
    }
}

/// The communicators of a group being enqueued, each pinned; unpinned when dropped.
struct Pinned<'a>(SmallVec<[&'a Communicator; 8]>);

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        for c in &self.0 {
            c.diag.group_end_done();
            c.diag.unpin();
        }
    }
}

/// NCCL's group, open on this thread between [`Open::start`] and [`Open::end`] only, with
/// no code of the caller's in between: so no call of the caller's can fall into it, and a
/// leaked [`Group`] leaves nothing queued. Dropped unended (an unwind), it still ends.
struct Open<'l> {
    lib: &'l Library,
    open: bool,
}

impl<'l> Open<'l> {
    fn start(lib: &'l Library) -> Result<Open<'l>> {
        // SAFETY: ncclGroupStart takes no arguments; it is paired with the ncclGroupEnd of
        // `end` or `Drop`.
        unsafe { nccl_call!(lib, ncclGroupStart(), CallContext::NONE) }?;
        Ok(Open { lib, open: true })
    }

    /// `ncclGroupEnd`: the operations enqueued since `start` are launched (host provider:
    /// run) now, with `comms` (the group's communicators) pinned. `Ok(true)` while NCCL's
    /// thread launches them (ncclInProgress).
    fn end(&mut self, comms: &[&Communicator], caller: &'static Location<'static>) -> Result<bool> {
        self.open = false;
        let lib = self.lib;
        let ctx = CallContext::at(None, caller);
        // The group's communicators stay pinned through the call, so the watchdog cannot
        // abort them to end it: its waits end by their tightest timeout instead. NVIDIA's
        // NCCL returns `ncclInProgress` at once (its communicators are non-blocking) and
        // `settle` bounds the wait; the host provider runs the group inside the call, so it
        // is given that deadline.
        let timeout = comms.iter().map(|c| c.diag.timeout()).min();
        // SAFETY: closes the ncclGroupStart of `start`; every buffer of the group is still
        // borrowed by the group's operations' guards. `Ok(true)`: ncclInProgress, NCCL's
        // answer for every group of two or more ranks (its launch runs on the group's
        // thread, which `settle` waits for), taken apart before the check, which would
        // build an error (strings, NCCL's last error) for it on every group.
        let end = || {
            // SAFETY: as above: closes `start`'s ncclGroupStart, the buffers still borrowed.
            let raw = unsafe { (lib.table().ncclGroupEnd)() };
            if raw == nccl_sys::bindings::ncclInProgress {
                Ok(true)
            } else {
                lib.check("ncclGroupEnd", raw, ctx).map(|()| false)
            }
        };
        let r = match timeout {
            #[cfg(feature = "host")]
            Some(t) if lib.provider() == crate::Provider::Host => {
                // A peer that leaves while the group waits for it ends the wait at once
                // (the watchdog would abort an unpinned communicator for it). The check
                // reads each communicator's diagnostics in place: nothing is allocated.
                let cancel = || comms.iter().any(|c| c.diag.peer_departed());
                crate::host::with_deadline(std::time::Instant::now() + t, Some(&cancel), end)
            }
            _ => end(),
        };
        match r {
            // Timed out inside the call (host provider): as the watchdog would, time out
            // the cliques of the group's communicators, so that every rank fails fast.
            Err(e) if e.code() == Some(crate::ResultCode::Timeout) => {
                let mut first = None;
                for c in comms {
                    let what = format!(
                        "in the group ended at {caller}, did not complete within {:?} on \
                         rank {} of {}: a peer never joined it (it skipped the group, left, \
                         or is late) ({e})",
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
        }
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: closes the ncclGroupStart of `start`.
            let _ = unsafe { nccl_call!(self.lib, ncclGroupEnd(), CallContext::NONE) };
        }
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        // On `?`, an error or a panic: still enqueue the group, exactly once.
        let _ = self.finish(self.made_at);
        Spare::give_back(&mut self.ops);
    }
}
