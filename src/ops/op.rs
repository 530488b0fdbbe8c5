//! [`Op`]: one checked operation, holding its borrows until it is run or its group ends.

use std::ffi::{c_int, c_void};
use std::panic::Location;

use nccl_sys::{ncclRedOp_t, CallArgs, Collective, EntryPoint, Extent, Length, OffRoot, RankArg};

use super::Reduction;
use crate::buffer::{BufferGuard, RecvBuffer, SendBuffer};
use crate::comm::Communicator;
use crate::diag::OpInfo;
use crate::error::{invalid, BufferRole, Error, Result};
use crate::stream::{AsStream, StreamRef};
use crate::types::NcclType;

/// The guards of one operation (at most a send and a receive buffer).
pub(crate) type Guards<'a> = [BufferGuard<'a>; 2];

/// One collective or point-to-point operation, its arguments checked and its buffers (and
/// reduction, stream and communicator) borrowed, ready to be enqueued.
///
/// Made by the `*_op` methods of [`Communicator`] (such as
/// [`all_reduce_op`](Communicator::all_reduce_op)), which run every check before NCCL sees
/// anything; a failed check is a typed error and leaves the communicator usable. Then:
///
/// * [`run`](Self::run) enqueues it on its own (what [`Communicator::all_reduce`] and the
///   other plain methods do), or
/// * [`Group::push`](crate::Group::push) adds it to a group, which keeps it (and its
///   borrows) and enqueues it with the group's other operations at the group's end.
///
/// The value holds no allocation. Dropping it without running it enqueues no NCCL work (it
/// releases its buffers, as the end of any operation does).
///
/// ```
/// use nccl_launch::Launcher;
/// use nccl_safe::{Group, ReduceOp};
/// Launcher::host(2).run(|rank| {
///     let (comm, s) = (rank.comm(), rank.stream());
///     let mut grads = vec![1.0f32; 4];
///     let mut stats = vec![rank.rank() as u32; 2];
///     let mut g = Group::new();
///     g.push(comm.all_reduce_in_place_op(&mut grads, ReduceOp::Sum, s)?)?;
///     g.push(comm.all_reduce_in_place_op(&mut stats, ReduceOp::Max, s)?)?;
///     g.end()?;
///     assert_eq!((grads, stats), (vec![2.0; 4], vec![1; 2]));
///     Ok(())
/// })?;
/// # Ok::<(), nccl_launch::Error>(())
/// ```
#[must_use = "an operation does nothing until it is run or pushed into a Group"]
pub struct Op<'a> {
    comm: &'a Communicator,
    /// The reduction, for a collective that reduces (else unused).
    red: ncclRedOp_t,
    /// For a put, the byte offset in the target window (else unused).
    offset: usize,
    send: *const c_void,
    recv: *mut c_void,
    /// Its name, element type and count, root and stream (what the diagnostics record).
    /// Kept once: a group holds its operations by value, and at 128 bytes or less an `Op`
    /// moves without a `memcpy` call.
    info: OpInfo<'a>,
    caller: &'static Location<'static>,
    /// Never read: held for their drop, which releases the buffers (cudarc records its
    /// events), once the work is enqueued (the operation is dropped after its call, or at
    /// the end of its group).
    #[allow(dead_code)]
    guards: Guards<'a>,
}

// An operation is moved from where it is made into its group's storage (or into `run`):
// within 128 bytes a move is a few stores, past it a `memcpy` call (about 40 instructions
// per move, measured with callgrind over the overhead bench).
const _: () = assert!(std::mem::size_of::<Op<'static>>() <= 128);

impl std::fmt::Debug for Op<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op")
            .field("call", &self.info.name())
            .field("rank", &self.comm.rank())
            .field("caller", &self.caller)
            .finish_non_exhaustive()
    }
}

impl<'a> Op<'a> {
    /// Enqueues the operation on its own (`ncclAllReduce` and so on, through the
    /// communicator's one checked call path). The buffers are released when it returns.
    #[inline(always)]
    pub fn run(self) -> Result<()> {
        if self.needs_relay() {
            return self.run_relayed();
        }
        // The guards drop as `self` does, after the call: cudarc's events then come
        // after the work on the stream.
        self.issue(false)
    }

    /// Whether NCCL would launch it from a thread of its own on the per-thread stream
    /// (`CU_STREAM_PER_THREAD` with two or more ranks): then it runs on the communicator's
    /// relay instead ([`onto_relay`](Self::onto_relay), `crate::stream::Relay`).
    #[inline(always)]
    pub(crate) fn needs_relay(&self) -> bool {
        self.info.stream().raw() as usize == crate::stream::PER_THREAD_STREAM
            && self.comm.world_size() > 1
    }

    #[cold]
    #[inline(never)]
    fn run_relayed(mut self) -> Result<()> {
        let relay = self.onto_relay()?;
        let r = self.issue(false);
        let r = Self::leave(relay, r);
        // Only now may cudarc record its events, on the caller's per-thread stream: it
        // waits for the relay's work since `leave` (recorded before, an event would not
        // cover the collective, and a stream ordered by it would race it).
        drop(self);
        r
    }

    /// Moves the operation onto its communicator's relay, entered (it waits for the
    /// caller's per-thread stream). The caller must [`leave`](Self::leave) the relay once
    /// the work is launched, before the guards go.
    #[cold]
    #[inline(never)]
    pub(crate) fn onto_relay(&mut self) -> Result<&'a crate::stream::Relay> {
        let relay = self.comm.enter_relay()?;
        let on = crate::stream::StreamRef::Cuda(relay.stream());
        self.info = self.info.on(on);
        Ok(relay)
    }

    /// The caller's per-thread stream waits for the relay's work, whatever the call's
    /// outcome (what NCCL launched must be behind it before the buffers are released).
    #[cold]
    #[inline(never)]
    pub(crate) fn leave(relay: &crate::stream::Relay, r: Result<()>) -> Result<()> {
        let left = relay.leave();
        r?;
        Ok(left?)
    }

    /// The communicator it runs on.
    pub fn comm(&self) -> &'a Communicator {
        self.comm
    }

    /// Reports `caller` as where the operation was called (in its errors, the flight record
    /// and the desync report) instead of the line that described it: for a wrapper whose
    /// own callers are the lines to name, where `#[track_caller]` cannot reach (a hook that
    /// another library calls, such as candle's storage operations).
    pub fn at(mut self, caller: &'static Location<'static>) -> Op<'a> {
        self.caller = caller;
        self
    }

    /// The NCCL call it makes, such as `"ncclAllReduce"`.
    pub fn name(&self) -> &'static str {
        self.info.name()
    }

    /// Makes the call. The guards stay with the operation: it is dropped once the work is
    /// enqueued (after the call, or at the end of the group inside one), and they with it.
    /// On its own stream: one that [`needs_relay`](Self::needs_relay) is moved
    /// [`onto_relay`](Self::onto_relay) first.
    ///
    /// By reference: a group issues its operations where they are kept, with no copy (a
    /// moved operation's fields were read back from the stack right after a vector store
    /// of them, a store-to-load forwarding stall per operation). `grouped`: issued by a
    /// group's end, between its `ncclGroupStart` and `ncclGroupEnd` (the only place that
    /// issues operations inside an NCCL group).
    #[inline(always)]
    pub(crate) fn issue(&self, grouped: bool) -> Result<()> {
        let Op {
            comm,
            red,
            offset,
            send,
            recv,
            info,
            caller,
            guards: _,
        } = *self;
        let (count, stream) = (info.count(), info.stream());
        let entry = info.entry_point();
        let collective = entry.collective();
        if count == 0 && collective.is_some_and(|c| c.every_rank()) {
            // NCCL discards an empty collective after its argument checks (taskAppend,
            // enqueue.cc:2554-2555 of 2.28.9): no work and no peer. So it is not issued,
            // and the diagnostics do not count it either: their sequence numbers must match
            // the peers' (one rank's empty call would otherwise read as a collective its
            // peers never call).
            return Ok(());
        }
        // Everything but the handle is known here (and, for a single operation, at compile
        // time): the closure below only makes the call.
        let args = CallArgs {
            send,
            recv,
            count,
            datatype: info
                .data_type()
                .map_or(nccl_sys::bindings::ncclInt8, |d| d.to_raw()),
            op: red,
            // The root or peer, checked in range by the description.
            rank: info.rank().map_or(0, |r| r as c_int),
            comm: std::ptr::null_mut(),
            stream: stream.raw(),
        };
        comm.issue(
            if grouped { info.in_group() } else { info },
            caller,
            #[inline(always)]
            |t, raw| {
                let args = CallArgs { comm: raw, ..args };
                // SAFETY: the description checked both buffers against the row's lengths
                // for `count` and this provider's memory, and every other argument (the
                // rank in range, the reduction of this communicator, the entry point
                // present); `guards` and the lifetime `'a` keep the buffers borrowed until
                // the work is enqueued. Inlined into the caller's line: left to the
                // compiler, the call was made out of line with its arguments passed through
                // memory (callgrind over the overhead bench: 22 more instructions for a
                // single operation, 9 per operation in a group).
                #[cfg(feature = "host")]
                return crate::host::with_caller(
                    caller,
                    #[inline(always)]
                    || unsafe { make_call(collective, entry, t, args, offset) },
                );
                #[cfg(not(feature = "host"))]
                // SAFETY: as above.
                unsafe {
                    make_call(collective, entry, t, args, offset)
                }
            },
        )
    }
}

/// The NCCL call of an operation: its collective's entry point, or a one-sided call's.
///
/// # Safety
/// As [`Collective::call`] and `one_sided_call`: `args` (and `offset`) checked for the call.
#[inline(always)]
unsafe fn make_call(
    collective: Option<Collective>,
    entry: EntryPoint,
    t: &nccl_sys::FunctionTable,
    args: CallArgs,
    offset: usize,
) -> nccl_sys::bindings::ncclResult_t {
    // SAFETY: the caller's.
    unsafe {
        match collective {
            Some(c) => c.call(t, args),
            None => one_sided_call(entry, t, args, offset),
        }
    }
}

impl<'a> Op<'a> {
    /// A one-sided operation (a put or a signal), its arguments checked by its description
    /// (`crate::register`): `send` read from, kept by its guard, and `recv` the target
    /// window (`ncclWindow_t`) of a put, on `info`'s stream.
    /// `offset` is a put's byte offset in the target window.
    pub(crate) fn one_sided(
        comm: &'a Communicator,
        send: (*const c_void, BufferGuard<'a>),
        recv: *mut c_void,
        offset: usize,
        info: OpInfo<'a>,
        caller: &'static Location<'static>,
    ) -> Op<'a> {
        Op {
            comm,
            red: 0,
            offset,
            send: send.0,
            recv,
            info,
            caller,
            guards: [send.1, BufferGuard::Host],
        }
    }
}

/// Makes a one-sided call of an [`Op`] (`crate::register` describes them): `ncclPutSignal` of `args.count` elements from
/// `args.send` into the window `args.recv` at byte `offset` of the peer `args.rank`, or
/// `ncclSignal` to that peer (signal index 0 of context 0, the one NCCL 2.29-2.30 has);
/// `ncclInvalidUsage` for another entry point or an absent one.
///
/// # Safety
/// NCCL's contract for the entry point: the source valid for `count` elements until the
/// work is done, `recv` a live window of this communicator, the peer in range.
// Out of line: it keeps the collectives' dispatch in `Op::enqueue` small (a group's
// operations dispatch at run time).
#[inline(never)]
unsafe fn one_sided_call(
    entry: EntryPoint,
    t: &nccl_sys::FunctionTable,
    args: nccl_sys::CallArgs,
    offset: usize,
) -> nccl_sys::ncclResult_t {
    let nccl_sys::CallArgs {
        send,
        recv,
        count,
        datatype,
        rank: peer,
        comm,
        stream,
        ..
    } = args;
    // SAFETY: the caller's contract.
    unsafe {
        match (entry, t.ncclPutSignal, t.ncclSignal) {
            (EntryPoint::ncclPutSignal, Some(f), _) => f(
                send,
                count,
                datatype,
                peer,
                recv.cast(),
                offset,
                0,
                0,
                0,
                comm,
                stream,
            ),
            (EntryPoint::ncclSignal, _, Some(f)) => f(peer, 0, 0, 0, comm, stream),
            _ => nccl_sys::bindings::ncclInvalidUsage,
        }
    }
}

/// An operation being described: admitted on its communicator, its stream checked, with its
/// reduction, root or peer and buffers to come.
///
/// Every length it asks of a buffer comes from the collective's row in nccl-sys
/// ([`Collective::lengths`], read with NCCL's count argument), which the host provider reads
/// too: the safe layer writes no length rule of its own.
pub(crate) struct OpChecks<'a> {
    comm: &'a Communicator,
    call: Collective,
    stream: StreamRef<'a>,
    caller: &'static Location<'static>,
    /// The reduction, once checked (for a collective that reduces).
    red: ncclRedOp_t,
    /// The root or peer, once checked (for a collective that takes one).
    rank: Option<usize>,
}

impl<'a> OpChecks<'a> {
    /// The first checks of every operation, in this order: the loaded NCCL has its entry
    /// point, the communicator has not failed (before any buffer or the CUDA driver is
    /// touched), then the stream.
    #[inline(always)]
    #[track_caller]
    pub(crate) fn new(
        comm: &'a Communicator,
        call: Collective,
        stream: &'a impl AsStream,
    ) -> Result<OpChecks<'a>> {
        let caller = Location::caller();
        let entry = call.entry_point();
        let lib = comm.library();
        if !lib.table().has(entry) {
            lib.optional(None::<()>, call.name())?;
        }
        comm.ensure_usable_for(entry)?;
        let stream = stream.as_stream();
        comm.check_stream(call.name(), stream)?;
        Ok(OpChecks {
            comm,
            call,
            stream,
            caller,
            red: 0,
            rank: None,
        })
    }

    /// The communicator's world size.
    #[inline(always)]
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Checks the reduction: refused when it belongs to another communicator.
    #[inline(always)]
    pub(crate) fn reduction<T>(&mut self, op: Reduction<'a, T>) -> Result<()> {
        self.red = op.raw_for(self.comm, self.call.name())?;
        Ok(())
    }

    /// Checks the root or peer (the row's [`RankArg`]): refused outside the communicator.
    #[inline(always)]
    pub(crate) fn rank_arg(&mut self, rank: usize) -> Result<()> {
        match self.world_size() {
            n if rank < n => {
                self.rank = Some(rank);
                Ok(())
            }
            world_size => Err(Error::RankOutOfRange {
                call: self.call.name(),
                what: match self.call.rank_arg() {
                    RankArg::Peer => "peer",
                    RankArg::Root | RankArg::None => "root",
                },
                rank,
                world_size,
            }),
        }
    }

    /// The buffer NCCL's count argument is read from: by the row, the one every rank
    /// passes at its smallest (a count, else a world of blocks; the send buffer when both
    /// are alike).
    #[inline(always)]
    fn source(&self) -> (BufferRole, Extent) {
        match self.call.extents() {
            (s @ Extent::Count, _) => (BufferRole::Send, s),
            (_, r @ Extent::Count) => (BufferRole::Recv, r),
            (s @ Extent::World, _) => (BufferRole::Send, s),
            (_, r) => (BufferRole::Recv, r),
        }
    }

    /// NCCL's count argument for a send buffer of `send` and a receive buffer of `recv`
    /// elements: the length of the [`source`](Self::source), or its block.
    #[inline(always)]
    fn count(&self, send: usize, recv: usize) -> Result<usize> {
        let (role, ext) = self.source();
        let len = if role == BufferRole::Send { send } else { recv };
        if ext.is_world() {
            let rule = match role {
                BufferRole::Send => "send = world_size x block",
                BufferRole::Recv => "recv = world_size x block",
            };
            self.block_of(role, len, rule)
        } else {
            Ok(len)
        }
    }

    /// `len / world_size`, refused (naming the buffer `role` and its `rule`) when `len`
    /// is not a multiple of it.
    #[inline(always)]
    fn block_of(&self, role: BufferRole, len: usize, rule: &'static str) -> Result<usize> {
        let n = self.world_size();
        if !len.is_multiple_of(n) {
            return Err(Error::LengthMismatch {
                call: self.call.name(),
                role,
                expected: (len / n + 1) * n,
                actual: len,
                rule,
            });
        }
        Ok(len / n)
    }

    /// The lengths the row gives this rank's (send, receive) buffers for `count`; refused
    /// when a world-sized one overflows the address space.
    #[inline(always)]
    fn lengths(&self, count: usize) -> Result<(Length, Length)> {
        let n = self.world_size();
        let is_root = self.rank.is_none_or(|r| r == self.comm.rank());
        let (s, r) = self.call.extents();
        let fits = |e: Extent| {
            !e.is_world()
                || e.on_root(count, n)
                    .is_some_and(|x| x.checked_mul(16).is_some())
        };
        match self.call.lengths(count, n, is_root) {
            Some(both) if fits(s) && fits(r) => Ok(both),
            _ => Err(self.overflow(count)),
        }
    }

    #[cold]
    fn overflow(&self, count: usize) -> Error {
        let n = self.world_size();
        let reason = format!("{count} elements x {n} ranks overflows the address space");
        invalid(self.call.name(), reason)
    }

    /// Checks a buffer against `len`, its length by the row: its element type, its length,
    /// its memory, its stream; one that NCCL ignores on this rank (empty where the row
    /// allows it, or of any length) only for where it lives. Whether NCCL gets its pointer
    /// (else a null one: an empty buffer that NCCL ignores).
    #[inline(always)]
    fn check<T: NcclType, B: SendBuffer<T> + ?Sized>(
        &self,
        role: BufferRole,
        buf: &B,
        len: Length,
    ) -> Result<bool> {
        let call = self.call.name();
        match len {
            Length::Exactly(_) => {}
            Length::EmptyOr(_) if !buf.is_empty() => {}
            Length::EmptyOr(_) | Length::Any => {
                self.comm.check_memory(call, role, buf.memory())?;
                return Ok(!buf.is_empty());
            }
        }
        T::DATA_TYPE.check_supported(self.comm.library())?;
        if !len.accepts(buf.len()) {
            return Err(self.length_error(role, len, buf.len()));
        }
        self.comm.check_memory(call, role, buf.memory())?;
        self.on_its_stream(role, buf.bound_stream())?;
        Ok(true)
    }

    #[cold]
    fn length_error(&self, role: BufferRole, len: Length, actual: usize) -> Error {
        let expected = match len {
            Length::Exactly(n) | Length::EmptyOr(n) => n,
            Length::Any => actual,
        };
        Error::LengthMismatch {
            call: self.call.name(),
            role,
            expected,
            actual,
            rule: self.rule(role, len),
        }
    }

    /// The row's rule for the buffer `role`, in words (what a length error quotes): its
    /// length in terms of the other buffer's.
    fn rule(&self, role: BufferRole, len: Length) -> &'static str {
        let (s, r) = self.call.extents();
        let (mine, other) = if role == BufferRole::Send {
            (s, r)
        } else {
            (r, s)
        };
        let world = mine.is_world() && !other.is_world();
        let on_root = matches!(
            mine,
            Extent::RootCount(off) | Extent::RootWorld(off) if off != OffRoot::AsRoot
        );
        macro_rules! rule {
            ($mine:literal, $other:literal) => {
                match (world, on_root, len) {
                    (true, true, Length::EmptyOr(_)) => {
                        concat!(
                            "off the root, ",
                            $mine,
                            " is empty or world_size x ",
                            $other
                        )
                    }
                    (false, true, Length::EmptyOr(_)) => {
                        concat!("off the root, ", $mine, " is empty or as long as ", $other)
                    }
                    (true, true, _) => concat!($mine, " = world_size x ", $other, " on the root"),
                    (false, true, _) => concat!($mine, " = ", $other, " on the root"),
                    (true, false, _) => concat!($mine, " = world_size x ", $other),
                    (false, false, _) => concat!($mine, " = ", $other),
                }
            };
        }
        if role == BufferRole::Send {
            rule!("send", "recv")
        } else {
            rule!("recv", "send")
        }
    }

    /// A buffer bound to one stream ([`crate::StreamBound`]) is used on that stream only.
    #[inline(always)]
    fn on_its_stream(&self, role: BufferRole, bound: Option<usize>) -> Result<()> {
        match bound {
            Some(b) if b != self.stream.raw() as usize => Err(self.wrong_stream(role, b)),
            _ => Ok(()),
        }
    }

    #[cold]
    fn wrong_stream(&self, role: BufferRole, bound: usize) -> crate::Error {
        invalid(self.call.name(), format!(
            "the {role} is a StreamBound of stream {bound:#x}, but the operation runs on stream {:#x}: run it on the buffer's stream, or take the slice back with into_inner",
            self.stream.raw() as usize
        ))
    }

    /// The operation on a send and a receive buffer, both checked against the row's
    /// lengths (send first) before either pointer is taken. A buffer that NCCL ignores on
    /// this rank and that is empty is passed as a null pointer; NCCL's header says it is
    /// not used, but under `NCCL_CHECK_POINTERS=1` NCCL 2.28.9 refuses a null one for a
    /// gather's receive and a scatter's send buffer (`ArgsCheck`, misc/argcheck.cc:71-83).
    #[inline(always)]
    pub(crate) fn buffers<T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        self,
        send: &'a S,
        recv: &'a mut R,
    ) -> Result<Op<'a>> {
        let count = self.count(send.len(), recv.len())?;
        let (send_len, recv_len) = self.lengths(count)?;
        let send_used = self.check(BufferRole::Send, send, send_len)?;
        let recv_used = self.check(BufferRole::Recv, recv, recv_len)?;
        let s = if send_used {
            send.send_ptr(self.stream)
        } else {
            NO_SEND
        };
        let r = if recv_used {
            recv.recv_ptr(self.stream)
        } else {
            NO_RECV
        };
        Ok(self.op::<T>(count, s, r))
    }

    /// The operation on its send buffer only (a point-to-point send).
    #[inline(always)]
    pub(crate) fn send_buffer<T: NcclType, S: SendBuffer<T> + ?Sized>(
        self,
        send: &'a S,
    ) -> Result<Op<'a>> {
        let count = self.count(send.len(), 0)?;
        let (len, _) = self.lengths(count)?;
        self.check(BufferRole::Send, send, len)?;
        let s = send.send_ptr(self.stream);
        Ok(self.op::<T>(count, s, NO_RECV))
    }

    /// The operation on its receive buffer only (a point-to-point receive).
    #[inline(always)]
    pub(crate) fn recv_buffer<T: NcclType, R: RecvBuffer<T> + ?Sized>(
        self,
        recv: &'a mut R,
    ) -> Result<Op<'a>> {
        let count = self.count(0, recv.len())?;
        let (_, len) = self.lengths(count)?;
        self.check(BufferRole::Recv, recv, len)?;
        let r = recv.recv_ptr(self.stream);
        Ok(self.op::<T>(count, NO_SEND, r))
    }

    /// The in-place operation on `buf`, which is both buffers: by the row, a world-sized
    /// one holds `world_size` blocks of NCCL's count and the count-sized one is this rank's
    /// block of it (NCCL's in-place all-gather and reduce-scatter); else they coincide.
    #[inline(always)]
    pub(crate) fn in_place<T: NcclType, B: RecvBuffer<T> + ?Sized>(
        self,
        buf: &'a mut B,
    ) -> Result<Op<'a>> {
        let (s, r) = self.call.extents();
        let count = if s.is_world() || r.is_world() {
            let rule = "in place: buffer = world_size x block";
            self.block_of(BufferRole::Recv, buf.len(), rule)?
        } else {
            buf.len()
        };
        // The block is whole (checked above), so the buffer's length is the row's.
        self.check(BufferRole::Recv, buf, Length::Exactly(buf.len()))?;
        let mine = self.comm.rank() * count;
        let (send_at, recv_at) = match (s.is_world(), r.is_world()) {
            (false, true) => (mine, 0),
            (true, false) => (0, mine),
            _ => (0, 0),
        };
        let (p, guard) = buf.recv_ptr(self.stream);
        let at = |i: usize| p.cast::<T>().wrapping_add(i).cast::<c_void>();
        let s = (at(send_at).cast_const(), BufferGuard::Host);
        Ok(self.op::<T>(count, s, (at(recv_at), guard)))
    }

    /// The described operation: `count` elements of T, reading `send` and writing `recv`.
    #[inline(always)]
    fn op<T: NcclType>(
        self,
        count: usize,
        send: (*const c_void, BufferGuard<'a>),
        recv: (*mut c_void, BufferGuard<'a>),
    ) -> Op<'a> {
        Op {
            comm: self.comm,
            red: self.red,
            offset: 0,
            send: send.0,
            recv: recv.0,
            info: OpInfo::new(self.call, T::DATA_TYPE, count, self.rank, self.stream),
            caller: self.caller,
            guards: [send.1, recv.1],
        }
    }
}

/// No pointer, no guard: the buffer an operation does not have, or that NCCL ignores.
const NO_SEND: (*const c_void, BufferGuard<'static>) = (std::ptr::null(), BufferGuard::Host);

/// See [`NO_SEND`].
const NO_RECV: (*mut c_void, BufferGuard<'static>) = (std::ptr::null_mut(), BufferGuard::Host);
