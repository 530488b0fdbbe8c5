//! [`Group`]: `ncclGroupStart` / `ncclGroupEnd` as a guard.

use std::marker::PhantomData;

use smallvec::SmallVec;
use std::panic::Location;
use std::sync::Arc;

use crate::buffer::{BufferGuard, RecvBuffer, SendBuffer};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::library::{CallContext, Library};
use crate::nccl_call;
use crate::ops::{Guards, Reduction};
use crate::stream::AsStream;
use crate::types::NcclType;

/// Operations fused between `ncclGroupStart` and `ncclGroupEnd`: send/receive pairs that
/// must progress together, or one thread driving several communicators (one per device).
///
/// * `ncclGroupEnd` runs on every path out: [`end`](Self::end), an early `?`, an error or a
///   panic (in `Drop`).
/// * Every buffer passed to the group stays borrowed until the group ends, so none can be
///   freed, moved or read while NCCL may still use it; cudarc's event guards are released
///   only after `ncclGroupEnd`.
/// * `!Send`: NCCL's group state belongs to the calling thread.
///
/// ```
/// use nccl_safe::{Communicator, Device, Group, HostStream};
/// // One thread drives two ranks: their send/recv pairs must be in one group.
/// let comms = Communicator::init_all(&[Device::Host, Device::Host])?;
/// let (a, b) = (vec![1i32; 3], vec![2i32; 3]);
/// let (mut at_a, mut at_b) = (vec![0i32; 3], vec![0i32; 3]);
/// let mut g = Group::new();
/// g.send(&comms[0], &a, 1, &HostStream)?;
/// g.recv(&comms[1], &mut at_b, 0, &HostStream)?;
/// g.send(&comms[1], &b, 0, &HostStream)?;
/// g.recv(&comms[0], &mut at_a, 1, &HostStream)?;
/// g.end()?;
/// assert_eq!((at_a, at_b), (vec![2; 3], vec![1; 3]));
/// # Ok::<(), nccl_safe::Error>(())
/// ```
pub struct Group<'a> {
    /// The library of the started group, borrowed from its first communicator (no
    /// reference count traffic per group).
    lib: Option<&'a Arc<Library>>,
    /// The distinct communicators used (inline for up to 8: no allocation per group).
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
    /// one library. (A failed communicator is refused by the operation itself, in `issue`.)
    #[inline(always)]
    fn enter(&mut self, comm: &'a Communicator, op: &'static str) -> Result<()> {
        match self.lib {
            Some(lib) if Arc::ptr_eq(lib, comm.library()) => Ok(()),
            _ => self.start(comm, op),
        }
    }

    #[inline(never)]
    fn start(&mut self, comm: &'a Communicator, op: &'static str) -> Result<()> {
        if self.lib.is_some() {
            return Err(Error::InvalidArgument {
                op,
                reason: "all communicators of a group must come from one NCCL library".into(),
            });
        }
        let lib = comm.library();
        // SAFETY: ncclGroupStart takes no arguments; it is paired with the ncclGroupEnd of
        // `end` or `Drop`.
        unsafe { nccl_call!(lib, ncclGroupStart(), CallContext::NONE) }?;
        crate::diag::group_started();
        self.lib = Some(lib);
        Ok(())
    }

    #[inline(always)]
    fn keep(&mut self, comm: &'a Communicator, guards: Guards<'a>) {
        self.operations += 1;
        // Consecutive operations usually share their communicator.
        if !self.comms.last().is_some_and(|c| std::ptr::eq(*c, comm)) {
            self.note(comm);
        }
        if guards.iter().any(|g| matches!(g, BufferGuard::Cuda(_))) {
            self.keep_guards(guards);
        }
    }

    #[inline(never)]
    fn note(&mut self, comm: &'a Communicator) {
        if !self.comms.iter().any(|c| std::ptr::eq(*c, comm)) {
            self.comms.push(comm);
        }
    }

    #[inline(never)]
    fn keep_guards(&mut self, guards: Guards<'a>) {
        for g in guards {
            if let BufferGuard::Cuda(_) = g {
                self.guards.push(g);
            }
        }
    }

    /// Ends the group (`ncclGroupEnd`): the operations are launched (host provider: run)
    /// now. An error marks every communicator of the group failed.
    #[track_caller]
    pub fn end(mut self) -> Result<()> {
        self.finish(Location::caller())
    }

    fn finish(&mut self, caller: &'static Location<'static>) -> Result<()> {
        let Some(lib) = self.lib.take() else {
            return Ok(());
        };
        let ctx = CallContext {
            comm: std::ptr::null_mut(),
            rank: None,
            caller: Some(caller),
        };
        // SAFETY: closes the ncclGroupStart of `enter`; every buffer of the group is still
        // borrowed by `self`.
        let r = unsafe { nccl_call!(lib, ncclGroupEnd(), ctx) };
        crate::diag::group_ended();
        // Only now may cudarc record its events: the work is enqueued.
        self.guards.clear();
        match r {
            Err(e) if e.code() == Some(crate::ResultCode::InProgress) => {
                // Non-blocking communicators: wait (bounded) until each has launched its part.
                for c in self.comms.iter() {
                    c.wait_ready("ncclGroupEnd", caller, c.diag.timeout())?;
                    c.diag.publish_group();
                }
                Ok(())
            }
            Err(e) => {
                for c in &self.comms {
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

    /// [`Communicator::all_reduce`] in this group.
    #[track_caller]
    pub fn all_reduce<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclAllReduce")?;
        let g = comm.all_reduce_enqueue(
            send,
            recv,
            op.into(),
            stream.as_stream(),
            Location::caller(),
        )?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::all_reduce_in_place`] in this group.
    #[track_caller]
    pub fn all_reduce_in_place<T, B>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut B,
        op: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        B: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclAllReduce")?;
        let g = comm.all_reduce_in_place_enqueue(
            buf,
            op.into(),
            stream.as_stream(),
            Location::caller(),
        )?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::broadcast`] in this group.
    #[track_caller]
    pub fn broadcast<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclBroadcast")?;
        let g = comm.broadcast_enqueue(send, recv, root, stream.as_stream(), Location::caller())?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::broadcast_in_place`] in this group.
    #[track_caller]
    pub fn broadcast_in_place<T, B>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut B,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        B: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclBroadcast")?;
        let g =
            comm.broadcast_in_place_enqueue(buf, root, stream.as_stream(), Location::caller())?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::reduce`] in this group.
    #[track_caller]
    pub fn reduce<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: impl Into<Reduction<'a, T>>,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclReduce")?;
        let g = comm.reduce_enqueue(
            send,
            recv,
            op.into(),
            root,
            stream.as_stream(),
            Location::caller(),
        )?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::all_gather`] in this group.
    #[track_caller]
    pub fn all_gather<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclAllGather")?;
        let g = comm.all_gather_enqueue(send, recv, stream.as_stream(), Location::caller())?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::reduce_scatter`] in this group.
    #[track_caller]
    pub fn reduce_scatter<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: impl Into<Reduction<'a, T>>,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclReduceScatter")?;
        let g = comm.reduce_scatter_enqueue(
            send,
            recv,
            op.into(),
            stream.as_stream(),
            Location::caller(),
        )?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::send`] in this group.
    #[track_caller]
    pub fn send<T, S>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a S,
        peer: usize,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclSend")?;
        let g = comm.send_enqueue(buf, peer, stream.as_stream(), Location::caller())?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::recv`] in this group.
    #[track_caller]
    pub fn recv<T, R>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut R,
        peer: usize,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclRecv")?;
        let g = comm.recv_enqueue(buf, peer, stream.as_stream(), Location::caller())?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::gather`] in this group (NCCL 2.28+).
    #[track_caller]
    pub fn gather<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclGather")?;
        let g = comm.gather_enqueue(send, recv, root, stream.as_stream(), Location::caller())?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::scatter`] in this group (NCCL 2.28+).
    #[track_caller]
    pub fn scatter<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        root: usize,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclScatter")?;
        let g = comm.scatter_enqueue(send, recv, root, stream.as_stream(), Location::caller())?;
        self.keep(comm, g);
        Ok(())
    }

    /// [`Communicator::all_to_all`] in this group.
    #[track_caller]
    pub fn all_to_all<T, S, R>(
        &mut self,
        comm: &'a Communicator,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        S: SendBuffer<T> + ?Sized,
        R: RecvBuffer<T> + ?Sized,
    {
        self.enter(comm, "ncclAlltoAll")?;
        let g = comm.all_to_all_enqueue(send, recv, stream.as_stream(), Location::caller())?;
        self.keep(comm, g);
        Ok(())
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        // On `?`, an error or a panic: still close the group, exactly once.
        let _ = self.finish(Location::caller());
    }
}
