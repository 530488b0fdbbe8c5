//! Typed collectives: argument checks, then one FFI call through [`Communicator::issue`].
//!
//! Each operation is written once, as an `*_enqueue` function that checks its arguments,
//! takes the buffers' pointers (and cudarc guards) and makes the NCCL call; it returns the
//! guards. The plain methods drop them when the work is enqueued; [`crate::Group`] keeps them
//! until its end.
//!
//! Checks, before NCCL sees anything: buffer lengths against the operation's rule, root and
//! peer ranges, element counts that overflow, host memory only on the host provider and
//! device memory only on NVIDIA's NCCL (on the communicator's device), the stream's
//! kind and device, and element types newer than the loaded NCCL (fp8 before 2.24). A failed check is a typed error and leaves the communicator usable.

mod reduce_op;

use std::ffi::c_int;
use std::panic::Location;

pub use reduce_op::{PreMulSum, Reduction};

use crate::buffer::{BufferGuard, Memory, RecvBuffer, SendBuffer};
use crate::comm::Communicator;
use crate::diag::OpInfo;
use crate::error::{BufferRole, Error, Result};
use crate::library::Provider;
use crate::stream::{AsStream, StreamRef};
use crate::types::NcclType;

/// The guards of one enqueued operation (at most a send and a receive buffer).
pub(crate) type Guards<'a> = [BufferGuard<'a>; 2];

impl Communicator {
    #[inline(always)]
    fn check_stream(&self, op: &'static str, stream: StreamRef<'_>) -> Result<()> {
        match (self.library().provider(), stream) {
            (Provider::Host, StreamRef::Host) => Ok(()),
            (Provider::Nccl, StreamRef::Cuda(_)) if stream.device() == self.device() => Ok(()),
            _ => Err(self.stream_error(op, stream)),
        }
    }

    #[cold]
    fn stream_error(&self, op: &'static str, stream: StreamRef<'_>) -> Error {
        let reason = match (self.library().provider(), stream) {
            (Provider::Nccl, StreamRef::Cuda(_)) => format!(
                "the stream is on CUDA device {:?} but the communicator on device {:?}",
                stream.device(),
                self.device()
            ),
            (Provider::Host, _) => {
                "a host-provider communicator takes HostStream, not a CUDA stream".into()
            }
            (_, _) => "NVIDIA's NCCL needs a CUDA stream, not HostStream".into(),
        };
        Error::InvalidArgument { op, reason }
    }

    #[inline(always)]
    fn check_memory(&self, op: &'static str, role: BufferRole, memory: Memory) -> Result<()> {
        match (self.library().provider(), memory) {
            (Provider::Host, Memory::Host) => Ok(()),
            (Provider::Nccl, Memory::Device(d)) if Some(d) == self.device() => Ok(()),
            _ => Err(self.memory_error(op, role, memory)),
        }
    }

    #[cold]
    fn memory_error(&self, op: &'static str, role: BufferRole, memory: Memory) -> Error {
        let reason = match (self.library().provider(), memory) {
            (Provider::Nccl, Memory::Device(d)) => format!(
                "the {role} is on CUDA device {d} but the communicator on device {:?}",
                self.device()
            ),
            (Provider::Nccl, Memory::Host) => format!(
                "the {role} is host memory, which NVIDIA's NCCL cannot read: copy it to the device"
            ),
            (_, Memory::Device(_)) => {
                format!("the {role} is GPU memory, which the host provider cannot read")
            }
            (_, Memory::Host) => format!("the {role} is host memory"),
        };
        Error::InvalidArgument { op, reason }
    }

    fn check_rank(&self, op: &'static str, what: &'static str, rank: usize) -> Result<c_int> {
        if rank < self.world_size() {
            Ok(rank as c_int)
        } else {
            Err(Error::RankOutOfRange {
                op,
                what,
                rank,
                world_size: self.world_size(),
            })
        }
    }

    /// `count * world_size`, or an error when it overflows.
    fn times_world(&self, op: &'static str, count: usize) -> Result<usize> {
        count
            .checked_mul(self.world_size())
            .filter(|n| n.checked_mul(16).is_some())
            .ok_or_else(|| Error::InvalidArgument {
                op,
                reason: format!(
                    "{count} elements x {} ranks overflows the address space",
                    self.world_size()
                ),
            })
    }

    fn send_arg<'a, T: NcclType, S: SendBuffer<T> + ?Sized>(
        &self,
        op: &'static str,
        buf: &'a S,
        expected: usize,
        rule: &'static str,
        stream: StreamRef<'a>,
    ) -> Result<(*const std::ffi::c_void, BufferGuard<'a>)> {
        T::DATA_TYPE.check_supported(self.library())?;
        check_len(op, BufferRole::Send, buf.len(), expected, rule)?;
        self.check_memory(op, BufferRole::Send, buf.memory())?;
        Ok(buf.send_ptr(stream))
    }

    fn recv_arg<'a, T: NcclType, R: RecvBuffer<T> + ?Sized>(
        &self,
        op: &'static str,
        buf: &'a mut R,
        expected: usize,
        rule: &'static str,
        stream: StreamRef<'a>,
    ) -> Result<(*mut std::ffi::c_void, BufferGuard<'a>)> {
        T::DATA_TYPE.check_supported(self.library())?;
        check_len(op, BufferRole::Recv, buf.len(), expected, rule)?;
        self.check_memory(op, BufferRole::Recv, buf.memory())?;
        Ok(buf.recv_ptr(stream))
    }

    // ---- all-reduce -------------------------------------------------------------------

    #[inline(always)]
    pub(crate) fn all_reduce_enqueue<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        op: Reduction<'a, T>,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclAllReduce";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let red = op.raw_for(self, OP)?;
        let count = send.len();
        let (s, sg) = self.send_arg(OP, send, count, "recv = send", stream)?;
        let (r, rg) = self.recv_arg(OP, recv, count, "recv = send", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, None, stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: both buffers hold `count` elements of T in the memory this provider
            // reads (checked above) and stay borrowed until the work is enqueued.
            unsafe {
                (t.ncclAllReduce)(s, r, count, T::DATA_TYPE.to_raw(), red, comm, stream.raw())
            }
        })?;
        Ok([sg, rg])
    }

    #[inline(always)]
    pub(crate) fn all_reduce_in_place_enqueue<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        op: Reduction<'a, T>,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclAllReduce";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let red = op.raw_for(self, OP)?;
        let count = buf.len();
        let (p, g) = self.recv_arg(OP, buf, count, "in place", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, None, stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: `p` holds `count` elements; send == recv is NCCL's in-place form.
            unsafe {
                (t.ncclAllReduce)(p, p, count, T::DATA_TYPE.to_raw(), red, comm, stream.raw())
            }
        })?;
        Ok([g, BufferGuard::Host])
    }

    /// Reduces `send` across all ranks into every rank's `recv` (`ncclAllReduce`).
    /// `recv.len() == send.len()`.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![r as f64 + 1.0; 4];
    ///     let mut recv = vec![0.0; 4];
    ///     comm.all_reduce(&send, &mut recv, ReduceOp::Max, s)?;
    ///     assert_eq!(recv, vec![3.0; 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn all_reduce<'a, T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: impl Into<Reduction<'a, T>>,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.all_reduce_enqueue(
            send,
            recv,
            op.into(),
            stream.as_stream(),
            Location::caller(),
        )
        .map(drop)
    }

    /// All-reduce in place: `buf` is both input and output (`ncclAllReduce`, send == recv).
    #[track_caller]
    pub fn all_reduce_in_place<'a, T, B>(
        &self,
        buf: &mut B,
        op: impl Into<Reduction<'a, T>>,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        B: RecvBuffer<T> + ?Sized,
    {
        self.all_reduce_in_place_enqueue(buf, op.into(), stream.as_stream(), Location::caller())
            .map(drop)
    }

    // ---- broadcast --------------------------------------------------------------------

    #[inline(always)]
    pub(crate) fn broadcast_enqueue<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclBroadcast";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let root = self.check_rank(OP, "root", root)?;
        let count = recv.len();
        let (s, sg) = self.send_arg(OP, send, count, "send = recv", stream)?;
        let (r, rg) = self.recv_arg(OP, recv, count, "send = recv", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, Some(root as usize), stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: both buffers hold `count` elements; root is in range.
            unsafe {
                (t.ncclBroadcast)(s, r, count, T::DATA_TYPE.to_raw(), root, comm, stream.raw())
            }
        })?;
        Ok([sg, rg])
    }

    #[inline(always)]
    pub(crate) fn broadcast_in_place_enqueue<'a, T: NcclType, B: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut B,
        root: usize,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclBroadcast";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let root = self.check_rank(OP, "root", root)?;
        let count = buf.len();
        let (p, g) = self.recv_arg(OP, buf, count, "in place", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, Some(root as usize), stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: `p` holds `count` elements; send == recv is the in-place form.
            unsafe {
                (t.ncclBroadcast)(p, p, count, T::DATA_TYPE.to_raw(), root, comm, stream.raw())
            }
        })?;
        Ok([g, BufferGuard::Host])
    }

    /// Copies `send` on `root` into every rank's `recv` (`ncclBroadcast`). All ranks pass
    /// buffers of the same length; `send` is read only on the root.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![10 * r as i32; 2];
    ///     let mut recv = vec![0; 2];
    ///     comm.broadcast(&send, &mut recv, 2, s)?; // root 2
    ///     assert_eq!(recv, vec![20, 20]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn broadcast<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        root: usize,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.broadcast_enqueue(send, recv, root, stream.as_stream(), Location::caller())
            .map(drop)
    }

    /// Broadcast in place: `buf` is the source on the root and the destination elsewhere.
    #[track_caller]
    pub fn broadcast_in_place<T, B>(
        &self,
        buf: &mut B,
        root: usize,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        B: RecvBuffer<T> + ?Sized,
    {
        self.broadcast_in_place_enqueue(buf, root, stream.as_stream(), Location::caller())
            .map(drop)
    }

    // ---- reduce -----------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn reduce_enqueue<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        op: Reduction<'a, T>,
        root: usize,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclReduce";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let red = op.raw_for(self, OP)?;
        let root = self.check_rank(OP, "root", root)?;
        let count = send.len();
        let (s, sg) = self.send_arg(OP, send, count, "recv = send", stream)?;
        let (r, rg) = self.recv_arg(OP, recv, count, "recv = send", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, Some(root as usize), stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: both buffers hold `count` elements; root is in range.
            unsafe {
                (t.ncclReduce)(
                    s,
                    r,
                    count,
                    T::DATA_TYPE.to_raw(),
                    red,
                    root,
                    comm,
                    stream.raw(),
                )
            }
        })?;
        Ok([sg, rg])
    }

    /// Reduces `send` across all ranks into `recv` on `root` (`ncclReduce`). Every rank
    /// passes `recv.len() == send.len()`; only the root's `recv` is written.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![r as u64 + 1; 2];
    ///     let mut recv = vec![0u64; 2];
    ///     comm.reduce(&send, &mut recv, ReduceOp::Prod, 0, s)?;
    ///     assert_eq!(recv, if r == 0 { vec![6, 6] } else { vec![0, 0] });
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn reduce<'a, T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: impl Into<Reduction<'a, T>>,
        root: usize,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.reduce_enqueue(
            send,
            recv,
            op.into(),
            root,
            stream.as_stream(),
            Location::caller(),
        )
        .map(drop)
    }

    /// Reduce in place: `buf` is every rank's input and, on the root, the result.
    #[track_caller]
    pub fn reduce_in_place<'a, T, B>(
        &self,
        buf: &mut B,
        op: impl Into<Reduction<'a, T>>,
        root: usize,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        B: RecvBuffer<T> + ?Sized,
    {
        const OP: &str = "ncclReduce";
        let caller = Location::caller();
        let stream = stream.as_stream();
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let red = op.into().raw_for(self, OP)?;
        let root = self.check_rank(OP, "root", root)?;
        let count = buf.len();
        let (p, _g) = self.recv_arg(OP, buf, count, "in place", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, Some(root as usize), stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: `p` holds `count` elements; send == recv is the in-place form.
            unsafe {
                (t.ncclReduce)(
                    p,
                    p,
                    count,
                    T::DATA_TYPE.to_raw(),
                    red,
                    root,
                    comm,
                    stream.raw(),
                )
            }
        })
    }

    // ---- all-gather -------------------------------------------------------------------

    #[inline(always)]
    pub(crate) fn all_gather_enqueue<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclAllGather";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let count = send.len();
        let total = self.times_world(OP, count)?;
        let (s, sg) = self.send_arg(OP, send, count, "send = count", stream)?;
        let (r, rg) = self.recv_arg(OP, recv, total, "recv = world_size x send", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, None, stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: send holds `count`, recv `world_size * count` elements.
            unsafe { (t.ncclAllGather)(s, r, count, T::DATA_TYPE.to_raw(), comm, stream.raw()) }
        })?;
        Ok([sg, rg])
    }

    /// Gathers every rank's `send` into every rank's `recv`, rank `i`'s block at
    /// `i * send.len()` (`ncclAllGather`). `recv.len() == world_size * send.len()`.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![r as u8; 2];
    ///     let mut recv = vec![9u8; 6];
    ///     comm.all_gather(&send, &mut recv, s)?;
    ///     assert_eq!(recv, vec![0, 0, 1, 1, 2, 2]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn all_gather<T, S, R>(&self, send: &S, recv: &mut R, stream: &impl AsStream) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.all_gather_enqueue(send, recv, stream.as_stream(), Location::caller())
            .map(drop)
    }

    /// All-gather in place: this rank's input is its own block of `buf`
    /// (`buf[rank * n .. (rank + 1) * n]`, `n = buf.len() / world_size`).
    #[track_caller]
    pub fn all_gather_in_place<T, B>(&self, buf: &mut B, stream: &impl AsStream) -> Result<()>
    where
        T: NcclType,
        B: RecvBuffer<T> + ?Sized,
    {
        const OP: &str = "ncclAllGather";
        let caller = Location::caller();
        let stream = stream.as_stream();
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let count = self.block_of(OP, buf.len())?;
        let rank = self.rank();
        let (p, _g) = self.recv_arg(OP, buf, count * self.world_size(), "in place", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, None, stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: `p` holds world_size * count elements of T; the send pointer is this
            // rank's block inside it, NCCL's in-place form.
            unsafe {
                let s = p.cast::<T>().add(rank * count).cast::<std::ffi::c_void>();
                (t.ncclAllGather)(s, p, count, T::DATA_TYPE.to_raw(), comm, stream.raw())
            }
        })
    }

    /// `len / world_size`, or an error when `len` is not a multiple of it.
    fn block_of(&self, op: &'static str, len: usize) -> Result<usize> {
        let n = self.world_size();
        if !len.is_multiple_of(n) {
            return Err(Error::LengthMismatch {
                op,
                role: BufferRole::Recv,
                expected: (len / n + 1) * n,
                actual: len,
                rule: "in place: buffer = world_size x block",
            });
        }
        Ok(len / n)
    }

    // ---- reduce-scatter ---------------------------------------------------------------

    #[inline(always)]
    pub(crate) fn reduce_scatter_enqueue<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        op: Reduction<'a, T>,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclReduceScatter";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let red = op.raw_for(self, OP)?;
        let count = recv.len();
        let total = self.times_world(OP, count)?;
        let (s, sg) = self.send_arg(OP, send, total, "send = world_size x recv", stream)?;
        let (r, rg) = self.recv_arg(OP, recv, count, "recv = count", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, None, stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: send holds `world_size * count`, recv `count` elements.
            unsafe {
                (t.ncclReduceScatter)(s, r, count, T::DATA_TYPE.to_raw(), red, comm, stream.raw())
            }
        })?;
        Ok([sg, rg])
    }

    /// Reduces `send` across ranks and leaves block `i` of the result on rank `i`
    /// (`ncclReduceScatter`). `send.len() == world_size * recv.len()`.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send: Vec<f32> = (0..6).map(|i| i as f32).collect(); // the same on every rank
    ///     let mut recv = vec![0.0f32; 2];
    ///     comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum, s)?;
    ///     assert_eq!(recv, vec![3.0 * (2 * r) as f32, 3.0 * (2 * r + 1) as f32]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn reduce_scatter<'a, T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: impl Into<Reduction<'a, T>>,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.reduce_scatter_enqueue(
            send,
            recv,
            op.into(),
            stream.as_stream(),
            Location::caller(),
        )
        .map(drop)
    }

    /// Reduce-scatter in place: the result lands in this rank's block of `buf`.
    #[track_caller]
    pub fn reduce_scatter_in_place<'a, T, B>(
        &self,
        buf: &mut B,
        op: impl Into<Reduction<'a, T>>,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        B: RecvBuffer<T> + ?Sized,
    {
        const OP: &str = "ncclReduceScatter";
        let caller = Location::caller();
        let stream = stream.as_stream();
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let red = op.into().raw_for(self, OP)?;
        let count = self.block_of(OP, buf.len())?;
        let rank = self.rank();
        let (p, _g) = self.recv_arg(OP, buf, count * self.world_size(), "in place", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, None, stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: `p` holds world_size * count elements; the receive pointer is this
            // rank's block inside it, NCCL's in-place form.
            unsafe {
                let r = p.cast::<T>().add(rank * count).cast::<std::ffi::c_void>();
                (t.ncclReduceScatter)(p, r, count, T::DATA_TYPE.to_raw(), red, comm, stream.raw())
            }
        })
    }

    // ---- point to point ---------------------------------------------------------------

    #[inline(always)]
    pub(crate) fn send_enqueue<'a, T: NcclType, S: SendBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a S,
        peer: usize,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclSend";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let peer = self.check_rank(OP, "peer", peer)?;
        let count = buf.len();
        let (s, sg) = self.send_arg(OP, buf, count, "any length", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, Some(peer as usize), stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: `s` holds `count` elements; peer is in range.
            unsafe { (t.ncclSend)(s, count, T::DATA_TYPE.to_raw(), peer, comm, stream.raw()) }
        })?;
        Ok([sg, BufferGuard::Host])
    }

    #[inline(always)]
    pub(crate) fn recv_enqueue<'a, T: NcclType, R: RecvBuffer<T> + ?Sized>(
        &'a self,
        buf: &'a mut R,
        peer: usize,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclRecv";
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let peer = self.check_rank(OP, "peer", peer)?;
        let count = buf.len();
        let (r, rg) = self.recv_arg(OP, buf, count, "any length", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, Some(peer as usize), stream);
        self.issue(info, caller, |t, comm| {
            // SAFETY: `r` holds `count` elements; peer is in range.
            unsafe { (t.ncclRecv)(r, count, T::DATA_TYPE.to_raw(), peer, comm, stream.raw()) }
        })?;
        Ok([rg, BufferGuard::Host])
    }

    /// Sends `buf` to `peer` (`ncclSend`); the peer posts a [`recv`](Self::recv) of the
    /// same length. A send and a receive that depend on each other must be in one
    /// [`crate::Group`].
    #[track_caller]
    pub fn send<T, S>(&self, buf: &S, peer: usize, stream: &impl AsStream) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
    {
        self.send_enqueue(buf, peer, stream.as_stream(), Location::caller())
            .map(drop)
    }

    /// Receives `buf.len()` elements from `peer` (`ncclRecv`).
    #[track_caller]
    pub fn recv<T, R>(&self, buf: &mut R, peer: usize, stream: &impl AsStream) -> Result<()>
    where
        T: NcclType,
        R: RecvBuffer<T> + ?Sized,
    {
        self.recv_enqueue(buf, peer, stream.as_stream(), Location::caller())
            .map(drop)
    }

    // ---- all-to-all, gather, scatter (NCCL 2.28+) -------------------------------------

    #[inline(always)]
    pub(crate) fn all_to_all_enqueue<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclAlltoAll";
        let f = self
            .library()
            .optional(self.library().table().ncclAlltoAll, OP)?;
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let total = send.len();
        let count = self.block_of(OP, total)?;
        let (s, sg) = self.send_arg(OP, send, total, "send = world_size x block", stream)?;
        let (r, rg) = self.recv_arg(OP, recv, total, "recv = send", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, None, stream);
        self.issue(info, caller, |_, comm| {
            // SAFETY: both buffers hold world_size * count elements.
            unsafe { f(s, r, count, T::DATA_TYPE.to_raw(), comm, stream.raw()) }
        })?;
        Ok([sg, rg])
    }

    /// Block `j` of `send` goes to rank `j`; block `i` of `recv` comes from rank `i`
    /// (`ncclAlltoAll`, NCCL 2.28+). Both hold `world_size` equal blocks.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send: Vec<i32> = (0..3).map(|to| (10 * r + to) as i32).collect();
    ///     let mut recv = vec![0i32; 3];
    ///     comm.all_to_all(&send, &mut recv, s)?;
    ///     assert_eq!(recv, (0..3).map(|from| (10 * from + r) as i32).collect::<Vec<_>>());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn all_to_all<T, S, R>(&self, send: &S, recv: &mut R, stream: &impl AsStream) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.all_to_all_enqueue(send, recv, stream.as_stream(), Location::caller())
            .map(drop)
    }

    #[inline(always)]
    pub(crate) fn gather_enqueue<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclGather";
        let f = self
            .library()
            .optional(self.library().table().ncclGather, OP)?;
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let root_c = self.check_rank(OP, "root", root)?;
        let count = send.len();
        let total = self.times_world(OP, count)?;
        let (s, sg) = self.send_arg(OP, send, count, "send = count", stream)?;
        let (r, rg) = if self.rank() == root {
            self.recv_arg(
                OP,
                recv,
                total,
                "recv = world_size x send on the root",
                stream,
            )?
        } else {
            self.check_memory(OP, BufferRole::Recv, recv.memory())?;
            (std::ptr::null_mut(), BufferGuard::Host)
        };
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, Some(root), stream);
        self.issue(info, caller, |_, comm| {
            // SAFETY: send holds `count`; on the root recv holds world_size * count; NCCL
            // ignores recv elsewhere (passed as null).
            unsafe {
                f(
                    s,
                    r,
                    count,
                    T::DATA_TYPE.to_raw(),
                    root_c,
                    comm,
                    stream.raw(),
                )
            }
        })?;
        Ok([sg, rg])
    }

    /// Gathers every rank's `send` into `recv` on `root`, rank `i` at `i * send.len()`
    /// (`ncclGather`, NCCL 2.28+). Only the root's `recv` is checked and written.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send = vec![r as i64];
    ///     let mut recv = if r == 1 { vec![0i64; 3] } else { Vec::new() };
    ///     comm.gather(&send, &mut recv, 1, s)?;
    ///     if r == 1 { assert_eq!(recv, vec![0, 1, 2]); }
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn gather<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        root: usize,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.gather_enqueue(send, recv, root, stream.as_stream(), Location::caller())
            .map(drop)
    }

    #[inline(always)]
    pub(crate) fn scatter_enqueue<
        'a,
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    >(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: StreamRef<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Guards<'a>> {
        const OP: &str = "ncclScatter";
        let f = self
            .library()
            .optional(self.library().table().ncclScatter, OP)?;
        self.admit(OP)?;
        self.check_stream(OP, stream)?;
        let root_c = self.check_rank(OP, "root", root)?;
        let count = recv.len();
        let total = self.times_world(OP, count)?;
        let (s, sg) = if self.rank() == root {
            self.send_arg(
                OP,
                send,
                total,
                "send = world_size x recv on the root",
                stream,
            )?
        } else {
            self.check_memory(OP, BufferRole::Send, send.memory())?;
            (std::ptr::null(), BufferGuard::Host)
        };
        let (r, rg) = self.recv_arg(OP, recv, count, "recv = count", stream)?;
        let info = OpInfo::new(&OP, T::DATA_TYPE, count, Some(root), stream);
        self.issue(info, caller, |_, comm| {
            // SAFETY: recv holds `count`; on the root send holds world_size * count; NCCL
            // ignores send elsewhere (passed as null).
            unsafe {
                f(
                    s,
                    r,
                    count,
                    T::DATA_TYPE.to_raw(),
                    root_c,
                    comm,
                    stream.raw(),
                )
            }
        })?;
        Ok([sg, rg])
    }

    /// Sends block `i` of `send` on `root` to rank `i`'s `recv` (`ncclScatter`, NCCL
    /// 2.28+). Only the root's `send` is checked and read.
    ///
    /// ```
    /// use nccl_safe::{launch::Launcher, ReduceOp};
    /// Launcher::host(3).run(|rank| {
    ///     let (r, comm, s) = (rank.rank(), rank.comm(), rank.stream());
    ///     let send: Vec<u32> = if r == 0 { vec![7, 8, 9] } else { Vec::new() };
    ///     let mut recv = vec![0u32; 1];
    ///     comm.scatter(&send, &mut recv, 0, s)?;
    ///     assert_eq!(recv, vec![7 + r as u32]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn scatter<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        root: usize,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.scatter_enqueue(send, recv, root, stream.as_stream(), Location::caller())
            .map(drop)
    }
}

fn check_len(
    op: &'static str,
    role: BufferRole,
    actual: usize,
    expected: usize,
    rule: &'static str,
) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            op,
            role,
            expected,
            actual,
            rule,
        })
    }
}
