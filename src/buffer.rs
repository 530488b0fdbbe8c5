//! What a collective may read and write: host slices (host provider only) and cudarc's
//! device buffers (NVIDIA's NCCL only).
//!
//! Device pointers are taken through cudarc's `DevicePtr::device_ptr(&stream)` /
//! `DevicePtrMut::device_ptr_mut(&stream)`, and the guards they return are kept until the
//! work is enqueued (to the end of a [`crate::Group`] inside one), so cudarc's cross-stream
//! event tracking stays right.

use std::ffi::c_void;

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
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
    /// Host memory: nothing to record.
    Host,
    /// cudarc's guard: on drop it records the stream's work on the buffer's event.
    Cuda(SyncOnDrop<'a>),
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
    /// Whether the memory came from `ncclMemAlloc` ([`crate::NcclMemory`] and its views),
    /// which symmetric windows need.
    #[doc(hidden)]
    fn is_nccl_alloc(&self) -> bool {
        false
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
                        (ptr as usize as *const c_void, BufferGuard::Cuda(guard))
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
                        (ptr as usize as *mut c_void, BufferGuard::Cuda(guard))
                    }
                    StreamRef::Host => (std::ptr::null_mut(), BufferGuard::Host),
                }
            }
        }
    )*};
}

device_send!(CudaSlice<T>, CudaView<'_, T>, CudaViewMut<'_, T>);
device_recv!(CudaSlice<T>, CudaViewMut<'_, T>);
