//! Typed collectives, each described once.
//!
//! Every collective is two plain methods: the description (`all_reduce_op`,
//! `broadcast_in_place_op`, ...) checks its arguments and returns an [`Op`] holding its
//! buffers' borrows and pointers, and the method of the same name without `_op`
//! ([`Communicator::all_reduce`], ...) is that description then [`Op::run`], which enqueues
//! it alone. [`crate::Group::push`] adds an [`Op`] to a group, which enqueues it at its end;
//! both go through the one generic path [`Communicator::issue`]. So every form, in place or not, works on its own
//! and in a group.
//!
//! Checks, in this order, before NCCL sees anything: the communicator has not failed, the
//! stream's kind and device, the reduction (one of this communicator), root and peer ranges,
//! element counts that overflow, element types newer than the loaded NCCL (fp8 before
//! 2.24), buffer lengths against the operation's rule, and host memory only on the host
//! provider and device memory only on NVIDIA's NCCL (on the communicator's device). Only then
//! are the buffers' pointers taken (with cudarc's guards, kept until the work is enqueued). A
//! failed check is a typed error and leaves the communicator usable.
//!
//! Adding a collective: ARCHITECTURE.md, "Adding a collective".

mod op;
mod reduce_op;

pub use op::Op;
pub use reduce_op::{PreMulSum, Reduction};

use crate::buffer::{RecvBuffer, SendBuffer};
use crate::comm::Communicator;
use crate::error::Result;
use crate::stream::AsStream;
use crate::types::NcclType;
use nccl_sys::Collective;
use op::OpChecks;

impl Communicator {
    // ---- all-reduce --------------------------------------------------------------------

    /// Reduces `send` across all ranks into every rank's `recv` (`ncclAllReduce`).
    /// `recv.len() == send.len()`.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![r as f64 + 1.0; 4];
    ///     let mut recv = vec![0.0; 4];
    ///     comm.all_reduce(&send, &mut recv, ReduceOp::Max, s)?;
    ///     assert_eq!(recv, vec![3.0; 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn all_reduce<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        reduction: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.all_reduce_op(send, recv, reduction, stream)?.run()
    }

    /// The [`Op`] of [`all_reduce`](Self::all_reduce), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn all_reduce_op<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        reduction: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::AllReduce, stream)?;
        at.reduction(reduction.into())?;
        at.buffers(send, recv)
    }

    /// All-reduce in place: `buf` is both input and output (`ncclAllReduce`, send == recv).
    #[track_caller]
    pub fn all_reduce_in_place<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        reduction: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.all_reduce_in_place_op(buf, reduction, stream)?.run()
    }

    /// The [`Op`] of [`all_reduce_in_place`](Self::all_reduce_in_place),
    /// to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn all_reduce_in_place_op<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        reduction: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::AllReduce, stream)?;
        at.reduction(reduction.into())?;
        at.in_place(buf)
    }

    // ---- broadcast ---------------------------------------------------------------------

    /// Copies `send` on `root` into every rank's `recv` (`ncclBroadcast`). All ranks pass
    /// buffers of the same length; `send` is read only on the root.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![10 * r as i32; 2];
    ///     let mut recv = vec![0; 2];
    ///     comm.broadcast(&send, &mut recv, 2, s)?; // root 2
    ///     assert_eq!(recv, vec![20, 20]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn broadcast<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.broadcast_op(send, recv, root, stream)?.run()
    }

    /// The [`Op`] of [`broadcast`](Self::broadcast), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn broadcast_op<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::Broadcast, stream)?;
        at.rank_arg(root)?;
        at.buffers(send, recv)
    }

    /// Broadcast in place: `buf` is the source on the root and the destination elsewhere.
    #[track_caller]
    pub fn broadcast_in_place<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.broadcast_in_place_op(buf, root, stream)?.run()
    }

    /// The [`Op`] of [`broadcast_in_place`](Self::broadcast_in_place),
    /// to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn broadcast_in_place_op<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::Broadcast, stream)?;
        at.rank_arg(root)?;
        at.in_place(buf)
    }

    // ---- reduce ------------------------------------------------------------------------

    /// Reduces `send` across all ranks into `recv` on `root` (`ncclReduce`). Every rank
    /// passes `recv.len() == send.len()`; only the root's `recv` is written.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![r as u64 + 1; 2];
    ///     let mut recv = vec![0u64; 2];
    ///     comm.reduce(&send, &mut recv, ReduceOp::Prod, 0, s)?;
    ///     assert_eq!(recv, if r == 0 { vec![6, 6] } else { vec![0, 0] });
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn reduce<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        reduction: impl Into<Reduction<'a, T>>,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.reduce_op(send, recv, reduction, root, stream)?.run()
    }

    /// The [`Op`] of [`reduce`](Self::reduce), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn reduce_op<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        reduction: impl Into<Reduction<'a, T>>,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::Reduce, stream)?;
        at.reduction(reduction.into())?;
        at.rank_arg(root)?;
        at.buffers(send, recv)
    }

    /// Reduce in place: `buf` is every rank's input and, on the root, the result.
    #[track_caller]
    pub fn reduce_in_place<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        reduction: impl Into<Reduction<'a, T>>,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.reduce_in_place_op(buf, reduction, root, stream)?.run()
    }

    /// The [`Op`] of [`reduce_in_place`](Self::reduce_in_place),
    /// to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn reduce_in_place_op<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        reduction: impl Into<Reduction<'a, T>>,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::Reduce, stream)?;
        at.reduction(reduction.into())?;
        at.rank_arg(root)?;
        at.in_place(buf)
    }

    // ---- all-gather --------------------------------------------------------------------

    /// Gathers every rank's `send` into every rank's `recv`, rank `i`'s block at
    /// `i * send.len()` (`ncclAllGather`). `recv.len() == world_size * send.len()`.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![r as u8; 2];
    ///     let mut recv = vec![9u8; 6];
    ///     comm.all_gather(&send, &mut recv, s)?;
    ///     assert_eq!(recv, vec![0, 0, 1, 1, 2, 2]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn all_gather<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.all_gather_op(send, recv, stream)?.run()
    }

    /// The [`Op`] of [`all_gather`](Self::all_gather), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn all_gather_op<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        OpChecks::new(self, Collective::AllGather, stream)?.buffers(send, recv)
    }

    /// All-gather in place: this rank's input is its own block of `buf`
    /// (`buf[rank * n .. (rank + 1) * n]`, `n = buf.len() / world_size`).
    #[track_caller]
    pub fn all_gather_in_place<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.all_gather_in_place_op(buf, stream)?.run()
    }

    /// The [`Op`] of [`all_gather_in_place`](Self::all_gather_in_place),
    /// to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn all_gather_in_place_op<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        OpChecks::new(self, Collective::AllGather, stream)?.in_place(buf)
    }

    // ---- reduce-scatter ----------------------------------------------------------------

    /// Reduces `send` across ranks and leaves block `i` of the result on rank `i`
    /// (`ncclReduceScatter`). `send.len() == world_size * recv.len()`.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send: Vec<f32> = (0..6).map(|i| i as f32).collect(); // the same on every rank
    ///     let mut recv = vec![0.0f32; 2];
    ///     comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum, s)?;
    ///     assert_eq!(recv, vec![3.0 * (2 * r) as f32, 3.0 * (2 * r + 1) as f32]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn reduce_scatter<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        reduction: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.reduce_scatter_op(send, recv, reduction, stream)?.run()
    }

    /// The [`Op`] of [`reduce_scatter`](Self::reduce_scatter),
    /// to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn reduce_scatter_op<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        reduction: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::ReduceScatter, stream)?;
        at.reduction(reduction.into())?;
        at.buffers(send, recv)
    }

    /// Reduce-scatter in place: the result lands in this rank's block of `buf`.
    #[track_caller]
    pub fn reduce_scatter_in_place<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        reduction: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.reduce_scatter_in_place_op(buf, reduction, stream)?
            .run()
    }

    /// The [`Op`] of [`reduce_scatter_in_place`](Self::reduce_scatter_in_place),
    /// to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn reduce_scatter_in_place_op<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        reduction: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::ReduceScatter, stream)?;
        at.reduction(reduction.into())?;
        at.in_place(buf)
    }

    // ---- point to point ----------------------------------------------------------------

    /// Sends `buf` to `peer` (`ncclSend`); the peer posts a [`recv`](Self::recv) of the
    /// same length. A send and a receive that depend on each other must be in one
    /// [`crate::Group`].
    #[track_caller]
    pub fn send<'a, T: NcclType, S: SendBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a S,
        peer: usize,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.send_op(buf, peer, stream)?.run()
    }

    /// The [`Op`] of [`send`](Self::send), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn send_op<'a, T: NcclType, S: SendBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a S,
        peer: usize,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::Send, stream)?;
        at.rank_arg(peer)?;
        at.send_buffer(buf)
    }

    /// Receives `buf.len()` elements from `peer` (`ncclRecv`).
    #[track_caller]
    pub fn recv<'a, T: NcclType, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut R,
        peer: usize,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.recv_op(buf, peer, stream)?.run()
    }

    /// The [`Op`] of [`recv`](Self::recv), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn recv_op<'a, T: NcclType, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut R,
        peer: usize,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::Recv, stream)?;
        at.rank_arg(peer)?;
        at.recv_buffer(buf)
    }

    // ---- all-to-all, gather, scatter (NCCL 2.28+) --------------------------------------

    /// Block `j` of `send` goes to rank `j`; block `i` of `recv` comes from rank `i`
    /// (`ncclAlltoAll`, NCCL 2.28+). Both hold `world_size` equal blocks.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send: Vec<i32> = (0..3).map(|to| (10 * r + to) as i32).collect();
    ///     let mut recv = vec![0i32; 3];
    ///     comm.all_to_all(&send, &mut recv, s)?;
    ///     assert_eq!(recv, (0..3).map(|from| (10 * from + r) as i32).collect::<Vec<_>>());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn all_to_all<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.all_to_all_op(send, recv, stream)?.run()
    }

    /// The [`Op`] of [`all_to_all`](Self::all_to_all), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn all_to_all_op<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        OpChecks::new(self, Collective::AllToAll, stream)?.buffers(send, recv)
    }

    /// Gathers every rank's `send` into `recv` on `root`, rank `i` at `i * send.len()`
    /// (`ncclGather`, NCCL 2.28+). Only the root's `recv` is written. Off the root, `recv`
    /// is empty (NCCL gets a null pointer) or `world_size * send.len()` long, as on the
    /// root: NCCL touches no element of it, but under `NCCL_CHECK_POINTERS=1` it refuses a
    /// null one, and over symmetric windows it finds the root's buffer through this one's
    /// place in its window ([`register_window`](Self::register_window) says why).
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![r as i64];
    ///     let mut recv = if r == 1 { vec![0i64; 3] } else { Vec::new() };
    ///     comm.gather(&send, &mut recv, 1, s)?;
    ///     if r == 1 { assert_eq!(recv, vec![0, 1, 2]); }
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn gather<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.gather_op(send, recv, root, stream)?.run()
    }

    /// The [`Op`] of [`gather`](Self::gather), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn gather_op<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::Gather, stream)?;
        at.rank_arg(root)?;
        at.buffers(send, recv)
    }

    /// Sends block `i` of `send` on `root` to rank `i`'s `recv` (`ncclScatter`, NCCL
    /// 2.28+). Only the root's `send` is checked and read. Off the root, NCCL touches no
    /// element of `send` but is given its address (null if empty): under
    /// `NCCL_CHECK_POINTERS=1` NCCL refuses an empty one, so pass device memory there.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send: Vec<u32> = if r == 0 { vec![7, 8, 9] } else { Vec::new() };
    ///     let mut recv = vec![0u32; 1];
    ///     comm.scatter(&send, &mut recv, 0, s)?;
    ///     assert_eq!(recv, vec![7 + r as u32]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn scatter<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()> {
        self.scatter_op(send, recv, root, stream)?.run()
    }

    /// The [`Op`] of [`scatter`](Self::scatter), to [`run`](Op::run) or push into a group.
    #[track_caller]
    #[inline(always)]
    pub fn scatter_op<'a, T: NcclType, S: SendBuffer<T> + ?Sized, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        let mut at = OpChecks::new(self, Collective::Scatter, stream)?;
        at.rank_arg(root)?;
        at.buffers(send, recv)
    }
}
