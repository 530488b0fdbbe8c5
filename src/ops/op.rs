//! [`Op`]: one checked operation, holding its borrows until it is run or its group ends.

use std::ffi::{c_int, c_void};
use std::panic::Location;

use nccl_sys::{ncclRedOp_t, Collective};

use super::{Call, Reduction};
use crate::buffer::{BufferGuard, RecvBuffer, SendBuffer};
use crate::comm::Communicator;
use crate::diag::OpInfo;
use crate::error::{check_len, invalid, BufferRole, Error, Result};
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
    call: Call,
    send: *const c_void,
    recv: *mut c_void,
    /// Its name, element type and count, root and stream (what the diagnostics record).
    /// Kept once: a group holds its operations by value, and at 128 bytes or less an `Op`
    /// moves without a `memcpy` call.
    info: OpInfo<'a>,
    caller: &'static Location<'static>,
    guards: Guards<'a>,
}

// A group holds its operations by value and moves each twice: within 128 bytes a move is
// a few vector stores, past it a `memcpy` call (about 40 instructions per move, measured
// with callgrind over the overhead bench).
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
        self.enqueue().map(drop)
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
    fn run_relayed(self) -> Result<()> {
        let (op, relay) = self.onto_relay()?;
        let r = op.enqueue().map(drop);
        Self::leave(relay, r)
    }

    /// The operation moved onto its communicator's relay, entered (it waits for the
    /// caller's per-thread stream). The caller must [`leave`](Self::leave) the relay once
    /// the work is launched, before the guards go.
    #[cold]
    #[inline(never)]
    pub(crate) fn onto_relay(self) -> Result<(Op<'a>, &'a crate::stream::Relay)> {
        let relay = self.comm.enter_relay()?;
        let on = crate::stream::StreamRef::Cuda(relay.stream());
        let info = self.info.on(on);
        Ok((Op { info, ..self }, relay))
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

    /// Makes the call, and hands back the guards to keep until the work is enqueued (the
    /// end of the group inside one). On its own stream: one that [`needs_relay`](Self::needs_relay)
    /// is moved [`onto_relay`](Self::onto_relay) first.
    #[inline(always)]
    pub(crate) fn enqueue(self) -> Result<Guards<'a>> {
        let Op {
            comm,
            call,
            send,
            recv,
            info,
            caller,
            guards,
        } = self;
        let (count, stream) = (info.count(), info.stream());
        let dtype = info
            .data_type()
            .map_or(nccl_sys::bindings::ncclInt8, |d| d.to_raw());
        if count == 0
            && !matches!(
                call,
                Call::Send { .. }
                    | Call::Recv { .. }
                    | Call::PutSignal { .. }
                    | Call::Signal { .. }
            )
        {
            // NCCL discards an empty collective after its argument checks (taskAppend,
            // enqueue.cc:2554-2555 of 2.28.9): no work and no peer. So it is not issued,
            // and the diagnostics do not count it either: their sequence numbers must match
            // the peers' (one rank's empty call would otherwise read as a collective its
            // peers never call).
            return Ok(guards);
        }
        comm.issue(
            info,
            caller,
            #[inline(always)]
            |t, raw| {
                // SAFETY: the description checked both buffers against `count` and this
                // provider's memory; `guards` and the lifetime `'a` keep them borrowed until
                // the work is enqueued.
                let make = || unsafe { call.make(t, send, recv, count, dtype, raw, stream.raw()) };
                #[cfg(feature = "host")]
                return crate::host::with_caller(caller, make);
                #[cfg(not(feature = "host"))]
                make()
            },
        )?;
        Ok(guards)
    }
}

impl<'a> Op<'a> {
    /// A one-sided operation (a put or a signal), its arguments checked by its description
    /// (`crate::register`): `send` read from, kept by its guard, and `recv` the target
    /// window (`ncclWindow_t`) of a put, on `info`'s stream.
    pub(crate) fn one_sided(
        comm: &'a Communicator,
        call: Call,
        send: (*const c_void, BufferGuard<'a>),
        recv: *mut c_void,
        info: OpInfo<'a>,
        caller: &'static Location<'static>,
    ) -> Op<'a> {
        Op {
            comm,
            call,
            send: send.0,
            recv,
            info,
            caller,
            guards: [send.1, BufferGuard::Host],
        }
    }
}

/// An operation being described: admitted on its communicator, its stream checked, with the
/// checks and the pointers of the description's buffers to come.
pub(crate) struct OpChecks<'a> {
    comm: &'a Communicator,
    call: Collective,
    stream: StreamRef<'a>,
    caller: &'static Location<'static>,
}

impl<'a> OpChecks<'a> {
    /// The first checks of every operation, in this order: the communicator has not failed
    /// (before any buffer or the CUDA driver is touched), then the stream.
    #[inline(always)]
    #[track_caller]
    pub(crate) fn new(
        comm: &'a Communicator,
        call: Collective,
        stream: &'a impl AsStream,
    ) -> Result<OpChecks<'a>> {
        let caller = Location::caller();
        comm.ensure_usable_for(call.entry_point())?;
        let stream = stream.as_stream();
        comm.check_stream(call.name(), stream)?;
        Ok(OpChecks {
            comm,
            call,
            stream,
            caller,
        })
    }

    /// The communicator's world size.
    #[inline(always)]
    pub(crate) fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// This rank.
    #[inline(always)]
    pub(crate) fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The raw reduction, refused when it belongs to another communicator.
    #[inline(always)]
    pub(crate) fn reduction<T>(&self, op: Reduction<'a, T>) -> Result<ncclRedOp_t> {
        op.raw_for(self.comm, self.call.name())
    }

    /// `rank` as a root or peer (`what`), refused outside the communicator.
    #[inline(always)]
    pub(crate) fn rank_arg(&self, what: &'static str, rank: usize) -> Result<c_int> {
        match self.world_size() {
            n if rank < n => Ok(rank as c_int),
            world_size => Err(Error::RankOutOfRange {
                call: self.call.name(),
                what,
                rank,
                world_size,
            }),
        }
    }

    /// `count * world_size`, refused when it overflows.
    #[inline(always)]
    pub(crate) fn times_world(&self, count: usize) -> Result<usize> {
        let n = self.world_size();
        (count.checked_mul(n))
            .filter(|total| total.checked_mul(16).is_some())
            .ok_or_else(|| {
                let reason = format!("{count} elements x {n} ranks overflows the address space");
                invalid(self.call.name(), reason)
            })
    }

    /// `len / world_size`, refused when `len` is not a multiple of it.
    #[inline(always)]
    pub(crate) fn block_of(&self, len: usize) -> Result<usize> {
        let n = self.world_size();
        if !len.is_multiple_of(n) {
            return Err(Error::LengthMismatch {
                call: self.call.name(),
                role: BufferRole::Recv,
                expected: (len / n + 1) * n,
                actual: len,
                rule: "in place: buffer = world_size x block",
            });
        }
        Ok(len / n)
    }

    /// Checks a buffer NCCL reads: the element type, its length against the operation's
    /// `rule`, its memory, its stream.
    #[inline(always)]
    pub(crate) fn send<T: NcclType, S: SendBuffer<T> + ?Sized>(
        &self,
        buf: &S,
        expected: usize,
        rule: &'static str,
    ) -> Result<()> {
        self.buffer(BufferRole::Send, buf, expected, rule)
    }

    /// Checks a buffer NCCL writes, as [`send`](Self::send).
    #[inline(always)]
    pub(crate) fn recv<T: NcclType, R: RecvBuffer<T> + ?Sized>(
        &self,
        buf: &R,
        expected: usize,
        rule: &'static str,
    ) -> Result<()> {
        self.buffer(BufferRole::Recv, buf, expected, rule)
    }

    #[inline(always)]
    fn buffer<T: NcclType, B: SendBuffer<T> + ?Sized>(
        &self,
        role: BufferRole,
        buf: &B,
        expected: usize,
        rule: &'static str,
    ) -> Result<()> {
        let call = self.call.name();
        T::DATA_TYPE.check_supported(self.comm.library())?;
        check_len(call, role, buf.len(), expected, rule)?;
        self.comm.check_memory(call, role, buf.memory())?;
        self.on_its_stream(role, buf.bound_stream())
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

    /// Checks only where a buffer lives: one NCCL ignores on a non-root rank.
    #[inline(always)]
    pub(crate) fn ignored<T: NcclType, B: SendBuffer<T> + ?Sized>(
        &self,
        role: BufferRole,
        buf: &B,
    ) -> Result<()> {
        self.comm.check_memory(self.call.name(), role, buf.memory())
    }

    /// Scatter's `send` off the root: only where it lives is checked, and its pointer is
    /// passed unless it is empty. NCCL's header says it is not used, but under
    /// `NCCL_CHECK_POINTERS=1` NCCL 2.28.9 refuses a null one (`ArgsCheck`,
    /// misc/argcheck.cc:71-83); it reads and writes no element of it.
    #[inline(always)]
    pub(crate) fn ignored_send<T: NcclType, S: SendBuffer<T> + ?Sized>(
        &self,
        buf: &'a S,
    ) -> Result<(*const c_void, BufferGuard<'a>)> {
        self.ignored(BufferRole::Send, buf)?;
        Ok(if buf.is_empty() {
            NO_SEND
        } else {
            self.send_ptr(buf)
        })
    }

    /// A checked buffer NCCL reads: its pointer and the guard to keep.
    #[inline(always)]
    pub(crate) fn send_ptr<T: NcclType, S: SendBuffer<T> + ?Sized>(
        &self,
        buf: &'a S,
    ) -> (*const c_void, BufferGuard<'a>) {
        buf.send_ptr(self.stream)
    }

    /// A checked buffer NCCL writes: its pointer and the guard to keep.
    #[inline(always)]
    pub(crate) fn recv_ptr<T: NcclType, R: RecvBuffer<T> + ?Sized>(
        &self,
        buf: &'a mut R,
    ) -> (*mut c_void, BufferGuard<'a>) {
        buf.recv_ptr(self.stream)
    }

    /// The one buffer of an in-place operation, checked: NCCL reads it from element
    /// `send_at` and writes it from element `recv_at` (this rank's block, or 0).
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    pub(crate) fn in_place<T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &self,
        buf: &'a mut B,
        send_at: usize,
        recv_at: usize,
    ) -> (
        (*const c_void, BufferGuard<'a>),
        (*mut c_void, BufferGuard<'a>),
    ) {
        let (p, guard) = buf.recv_ptr(self.stream);
        let at = |i: usize| p.cast::<T>().wrapping_add(i).cast::<c_void>();
        (
            (at(send_at).cast_const(), BufferGuard::Host),
            (at(recv_at), guard),
        )
    }

    /// The described operation: `call` with `count` elements of T (and `root`, the root or
    /// peer the diagnostics report), reading `send` and writing `recv`.
    #[inline(always)]
    pub(crate) fn op<T: NcclType>(
        self,
        call: Call,
        count: usize,
        root: Option<usize>,
        send: (*const c_void, BufferGuard<'a>),
        recv: (*mut c_void, BufferGuard<'a>),
    ) -> Op<'a> {
        Op {
            comm: self.comm,
            call,
            send: send.0,
            recv: recv.0,
            info: OpInfo::new(self.call, T::DATA_TYPE, count, root, self.stream),
            caller: self.caller,
            guards: [send.1, recv.1],
        }
    }
}

/// No pointer, no guard: the buffer an operation does not have, or that NCCL ignores.
pub(crate) const NO_SEND: (*const c_void, BufferGuard<'static>) =
    (std::ptr::null(), BufferGuard::Host);

/// See [`NO_SEND`].
pub(crate) const NO_RECV: (*mut c_void, BufferGuard<'static>) =
    (std::ptr::null_mut(), BufferGuard::Host);
