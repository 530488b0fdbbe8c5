//! [`NcclMemory`]: memory from NCCL's own allocator (`ncclMemAlloc`, NCCL 2.19+), freed with
//! `ncclMemFree` exactly once.
//!
//! NCCL's allocator hands out memory that NCCL can map into its peers (CUDA's virtual memory
//! management API, with the handle types NVLink SHARP and symmetric windows need). Buffers
//! from it are what [`crate::Communicator::register`] and, for
//! [`crate::WindowFlags::COLL_SYMMETRIC`], [`crate::Communicator::register_window`] work
//! best with (PyTorch's `MemPool` over NCCL's allocator is the same idea).
//!
//! An [`NcclMemory`] is a buffer like any other: a send and receive buffer of every
//! collective, with views ([`NcclMemory::slice`], [`NcclMemory::slice_mut`]), host copies
//! ([`NcclMemory::copy_from_host`], [`NcclMemory::to_vec`]) and, on a GPU, cudarc views
//! ([`NcclMemory::cuda_view`], [`NcclMemory::cuda_view_mut`]) that cudarc's own copies and
//! kernels take. It knows its device and is checked like any other buffer. On the host
//! provider `ncclMemAlloc` returns host memory, and an `NcclMemory` is a host buffer there.

use std::ffi::c_void;
use std::ops::{Bound, RangeBounds};
use std::panic::Location;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};

use crate::buffer::{sealed, BufferGuard, Memory, RecvBuffer, SendBuffer};
use crate::comm::Communicator;
use crate::error::{check_len, invalid, BufferRole, Error, Result};
use crate::library::{CallContext, Library, Provider};
use crate::stream::{AsStream, Stream, StreamRef};
use crate::types::NcclType;

/// Device memory from `ncclMemAlloc` (host memory on the host provider), freed with
/// `ncclMemFree` exactly once: on drop, or by [`free`](Self::free), which reports errors.
///
/// ```
/// use nccl_launch::Launcher;
/// use nccl_safe::{NcclMemory, ReduceOp};
/// Launcher::host(2).run(|rank| {
///     let (comm, s) = (rank.comm(), rank.stream());
///     let mut grads = NcclMemory::<f32>::alloc_zeros(comm, 4, s.clone())?;
///     grads.copy_from_host(&[rank.rank() as f32 + 1.0; 4], s)?;
///     comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, s)?;
///     assert_eq!(grads.to_vec(s)?, vec![3.0; 4]);
///     Ok(())
/// })?;
/// # Ok::<(), nccl_launch::Error>(())
/// ```
pub struct NcclMemory<T: NcclType> {
    lib: Arc<Library>,
    len: usize,
    /// The bound on its release (the communicator's `abort_timeout`, or the
    /// environment's default for memory made without one).
    bound: crate::teardown::Bound,
    /// `None` only once freed (inside `free`/`drop`).
    storage: Option<Storage<T>>,
}

enum Storage<T> {
    /// The host provider's `ncclMemAlloc`: host memory, zeroed, 4096-aligned.
    Host(NonNull<T>),
    /// NVIDIA's NCCL: device memory, held as a cudarc slice (for its stream, device and
    /// event tracking) that is leaked back, never freed by cudarc, before `ncclMemFree`.
    Cuda(CudaSlice<T>),
}

// SAFETY: an NcclMemory owns its allocation as a Vec owns its buffer (the raw pointer is
// never shared outside borrows of `self`); T is Send + Sync (NcclType), and CudaSlice is.
unsafe impl<T: NcclType> Send for NcclMemory<T> {}
// SAFETY: `&NcclMemory` only reads (host: `&[T]`; device: cudarc's `&CudaSlice`).
unsafe impl<T: NcclType> Sync for NcclMemory<T> {}

impl<T: NcclType> std::fmt::Debug for NcclMemory<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclMemory")
            .field("dtype", &T::DATA_TYPE)
            .field("len", &self.len)
            .field("memory", &self.memory())
            .finish()
    }
}

impl From<Arc<CudaStream>> for Stream {
    fn from(s: Arc<CudaStream>) -> Stream {
        Stream::Cuda(s)
    }
}

impl From<&Arc<CudaStream>> for Stream {
    fn from(s: &Arc<CudaStream>) -> Stream {
        Stream::Cuda(Arc::clone(s))
    }
}

impl From<&Stream> for Stream {
    fn from(s: &Stream) -> Stream {
        s.clone()
    }
}

impl<T: NcclType> NcclMemory<T> {
    /// Allocates `len` zeroed elements with `ncclMemAlloc` (NCCL 2.19+) for `comm`'s device,
    /// zeroed on `stream` (a stream of that device; [`Stream::Host`] on the host provider).
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.19, [`Error::InvalidArgument`] for a
    /// size that overflows, or a stream of another kind or device. A zero length gives an
    /// empty buffer (which still holds the allocator's smallest allocation).
    #[track_caller]
    pub fn alloc_zeros(comm: &Communicator, len: usize, stream: impl Into<Stream>) -> Result<Self> {
        const OP: &str = "ncclMemAlloc";
        let stream = stream.into();
        comm.check_stream(OP, stream.as_stream())?;
        let mut mem = Self::alloc_zeros_in(comm.library(), len, stream)?;
        mem.bound = comm.diag.bound();
        Ok(mem)
    }

    /// [`alloc_zeros`](Self::alloc_zeros) without a communicator: from `lib`'s allocator, on
    /// `stream`'s device (NVIDIA's NCCL) or in host memory (the host provider).
    #[track_caller]
    pub fn alloc_zeros_in(
        lib: &Arc<Library>,
        len: usize,
        stream: impl Into<Stream>,
    ) -> Result<Self> {
        const OP: &str = "ncclMemAlloc";
        let caller = Location::caller();
        let alloc = lib.optional(lib.table().ncclMemAlloc, "ncclMemAlloc")?;
        lib.optional(lib.table().ncclMemFree, "ncclMemFree")?;
        // An empty NcclMemory still holds one element's allocation (NCCL's allocator has
        // no empty allocations); its length stays 0.
        let bytes = len
            .max(1)
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                invalid(
                    OP,
                    format!(
                        "{len} elements of {} overflow the address space",
                        T::DATA_TYPE.name()
                    ),
                )
            })?;
        let ctx = CallContext::at(None, caller);
        let mut raw: *mut c_void = std::ptr::null_mut();
        match (lib.provider(), stream.into()) {
            (Provider::Host, Stream::Host) => {
                // SAFETY: `raw` is a writable out-pointer; the size is checked above.
                let r = unsafe { alloc(&mut raw, bytes) };
                lib.check(OP, r, ctx)?;
                let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
                    return Err(invalid(OP, "ncclMemAlloc returned success but no memory"));
                };
                let mem = NcclMemory {
                    lib: Arc::clone(lib),
                    len,
                    bound: crate::diag::default_bound(),
                    storage: Some(Storage::Host(ptr)),
                };
                if !raw.cast::<T>().is_aligned() {
                    return Err(invalid(
                        OP,
                        "ncclMemAlloc returned memory not aligned for the type",
                    ));
                }
                // SAFETY: `ptr` points to `bytes` writable bytes that this NcclMemory owns.
                unsafe { std::ptr::write_bytes(raw.cast::<u8>(), 0, bytes) };
                Ok(mem)
            }
            (Provider::Nccl, Stream::Cuda(s)) => {
                // Not `bind_to_thread`, here or in cudarc's calls below (their binds run
                // with it set aside): the context's recorded error stays the user's.
                use crate::stream::keeping_recorded_error as keeping;
                crate::stream::make_current(s.context())?;
                // SAFETY: `raw` is a writable out-pointer; the size is checked above; the
                // stream's device is current, so NCCL allocates there.
                let r = unsafe { alloc(&mut raw, bytes) };
                lib.check(OP, r, ctx)?;
                if raw.is_null() {
                    return Err(invalid(OP, "ncclMemAlloc returned success but no memory"));
                }
                // SAFETY: `raw` is a live device allocation of `bytes` = len * size_of::<T>()
                // bytes on the stream's device. The slice never frees it: `release` leaks it
                // back before `ncclMemFree`. Its contents are zeroed below before any read.
                let slice = keeping(s.context(), || unsafe {
                    s.upgrade_device_ptr::<T>(raw as usize as u64, len)
                });
                let mut mem = NcclMemory {
                    lib: Arc::clone(lib),
                    len,
                    bound: crate::diag::default_bound(),
                    storage: Some(Storage::Cuda(slice)),
                };
                if let Some(Storage::Cuda(slice)) = mem.storage.as_mut() {
                    // On error `mem` is dropped, which frees the memory (once).
                    keeping(s.context(), || s.memset_zeros(slice))?;
                }
                Ok(mem)
            }
            (Provider::Host, _) => Err(invalid(OP, "the Host provider needs Stream::Host")),
            (Provider::Nccl, _) => Err(invalid(OP, "the Nccl provider needs a CUDA stream")),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where it lives: `Memory::Device(ordinal)`, or `Memory::Host` on the host provider.
    pub fn memory(&self) -> Memory {
        match &self.storage {
            Some(Storage::Cuda(s)) => Memory::Device(s.context().ordinal()),
            _ => Memory::Host,
        }
    }

    /// The library whose allocator it came from (and that frees it).
    pub fn library(&self) -> &Arc<Library> {
        &self.lib
    }

    /// The elements, for memory of the host provider; [`Error::InvalidArgument`] for
    /// device memory (copy it with [`to_vec`](Self::to_vec)).
    pub fn as_host_slice(&self) -> Result<&[T]> {
        match &self.storage {
            // SAFETY: the host allocation holds `len` initialized (zeroed, then written only
            // as T) elements, owned by `self` and borrowed shared with it.
            Some(Storage::Host(p)) => {
                Ok(unsafe { std::slice::from_raw_parts(p.as_ptr(), self.len) })
            }
            _ => Err(self.not_host("NcclMemory::as_host_slice")),
        }
    }

    /// The elements, mutably, for memory of the host provider.
    pub fn as_host_slice_mut(&mut self) -> Result<&mut [T]> {
        match &mut self.storage {
            // SAFETY: as in `as_host_slice`, borrowed exclusively with `self`.
            Some(Storage::Host(p)) => {
                Ok(unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), self.len) })
            }
            _ => Err(self.not_host("NcclMemory::as_host_slice_mut")),
        }
    }

    #[cold]
    fn not_host(&self, call: &'static str) -> Error {
        invalid(
            call,
            format!(
                "the memory is {:?}, not host memory: copy it with to_vec",
                self.memory()
            ),
        )
    }

    #[cold]
    fn not_cuda(call: &'static str) -> Error {
        invalid(
            call,
            "the memory is the host provider's host memory, which has no CUDA view",
        )
    }

    /// The whole buffer as a cudarc view (NVIDIA's NCCL only): what cudarc's copies,
    /// memsets and kernel launches take (`stream.memcpy_dtoh(&mem.cuda_view()?, &mut v)`).
    pub fn cuda_view(&self) -> Result<CudaView<'_, T>> {
        match &self.storage {
            Some(Storage::Cuda(s)) => Ok(s.as_view()),
            _ => Err(Self::not_cuda("NcclMemory::cuda_view")),
        }
    }

    /// The whole buffer as a mutable cudarc view (NVIDIA's NCCL only), e.g. for
    /// `stream.memcpy_htod(&host, &mut mem.cuda_view_mut()?)`.
    pub fn cuda_view_mut(&mut self) -> Result<CudaViewMut<'_, T>> {
        match &mut self.storage {
            Some(Storage::Cuda(s)) => Ok(s.as_view_mut()),
            _ => Err(Self::not_cuda("NcclMemory::cuda_view_mut")),
        }
    }

    /// Elements `range` as a buffer of their own, for any collective. An out-of-range or
    /// reversed range is [`Error::InvalidArgument`].
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<NcclView<'_, T>> {
        let (a, b) = bounds("NcclMemory::slice", range, self.len)?;
        let view = match &self.storage {
            Some(Storage::Cuda(s)) => ViewInner::Cuda(s.slice(a..b)),
            _ => ViewInner::Host(&self.as_host_slice()?[a..b]),
        };
        Ok(NcclView(view, a))
    }

    /// Elements `range` as a mutable buffer of their own, for any collective.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<NcclViewMut<'_, T>> {
        let (a, b) = bounds("NcclMemory::slice_mut", range, self.len)?;
        let view = match self.storage {
            Some(Storage::Cuda(ref mut s)) => ViewMutInner::Cuda(s.slice_mut(a..b)),
            _ => ViewMutInner::Host(&mut self.as_host_slice_mut()?[a..b]),
        };
        Ok(NcclViewMut(view, a))
    }

    /// Copies `src` (exactly [`len`](Self::len) elements) into the buffer on `stream`
    /// (cudarc's host-to-device copy, ordered after the buffer's earlier work when cudarc's
    /// event tracking is on); returns when the copy is done.
    pub fn copy_from_host(&mut self, src: &[T], stream: &impl AsStream) -> Result<()> {
        const OP: &str = "NcclMemory::copy_from_host";
        check_len(OP, BufferRole::Send, src.len(), self.len, HOST_SLICE)?;
        let stream = stream.as_stream();
        match (&mut self.storage, stream) {
            (Some(Storage::Host(p)), StreamRef::Host) => {
                // SAFETY: the allocation holds `len` == src.len() elements owned by `self`
                // (borrowed exclusively); `src` is a separate shared borrow, so no overlap.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p.as_ptr(), src.len()) };
                Ok(())
            }
            (Some(Storage::Cuda(slice)), StreamRef::Cuda(s)) if same_device(slice, s) => {
                s.memcpy_htod(src, slice)?;
                Ok(s.synchronize()?)
            }
            (_, stream) => Err(self.stream_mismatch(OP, stream)),
        }
    }

    /// Copies the buffer into `dst` (exactly [`len`](Self::len) elements) on `stream`;
    /// returns when the copy is done.
    pub fn copy_to_host(&self, dst: &mut [T], stream: &impl AsStream) -> Result<()> {
        const OP: &str = "NcclMemory::copy_to_host";
        check_len(OP, BufferRole::Recv, dst.len(), self.len, HOST_SLICE)?;
        let stream = stream.as_stream();
        match (&self.storage, stream) {
            (Some(Storage::Host(_)), StreamRef::Host) => {
                dst.copy_from_slice(self.as_host_slice()?);
                Ok(())
            }
            (Some(Storage::Cuda(slice)), StreamRef::Cuda(s)) if same_device(slice, s) => {
                s.memcpy_dtoh(slice, dst)?;
                Ok(s.synchronize()?)
            }
            (_, stream) => Err(self.stream_mismatch(OP, stream)),
        }
    }

    /// The elements, copied to a new `Vec` on `stream`.
    pub fn to_vec(&self, stream: &impl AsStream) -> Result<Vec<T>> {
        // SAFETY: every NcclType is ValidAsZeroBits: all-zero bytes are a valid T.
        let zero: T = unsafe { std::mem::zeroed() };
        let mut v = vec![zero; self.len];
        self.copy_to_host(&mut v, stream)?;
        Ok(v)
    }

    #[cold]
    fn stream_mismatch(&self, call: &'static str, stream: StreamRef<'_>) -> Error {
        invalid(
            call,
            format!(
                "the memory is {:?} but the stream is {}",
                self.memory(),
                match stream.cuda_ordinal() {
                    Some(d) => format!("on CUDA device {d}"),
                    None => "the host provider's Stream::Host".into(),
                }
            ),
        )
    }

    /// Frees the memory now (`ncclMemFree`), reporting an error that drop would ignore. On
    /// NVIDIA's NCCL it first waits for the device's work (as `cudaFree` does), since
    /// `ncclMemFree` is not ordered on a stream. That wait and the free run on the device's
    /// teardown lane and are bounded by the communicator's
    /// [`Config::abort_timeout`](crate::Config::abort_timeout) (memory made with
    /// [`alloc_zeros_in`](Self::alloc_zeros_in): `NCCL_SAFE_ABORT_TIMEOUT_MS`, default
    /// 30 s): if the wait fails, or does not end in time (a stalled stream), the memory is
    /// leaked, never freed while in use, and this returns an error.
    #[track_caller]
    pub fn free(mut self) -> Result<()> {
        self.release(Location::caller())
    }

    fn release(&mut self, caller: &'static Location<'static>) -> Result<()> {
        let Some(storage) = self.storage.take() else {
            return Ok(());
        };
        let ctx = CallContext::at(None, caller);
        let free = self
            .lib
            .optional(self.lib.table().ncclMemFree, "ncclMemFree")?;
        match storage {
            Storage::Host(p) => {
                // SAFETY: `p` came from this library's ncclMemAlloc, is freed here exactly
                // once (the storage was taken out of `self`), and no borrow of `self` (so
                // no use of the memory) is left.
                let r = unsafe { free(p.as_ptr().cast()) };
                self.lib.check("ncclMemFree", r, ctx)
            }
            Storage::Cuda(slice) => {
                // The device-wide wait (as `cudaFree`'s: `ncclMemFree` is not ordered on a
                // stream) and the free run on the device's teardown lane, bounded by the
                // communicator's abort timeout: behind a stalled stream the
                // memory is leaked and reported, and this returns; it never waits unbounded.
                let cuda = Arc::clone(slice.context());
                let bytes = self.len * std::mem::size_of::<T>();
                let what = format!(
                    "ncclMemFree of {bytes} bytes on CUDA device {}",
                    cuda.ordinal()
                );
                // Makes the slice's stream wait for its pending reads and writes, and hands
                // the pointer back without freeing it.
                let p = slice.leak() as usize;
                let free = move || {
                    // Not cudarc's `synchronize` (see `on_device_lane`). A failed wait
                    // leaks rather than frees memory still in use.
                    if cudarc::driver::result::ctx::synchronize().is_err() {
                        return nccl_sys::bindings::ncclUnhandledCudaError;
                    }
                    // SAFETY: `p` came from this library's ncclMemAlloc, is freed here
                    // exactly once (the storage was taken out of `self`), and the device's
                    // work has completed, so nothing uses it any more.
                    unsafe { free(p as *mut c_void) }
                };
                let then = "the memory is left to the background";
                let r = on_device_lane(cuda, self.bound, what, then, free)?;
                self.lib.check("ncclMemFree", r, ctx)
            }
        }
    }
}

/// Runs `call` (`what`) on CUDA device `cuda`'s teardown lane, bounded by `b`, with the
/// context made current (`ncclUnhandledCudaError` when it cannot be). Not cudarc's
/// `bind_to_thread`: it takes the context's recorded error, the user's to see. Past the
/// bound the call is left to the background, and this is [`Error::Timeout`] ending with
/// `then`.
pub(crate) fn on_device_lane(
    cuda: Arc<cudarc::driver::CudaContext>,
    b: crate::teardown::Bound,
    what: String,
    then: &str,
    call: impl FnOnce() -> nccl_sys::ncclResult_t + Send + 'static,
) -> Result<nccl_sys::ncclResult_t> {
    let lane = crate::teardown::TeardownLane::Device(cuda.ordinal());
    let work = Box::new(move || match crate::stream::make_current(&cuda) {
        Ok(()) => call(),
        Err(_) => nccl_sys::bindings::ncclUnhandledCudaError,
    });
    let until = std::time::Instant::now() + b.bound;
    let late = format!("{what} waited behind the device's work for longer than its bound: {then}");
    let r = crate::teardown::run_bounded(lane, b, what, work, until);
    r.ok_or(Error::Timeout {
        what: late,
        timeout: b.bound,
    })
}

impl<T: NcclType> Drop for NcclMemory<T> {
    fn drop(&mut self) {
        let _ = self.release(Location::caller());
    }
}

/// The length rule of a copy between a buffer and a host slice.
const HOST_SLICE: &str = "host slice = buffer";

fn same_device<T>(slice: &CudaSlice<T>, s: &CudaStream) -> bool {
    slice.context().ordinal() == s.context().ordinal()
}

/// `range` within `0..len`, as `(start, end)`.
fn bounds(
    call: &'static str,
    range: impl RangeBounds<usize>,
    len: usize,
) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&a) => Some(a),
        Bound::Excluded(&a) => a.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&b) => b.checked_add(1),
        Bound::Excluded(&b) => Some(b),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(a), Some(b)) if a <= b && b <= len => Ok((a, b)),
        _ => Err(invalid(
            call,
            format!(
                "range {:?}..{:?} is not within the buffer's {len} elements",
                range.start_bound(),
                range.end_bound()
            ),
        )),
    }
}

impl<T: NcclType> sealed::Sealed for NcclMemory<T> {}
impl<T: NcclType> SendBuffer<T> for NcclMemory<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn memory(&self) -> Memory {
        NcclMemory::memory(self)
    }
    fn send_ptr<'a>(&'a self, stream: StreamRef<'a>) -> (*const c_void, BufferGuard<'a>) {
        match (&self.storage, stream) {
            (Some(Storage::Host(p)), StreamRef::Host) => {
                (p.as_ptr().cast_const().cast(), BufferGuard::Host)
            }
            (Some(Storage::Cuda(s)), StreamRef::Cuda(_)) => s.send_ptr(stream),
            _ => (std::ptr::null(), BufferGuard::Host),
        }
    }
    fn base_ptr(&self) -> *const c_void {
        match &self.storage {
            Some(Storage::Host(p)) => p.as_ptr().cast_const().cast(),
            Some(Storage::Cuda(s)) => SendBuffer::<T>::base_ptr(s),
            None => std::ptr::null(),
        }
    }
    fn nccl_alloc_offset(&self) -> Option<usize> {
        Some(0)
    }
}
impl<T: NcclType> RecvBuffer<T> for NcclMemory<T> {
    fn recv_ptr<'a>(&'a mut self, stream: StreamRef<'a>) -> (*mut c_void, BufferGuard<'a>) {
        match (&mut self.storage, stream) {
            (Some(Storage::Host(p)), StreamRef::Host) => (p.as_ptr().cast(), BufferGuard::Host),
            (Some(Storage::Cuda(s)), StreamRef::Cuda(_)) => s.recv_ptr(stream),
            _ => (std::ptr::null_mut(), BufferGuard::Host),
        }
    }
}

/// A shared view of part of an [`NcclMemory`] ([`NcclMemory::slice`]): a send buffer.
#[derive(Debug)]
pub struct NcclView<'a, T>(ViewInner<'a, T>, usize);

#[derive(Debug)]
enum ViewInner<'a, T> {
    Host(&'a [T]),
    Cuda(CudaView<'a, T>),
}

/// A mutable view of part of an [`NcclMemory`] ([`NcclMemory::slice_mut`]): a send and
/// receive buffer.
#[derive(Debug)]
pub struct NcclViewMut<'a, T>(ViewMutInner<'a, T>, usize);

#[derive(Debug)]
enum ViewMutInner<'a, T> {
    Host(&'a mut [T]),
    Cuda(CudaViewMut<'a, T>),
}

/// A view's buffer impls: each call goes to the view's host slice or CUDA view.
macro_rules! view_send {
    ($($view:ident: $inner:ident),*) => {$(
        impl<T: NcclType> sealed::Sealed for $view<'_, T> {}
        impl<T: NcclType> SendBuffer<T> for $view<'_, T> {
            fn len(&self) -> usize {
                match &self.0 {
                    $inner::Host(s) => s.len(),
                    $inner::Cuda(v) => SendBuffer::<T>::len(v),
                }
            }
            fn memory(&self) -> Memory {
                match &self.0 {
                    $inner::Host(_) => Memory::Host,
                    $inner::Cuda(v) => SendBuffer::<T>::memory(v),
                }
            }
            fn send_ptr<'a>(&'a self, stream: StreamRef<'a>) -> (*const c_void, BufferGuard<'a>) {
                match &self.0 {
                    $inner::Host(s) => s.send_ptr(stream),
                    $inner::Cuda(v) => v.send_ptr(stream),
                }
            }
            fn base_ptr(&self) -> *const c_void {
                match &self.0 {
                    $inner::Host(s) => SendBuffer::<T>::base_ptr(&**s),
                    $inner::Cuda(v) => SendBuffer::<T>::base_ptr(v),
                }
            }
            fn nccl_alloc_offset(&self) -> Option<usize> {
                Some(self.1 * std::mem::size_of::<T>())
            }
        }
    )*};
}
view_send!(NcclView: ViewInner, NcclViewMut: ViewMutInner);

impl<T: NcclType> RecvBuffer<T> for NcclViewMut<'_, T> {
    fn recv_ptr<'a>(&'a mut self, stream: StreamRef<'a>) -> (*mut c_void, BufferGuard<'a>) {
        match &mut self.0 {
            ViewMutInner::Host(s) => s.recv_ptr(stream),
            ViewMutInner::Cuda(v) => v.recv_ptr(stream),
        }
    }
}
