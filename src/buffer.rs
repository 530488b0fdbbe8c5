//! What a collective may read and write: host slices (host provider only) and cudarc's
//! device buffers (NVIDIA's NCCL only).
//!
//! Device pointers are taken through cudarc's `DevicePtr::device_ptr(&stream)` /
//! `DevicePtrMut::device_ptr_mut(&stream)`, and the guards they return are kept until the
//! work is enqueued (to the end of a [`crate::Group`] inside one), so cudarc's cross-stream
//! event tracking stays right. Dropping one ([`BufferGuard`]) records cudarc's event as
//! cudarc's guard would, without the context check before it.

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::stream::StreamRef;
use crate::types::NcclType;

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Host memory: only the host provider may touch it.
    Host,
    /// GPU memory of this CUDA device ordinal.
    Device(usize),
}

/// Keeps a buffer's cudarc synchronization guard alive until the work is enqueued.
#[must_use]
pub enum BufferGuard<'a> {
    /// Nothing to record: host memory, or a device buffer without cudarc's events.
    Host,
    /// cudarc's guard: on drop it records the stream's work on the buffer's event. Held in
    /// a `ManuallyDrop` that this guard's own drop empties, once: so the drop of a host
    /// buffer's guard is one comparison inlined at the caller (two guards an operation, a
    /// `drop_in_place` call of about 25 instructions before, with callgrind over the
    /// overhead bench), and cudarc's code runs out of line, for device buffers only.
    Cuda(ManuallyDrop<SyncOnDrop<'a>>),
}

impl<'a> BufferGuard<'a> {
    /// The guard of a device buffer, from cudarc's `device_ptr`/`device_ptr_mut`. One that
    /// holds no event (a buffer made with cudarc's event tracking off) has nothing to do on
    /// drop (cudarc's own drop of it takes `None` and returns): it is kept as
    /// [`Host`](Self::Host)'s, so its drop is the one inlined comparison, not the call
    /// into `release` (about 25 instructions an operation with tracking off, measured with
    /// callgrind over the overhead bench's group rows).
    #[inline(always)]
    pub(crate) fn cuda(guard: SyncOnDrop<'a>) -> Self {
        if matches!(guard, SyncOnDrop::Record(None)) {
            // Nothing to drop: `Record(None)`'s drop does nothing.
            std::mem::forget(guard);
            return BufferGuard::Host;
        }
        BufferGuard::Cuda(ManuallyDrop::new(guard))
    }
}

impl Drop for BufferGuard<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        if let BufferGuard::Cuda(guard) = self {
            // SAFETY: taken once, here, as the guard is dropped: nothing reads it after.
            release(unsafe { ManuallyDrop::take(guard) });
        }
    }
}

/// Records cudarc's event of a device buffer's guard, as cudarc's own guard would, with one
/// driver call less; a guard of another kind is dropped as cudarc's.
///
/// cudarc's record makes the event's context current first (a `cuCtxGetCurrent`, and a
/// `cuCtxSetCurrent` when it was not). Here the guard came from cudarc's
/// `device_ptr`/`device_ptr_mut`, whose waits made that context current on this thread, and
/// the work was enqueued on this thread since: `cuEventRecord` is tried as it is, and only
/// when it fails (the context was not current, say after a group over devices of several
/// contexts) is cudarc's record made, which binds the context and keeps a failure in the
/// context's error, as its guard does. A failed record changes nothing, so trying again is
/// safe.
#[inline(never)]
fn release(mut guard: SyncOnDrop<'_>) {
    let SyncOnDrop::Record(target) = &mut guard else {
        return; // dropped here: cudarc's own drop
    };
    let Some((event, stream)) = target.take() else {
        return;
    };
    let ctx = stream.context();
    if !ctx.is_managing_stream_synchronization() {
        return;
    }
    // SAFETY: the event and the stream are alive (the guard borrowed both).
    let raw =
        unsafe { cudarc::driver::result::event::record(event.cu_event(), stream.cu_stream()) };
    if raw.is_err() {
        ctx.record_err(event.record(stream));
    }
}

impl std::fmt::Debug for BufferGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BufferGuard::Host => "BufferGuard::Host",
            BufferGuard::Cuda(_) => "BufferGuard::Cuda",
        })
    }
}

pub(crate) mod sealed {
    pub trait Sealed {}
}

/// A buffer a collective reads (`sendbuff`). Sealed: only buffers whose pointer and length
/// this crate can vouch for.
pub trait SendBuffer<T: NcclType>: sealed::Sealed {
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether it has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where it lives.
    fn memory(&self) -> Memory;
    /// The pointer NCCL reads through, and the guard to hold until the work is enqueued.
    /// `stream` must match [`Self::memory`] (callers check first); else the pointer is null.
    #[doc(hidden)]
    fn send_ptr<'a>(&'a self, stream: StreamRef<'a>) -> (*const c_void, BufferGuard<'a>);
    /// The buffer's address, for registration: taken on the buffer's own stream (device
    /// memory), with no stream of the caller's involved.
    #[doc(hidden)]
    fn base_ptr(&self) -> *const c_void;
    /// Where the buffer starts inside the `ncclMemAlloc` allocation it is part of, in
    /// bytes ([`crate::NcclMemory`]: 0, a view: its offset), or `None` for other memory:
    /// what symmetric windows need.
    #[doc(hidden)]
    fn nccl_alloc_offset(&self) -> Option<usize> {
        None
    }
    /// The one stream an operation on it may run on ([`StreamBound`]): its handle.
    #[doc(hidden)]
    fn bound_stream(&self) -> Option<usize> {
        None
    }
}

/// A buffer a collective writes (`recvbuff`).
pub trait RecvBuffer<T: NcclType>: SendBuffer<T> {
    /// The pointer NCCL writes through, and the guard to hold until the work is enqueued.
    #[doc(hidden)]
    fn recv_ptr<'a>(&'a mut self, stream: StreamRef<'a>) -> (*mut c_void, BufferGuard<'a>);
}

impl<T: NcclType> sealed::Sealed for [T] {}
impl<T: NcclType> SendBuffer<T> for [T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
    fn memory(&self) -> Memory {
        Memory::Host
    }
    fn send_ptr<'a>(&'a self, _stream: StreamRef<'a>) -> (*const c_void, BufferGuard<'a>) {
        (self.as_ptr().cast(), BufferGuard::Host)
    }
    fn base_ptr(&self) -> *const c_void {
        self.as_ptr().cast()
    }
}
impl<T: NcclType> RecvBuffer<T> for [T] {
    fn recv_ptr<'a>(&'a mut self, _stream: StreamRef<'a>) -> (*mut c_void, BufferGuard<'a>) {
        (self.as_mut_ptr().cast(), BufferGuard::Host)
    }
}

/// `Vec<T>` and `[T; N]`: host memory, passed as their slice.
macro_rules! host_as_slice {
    ($([$($generics:tt)*] $ty:ty),*) => {$(
        impl<T: NcclType $($generics)*> sealed::Sealed for $ty {}
        impl<T: NcclType $($generics)*> SendBuffer<T> for $ty {
            fn len(&self) -> usize {
                self.as_slice().len()
            }
            fn memory(&self) -> Memory {
                Memory::Host
            }
            fn send_ptr<'a>(&'a self, stream: StreamRef<'a>) -> (*const c_void, BufferGuard<'a>) {
                self.as_slice().send_ptr(stream)
            }
            fn base_ptr(&self) -> *const c_void {
                self.as_ptr().cast()
            }
        }
        impl<T: NcclType $($generics)*> RecvBuffer<T> for $ty {
            fn recv_ptr<'a>(&'a mut self, stream: StreamRef<'a>) -> (*mut c_void, BufferGuard<'a>) {
                self.as_mut_slice().recv_ptr(stream)
            }
        }
    )*};
}
host_as_slice!([] Vec<T>, [, const N: usize] [T; N]);

macro_rules! device_send {
    ($($ty:ty),*) => {$(
        impl<T: NcclType> sealed::Sealed for $ty {}
        impl<T: NcclType> SendBuffer<T> for $ty {
            fn len(&self) -> usize {
                DeviceSlice::len(self)
            }
            fn memory(&self) -> Memory {
                Memory::Device(DeviceSlice::stream(self).context().ordinal())
            }
            fn send_ptr<'a>(&'a self, stream: StreamRef<'a>) -> (*const c_void, BufferGuard<'a>) {
                match stream {
                    StreamRef::Cuda(s) => {
                        let (ptr, guard) = self.device_ptr(s);
                        (ptr as usize as *const c_void, BufferGuard::cuda(guard))
                    }
                    StreamRef::Host => (std::ptr::null(), BufferGuard::Host),
                }
            }
            fn base_ptr(&self) -> *const c_void {
                // On the buffer's own stream: waits for its writes there, records a read.
                let (ptr, _guard) = self.device_ptr(DeviceSlice::stream(self));
                ptr as usize as *const c_void
            }
        }
    )*};
}

macro_rules! device_recv {
    ($($ty:ty),*) => {$(
        impl<T: NcclType> RecvBuffer<T> for $ty {
            fn recv_ptr<'a>(&'a mut self, stream: StreamRef<'a>) -> (*mut c_void, BufferGuard<'a>) {
                match stream {
                    StreamRef::Cuda(s) => {
                        let (ptr, guard) = self.device_ptr_mut(s);
                        (ptr as usize as *mut c_void, BufferGuard::cuda(guard))
                    }
                    StreamRef::Host => (std::ptr::null_mut(), BufferGuard::Host),
                }
            }
        }
    )*};
}

device_send!(CudaSlice<T>, CudaView<'_, T>, CudaViewMut<'_, T>);
device_recv!(CudaSlice<T>, CudaViewMut<'_, T>);

/// A cudarc buffer that only NCCL's operations on its own stream touch, without cudarc's
/// event tracking per operation (an opt-in: a plain [`CudaSlice`] is always right).
///
/// With tracking on (cudarc's default, once a context has a second stream), every use of a
/// [`CudaSlice`] makes its stream wait for the buffer's last write (and, to write, its last
/// read) and records an event afterwards: two `cuStreamWaitEvent` and a `cuEventRecord` per
/// operation, GPU work included. Work on one stream runs in order, so for a buffer that
/// only the communication stream touches, those calls order nothing. A `StreamBound` takes
/// the slice by value and makes them once at each end instead:
///
/// - [`new`](Self::new) makes the slice's own stream wait for what other streams did to it
///   (cudarc's waits, once);
/// - an operation takes its pointer with no call at all, and is refused with
///   [`Error::InvalidArgument`](crate::Error::InvalidArgument) on any other stream;
/// - [`into_inner`](Self::into_inner) (and the drop) record the buffer's write event on its
///   stream after every operation on it, so the next use on another stream, through cudarc,
///   waits for them.
///
/// Nothing else can reach the memory meanwhile: the slice is owned here. The stream must
/// be one stream for every thread: [`new`](Self::new) refuses `CU_STREAM_PER_THREAD`. With
/// tracking off, cudarc orders nothing, here or elsewhere. `tests/stream_order.rs` checks
/// it with the fake CUDA driver's model of CUDA's stream order: a buffer written on a
/// compute stream, reduced under a `StreamBound` on the communication stream and read back
/// on the compute stream has no unordered access.
///
/// ```no_run
/// use nccl_safe::{Communicator, ReduceOp, StreamBound};
/// # fn f(comm: &Communicator, comm_stream: &std::sync::Arc<cudarc::driver::CudaStream>)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// let grads = comm_stream.alloc_zeros::<f32>(1 << 20)?;
/// let mut grads = StreamBound::new(grads).map_err(|(_, e)| e)?;
/// for _ in 0..100 {
///     comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, comm_stream)?;
/// }
/// let grads = grads.into_inner(); // ordered for every stream again
/// # Ok(()) }
/// ```
pub struct StreamBound<T> {
    /// `None` only inside `into_inner` and the drop.
    slice: Option<CudaSlice<T>>,
    ptr: cudarc::driver::sys::CUdeviceptr,
    stream: usize,
}

impl<T> StreamBound<T> {
    /// Binds `slice` to its own stream ([`CudaSlice::stream`]): that stream waits for the
    /// slice's pending uses on other streams. The slice comes back with
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when its stream is
    /// `CU_STREAM_PER_THREAD` (a different stream on every thread).
    #[allow(clippy::result_large_err)] // the slice comes back
    pub fn new(
        mut slice: CudaSlice<T>,
    ) -> std::result::Result<StreamBound<T>, (CudaSlice<T>, crate::Error)> {
        let own = Arc::clone(DeviceSlice::stream(&slice));
        let stream = own.cu_stream() as usize;
        if stream == crate::stream::PER_THREAD_STREAM {
            let e = crate::error::invalid("StreamBound::new", "the slice's stream is CU_STREAM_PER_THREAD, a different stream on every thread: allocate it on a stream of its own");
            return Err((slice, e));
        }
        // cudarc's waits for the slice's last read and write, made on its own stream; the
        // guard's drop records a write there, which orders nothing new.
        let ptr = slice.device_ptr_mut(&own).0;
        Ok(StreamBound {
            slice: Some(slice),
            ptr,
            stream,
        })
    }

    /// The slice, its write event recorded on its stream after every operation on it, so
    /// cudarc orders its next use on any stream after them.
    pub fn into_inner(mut self) -> CudaSlice<T> {
        self.hand_back().expect("the slice is here until now")
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.slice.as_ref().map_or(0, DeviceSlice::len)
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stream it is bound to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::stream(self.slice.as_ref().expect("the slice is here"))
    }

    fn hand_back(&mut self) -> Option<CudaSlice<T>> {
        let mut slice = self.slice.take()?;
        let own = Arc::clone(DeviceSlice::stream(&slice));
        // The guard's drop records the slice's write event on its stream.
        drop(slice.device_ptr_mut(&own));
        Some(slice)
    }
}

impl<T> Drop for StreamBound<T> {
    /// Records the write event as [`into_inner`](Self::into_inner) does, so cudarc's free
    /// of the slice (on its stream, after waiting for its events) follows every operation.
    fn drop(&mut self) {
        drop(self.hand_back());
    }
}

impl<T> std::fmt::Debug for StreamBound<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamBound")
            .field("len", &self.len())
            .field("stream", &format_args!("{:#x}", self.stream))
            .finish_non_exhaustive()
    }
}

impl<T: NcclType> sealed::Sealed for StreamBound<T> {}
impl<T: NcclType> SendBuffer<T> for StreamBound<T> {
    fn len(&self) -> usize {
        StreamBound::len(self)
    }
    fn memory(&self) -> Memory {
        Memory::Device(self.stream().context().ordinal())
    }
    fn send_ptr<'a>(&'a self, stream: StreamRef<'a>) -> (*const c_void, BufferGuard<'a>) {
        match stream {
            // The operation's checks refused any other stream.
            StreamRef::Cuda(s) if s.cu_stream() as usize == self.stream => {
                (self.ptr as usize as *const c_void, BufferGuard::Host)
            }
            _ => (std::ptr::null(), BufferGuard::Host),
        }
    }
    fn base_ptr(&self) -> *const c_void {
        self.ptr as usize as *const c_void
    }
    fn bound_stream(&self) -> Option<usize> {
        Some(self.stream)
    }
}
impl<T: NcclType> RecvBuffer<T> for StreamBound<T> {
    fn recv_ptr<'a>(&'a mut self, stream: StreamRef<'a>) -> (*mut c_void, BufferGuard<'a>) {
        let (p, guard) = self.send_ptr(stream);
        (p.cast_mut(), guard)
    }
}
