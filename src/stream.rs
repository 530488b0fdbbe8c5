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

/// A stream of the communicator's own that stands in for `CU_STREAM_PER_THREAD` (0x2)
/// when NCCL launches from a thread of its own, joined to and from the caller's
/// per-thread stream by events.
///
/// On a non-blocking communicator of two or more ranks NCCL launches a collective from its
/// group's thread (group.cc:705-738 → `doLaunches`, enqueue.cc of 2.28.9), where 0x2 means
/// *that* thread's per-thread stream: the collective would be ordered with nothing the
/// caller enqueued, and every event recorded on the caller's 0x2 would cover nothing. So
/// the collective goes to this stream instead: [`enter`](Self::enter) (on the caller's
/// thread, before NCCL's call) makes it wait for the caller's per-thread stream, and
/// [`leave`](Self::leave) (after NCCL launched the work) makes the caller's per-thread
/// stream wait for it. Made, recorded and destroyed through the driver's calls directly,
/// with the context made current without cudarc's `bind_to_thread` (which would take the
/// user's recorded error).
pub(crate) struct Relay {
    /// `raw`, as cudarc's borrowed wrapper: the stream the diagnostics watch.
    stream: Arc<CudaStream>,
    raw: cudarc::driver::sys::CUstream,
    into: cudarc::driver::sys::CUevent,
    out: cudarc::driver::sys::CUevent,
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").field("stream", &self.raw).finish()
    }
}

impl Relay {
    /// A non-blocking stream and two events of `ctx`.
    pub(crate) fn new(
        ctx: &Arc<cudarc::driver::CudaContext>,
    ) -> Result<Relay, cudarc::driver::DriverError> {
        use cudarc::driver::result::{event, stream};
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        make_current(ctx)?;
        let raw = stream::create(stream::StreamKind::NonBlocking)?;
        let events = event::create(CU_EVENT_DISABLE_TIMING).and_then(|into| {
            match event::create(CU_EVENT_DISABLE_TIMING) {
                Ok(out) => Ok((into, out)),
                Err(e) => {
                    // SAFETY: made just above, used by nothing.
                    let _ = unsafe { event::destroy(into) };
                    Err(e)
                }
            }
        });
        let (into, out) = match events {
            Ok(ev) => ev,
            Err(e) => {
                // SAFETY: made just above, used by nothing.
                let _ = unsafe { stream::destroy(raw) };
                return Err(e);
            }
        };
        // SAFETY: `raw` is a live stream of `ctx`, destroyed only by this relay's `Drop`,
        // after the wrapper (a field of the relay, never handed out by value) is gone.
        let stream = unsafe { ctx.wrap_borrowed_stream(raw) };
        Ok(Relay {
            stream,
            raw,
            into,
            out,
            ctx: Arc::clone(ctx),
        })
    }

    /// The relay stream, for the operation's call and its diagnostics.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// On the caller's thread: the relay waits for the work enqueued so far on the
    /// caller's per-thread stream (of the relay's context).
    pub(crate) fn enter(&self) -> Result<(), cudarc::driver::DriverError> {
        self.join(PER_THREAD_STREAM as _, self.into, self.raw)
    }

    /// On the caller's thread, once NCCL launched the work: the caller's per-thread stream
    /// waits for the relay.
    pub(crate) fn leave(&self) -> Result<(), cudarc::driver::DriverError> {
        self.join(self.raw, self.out, PER_THREAD_STREAM as _)
    }

    /// `to` waits for `from`'s work so far, through `event`.
    fn join(
        &self,
        from: cudarc::driver::sys::CUstream,
        event: cudarc::driver::sys::CUevent,
        to: cudarc::driver::sys::CUstream,
    ) -> Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::result::{event as ev, stream};
        // 0x2 is the per-thread stream of the current context.
        make_current(&self.ctx)?;
        // SAFETY: the event and the relay stream are live (owned by `self`), of the
        // current context, as the per-thread stream is.
        unsafe {
            ev::record(event, from)?;
            stream::wait_event(
                to,
                event,
                cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        use cudarc::driver::result::{event, stream};
        if make_current(&self.ctx).is_err() {
            return; // the context is gone with its streams and events
        }
        // SAFETY: owned by this relay and used by nothing else any more; CUDA releases a
        // stream with work pending once that work is done.
        unsafe {
            let _ = event::destroy(self.into);
            let _ = event::destroy(self.out);
            let _ = stream::destroy(self.raw);
        }
    }
}

// SAFETY: CUDA streams and events may be used from any thread; the context they belong
// to is kept alive by `ctx`.
unsafe impl Send for Relay {}
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
