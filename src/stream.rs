//! Where a collective runs: a cudarc [`CudaStream`] for NVIDIA's NCCL, or [`Stream::Host`]
//! for the host provider. A collective takes either by reference ([`AsStream`]).

use std::sync::Arc;

use cudarc::driver::CudaStream;
use nccl_sys::cudaStream_t;

/// `CU_STREAM_PER_THREAD`: the calling thread's default stream, a different stream on
/// every thread.
pub(crate) const PER_THREAD_STREAM: usize = 0x2;

/// A stream of either kind, owned (what the launcher hands each rank). `&Stream::Host`
/// is the host provider's stream wherever a collective takes one.
#[derive(Debug, Clone)]
pub enum Stream {
    /// A CUDA stream.
    Cuda(Arc<CudaStream>),
    /// The host provider's stream: its work is complete when the call (or the group)
    /// returns, so there is nothing to synchronize.
    Host,
}

/// A stream, borrowed for one call: what [`AsStream`] yields, inside the crate.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub enum StreamRef<'a> {
    /// A CUDA stream.
    Cuda(&'a Arc<CudaStream>),
    /// The host provider's stream.
    Host,
}

impl StreamRef<'_> {
    /// The raw `cudaStream_t` NCCL receives (null for the host provider).
    pub fn raw(&self) -> cudaStream_t {
        match self {
            StreamRef::Cuda(s) => s.cu_stream() as cudaStream_t,
            StreamRef::Host => std::ptr::null_mut(),
        }
    }

    /// The CUDA device ordinal, for a CUDA stream.
    pub fn cuda_ordinal(&self) -> Option<usize> {
        match self {
            StreamRef::Cuda(s) => Some(s.context().ordinal()),
            StreamRef::Host => None,
        }
    }
}

mod sealed {
    /// Only the crate's stream types are streams.
    pub trait Sealed {}
    impl Sealed for std::sync::Arc<cudarc::driver::CudaStream> {}
    impl Sealed for super::Stream {}
}

/// Anything a collective accepts as its stream: `&Arc<CudaStream>` (cudarc's) or
/// `&Stream` (`&Stream::Host` on the host provider). Sealed.
pub trait AsStream: sealed::Sealed {
    /// The stream for one call.
    #[doc(hidden)]
    fn as_stream(&self) -> StreamRef<'_>;
}

impl AsStream for Arc<CudaStream> {
    fn as_stream(&self) -> StreamRef<'_> {
        StreamRef::Cuda(self)
    }
}

impl AsStream for Stream {
    fn as_stream(&self) -> StreamRef<'_> {
        match self {
            Stream::Cuda(s) => StreamRef::Cuda(s),
            Stream::Host => StreamRef::Host,
        }
    }
}

impl Stream {
    /// Waits until the stream's work is done (nothing to wait for on the host provider).
    pub fn synchronize(&self) -> crate::Result<()> {
        match self {
            Stream::Cuda(s) => Ok(s.synchronize()?),
            Stream::Host => Ok(()),
        }
    }
}

/// Makes `ctx` current on the calling thread **without** cudarc's `bind_to_thread`, which
/// first takes (`check_err`) the error cudarc recorded for the context from an earlier
/// asynchronous failure: a thread of the crate's own (the watchdog, a teardown lane) that
/// took it would hide it from the user's `check_err`.
pub(crate) fn make_current(
    ctx: &cudarc::driver::CudaContext,
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::result::ctx;
    if ctx::get_current()? != Some(ctx.cu_ctx()) {
        // SAFETY: `ctx.cu_ctx()` is a live context (cudarc keeps it while `ctx` lives).
        unsafe { ctx::set_current(ctx.cu_ctx()) }?;
    }
    Ok(())
}

/// Runs `f`, cudarc calls of the crate's on `ctx` that begin with cudarc's own
/// `bind_to_thread` (a new stream or event, a memset), with the error cudarc recorded for
/// the context set aside, and recorded again afterwards: such a call would otherwise fail
/// with the user's error (or panic, as cudarc's `upgrade_device_ptr` does on it) and leave
/// the user's `check_err` clean. An error `f` records meanwhile gives way to the user's.
pub(crate) fn keeping_recorded_error<R>(
    ctx: &cudarc::driver::CudaContext,
    f: impl FnOnce() -> R,
) -> R {
    let recorded = ctx.check_err();
    let r = f();
    ctx.record_err(recorded);
    r
}
