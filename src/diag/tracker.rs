//! How the watchdog learns that queued work finished: markers recorded after the work on
//! each queue (a CUDA stream, or a host-provider communicator), behind one small interface.
//!
//! Only the watchdog thread (and a communicator's teardown) calls a [`Tracker`]. The
//! per-operation path publishes its journal position with a plain store and touches no
//! tracker, so an operation on a CUDA stream costs no CUDA driver call of ours: the
//! watchdog records at most one event per stream per tick, after whatever was published
//! by then, and queries it on later ticks. Tests swap in a counting tracker to prove it.
//!
//! CUDA graph capture: the watchdog never records an event on a capturing stream (that
//! would put the event into the graph), and it does not time out work while one of the
//! communicator's streams is capturing; a collective captured into a graph is never run on
//! the stream, so the first marker after the capture completes at once. Work a replayed
//! graph runs is not watched.

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaStream, DriverError};

/// Where an operation's work is queued.
#[derive(Debug, Clone)]
pub(crate) enum Queue {
    /// A CUDA stream (NVIDIA's NCCL).
    Cuda(Arc<CudaStream>),
    /// A host-provider communicator handle (its work completes in the call, unless a
    /// fault holds it).
    Host(usize),
}

impl Queue {
    /// The identity the owner compares to skip queues it already noted.
    pub(crate) fn key(&self) -> usize {
        match self {
            Queue::Cuda(s) => s.cu_stream() as usize,
            Queue::Host(h) => *h,
        }
    }
}

/// A CUDA event of the watchdog's, made, recorded, queried and destroyed through the
/// driver's calls directly: cudarc's own (`new_event`, `record`, `Drop`) call
/// `bind_to_thread`, which takes the context's recorded error away from the user's
/// `check_err`.
#[derive(Debug)]
pub(crate) struct RawEvent {
    event: cudarc::driver::sys::CUevent,
    ctx: Arc<cudarc::driver::CudaContext>,
}

// SAFETY: a CUDA event handle may be used from any thread; the context it belongs to is
// kept alive by `ctx`.
unsafe impl Send for RawEvent {}
// SAFETY: as above; `&RawEvent` only queries the event.
unsafe impl Sync for RawEvent {}

impl RawEvent {
    fn new(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<RawEvent, DriverError> {
        crate::stream::make_current(ctx)?;
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        Ok(RawEvent {
            event: cudarc::driver::result::event::create(flags)?,
            ctx: Arc::clone(ctx),
        })
    }

    fn record(&self, stream: &CudaStream) -> Result<(), DriverError> {
        crate::stream::make_current(&self.ctx)?;
        // SAFETY: the event and the stream are live, and of one context (checked by the
        // caller: the stream's context made it).
        unsafe { cudarc::driver::result::event::record(self.event, stream.cu_stream()) }
    }

    /// `Ok(true)` when the work before it finished, `Ok(false)` while it runs, and the
    /// driver's error otherwise (a sticky fault of the context, say).
    fn query(&self) -> Result<bool, DriverError> {
        // SAFETY: the event is live.
        match unsafe { cudarc::driver::result::event::query(self.event) } {
            Ok(()) => Ok(true),
            Err(DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        if crate::stream::make_current(&self.ctx).is_ok() {
            // SAFETY: the event is live and destroyed once, here.
            let _ = unsafe { cudarc::driver::result::event::destroy(self.event) };
        }
    }
}

/// A marker recorded after the work queued so far.
#[derive(Debug)]
#[cfg_attr(not(feature = "host"), allow(dead_code))]
pub(crate) enum Marker {
    Cuda(RawEvent),
    Host(usize),
    #[cfg(test)]
    Fake,
}

/// What [`Tracker::mark`] could do.
#[derive(Debug)]
pub(crate) enum Mark {
    Marker(Marker),
    /// The stream is being captured into a CUDA graph: nothing was recorded.
    Capturing,
    /// The work cannot be watched: treat it as done.
    Unwatched,
    /// The driver failed the stream (a sticky fault of its context): the work will never
    /// complete, and this is why.
    Failed(DriverError),
}

/// Records and queries completion markers. See the module docs for who may call it.
pub(crate) trait Tracker: Send + Sync + std::fmt::Debug {
    /// Records a marker after everything queued on `q` so far.
    fn mark(&self, q: &Queue) -> Mark;
    /// Whether the work before `m` finished (`Ok(false)`: still running), or the error the
    /// driver reports for it (a sticky fault of the context). Never blocks.
    fn done(&self, m: &Marker) -> Result<bool, DriverError>;
    /// Takes back a marker that is no longer needed (events are reused).
    fn recycle(&self, _m: Marker) {}
}

/// The tracker for a library's provider.
pub(crate) fn for_provider(provider: crate::library::Provider) -> Arc<dyn Tracker> {
    match provider {
        crate::library::Provider::Nccl => Arc::new(CudaTracker::default()),
        crate::library::Provider::Host => Arc::new(HostTracker),
    }
}

/// Completed events kept for reuse, per tracker.
const SPARE_EVENTS: usize = 16;

/// CUDA events on the communicator's streams.
#[derive(Debug, Default)]
pub(crate) struct CudaTracker {
    spare: Mutex<Vec<RawEvent>>,
}

thread_local! {
    static RELAXED: Cell<bool> = const { Cell::new(false) };
}

/// Puts this thread in relaxed stream-capture mode, once: its event calls then never
/// invalidate a capture in global mode on another thread (NCCL does the same).
fn relaxed_capture_mode() {
    if RELAXED.with(|r| r.replace(true)) {
        return;
    }
    let mut mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid, writable capture mode; the call only swaps this thread's
    // mode (the old one is written back into `mode` and not needed).
    let _ = unsafe { cudarc::driver::sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
}

impl Tracker for CudaTracker {
    fn mark(&self, q: &Queue) -> Mark {
        let Queue::Cuda(stream) = q else {
            return Mark::Unwatched;
        };
        relaxed_capture_mode();
        if crate::stream::make_current(stream.context()).is_err() {
            return Mark::Unwatched;
        }
        // SAFETY: the stream is live (the queue holds it).
        match unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) } {
            Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) => {}
            Ok(_) => return Mark::Capturing,
            Err(e) => return Mark::Failed(e),
        }
        let spare = self.spare.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let event = match spare {
            Some(ev) => ev,
            None => match RawEvent::new(stream.context()) {
                Ok(ev) => ev,
                Err(e) => return Mark::Failed(e),
            },
        };
        match event.record(stream) {
            Ok(()) => Mark::Marker(Marker::Cuda(event)),
            Err(e) => Mark::Failed(e),
        }
    }

    fn done(&self, m: &Marker) -> Result<bool, DriverError> {
        match m {
            Marker::Cuda(ev) => ev.query(),
            _ => Ok(true),
        }
    }

    fn recycle(&self, m: Marker) {
        if let Marker::Cuda(ev) = m {
            let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
            if spare.len() < SPARE_EVENTS {
                spare.push(ev);
            }
        }
    }
}

/// The host provider: work completes in the call unless [`crate::host::fault`] holds it.
#[derive(Debug)]
pub(crate) struct HostTracker;

impl Tracker for HostTracker {
    fn mark(&self, q: &Queue) -> Mark {
        match q {
            Queue::Host(h) => Mark::Marker(Marker::Host(*h)),
            _ => Mark::Unwatched,
        }
    }

    fn done(&self, m: &Marker) -> Result<bool, DriverError> {
        Ok(match m {
            #[cfg(feature = "host")]
            Marker::Host(h) => crate::host::stuck_ops(*h) == 0,
            _ => true,
        })
    }
}

#[cfg(all(test, feature = "host"))]
pub(crate) mod counting {
    //! A tracker that counts its calls and the threads they come from.

    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::thread::ThreadId;

    #[derive(Debug)]
    pub(crate) struct Counting {
        /// The communicator's owning thread: calls from it are what must never happen
        /// per operation.
        pub owner: ThreadId,
        pub marks: AtomicU64,
        pub queries: AtomicU64,
        pub owner_marks: AtomicU64,
        pub owner_queries: AtomicU64,
        /// Markers complete only while this is set.
        pub complete: AtomicBool,
        /// While set, every queue reports a capture in progress.
        pub capturing: AtomicBool,
    }

    impl Counting {
        pub(crate) fn new(owner: ThreadId) -> Counting {
            Counting {
                owner,
                marks: AtomicU64::new(0),
                queries: AtomicU64::new(0),
                owner_marks: AtomicU64::new(0),
                owner_queries: AtomicU64::new(0),
                complete: AtomicBool::new(true),
                capturing: AtomicBool::new(false),
            }
        }

        fn on_owner(&self) -> bool {
            std::thread::current().id() == self.owner
        }
    }

    impl Tracker for Counting {
        fn mark(&self, _q: &Queue) -> Mark {
            self.marks.fetch_add(1, Ordering::SeqCst);
            if self.on_owner() {
                self.owner_marks.fetch_add(1, Ordering::SeqCst);
            }
            if self.capturing.load(Ordering::SeqCst) {
                return Mark::Capturing;
            }
            Mark::Marker(Marker::Fake)
        }

        fn done(&self, _m: &Marker) -> Result<bool, DriverError> {
            self.queries.fetch_add(1, Ordering::SeqCst);
            if self.on_owner() {
                self.owner_queries.fetch_add(1, Ordering::SeqCst);
            }
            Ok(self.complete.load(Ordering::SeqCst))
        }
    }
}
