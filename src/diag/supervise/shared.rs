//! One communicator's watched state, shared by its owner, the watchdog thread and its
//! clique: its journal, the handle and the flags of the claim protocol (`claim`), the
//! tracking of queued work, and the reports.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nccl_sys::EntryPoint;

use super::clique::{Clique, LiveRank, RankView, TimeoutReport};
use super::clock;
use super::journal::Journal;
use super::ranges::{Info, Ranges, MARKED};
use super::record::{OpRecord, OpState};
use super::tracker::{CudaTracker, Event, How, Mark, Queue, Tracker};
use crate::diag::settings::Settings;
use crate::error::Error;
use crate::library::Library;
use crate::teardown::{lock, Task, TeardownLane};

/// `Shared::current` while no operation of the communicator is inside its NCCL call.
pub(in crate::diag) const IDLE: u64 = 0;

/// `Shared::current` while the owner is inside an NCCL call on the handle that is not an
/// operation (a poll, a registration, a destroy) or inside an open group: the watchdog
/// never claims the communicator then.
pub(in crate::diag) const PINNED: u64 = u64::MAX;

/// How many queues (streams) a communicator's watch keeps.
pub(in crate::diag) const MAX_QUEUES: usize = 16;

/// One queue (stream) this communicator's operations used, and the watch of its work.
///
/// Completion is learned per queue: a marker recorded on this queue covers only the
/// operations issued on it, so another stream's backlog never delays or times out this
/// one's work, and a capture pauses the watching of the captured stream only.
#[derive(Debug)]
pub(crate) struct QueueWatch {
    pub(in crate::diag) queue: Queue,
    pub(in crate::diag) key: usize,
    /// Journal position + 1 of the last operation on this queue whose work is queued (the
    /// owner's plain store after each operation; for a group's, at the group's end).
    pub(in crate::diag) published: AtomicU64,
    /// The same for operations inside an open group, published when it ends.
    pub(in crate::diag) staged: AtomicU64,
    /// This queue's operations below this position are known complete.
    pub(in crate::diag) retired: AtomicU64,
    /// Whether the owner marks this queue's ranges at enqueue (exact completion, on a CUDA
    /// stream): then it is the ring's one producer, and the watchdog only retires. Else the
    /// watchdog's tick (or a teardown's wait) marks, under `watch`'s lock.
    pub(in crate::diag) by_owner: bool,
    /// Marked ranges not yet known complete: the owner's lock-free hand-off to the
    /// watchdog (`ranges`).
    pub(in crate::diag) ranges: Ranges,
    /// The watchdog's (and teardown's) state; the owner never takes it.
    pub(in crate::diag) watch: Mutex<Watch>,
    /// Takes the ring's events back when the watch is dropped.
    tracker: Arc<dyn Tracker>,
}

impl QueueWatch {
    pub(in crate::diag) fn new(
        queue: Queue,
        by_owner: bool,
        tracker: Arc<dyn Tracker>,
    ) -> QueueWatch {
        QueueWatch {
            key: queue.key(),
            queue,
            published: AtomicU64::new(0),
            staged: AtomicU64::new(0),
            retired: AtomicU64::new(0),
            by_owner,
            ranges: Ranges::new(),
            watch: Mutex::new(Watch::default()),
            tracker,
        }
    }

    pub(in crate::diag) fn watch(&self) -> MutexGuard<'_, Watch> {
        lock(&self.watch)
    }

    /// Whether published work on this queue is not yet known complete.
    pub(in crate::diag) fn in_flight(&self) -> bool {
        self.retired.load(Ordering::Acquire) < self.published.load(Ordering::Acquire)
    }

    /// The ranges not retired (their end, and whether a marker covers them), oldest first.
    #[cfg(all(test, feature = "host"))]
    pub(in crate::diag) fn pending(&self) -> Vec<(u64, bool)> {
        let w = self.watch();
        (w.tail..self.ranges.head())
            .map(|p| self.ranges.word(p))
            .map(|word| (word >> 1, word & MARKED != 0))
            .collect()
    }
}

impl Drop for QueueWatch {
    fn drop(&mut self) {
        let tracker = Arc::clone(&self.tracker);
        for m in self.ranges.take_events() {
            tracker.recycle(m);
        }
    }
}

/// The watchdog's side of one queue's ranges (see `ranges`).
#[derive(Debug, Default)]
pub(in crate::diag) struct Watch {
    /// Ring positions below this are retired.
    pub(in crate::diag) tail: u64,
    /// The queue was capturing into a CUDA graph at the last attempt to mark, or to
    /// query its markers.
    pub(in crate::diag) capturing: bool,
}

/// The longest an operation waits before the watchdog's notice about it.
const NOTICE_AFTER: Duration = Duration::from_secs(60);

/// How far back from a range's newest operation the watchdog looks for its oldest one.
const OLDEST_SCAN: u64 = 256;

/// How many of a departing rank's last collectives its departure keeps, to tell whether a
/// peer's collective of a number it issued was the same call.
const RECENT_COLLECTIVES: usize = 64;

/// One communicator's diagnostics state, shared with the watchdog thread and its clique.
/// The owner's per-operation path takes no lock (the module docs of `diag`).
#[derive(Debug)]
pub(crate) struct Shared {
    pub(in crate::diag) rank: usize,
    pub(in crate::diag) world_size: usize,
    pub(in crate::diag) settings: Settings,
    pub(in crate::diag) lib: Arc<Library>,
    pub(in crate::diag) clique: Arc<Clique>,
    /// Records markers and learns when queued work finished: the watchdog's and
    /// teardown's, and the owner's marking at enqueue unless `cuda_tracker` is set.
    pub(in crate::diag) tracker: Arc<dyn Tracker>,
    /// `tracker`, when it is the CUDA one: the owner's marking at enqueue calls it
    /// directly (no virtual call on the per-operation path).
    pub(in crate::diag) cuda_tracker: Option<Arc<CudaTracker>>,
    /// The queues (streams) this communicator's operations used, at most [`MAX_QUEUES`].
    pub(in crate::diag) queues: Mutex<Vec<Arc<QueueWatch>>>,
    /// The host provider's one queue (the communicator itself).
    pub(in crate::diag) host_queue: Option<Arc<QueueWatch>>,
    pub(in crate::diag) journal: Journal,
    /// The raw handle while it may be torn down; 0 once taken. Whoever swaps it out (the
    /// owner's teardown or the watchdog's abort) is its one teardown.
    pub(in crate::diag) handle: AtomicUsize,
    /// [`IDLE`], or the journal position + 1 of the operation inside its NCCL call.
    /// Written only by the owner.
    pub(in crate::diag) current: AtomicU64,
    /// [`UNCLAIMED`](super::claim::UNCLAIMED), [`DECIDING`](super::claim::DECIDING) or
    /// [`ABORTING`](super::claim::ABORTING). Written only by the watchdog (the one
    /// worker that handles its clique's timeout, `watchdog::sweep`), read by
    /// the owner after it stored `current` and fenced (ARCHITECTURE.md, "Who may use a
    /// handle: the claim").
    pub(in crate::diag) claim: AtomicU8,
    /// Whether [`fence::asymmetric`](super::fence::asymmetric) is in use.
    pub(in crate::diag) asym: bool,
    /// The report of the timeout that made the watchdog abort this communicator.
    pub(in crate::diag) report: Mutex<Option<Arc<TimeoutReport>>>,
    /// Where its teardowns run.
    pub(in crate::diag) lane: TeardownLane,
    /// The watchdog's abort of its handle, once taken (so `abort()` can wait for it).
    pub(in crate::diag) abort_task: Mutex<Option<Arc<Task>>>,
    pub(in crate::diag) aborted_by_watchdog: AtomicBool,
    /// The watchdog revoked the handle in place (`Config::elastic`) and left it with its
    /// owner.
    pub(in crate::diag) revoked_by_watchdog: AtomicBool,
    /// An NCCL group job may be linked to the handle (`Communicator::set_job_linked`): a
    /// revoke is not sound on it (`Communicator::revocable`).
    pub(in crate::diag) job_linked: AtomicBool,
    /// The watchdog aborted the handle of an elastic communicator because NCCL's revoke
    /// was not sound on it: its errors say it cannot be shrunk.
    pub(in crate::diag) unrevocable: AtomicBool,
    /// Held by the watchdog while it revokes the handle in place, and by the owner while
    /// it takes the handle for its teardown: a revoke never runs on a handle its owner
    /// already took.
    pub(in crate::diag) in_place: Mutex<()>,
    /// Whether a revoke of the watchdog's runs under `in_place`, and whether the owner's
    /// teardown gave up waiting for it (`NOT_REVOKING`, `REVOKING`, `OWNER_LEFT`).
    pub(in crate::diag) revoking: AtomicU8,
    /// Torn down by its owner.
    pub(in crate::diag) gone: AtomicBool,
    pub(in crate::diag) seq: AtomicU64,
    pub(in crate::diag) wait_ns: AtomicU64,
    pub(in crate::diag) checks: AtomicU64,
    /// The driver's error for this communicator's stream work (a sticky fault of its
    /// context), once the tracker met one: the watchdog fails the communicator at once,
    /// and its own operations report it as `Error::Cuda`.
    pub(in crate::diag) cuda_fault: std::sync::OnceLock<cudarc::driver::DriverError>,
    /// Sequence number + 1 of the last operation the watchdog printed a notice about.
    pub(in crate::diag) noticed: AtomicU64,
    /// The owner is inside a group's end with this communicator pinned (its operations
    /// staged): the watchdog's notice looks at them.
    pub(in crate::diag) group_ending: AtomicBool,
    /// Work of this communicator was seen captured into a CUDA graph: a stream of it was
    /// capturing when marked or queried, or a marker read back as a captured event. NCCL's
    /// destroy and abort wait until every graph holding its work is destroyed
    /// (`commDestroySync`, init.cc:2232-2234 of 2.28.9), so a teardown past its bound names
    /// the graph as the likely cause. Never cleared: the crate cannot see the graph go.
    pub(in crate::diag) captured: AtomicBool,
}

impl Shared {
    /// Diagnostics clock time (coarse unless precise timing is on).
    #[inline]
    pub(in crate::diag) fn now(&self) -> u64 {
        if self.settings.precise {
            clock::precise()
        } else {
            clock::coarse()
        }
    }

    /// How much older than it is an operation enqueued at `enqueued` (a time read from
    /// the coarse clock) may look: the clock lags by up to a tick, or by a longer
    /// stand-still of the clock (a watchdog starved of CPU) in which that time was read.
    ///
    /// So a stalled watchdog makes a timeout late, never false; and a stand-still that was
    /// over before the operation began does not delay its timeout.
    pub(in crate::diag) fn slack(&self, enqueued: Instant) -> Duration {
        if self.settings.precise {
            Duration::ZERO
        } else {
            clock::lag_since(clock::nanos(enqueued))
        }
    }

    /// The bound on this communicator's teardowns: [`Settings::bound`], extended for
    /// NVIDIA's NCCL by [`NCCL_RECLAIM_PER_LOCAL_RANK`](crate::teardown::NCCL_RECLAIM_PER_LOCAL_RANK)
    /// for each other rank of its clique in this process, whose resources the last
    /// teardown among them frees.
    pub(in crate::diag) fn teardown_bound(&self) -> crate::teardown::Bound {
        let mut b = self.settings.bound();
        if self.lib.provider() == crate::library::Provider::Nccl {
            let others = self.clique.local_ranks().saturating_sub(1) as u32;
            b.bound += crate::teardown::NCCL_RECLAIM_PER_LOCAL_RANK * others;
        }
        b
    }

    pub(in crate::diag) fn queue_list(&self) -> MutexGuard<'_, Vec<Arc<QueueWatch>>> {
        lock(&self.queues)
    }

    /// Whether published work is not yet known complete, on any of its queues.
    pub(in crate::diag) fn in_flight(&self) -> bool {
        self.queue_list().iter().any(|q| q.in_flight())
    }

    /// The watchdog's tick for this communicator: on each queue, retires ranges whose
    /// marker completed, then records one marker after whatever was published on it since
    /// the last tick.
    pub(in crate::diag) fn track(&self) {
        // Not under the list's lock: the tracker calls into CUDA, and the owner takes the
        // lock when it uses a new stream.
        let queues: smallvec::SmallVec<[Arc<QueueWatch>; MAX_QUEUES]> =
            self.queue_list().iter().cloned().collect();
        for q in &queues {
            self.track_queue(q);
        }
    }

    pub(in crate::diag) fn track_queue(&self, q: &QueueWatch) {
        let published = q.published.load(Ordering::Acquire);
        let mut w = q.watch();
        let r = &q.ranges;
        let marks = !q.by_owner && published > r.marked();
        if w.tail == r.head() && !marks {
            return;
        }
        self.retire_done(q, &mut w);
        if marks {
            self.produce(q, published, Some(&mut w));
            self.retire_done(q, &mut w);
        }
    }

    /// The owner's marker right after its NCCL call (exact completion): one on `q`'s stream
    /// for this queue's work below `upto`, recorded from the calling thread before the
    /// position is published, so the watchdog never marks that work itself. It takes no
    /// lock: the range goes to the watchdog through the queue's ring (`ranges`), whose one
    /// producer the owner is. With every slot in use ([`SLOTS`](super::ranges::SLOTS)
    /// markers in flight), the newest is recorded again and its range extended (no
    /// allocation, no new event).
    ///
    /// A marker recorded again covers work queued before this operation, which may run on
    /// the stream: the tracker records it again only when the stream is not capturing
    /// ([`How::Again`]), since a captured event reads as complete once its capture ended
    /// and would retire that work unrun. While the stream captures, this operation joins
    /// the newest range as it is (it never runs on the stream: complete once the work
    /// before it is), so the queue stays within its slots however captures and work
    /// alternate.
    pub(in crate::diag) fn mark_at_enqueue(&self, q: &QueueWatch, upto: u64) {
        if upto > q.ranges.marked() {
            match (&self.cuda_tracker, &q.queue) {
                // The CUDA tracker's record inlined: no virtual call, and the owner's
                // `How` known here.
                (Some(cuda), Queue::Cuda(stream)) => {
                    self.produce_with(q, upto, None, |ev, how| cuda.record_stream(stream, ev, how));
                }
                _ => self.produce(q, upto, None),
            }
        }
    }

    /// Puts this queue's work below `upto` in a range: the producer's side of the ring, the
    /// owner's at enqueue (`tick` `None`), else the watchdog's tick or a teardown's wait,
    /// holding the queue's watch (`tick`).
    fn produce(&self, q: &QueueWatch, upto: u64, tick: Option<&mut Watch>) {
        self.produce_with(q, upto, tick, |ev, how| {
            self.tracker.record(&q.queue, ev, how)
        });
    }

    /// [`produce`](Self::produce), the marker recorded by `record` (the tracker's
    /// [`Tracker::record`] on `q`'s queue).
    #[inline(always)]
    fn produce_with(
        &self,
        q: &QueueWatch,
        upto: u64,
        mut tick: Option<&mut Watch>,
        record: impl Fn(Event<'_>, How) -> Mark,
    ) {
        let r = &q.ranges;
        // Twice at most: an extension that finds its range retired leaves the ring empty.
        loop {
            if !r.has_free() {
                // Every slot in use: the newest range is extended (only a range that is the
                // only one may lack a marker, so the newest has one here).
                let how = if tick.is_some() {
                    How::Tick
                } else {
                    How::Again
                };
                let Some(mark) = r.with_newest_event(|ev| record(ev, how)) else {
                    return; // not reached: a full ring has a newest range, marked
                };
                let marked = match mark {
                    Mark::Recorded => true,
                    Mark::Capturing if tick.is_some() => {
                        self.note_capturing(tick.as_deref_mut());
                        return;
                    }
                    // Captured (never runs on the stream) or not watchable: complete once
                    // what is before it is, as the newest range's work.
                    m @ (Mark::Capturing | Mark::Unwatched) => {
                        if matches!(m, Mark::Capturing) {
                            self.note_capturing(None);
                        }
                        false
                    }
                    Mark::Failed(e) => {
                        let _ = self.cuda_fault.set(e);
                        return;
                    }
                };
                if let Some(w) = tick.as_deref_mut() {
                    w.capturing = false; // it was asked: not capturing now
                }
                if r.extend(upto, marked) {
                    return;
                }
                continue;
            }
            let how = if tick.is_some() {
                How::Tick
            } else {
                How::Enqueue
            };
            let mark = r.with_free_event(|ev| record(ev, how));
            let marked = match mark {
                // A new marker, recorded without asking whether the stream is capturing
                // (it covers only the work of this operation, or group, on the stream):
                // see `retire_done`.
                Mark::Recorded => true,
                Mark::Capturing if tick.is_some() => {
                    // Nothing of this range reaches the stream before the capture ends:
                    // try again next tick. Only this queue's watching pauses.
                    self.note_capturing(tick.as_deref_mut());
                    return;
                }
                // Captured (asked at enqueue on the per-thread stream: never run on the
                // stream), or not watchable: complete once what is before it is. Joined
                // to the newest range, so a long capture does not grow the queue.
                m @ (Mark::Capturing | Mark::Unwatched) => {
                    if matches!(m, Mark::Capturing) {
                        self.note_capturing(None);
                    }
                    if r.has_newest() && r.extend(upto, false) {
                        return;
                    }
                    false
                }
                Mark::Failed(e) => {
                    // Left to the watchdog, which fails the communicator for the fault; the
                    // range stays pending: the fault, not a retirement, ends it.
                    let _ = self.cuda_fault.set(e);
                    return;
                }
            };
            if let Some(w) = tick.as_deref_mut() {
                w.capturing = false; // it was asked: not capturing now
            }
            // The owner's: when every operation published on this queue before is in a
            // range, the range's oldest is the operation being marked (position
            // `upto - 1`), and the journal is not searched (one entry read for each
            // operation of the other streams in between: 8 on the overhead bench's tail).
            let oldest = if tick.is_none()
                && q.published
                    .load(Ordering::Relaxed)
                    .max(q.staged.load(Ordering::Relaxed))
                    <= r.marked()
            {
                upto.checked_sub(1).and_then(|p| self.journal.get(p))
            } else {
                self.oldest_on(q.key, r.marked(), upto)
            };
            let since = match (&tick, oldest) {
                (None, Some(rec)) => rec.enqueued,
                _ => Instant::now(),
            };
            r.push(upto, marked, Info { oldest, since });
            return;
        }
    }

    /// The owner's, for a queue it no longer uses often: gives back the events its retired
    /// ranges kept for the next ones (to the tracker's spare ring, which destroys what it
    /// has no room for).
    pub(in crate::diag) fn reclaim_parked(&self, q: &QueueWatch) {
        if q.by_owner {
            q.ranges.take_free_events(|m| self.tracker.recycle(m));
        }
    }

    /// Notes that work of this communicator met a capture (and, for the watchdog, that
    /// this queue is capturing now).
    fn note_capturing(&self, w: Option<&mut Watch>) {
        if let Some(w) = w {
            w.capturing = true;
        }
        self.captured.store(true, Ordering::Relaxed);
    }

    /// The record of the oldest operation on queue `key` at positions `from..upto` still
    /// in the ring (at worst the newest: position `upto - 1` is on this queue).
    fn oldest_on(&self, key: usize, from: u64, upto: u64) -> Option<OpRecord> {
        let ring = self.journal.capacity().min(OLDEST_SCAN);
        let start = from.max(upto.saturating_sub(ring));
        (start..upto)
            .find(|&p| self.journal.queue_of(p) == Some(key))
            .and_then(|p| self.journal.get(p))
            .or_else(|| self.journal.get(upto.checked_sub(1)?))
    }

    /// Retires the oldest ranges of `q` whose marker completed (the consumer's side of the
    /// ring; the caller holds `w`). Reads the ring's head, then asks whether the queue is
    /// capturing into a graph, and then queries nothing (`tracker`'s module docs); it
    /// queries only ranges published before the question, so every new marker queried was
    /// recorded before the answer (one recorded again later was recorded outside a capture:
    /// [`How::Again`] asks).
    fn retire_done(&self, q: &QueueWatch, w: &mut Watch) {
        let r = &q.ranges;
        let head = r.head();
        if (w.tail..head).any(|p| r.word(p) & MARKED != 0) {
            match self.tracker.capturing(&q.queue) {
                Ok(false) => w.capturing = false,
                Ok(true) => {
                    self.note_capturing(Some(w));
                    return;
                }
                Err(e) => {
                    let _ = self.cuda_fault.set(e);
                    return;
                }
            }
        }
        while w.tail < head {
            let pos = w.tail;
            let word = r.word(pos);
            let marker = (word & MARKED != 0).then(|| r.marker(pos)).flatten();
            let done = match marker.map(|m| self.tracker.done(m)) {
                None | Some(Ok(true)) => true,
                Some(Ok(false)) => false,
                Some(Err(e)) => {
                    let _ = self.cuda_fault.set(e);
                    false
                }
            };
            if !done {
                break;
            }
            if marker.is_some_and(|m| self.tracker.take_captured(m)) {
                self.captured.store(true, Ordering::Relaxed);
            }
            // The owner extended it meanwhile (its marker recorded again after the
            // query): looked at again next time. Once retired, the slot is the owner's,
            // its event with it (kept for the slot's next range).
            if !r.retire(pos, word) {
                break;
            }
            w.tail = pos + 1;
            q.retired.store(word >> 1, Ordering::Release);
        }
    }

    /// The oldest range of `q` not retired: its end and info (the caller holds `w`).
    fn front(q: &QueueWatch, w: &Watch) -> Option<(u64, Info)> {
        let r = &q.ranges;
        (w.tail < r.head()).then(|| (r.word(w.tail) >> 1, r.info(w.tail)))
    }

    /// The oldest tracked operation not known complete, on a queue not capturing, if it is
    /// older than `limit`.
    ///
    /// `lagged`: the limit is a timeout, extended by the clock's lag at the record's
    /// enqueue time ([`slack`](Self::slack)); a marking time is precise.
    pub(in crate::diag) fn late_work(
        &self,
        now: Instant,
        limit: Duration,
        lagged: bool,
    ) -> Option<OpRecord> {
        let mut late: Option<(Instant, OpRecord)> = None;
        for q in self.queue_list().iter() {
            let w = q.watch();
            if w.capturing {
                continue;
            }
            let Some((upto, p)) = Self::front(q, &w) else {
                continue;
            };
            let rec = p.oldest.or_else(|| self.journal.get(upto.checked_sub(1)?));
            let Some(rec) = rec else {
                continue;
            };
            // The record's enqueue time, or the marking when the record is a later one.
            let (start, limit) = match p.oldest {
                Some(_) if lagged => (rec.enqueued, limit + self.slack(rec.enqueued)),
                Some(_) => (rec.enqueued, limit),
                None => (p.since, limit),
            };
            if now.saturating_duration_since(start) >= limit
                && late.as_ref().is_none_or(|(s, _)| start < *s)
            {
                late = Some((start, rec));
            }
        }
        late.map(|(_, r)| r)
    }

    /// The queue (its key: a CUDA stream's handle, or a host communicator's) whose tracked
    /// work not known complete is the oldest, with the record of that work: what a stream
    /// synchronize of NCCL's would wait for.
    pub(in crate::diag) fn stream_behind(&self) -> Option<(usize, OpRecord)> {
        let mut oldest: Option<(Instant, usize, OpRecord)> = None;
        for q in self.queue_list().iter() {
            if !q.in_flight() || !self.tracker.busy(&q.queue) {
                continue;
            }
            let w = q.watch();
            if w.capturing {
                continue;
            }
            // The oldest range the watchdog marked, else (not marked yet) the last work
            // published.
            let rec = match Self::front(q, &w) {
                Some((upto, p)) => p.oldest.or_else(|| self.journal.get(upto.checked_sub(1)?)),
                None => self
                    .journal
                    .get(q.published.load(Ordering::Acquire).checked_sub(1)?),
            };
            let Some(rec) = rec else {
                continue;
            };
            if oldest.as_ref().is_none_or(|(s, _, _)| rec.enqueued < *s) {
                oldest = Some((rec.enqueued, q.key, rec));
            }
        }
        oldest.map(|(_, k, r)| (k, r))
    }

    /// Adds a queue the owner has not used before (or notes it again); returns its watch.
    ///
    /// At most [`MAX_QUEUES`] are kept, the least recently noted dropped first, so a rank
    /// that makes a new stream per step neither leaks streams nor grows the watchdog's
    /// work per tick. Work queued on a dropped stream after its last marker is no longer
    /// watched (never falsely timed out).
    #[cold]
    pub(in crate::diag) fn note_queue(&self, q: Queue) -> Arc<QueueWatch> {
        let mut qs = self.queue_list();
        let key = q.key();
        if let Some(i) = qs.iter().position(|x| x.key == key) {
            let q = qs.remove(i);
            qs.push(Arc::clone(&q));
            return q;
        }
        if qs.len() >= MAX_QUEUES {
            qs.remove(0);
        }
        let by_owner = self.settings.exact && matches!(q, Queue::Cuda(_));
        let q = Arc::new(QueueWatch::new(q, by_owner, Arc::clone(&self.tracker)));
        qs.push(Arc::clone(&q));
        q
    }

    /// The record at journal position `pos`, with completion of tracked work applied.
    pub(in crate::diag) fn record(&self, pos: u64) -> Option<OpRecord> {
        let mut r = self.journal.get(pos)?;
        if r.state == OpState::Enqueued {
            let key = self.journal.queue_of(pos);
            let done = self
                .queue_list()
                .iter()
                .any(|q| Some(q.key) == key && pos < q.retired.load(Ordering::Acquire));
            if done {
                r.state = OpState::Completed;
            }
        }
        Some(r)
    }

    /// The last collectives this rank issued (sequence number, call), oldest first, as
    /// far as the journal still holds them (at most [`RECENT_COLLECTIVES`]): what a
    /// departure compares its peers' collectives with. None with the fingerprint check
    /// on: a peer's collective numbered as another call of this rank is then a mismatch
    /// that the check reports to every rank (`CollectiveMismatch`, with the table), which
    /// the departure must not preempt.
    pub(in crate::diag) fn recent_collectives(&self) -> Vec<(u64, EntryPoint)> {
        let Some(last) = self.journal.last_pos().filter(|_| !self.settings.check) else {
            return Vec::new();
        };
        let first = (last + 1).saturating_sub(self.journal.capacity());
        let mut out: Vec<(u64, EntryPoint)> = (first..=last)
            .rev()
            .filter_map(|p| self.journal.get(p))
            .filter(|r| crate::diag::op::is_collective(r.op))
            .map(|r| (r.seq, r.op))
            .take(RECENT_COLLECTIVES)
            .collect();
        out.reverse();
        out
    }

    #[cold]
    pub(in crate::diag) fn timeout_error(&self, report: &str) -> Error {
        if let Some(&e) = self.cuda_fault.get() {
            // Its own stream's work failed on the GPU: the driver's error is the cause.
            return Error::Cuda(e);
        }
        let what = if self.unrevocable.load(Ordering::Acquire) {
            format!(
                "{report}. This rank's communicator: {}",
                crate::error::UNREVOCABLE
            )
        } else {
            report.to_string()
        };
        if let Some(rank) = self.timed_out().and_then(|r| r.left) {
            return Error::RankLeft { rank, what };
        }
        Error::Timeout {
            what,
            timeout: self.settings.timeout,
        }
    }

    /// The operation of this communicator that waits for a collective a departed rank
    /// never issued (see `Clique::depart`), if any: the one inside its NCCL call, else the
    /// oldest tracked work not known complete.
    pub(in crate::diag) fn waits_for_departed(&self, now: Instant) -> Option<OpRecord> {
        let rec = (self.in_call()).or_else(|| self.late_work(now, Duration::ZERO, false))?;
        self.clique.waits_for_departed(self.rank, &rec).map(|_| rec)
    }

    /// Publishes the work of a group that just ended on every queue it used (marking each
    /// first, with exact completion: the group's work is on its streams now).
    pub(in crate::diag) fn publish_staged(&self) {
        for q in self.queue_list().iter() {
            self.publish_staged_on(q);
        }
    }

    /// [`publish_staged`](Self::publish_staged) for one queue: its staged work published
    /// (marked first, with exact completion), if any. The owner only.
    #[inline]
    pub(in crate::diag) fn publish_staged_on(&self, q: &QueueWatch) {
        let staged = q.staged.load(Ordering::Acquire);
        if staged > q.published.load(Ordering::Acquire) {
            if q.by_owner {
                self.mark_at_enqueue(q, staged);
            }
            q.published.store(staged, Ordering::Release);
        }
    }

    /// The records of the operations of the group being ended (staged on a queue, not yet
    /// published), queue by queue.
    pub(in crate::diag) fn staged(&self) -> Vec<OpRecord> {
        let mut staged = Vec::new();
        for q in self.queue_list().iter() {
            let from = q.published.load(Ordering::Acquire);
            let to = q.staged.load(Ordering::Acquire);
            staged.extend((from..to).filter_map(|pos| self.journal.get(pos)));
        }
        staged
    }

    /// The ranks of another process that the host provider says have not reached the
    /// collective this rank waits in (its shared memory's barrier counts), for a timeout
    /// report with no desync board or one that cannot be read; `None` for NVIDIA's NCCL,
    /// a clique within one process, and a handle the watchdog already took.
    pub(in crate::diag) fn host_behind(&self) -> Option<Vec<usize>> {
        #[cfg(feature = "host")]
        if self.lib.provider() == crate::library::Provider::Host {
            let raw = self.handle.load(Ordering::Acquire) as nccl_sys::ncclComm_t;
            if raw.is_null() {
                return None;
            }
            let behind = crate::host::behind_peers(raw);
            return (!behind.is_empty()).then_some(behind);
        }
        None
    }

    /// Times the clique out (unless it already was) for `rec`, this rank's operation, which
    /// `what` says happened to: the desync report ([`Clique::report`], `ours` as there).
    /// Returns the clique's first report.
    pub(in crate::diag) fn time_out(
        &self,
        rec: &OpRecord,
        what: &str,
        ours: bool,
    ) -> Arc<TimeoutReport> {
        let host = self.host_behind();
        let report = (self.clique).report(
            self.rank,
            rec,
            self.settings.timeout,
            what,
            ours,
            host.as_deref(),
        );
        self.clique
            .set_timed_out(&TimeoutReport::of(self.rank, rec, report))
    }

    /// The report this communicator's failure is about, if the clique timed out.
    pub(in crate::diag) fn timed_out(&self) -> Option<Arc<TimeoutReport>> {
        if self.aborted_by_watchdog.load(Ordering::Acquire) {
            let r = lock(&self.report).clone();
            if r.is_some() {
                return r;
            }
        }
        self.clique.timed_out()
    }

    /// The report of the watchdog's abort of this communicator.
    pub(in crate::diag) fn abort_report(&self) -> Arc<TimeoutReport> {
        self.timed_out()
            .unwrap_or_else(|| TimeoutReport::text("the watchdog aborted it"))
    }

    /// The report for an operation of this rank that was not run (or was woken) because the
    /// clique already timed out.
    #[cold]
    pub(in crate::diag) fn peer_timeout(&self, rec: &OpRecord, first: &str) -> Error {
        let done = if self.settings.elastic && !self.aborted_by_watchdog.load(Ordering::Acquire) {
            "the watchdog revoked the communicators of its clique (Config::elastic: shrink_after_failure makes one of the ranks left)"
        } else {
            "the watchdog aborted this communicator"
        };
        let why = match self.timed_out().and_then(|r| r.left) {
            Some(r) => {
                // In this rank's words: who left, and how (it panicked, returned, failed).
                let how = (self.clique.departed_other_than(self.rank))
                    .filter(|d| d.rank == r)
                    .and_then(|d| d.how.lines().next().map(|l| format!(" ({l})")))
                    .unwrap_or_default();
                format!("rank {r} left{how}, so {done}")
            }
            None => format!("a peer timed out, so {done}. The first timeout"),
        };
        let what = format!(
            "{} (seq {}) on rank {}, called at {}: {why}:\n{first}\n=> {} seq {} on rank {}",
            rec.signature(),
            rec.seq,
            self.rank,
            rec.at(),
            rec.op,
            rec.seq,
            self.rank
        );
        self.timeout_error(&what)
    }

    // ---- the watchdog's side ------------------------------------------------------------

    /// When the tracker met a driver error for this communicator's work: the oldest
    /// operation not known complete (else the latest), with the error.
    pub(in crate::diag) fn faulted(&self) -> Option<(OpRecord, cudarc::driver::DriverError)> {
        let e = *self.cuda_fault.get()?;
        let pending = self.queue_list().iter().find_map(|q| {
            let w = q.watch();
            let (upto, p) = Self::front(q, &w)?;
            p.oldest.or_else(|| self.journal.get(upto.checked_sub(1)?))
        });
        let rec = pending.or_else(|| self.journal.get(self.journal.last_pos()?))?;
        Some((rec, e))
    }

    /// The operation that ran out of time at `now`, if any.
    pub(in crate::diag) fn late(&self, now: Instant) -> Option<OpRecord> {
        self.late_by(now, self.settings.timeout)
    }

    /// The notice of an operation that has waited a quarter of the timeout, at most
    /// [`NOTICE_AFTER`] (so a stuck rank shows long before the timeout turns it into an
    /// error), once per operation: what this rank waits in and, of the ranks in this
    /// process, which have not called it yet.
    pub(in crate::diag) fn notice(&self, now: Instant) -> Option<String> {
        let limit = (self.settings.timeout / 4).min(NOTICE_AFTER);
        let rec = (self.late_by(now, limit)).or_else(|| self.group_late_by(now, limit))?;
        if self.noticed.fetch_max(rec.seq + 1, Ordering::AcqRel) > rec.seq {
            return None;
        }
        let behind = self.clique.behind_here(rec.seq);
        let who = if !behind.is_empty() {
            format!("rank(s) {behind:?} of this process have not called it yet")
        } else if self.clique.local_ranks() < self.world_size {
            "every rank of this process called it: a rank in another process has not, or is slow"
                .into()
        } else {
            "every rank called it: the work itself is slow or stuck".into()
        };
        Some(format!(
            "nccl-safe: rank {} has waited {:.0?} in {} (seq {}), called at {}; {who}. It times out after {:?} (Config::timeout, NCCL_SAFE_TIMEOUT_MS).",
            self.rank,
            now.saturating_duration_since(rec.enqueued),
            rec.signature(),
            rec.seq,
            rec.at(),
            self.settings.timeout
        ))
    }

    /// [`late`](Self::late) with `limit` instead of the timeout.
    fn late_by(&self, now: Instant, limit: Duration) -> Option<OpRecord> {
        (self.in_call())
            .filter(|r| now.saturating_duration_since(r.enqueued) >= limit + self.slack(r.enqueued))
            .or_else(|| self.late_work(now, limit, true))
    }

    /// The oldest operation of the group whose end the owner is inside (its communicators
    /// pinned, so none is in a call of its own, and its work staged, not published), when
    /// it has waited `limit`. A group's end is watched by its own timeout (`Group::end`,
    /// host provider) or its wait for the launch (`settle`); the notice is the watchdog's.
    fn group_late_by(&self, now: Instant, limit: Duration) -> Option<OpRecord> {
        if !self.group_ending.load(Ordering::Acquire)
            || self.current.load(Ordering::Acquire) != PINNED
        {
            return None;
        }
        (self.staged().into_iter())
            .filter(|r| now.saturating_duration_since(r.enqueued) >= limit + self.slack(r.enqueued))
            .min_by_key(|r| r.enqueued)
    }

    /// The operation whose NCCL call the owner is inside, if any (not while it is idle or
    /// pinned).
    pub(in crate::diag) fn in_call(&self) -> Option<OpRecord> {
        let cur = self.current.load(Ordering::Acquire);
        (cur != IDLE && cur != PINNED)
            .then(|| self.journal.get(cur - 1))
            .flatten()
    }
}

impl LiveRank for Shared {
    /// What the clique's desync report shows for this rank.
    fn view(&self) -> RankView {
        RankView {
            present: true,
            gone: self.gone.load(Ordering::Acquire),
            issued: self.seq.load(Ordering::Relaxed),
            last: self.journal.last_pos().and_then(|p| self.record(p)),
        }
    }
}
