//! The flight recorder's storage: a fixed ring of operation records that the
//! communicator's own thread writes without a lock, a read-modify-write or an allocation,
//! and that the watchdog and the reports read from other threads.
//!
//! Each slot is a sequence lock. The one writer makes the slot's version odd, writes the
//! fields and makes the version even again; a reader copies the fields between two reads
//! of the version and retries when they differ or are odd. Every field is an atomic word,
//! so a read that races a write is retried, never undefined behaviour. The call is stored
//! as its entry point's index (a small integer); the one reference a record holds, the
//! caller's `Location`, is stored as a pointer to `'static` data: every value ever stored in
//! that word is such a pointer (or the initial null), so following one is sound whether or
//! not the version check passes.

use std::panic::Location;
use std::sync::atomic::{fence, AtomicPtr, AtomicU64, Ordering};
use std::time::Duration;

use nccl_sys::EntryPoint;

use super::clock;
use super::record::{OpRecord, OpState};
use crate::types::DataType;

const NONE: u64 = u64::MAX;

/// The fields of one record as the writer gives them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    pub seq: u64,
    pub name: EntryPoint,
    pub dtype: Option<DataType>,
    pub count: usize,
    pub root: Option<usize>,
    pub caller: &'static Location<'static>,
    /// Diagnostics clock time ([`clock`]).
    pub enqueued: u64,
    /// The key of the queue (stream) its work goes to (`Queue::key`).
    pub queue: usize,
}

#[derive(Debug, Default)]
struct Slot {
    version: AtomicU64,
    /// The record's position (a slot is reused every `slots.len()` records).
    pos: AtomicU64,
    seq: AtomicU64,
    caller: AtomicPtr<Location<'static>>,
    /// `dtype code | state << 8 | entry point index << 16` (dtype code 0: none, else
    /// index + 1).
    meta: AtomicU64,
    count: AtomicU64,
    root: AtomicU64,
    enqueued: AtomicU64,
    /// The queue key of the record's work.
    queue: AtomicU64,
    /// Nanoseconds; meaningful only once the state is not `Enqueued`.
    took: AtomicU64,
}

#[inline]
fn state_code(s: OpState) -> u64 {
    match s {
        OpState::Enqueued => 0,
        OpState::Completed => 1,
        OpState::Failed => 2,
    }
}

fn state_of(code: u64) -> OpState {
    match code {
        1 => OpState::Completed,
        2 => OpState::Failed,
        _ => OpState::Enqueued,
    }
}

#[inline]
fn dtype_code(d: Option<DataType>) -> u64 {
    d.map_or(0, |d| d as u64 + 1)
}

fn dtype_of(code: u64) -> Option<DataType> {
    DataType::ALL.get((code as usize).checked_sub(1)?).copied()
}

/// One communicator's records. Written only by the thread that owns the communicator
/// (one at a time: `Communicator` is not `Sync`).
#[derive(Debug)]
pub(crate) struct Journal {
    /// A power of two long (at least `cap`), so a position's slot is a mask away.
    slots: Box<[Slot]>,
    /// `slots.len() - 1`.
    mask: u64,
    /// How many records the flight record shows (0: recording is off; the newest record is
    /// still kept for the watchdog and the desync report).
    cap: usize,
    /// Records ever pushed: the next record's position.
    next: AtomicU64,
}

impl Journal {
    /// A journal showing the last `cap` records (allocates its slots once, here).
    pub(crate) fn new(cap: usize) -> Journal {
        // Settings refuse longer records; clamped here too, so no length can overflow.
        let cap = cap.min(crate::diag::settings::MAX_FLIGHT_RECORD_LEN);
        let len = cap.max(1).next_power_of_two();
        Journal {
            slots: (0..len).map(|_| Slot::default()).collect(),
            mask: len as u64 - 1,
            cap,
            next: AtomicU64::new(0),
        }
    }

    /// Records ever pushed.
    #[inline]
    pub(crate) fn len(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }

    #[inline]
    fn slot(&self, pos: u64) -> &Slot {
        &self.slots[(pos & self.mask) as usize]
    }

    /// Opens `slot` for writing (the owner only).
    #[inline]
    fn open(slot: &Slot) -> u64 {
        let v = slot.version.load(Ordering::Relaxed);
        slot.version.store(v.wrapping_add(1), Ordering::Relaxed);
        // Orders the odd version before the field stores that follow.
        fence(Ordering::Release);
        v
    }

    /// Appends `e` as enqueued; returns its position. The owner only.
    #[inline]
    pub(crate) fn push(&self, e: &Entry) -> u64 {
        let pos = self.next.load(Ordering::Relaxed);
        let s = self.slot(pos);
        let v = Self::open(s);
        s.pos.store(pos, Ordering::Relaxed);
        s.seq.store(e.seq, Ordering::Relaxed);
        s.caller.store(
            (e.caller as *const Location<'static>).cast_mut(),
            Ordering::Relaxed,
        );
        s.meta.store(
            dtype_code(e.dtype) | u64::from(e.name.index()) << 16,
            Ordering::Relaxed,
        );
        s.count.store(e.count as u64, Ordering::Relaxed);
        s.root
            .store(e.root.map_or(NONE, |r| r as u64), Ordering::Relaxed);
        s.enqueued.store(e.enqueued, Ordering::Relaxed);
        s.queue.store(e.queue as u64, Ordering::Relaxed);
        s.version.store(v.wrapping_add(2), Ordering::Release);
        // Readers find the record through `next`: publish it after its fields.
        self.next.store(pos + 1, Ordering::Release);
        pos
    }

    /// Sets the state of the record at `pos` and how long it took (when it was not
    /// overwritten since). The owner only.
    #[inline]
    pub(crate) fn finish(&self, pos: u64, state: OpState, took_ns: u64) {
        if pos + self.mask + 1 < self.len() {
            return;
        }
        let s = self.slot(pos);
        let v = Self::open(s);
        let meta = s.meta.load(Ordering::Relaxed) & !(0xff << 8);
        s.meta
            .store(meta | state_code(state) << 8, Ordering::Relaxed);
        s.took.store(took_ns, Ordering::Relaxed);
        s.version.store(v.wrapping_add(2), Ordering::Release);
    }

    /// Marks the record at `pos` `state`, with the time from its enqueue to `now` (both
    /// diagnostics clock times), when it is still in the ring and still enqueued. The owner
    /// only: it reads back its own writes, so it needs no seqlock read and no clock of its
    /// own (a group's end marks each of its operations here, with one `now` for them all).
    #[inline]
    pub(crate) fn finish_enqueued(&self, pos: u64, state: OpState, now: u64) {
        let len = self.len();
        if pos >= len || pos + self.mask + 1 < len {
            return;
        }
        let s = self.slot(pos);
        let meta = s.meta.load(Ordering::Relaxed);
        if s.pos.load(Ordering::Relaxed) != pos || state_of(meta >> 8 & 0xff) != OpState::Enqueued {
            return;
        }
        let took = now.saturating_sub(s.enqueued.load(Ordering::Relaxed));
        self.finish(pos, state, took);
    }

    /// One consistent read of `pos`'s slot by `load`, with the position the slot held then
    /// (a seqlock read: retried while a writer is in the slot); `None` when `pos` is not
    /// written yet. Any thread.
    fn read<T>(&self, pos: u64, load: impl Fn(&Slot) -> T) -> Option<(u64, T)> {
        let s = self.slot(pos);
        loop {
            if pos >= self.next.load(Ordering::Acquire) {
                return None;
            }
            let v1 = s.version.load(Ordering::Acquire);
            if v1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let at = s.pos.load(Ordering::Relaxed);
            let loaded = load(s);
            // Orders the field loads before the second version load.
            fence(Ordering::Acquire);
            if s.version.load(Ordering::Relaxed) != v1 {
                continue;
            }
            return Some((at, loaded));
        }
    }

    /// The record at `pos`, if it is still in the ring. Any thread.
    pub(crate) fn get(&self, pos: u64) -> Option<OpRecord> {
        let (at, (seq, caller, meta, count, root, enqueued, took)) = self.read(pos, |s| {
            (
                s.seq.load(Ordering::Relaxed),
                s.caller.load(Ordering::Relaxed),
                s.meta.load(Ordering::Relaxed),
                s.count.load(Ordering::Relaxed),
                s.root.load(Ordering::Relaxed),
                s.enqueued.load(Ordering::Relaxed),
                s.took.load(Ordering::Relaxed),
            )
        })?;
        // The slot may since have been reused for a later record.
        if at != pos || caller.is_null() {
            return None;
        }
        let op = EntryPoint::from_index((meta >> 16) as u16)?;
        // SAFETY: every non-null value stored in this word came from a
        // `&'static Location<'static>` (`push`): it points to immutable data that lives
        // for the whole program.
        let caller = unsafe { &*caller };
        Some(OpRecord {
            seq,
            op,
            dtype: dtype_of(meta & 0xff),
            count: count as usize,
            root: (root != NONE).then_some(root as usize),
            caller,
            enqueued: clock::instant(enqueued),
            took: (state_of(meta >> 8 & 0xff) != OpState::Enqueued)
                .then(|| Duration::from_nanos(took)),
            state: state_of(meta >> 8 & 0xff),
        })
    }

    /// The queue key of the record at `pos`, if it is still in the ring. Any thread.
    pub(crate) fn queue_of(&self, pos: u64) -> Option<usize> {
        let (at, queue) = self.read(pos, |s| s.queue.load(Ordering::Relaxed))?;
        (at == pos).then_some(queue as usize)
    }

    /// How many records the ring holds (a power of two).
    pub(crate) fn capacity(&self) -> u64 {
        self.mask + 1
    }

    /// The newest record.
    #[cfg(test)]
    fn last(&self) -> Option<OpRecord> {
        self.len().checked_sub(1).and_then(|p| self.get(p))
    }

    /// The position of the newest record (the count of records, minus one).
    pub(crate) fn last_pos(&self) -> Option<u64> {
        self.len().checked_sub(1)
    }

    /// The positions of the records the flight record shows (the last `cap`).
    pub(crate) fn shown(&self) -> std::ops::Range<u64> {
        let end = self.len();
        end.saturating_sub(self.cap as u64)..end
    }

    /// The records [`shown`](Self::shown), oldest first.
    #[cfg(test)]
    fn snapshot(&self) -> Vec<OpRecord> {
        self.shown().filter_map(|p| self.get(p)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, name: EntryPoint) -> Entry {
        Entry {
            seq,
            name,
            dtype: Some(DataType::Float32),
            count: seq as usize * 10,
            root: seq.is_multiple_of(2).then_some(seq as usize),
            caller: Location::caller(),
            enqueued: seq * 1000,
            queue: seq as usize % 3,
        }
    }

    #[test]
    fn finish_enqueued_marks_only_records_still_enqueued_and_in_the_ring() {
        let j = Journal::new(4);
        for i in 0..3u64 {
            j.push(&entry(i, EntryPoint::ncclAllReduce));
        }
        j.finish(1, OpState::Failed, 5);
        // One `now` for all: each record's time is counted from its own enqueue.
        for p in 0..4 {
            j.finish_enqueued(p, OpState::Completed, 2500);
        }
        let took = |p| j.get(p).map(|r| (r.state, r.took));
        assert_eq!(
            took(0),
            Some((OpState::Completed, Some(Duration::from_nanos(2500))))
        );
        assert_eq!(
            took(1),
            Some((OpState::Failed, Some(Duration::from_nanos(5))))
        );
        assert_eq!(
            took(2),
            Some((OpState::Completed, Some(Duration::from_nanos(500))))
        );
        // A position not yet written, and one since overwritten, are left alone.
        assert_eq!(j.len(), 3);
        for i in 3..8u64 {
            j.push(&entry(i, EntryPoint::ncclBroadcast));
        }
        j.finish_enqueued(2, OpState::Failed, 9000);
        assert!(j.get(2).is_none());
        assert_eq!(took(6), Some((OpState::Enqueued, None)));
        j.finish_enqueued(6, OpState::Failed, 9000);
        assert_eq!(
            took(6),
            Some((OpState::Failed, Some(Duration::from_nanos(3000))))
        );
    }

    #[test]
    fn records_round_trip_and_the_ring_keeps_the_newest() {
        let j = Journal::new(3);
        assert!(j.last().is_none() && j.snapshot().is_empty());
        for i in 0..5u64 {
            let p = j.push(&entry(i, EntryPoint::ncclAllReduce));
            assert_eq!(p, i);
            j.finish(p, OpState::Completed, 7 + i);
        }
        let snap = j.snapshot();
        assert_eq!(
            snap.iter().map(|r| r.seq).collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
        let r = &snap[2];
        assert_eq!(
            (r.op, r.count, r.root),
            (EntryPoint::ncclAllReduce, 40, Some(4))
        );
        assert_eq!(r.dtype, Some(DataType::Float32));
        assert_eq!(r.state, OpState::Completed);
        assert_eq!(r.took, Some(Duration::from_nanos(11)));
        assert_eq!(snap[1].root, None);
        // Overwritten positions are gone; finishing one is a no-op.
        assert!(j.get(0).is_none() && j.get(5).is_none());
        assert_eq!((j.queue_of(0), j.queue_of(4)), (None, Some(1)));
        j.finish(0, OpState::Failed, 1);
        assert_eq!(j.get(2).unwrap().state, OpState::Completed);
        let p = j.push(&entry(9, EntryPoint::ncclBroadcast));
        assert_eq!(j.last().unwrap().state, OpState::Enqueued);
        assert_eq!(j.last().unwrap().took, None);
        j.finish(p, OpState::Failed, 3);
        assert_eq!(j.last().unwrap().state, OpState::Failed);
    }

    #[test]
    fn every_dtype_round_trips() {
        assert_eq!(dtype_of(dtype_code(None)), None);
        for (i, d) in DataType::ALL.iter().enumerate() {
            assert_eq!(*d as usize, i);
            assert_eq!(dtype_of(dtype_code(Some(*d))), Some(*d));
        }
    }

    #[test]
    fn a_zero_length_record_keeps_only_the_newest_for_reports() {
        let j = Journal::new(0);
        j.push(&entry(1, EntryPoint::ncclAllGather));
        j.push(&entry(2, EntryPoint::ncclAllGather));
        assert!(j.snapshot().is_empty());
        assert_eq!(j.last().unwrap().seq, 2);
        assert_eq!(j.len(), 2);
    }

    /// A reader racing the writer only ever sees whole records.
    #[test]
    fn concurrent_readers_never_see_a_torn_record() {
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        let j = Journal::new(2);
        let (stop, seen) = (AtomicBool::new(false), AtomicUsize::new(0));
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(r) = j.last() {
                        // Every field was written from the same seq.
                        assert_eq!(r.count, r.seq as usize * 10, "{r:?}");
                        assert_eq!(r.root, r.seq.is_multiple_of(2).then_some(r.seq as usize));
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            // Writes on until the reader has read some records while they were being written
            // (on a loaded machine it may get no CPU during the first 200,000).
            let mut i = 0u64;
            while i < 200_000 || seen.load(Ordering::Relaxed) < 1_000 {
                let p = j.push(&entry(i, EntryPoint::ncclReduce));
                j.finish(p, OpState::Completed, i);
                i += 1;
            }
            stop.store(true, Ordering::Relaxed);
        });
    }
}
