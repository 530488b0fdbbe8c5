//! How the watchdog learns that queued work finished: markers recorded after the work on
//! each queue (a CUDA stream, or a host-provider communicator), behind one small interface.
//! Tests swap in a counting tracker to prove who calls what, and on which thread.
//!
//! Two ways to place a marker, chosen by [`crate::Config::exact_completion`]:
//!
//! - **At enqueue (the default).** The owner records a marker on the operation's stream
//!   right after its NCCL call returned (for a group, once per stream after
//!   `ncclGroupEnd`), on its own thread ([`Tracker::record`], [`How::Enqueue`]). It covers that work and
//!   nothing enqueued later, so a stream blocked *after* a collective never times the
//!   collective out; and `CU_STREAM_PER_THREAD` (candle's stream, handle 0x2) resolves to
//!   the caller's stream, where NCCL enqueued. Cost: one `cuEventRecord` per operation or
//!   group, as PyTorch's ProcessGroupNCCL, and no allocation and no lock: the marker goes
//!   to the watchdog through the queue's ring of ranges (`ranges`); its event is the one
//!   its slot's retired range kept (or the newest retired range's, or one from the
//!   tracker's spare ring, for a slot never used), so a steady run, on any number of
//!   streams, makes no event and no event passes between the threads; past
//!   [`MAX_PENDING`] markers in flight on a stream, the
//!   newest is recorded again, once the stream is known not to be capturing: see below).
//! - **Lazily, on the watchdog's tick.** The per-operation path makes no CUDA call: the
//!   watchdog records at most one event per stream per tick, after whatever was published
//!   by then. Cheaper, but work the caller enqueued on the same stream before the tick
//!   counts against the operation, and a per-thread stream (0x2) is not watched (the
//!   watchdog's own 0x2 is another stream).
//!
//! CUDA graph capture. A captured collective never runs on the stream, so it must never
//! time out, and nothing of ours may change the user's graph or invalidate the capture:
//!
//! - **At enqueue**, a new marker is recorded without asking whether the stream is
//!   capturing (a second driver call per operation). On a capturing stream a plain
//!   `cuEventRecord` adds no graph node (only `CU_EVENT_RECORD_EXTERNAL` would): it makes a
//!   *captured event*, which CUDA refuses to query (`CUDA_ERROR_CAPTURED_EVENT`) until it is
//!   recorded again outside a capture, and whose query while that capture is open it calls
//!   invalid. A new marker covers only the operation (or group) just enqueued, so a
//!   captured one covers captured work alone.
//! - **A marker recorded again** (past [`MAX_PENDING`] in flight: work enqueued faster than
//!   the watchdog's tick retires it) covers earlier work too, which may run on the stream:
//!   recorded into a capture, it would read as complete once the capture ended and retire
//!   that work unrun (no timeout, and a teardown that destroys instead of aborting). So
//!   the owner asks `cuStreamIsCapturing` first, for these only (one driver call per
//!   operation while so many are in flight), and while the stream captures records
//!   nothing: the operation (which never runs on the stream) joins the newest range as it
//!   is, complete once the work before it is, and the next marker recorded again outside
//!   the capture covers it too
//!   (`tests/cuda_path.rs`: `a_marker_recorded_again_under_capture_never_retires_stuck_work`).
//! - **The watchdog asks instead**, off the caller's thread and in relaxed capture mode:
//!   before it queries a queue's markers it asks `cuStreamIsCapturing` of the stream
//!   ([`Tracker::capturing`]); while a capture is open it queries none of them and times
//!   nothing out on that stream. It queries only the ranges published before it asked
//!   (it reads the ring's head first), and a marker recorded again later was recorded
//!   outside a capture (the owner asked), so with no capture open a captured marker
//!   belongs to a capture that has ended, covers only work that capture took, and its
//!   query's capture error reads as complete ([`RawEvent::query`]).
//! - **The per-thread stream** (0x2) is the exception: on the watchdog's thread that handle
//!   is the watchdog's own stream. For it (and the legacy stream) the owner asks
//!   `cuStreamIsCapturing` at enqueue and records no marker into a capture.
//! - **Lazily**, the watchdog asks before it records, and records nothing on a capturing
//!   stream; the first marker after the capture completes at once.
//!
//! Work a replayed graph runs is not watched. `tests/gpu.rs` puts each step of this to the
//! driver (`a_marker_recorded_under_capture_can_be_checked_from_the_watchdogs_thread`).

use std::cell::Cell;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

use crate::stream::PER_THREAD_STREAM;
use crate::teardown::lock;

/// Markers in flight on one stream (the slots of its ring of ranges) past which the owner
/// records the newest again instead of taking another slot (the caller runs far ahead of the GPU, or of the
/// watchdog's tick).
pub(crate) const MAX_PENDING: usize = 64;

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
    /// Its last query failed with a stream-capture error: it was recorded in a capture, so
    /// the work it covered went into a CUDA graph ([`RawEvent::query`]). Such a marker is
    /// retired at once, and the flag cleared as it retires, or when it is recycled (not at
    /// each record: the owner's per-operation path makes no store of it).
    captured: std::sync::atomic::AtomicBool,
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
            captured: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Records it on `stream`, of the event's context (the driver may ask for that
    /// context current: see [`CudaTracker::record_on`]).
    fn record(&self, stream: &CudaStream) -> Result<(), DriverError> {
        // SAFETY: the event and the stream are live, and of one context (checked by the
        // caller: the stream's context made it).
        unsafe { cudarc::driver::result::event::record(self.event, stream.cu_stream()) }
    }

    /// `Ok(true)` when the work before it finished, `Ok(false)` while it runs, and the
    /// driver's error otherwise (a sticky fault of the context, say).
    ///
    /// A marker recorded at enqueue on a stream that was capturing is a captured event: its
    /// collective went into a graph and never runs on the stream, and CUDA refuses the
    /// query with `CUDA_ERROR_CAPTURED_EVENT`. That reads as complete. So do the other
    /// stream-capture errors (900 to 908): each says a capture was in the way, none says
    /// the work failed, and reading one as a fault would fail a healthy communicator.
    /// Callers ask [`Tracker::capturing`] first, so the capture that recorded it has ended.
    /// Such an answer is noted ([`Tracker::was_captured`]): the graph holds the work.
    fn query(&self) -> Result<bool, DriverError> {
        use cudarc::driver::sys::CUresult as R;
        // SAFETY: the event is live.
        match unsafe { cudarc::driver::result::event::query(self.event) } {
            Ok(()) => Ok(true),
            Err(DriverError(R::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(DriverError(
                R::CUDA_ERROR_CAPTURED_EVENT
                | R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                | R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                | R::CUDA_ERROR_STREAM_CAPTURE_MERGE
                | R::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
                | R::CUDA_ERROR_STREAM_CAPTURE_UNJOINED
                | R::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
                | R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
                | R::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
            )) => {
                self.captured
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(true)
            }
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
    /// The counting tracker's.
    #[cfg(test)]
    Fake,
}

/// A range's slot's event as the producer of the queue's ring (`ranges`) may use it.
#[derive(Debug)]
pub(crate) enum Event<'a> {
    /// Its own (the slot is free, or its range is the newest and has no marker): it may
    /// make one.
    Own(&'a mut Option<Marker>),
    /// The newest range's marker, which the consumer may be querying.
    Shared(&'a Marker),
}

/// How [`Tracker::record`] is asked to record a marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum How {
    /// The owner, right after its NCCL call, into a new range: recorded without asking
    /// whether the stream is capturing (it covers only this operation's work: a captured
    /// one went into the graph), except on the legacy and per-thread streams.
    Enqueue,
    /// The owner, recording the newest range's marker again to extend it (every slot in
    /// use): it covers earlier work too, so never into a capture (it asks first).
    Again,
    /// The watchdog's tick (lazy completion), or a teardown's wait: any thread; asks first,
    /// and never marks the per-thread stream (on this thread it is another stream).
    Tick,
}

/// What [`Tracker::record`] could do.
#[derive(Debug)]
pub(crate) enum Mark {
    /// The event was recorded (made first, when its slot had none).
    Recorded,
    /// The stream is being captured into a CUDA graph: nothing was recorded (only
    /// [`How::Again`], [`How::Tick`] and the implicit streams ask).
    Capturing,
    /// The work cannot be watched: treat it as done.
    Unwatched,
    /// The driver failed the stream (a sticky fault of its context): the work will never
    /// complete, and this is why.
    Failed(DriverError),
}

/// Records and queries completion markers. See the module docs for who may call it.
pub(crate) trait Tracker: Send + Sync + std::fmt::Debug {
    /// Records `ev` (a range's slot's event: made, or taken from the spare pool, when the
    /// slot has none yet) after the work queued on `q` so far, as `how` says: see [`How`].
    /// Never changes the calling thread's capture mode.
    fn record(&self, q: &Queue, ev: Event<'_>, how: How) -> Mark;
    /// Whether `q` is being captured into a graph now: its markers must not be queried
    /// (one recorded by this capture would be a query CUDA calls invalid), and its work
    /// must not time out. Asked before each round of [`Tracker::done`] on a queue's
    /// markers (on the watchdog's thread, in relaxed capture mode).
    fn capturing(&self, _q: &Queue) -> Result<bool, DriverError> {
        Ok(false)
    }
    /// Whether the work before `m` finished (`Ok(false)`: still running), or the error the
    /// driver reports for it (a sticky fault of the context). Never blocks. A marker of a
    /// capture that has ended is complete.
    fn done(&self, m: &Marker) -> Result<bool, DriverError>;
    /// Whether `q` still has work not complete, asked now (not through markers): for
    /// what a stream synchronize of NCCL's would wait for. Never blocks.
    fn busy(&self, _q: &Queue) -> bool {
        false
    }
    /// Takes back a marker that is no longer needed (events are reused).
    fn recycle(&self, _m: Marker) {}
    /// Whether [`done`](Self::done) read `m` as complete because it was recorded in a
    /// capture (the work it covered went into a CUDA graph, not onto the stream); the note
    /// is cleared, as the marker's range retires (its event is recorded again later).
    fn take_captured(&self, _m: &Marker) -> bool {
        false
    }
}

/// The tracker for a library's provider, and the same tracker as a [`CudaTracker`] when it
/// is one (for the owner's marking at enqueue, which then makes no virtual call).
pub(crate) fn for_provider(
    provider: crate::library::Provider,
) -> (Arc<dyn Tracker>, Option<Arc<CudaTracker>>) {
    match provider {
        crate::library::Provider::Nccl => {
            let cuda = Arc::new(CudaTracker::default());
            (Arc::clone(&cuda) as Arc<dyn Tracker>, Some(cuda))
        }
        crate::library::Provider::Host => (Arc::new(HostTracker), None),
    }
}

/// Events kept for reuse, per tracker: the ring of a queue whose watch is dropped (a
/// stream no longer used) gives its events back here, for the slots of the next queue's,
/// so a rank that makes a new stream per step makes no event.
const SPARE_EVENTS: usize = MAX_PENDING;

/// CUDA events on the communicator's streams.
#[derive(Debug, Default)]
pub(crate) struct CudaTracker {
    spare: Spare,
}

/// The spare events: a ring that any thread gives events back to (one at a time, under
/// `give`'s lock: a dropped queue's watch, the owner's queue leaving its cache) and
/// the owner takes them from without a lock (a slot of its ranges without an event: a
/// burst of work in flight). Takers are one at a time too, by `taking`: one that finds it
/// held makes an event instead of waiting.
#[derive(Debug)]
struct Spare {
    slots: Box<[UnsafeCell<Option<RawEvent>>]>,
    /// Events given back below it (written under `give`).
    head: AtomicUsize,
    /// Events taken below it (written by the one holding `taking`).
    tail: AtomicUsize,
    give: Mutex<()>,
    taking: AtomicBool,
}

impl Default for Spare {
    fn default() -> Spare {
        Spare {
            slots: (0..SPARE_EVENTS).map(|_| UnsafeCell::new(None)).collect(),
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
            give: Mutex::new(()),
            taking: AtomicBool::new(false),
        }
    }
}

// SAFETY: a slot is written by the giver (under `give`) only while it is free (below
// `tail + SPARE_EVENTS`, `tail` read `Acquire` after the taker's `Release` store that freed
// it), then published by `head` (`Release`); and taken by the one taker (`taking` held)
// only once published (`head` read `Acquire`), then freed by `tail`. A `RawEvent` may be
// sent between threads.
unsafe impl Sync for Spare {}

impl Spare {
    /// Gives `ev` back; the event is destroyed when the ring is full.
    fn give(&self, ev: RawEvent) {
        let _held = lock(&self.give);
        let head = self.head.load(Ordering::Relaxed);
        if head - self.tail.load(Ordering::Acquire) >= SPARE_EVENTS {
            return;
        }
        // SAFETY: a free slot, the giver's (see the `Sync` impl).
        unsafe { *self.slots[head % SPARE_EVENTS].get() = Some(ev) };
        self.head.store(head + 1, Ordering::Release);
    }

    /// A spare event, if there is one (and no other thread is taking one now).
    fn take(&self) -> Option<RawEvent> {
        if self.taking.swap(true, Ordering::Acquire) {
            return None;
        }
        let tail = self.tail.load(Ordering::Relaxed);
        let ev = if tail == self.head.load(Ordering::Acquire) {
            None
        } else {
            // SAFETY: a published slot, the taker's (see the `Sync` impl).
            let ev = unsafe { (*self.slots[tail % SPARE_EVENTS].get()).take() };
            self.tail.store(tail + 1, Ordering::Release);
            ev
        };
        self.taking.store(false, Ordering::Release);
        ev
    }
}

thread_local! {
    /// Whether this thread is the watchdog's (set by [`on_the_watchdogs_thread`]).
    static WATCHDOG: Cell<bool> = const { Cell::new(false) };
    static RELAXED: Cell<bool> = const { Cell::new(false) };
}

/// Called once by the watchdog's thread: the tracker's calls from it run in relaxed
/// capture mode.
pub(crate) fn on_the_watchdogs_thread() {
    WATCHDOG.with(|w| w.set(true));
}

/// Puts the watchdog's thread in relaxed stream-capture mode, once: its event calls then
/// never invalidate a capture in global mode on another thread (NCCL does the same). Any
/// other thread (an owner waiting for its work at teardown) keeps the mode its user chose.
fn relaxed_capture_mode() {
    if !WATCHDOG.with(Cell::get) || RELAXED.with(|r| r.replace(true)) {
        return;
    }
    let mut mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid, writable capture mode; the call only swaps this thread's
    // mode (the old one is written back into `mode` and not needed).
    let _ = unsafe { cudarc::driver::sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
}

/// Whether `stream` is the legacy or the per-thread stream (handles 0, 1, 2): the calling
/// thread's current context's, and for 0x2 the calling thread's own stream.
fn implicit(stream: &CudaStream) -> bool {
    (stream.cu_stream() as usize) <= PER_THREAD_STREAM
}

/// Whether `stream` is being captured into a graph now (a capture that is open, or one
/// invalidated and not yet ended: its markers are not to be queried either).
fn is_capturing(stream: &CudaStream) -> Result<bool, DriverError> {
    // SAFETY: the stream is live (its queue holds it).
    let status = unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) }?;
    Ok(status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl CudaTracker {
    /// Records `ev` (made, or taken from the spare pool, when it has none) after the work
    /// queued on `stream` so far, from the calling thread; when `ask`, it first asks
    /// whether the stream is capturing, and records nothing then.
    ///
    /// The calls are tried as they are, and again with the stream's context made current
    /// only when one fails: on the owner's thread it almost always is already (cudarc binds
    /// it at every tracked use of a buffer), so a `cuCtxGetCurrent` per operation is saved;
    /// the driver does not say whether the calls need it (the fake driver says they do), and
    /// a failed `cuStreamIsCapturing` or `cuEventRecord` changes nothing. The legacy and
    /// per-thread streams (handles 0, 1, 2) are the current context's: it is made current
    /// first, and they are always asked about here (on the watchdog's thread 0x2 is another
    /// stream: see [`Tracker::capturing`]).
    ///
    /// Inlined into [`Tracker::record`], with the first try: on the owner's path at
    /// enqueue, the tracker's one call through its trait object is the only call of the
    /// crate's between the ring and the driver; the retries and the implicit streams are
    /// out of line.
    #[inline(always)]
    fn record_on(&self, stream: &CudaStream, mut ev: Event<'_>, ask: bool) -> Mark {
        if implicit(stream) {
            // The current context's stream: made current first, and always asked about.
            return self.record_current(stream, ev, true);
        }
        match self.try_record(stream, &mut ev, ask) {
            Ok(mark) => mark,
            Err(_) => self.record_current(stream, ev, ask),
        }
    }

    /// [`record_on`](Self::record_on)'s calls with the stream's context made current: after
    /// a failed first try, and first of all on an implicit stream.
    #[cold]
    #[inline(never)]
    fn record_current(&self, stream: &CudaStream, mut ev: Event<'_>, ask: bool) -> Mark {
        if crate::stream::make_current(stream.context()).is_err() {
            return Mark::Unwatched;
        }
        self.try_record(stream, &mut ev, ask)
            .unwrap_or_else(Mark::Failed)
    }

    /// [`CudaTracker::record_on`]'s calls, once.
    #[inline(always)]
    fn try_record(
        &self,
        stream: &CudaStream,
        ev: &mut Event<'_>,
        ask: bool,
    ) -> Result<Mark, DriverError> {
        if ask && is_capturing(stream)? {
            return Ok(Mark::Capturing);
        }
        let m: &Marker = match ev {
            Event::Shared(m) => m,
            Event::Own(slot) => match slot {
                Some(m) => m,
                None => self.fill(stream, slot)?,
            },
        };
        let Marker::Cuda(event) = m else {
            return Ok(Mark::Unwatched);
        };
        event.record(stream)?;
        Ok(Mark::Recorded)
    }

    /// A slot's first event: a spare one, else made on `stream`'s context.
    #[cold]
    #[inline(never)]
    fn fill<'s>(
        &self,
        stream: &CudaStream,
        slot: &'s mut Option<Marker>,
    ) -> Result<&'s Marker, DriverError> {
        let event = match self.spare.take() {
            Some(e) => e,
            None => RawEvent::new(stream.context())?,
        };
        Ok(slot.insert(Marker::Cuda(event)))
    }

    /// [`Tracker::record`] on a CUDA stream's queue, called directly (inlined) by the
    /// owner's marking at enqueue.
    #[inline(always)]
    pub(crate) fn record_stream(&self, stream: &CudaStream, ev: Event<'_>, how: How) -> Mark {
        if how == How::Tick {
            if stream.cu_stream() as usize == PER_THREAD_STREAM {
                // This thread's per-thread stream is not the one the work went to.
                return Mark::Unwatched;
            }
            relaxed_capture_mode();
        }
        self.record_on(stream, ev, how != How::Enqueue)
    }
}

impl Tracker for CudaTracker {
    fn record(&self, q: &Queue, ev: Event<'_>, how: How) -> Mark {
        let Queue::Cuda(stream) = q else {
            return Mark::Unwatched;
        };
        self.record_stream(stream, ev, how)
    }

    fn capturing(&self, q: &Queue) -> Result<bool, DriverError> {
        let Queue::Cuda(stream) = q else {
            return Ok(false);
        };
        if implicit(stream) {
            // Asked at enqueue instead: their markers are never captured.
            return Ok(false);
        }
        relaxed_capture_mode();
        // As `record_on`: tried as it is, and again with the context current.
        is_capturing(stream).or_else(|e| {
            crate::stream::make_current(stream.context()).map_err(|_| e)?;
            is_capturing(stream)
        })
    }

    fn done(&self, m: &Marker) -> Result<bool, DriverError> {
        match m {
            Marker::Cuda(ev) => ev.query(),
            _ => Ok(true),
        }
    }

    fn busy(&self, q: &Queue) -> bool {
        let Queue::Cuda(stream) = q else {
            return false;
        };
        // SAFETY: the stream is alive (held by the queue's Arc); the query only reads its
        // state.
        let r = unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) };
        r == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY
    }

    fn take_captured(&self, m: &Marker) -> bool {
        // Read first: a swap would write the event's cache line on every retirement, and
        // the owner reads that line when it records the slot's next marker.
        matches!(m, Marker::Cuda(ev)
            if ev.captured.load(Ordering::Relaxed) && ev.captured.swap(false, Ordering::Relaxed))
    }

    fn recycle(&self, m: Marker) {
        if let Marker::Cuda(ev) = m {
            ev.captured.store(false, Ordering::Relaxed);
            self.spare.give(ev);
        }
    }
}

/// The host provider: work completes in the call unless [`crate::host::fault`] holds it.
#[derive(Debug)]
pub(crate) struct HostTracker;

impl Tracker for HostTracker {
    fn record(&self, q: &Queue, ev: Event<'_>, _how: How) -> Mark {
        match (q, ev) {
            (Queue::Host(h), Event::Own(slot)) => {
                slot.get_or_insert(Marker::Host(*h));
                Mark::Recorded
            }
            (Queue::Host(_), Event::Shared(_)) => Mark::Recorded,
            _ => Mark::Unwatched,
        }
    }

    fn busy(&self, q: &Queue) -> bool {
        match q {
            #[cfg(feature = "host")]
            Queue::Host(h) => crate::host::stuck_ops(*h) > 0,
            _ => false,
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
        /// Markers recorded by the owner's path ([`How::Enqueue`], [`How::Again`]), and those on the owner.
        pub now_marks: AtomicU64,
        pub owner_now_marks: AtomicU64,
        /// Markers complete only while this is set.
        pub complete: AtomicBool,
        /// The stream captures: [`Tracker::record`] answers as [`CudaTracker`]'s on a
        /// stream of the user's (a new marker is recorded, a captured event; one to record
        /// again is not).
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
                now_marks: AtomicU64::new(0),
                owner_now_marks: AtomicU64::new(0),
                complete: AtomicBool::new(true),
                capturing: AtomicBool::new(false),
            }
        }

        /// Counts a call in `all`, and in `owners` when it comes from the owner.
        fn count(&self, all: &AtomicU64, owners: &AtomicU64) {
            all.fetch_add(1, Ordering::SeqCst);
            if std::thread::current().id() == self.owner {
                owners.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    impl Tracker for Counting {
        fn record(&self, _q: &Queue, ev: Event<'_>, how: How) -> Mark {
            if how == How::Tick {
                self.count(&self.marks, &self.owner_marks);
            } else {
                self.count(&self.now_marks, &self.owner_now_marks);
            }
            if how == How::Again && self.capturing.load(Ordering::SeqCst) {
                return Mark::Capturing;
            }
            if let Event::Own(slot) = ev {
                slot.get_or_insert(Marker::Fake);
            }
            Mark::Recorded
        }

        fn done(&self, _m: &Marker) -> Result<bool, DriverError> {
            self.count(&self.queries, &self.owner_queries);
            Ok(self.complete.load(Ordering::SeqCst))
        }
    }
}
