//! The hand-off of one queue's marked ranges from the thread that marks them (the owner,
//! with exact completion) to the thread that retires them (the watchdog), without a lock.
//!
//! A ring of [`SLOTS`] slots, single producer, single consumer. Position `p` (the `p`th
//! range of the queue) lives in slot `p % SLOTS`; a slot's `word` is [`TAKEN`] while it is
//! free, else the range's end (`upto << 1`) with [`MARKED`] set when its marker covers it.
//!
//! * **The producer** (the owner; with lazy completion, and for the host provider's queue,
//!   whoever holds the queue's `Watch` lock: the watchdog or a teardown) writes only free
//!   slots: it reads the slot of position `head` (`Acquire`), and when it is [`TAKEN`]
//!   fills it (event, record, word) and then publishes `head + 1` (`Release`). With every
//!   slot in use (the ring is full: [`MAX_PENDING`](super::tracker::MAX_PENDING) markers in
//!   flight) it extends the newest range instead, with a `swap` of its word: a swap that
//!   finds [`TAKEN`] means the consumer retired that range first, so the producer frees
//!   the slot again and pushes the extension as a range of its own (the ring is empty
//!   then). These are the producer's only read-modify-writes, and they happen only while
//!   the ring is full (or a capture's range joins the newest).
//! * **The consumer** (the watchdog, or a teardown, holding the queue's `Watch` lock, so
//!   one at a time) reads positions `tail..head` (`head` loaded `Acquire`), and retires the
//!   oldest with a `compare_exchange` of the word it read to [`TAKEN`]: it fails when the
//!   producer extended the range meanwhile (its marker was recorded again after the query),
//!   and the range is looked at again on the next tick. After that exchange the consumer
//!   touches the slot no more; the producer may fill it at once.
//!
//! `tests/handoff_model.rs` checks this protocol with `shuttle` (owner pushing and
//! extending, with captures, while the watchdog retires), and that it fails without each of
//! its steps.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use super::recorder::OpRecord;
use super::tracker::{Marker, MAX_PENDING};

/// Slots per queue: at most this many ranges are in flight on one queue.
pub(crate) const SLOTS: usize = MAX_PENDING;

/// A free slot's word.
pub(crate) const TAKEN: u64 = u64::MAX;

/// The word's bit for a range covered by its slot's marker (else it has none: captured or
/// unwatched work, complete once what is before it is).
pub(crate) const MARKED: u64 = 1;

/// What the producer wrote into a slot with its range, for the watchdog's reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Info {
    /// The oldest operation of the range on this queue, if its record was still known.
    pub(crate) oldest: Option<OpRecord>,
    /// When the range began (its oldest operation's enqueue time, else when it was marked).
    pub(crate) since: Instant,
}

/// One range's slot.
#[derive(Debug)]
struct Slot {
    word: AtomicU64,
    /// The slot's event, made at its first use and recorded again at each (the events of a
    /// queue are reused in place: no allocation, no new event in a steady run).
    event: OnceLock<Marker>,
    /// Written by the producer while the slot is free; read by the consumer while the
    /// slot's position is in `tail..head`.
    info: UnsafeCell<Info>,
}

/// A queue's ranges: see the module docs.
#[derive(Debug)]
pub(crate) struct Ranges {
    slots: Box<[Slot]>,
    /// Positions below it were published by the producer.
    head: AtomicU64,
    /// The producer's own: positions of the queue's work below it are in a range.
    marked: AtomicU64,
    /// The producer's own: the word it last wrote into the newest range's slot (position
    /// `head - 1`), or [`TAKEN`] once it learned that range was retired.
    newest: AtomicU64,
}

// SAFETY: `info` is the only field that is not `Sync`. It is written by the one producer
// only while its slot is free (its word read as `TAKEN` with `Acquire`, which synchronizes
// with the consumer's exchange that freed it, after the consumer's last read of it), and
// read by a consumer (under the queue's `Watch` lock) only for a published position not
// yet retired, whose slot the producer does not write until the consumer frees it.
unsafe impl Sync for Ranges {}

impl Ranges {
    pub(crate) fn new() -> Ranges {
        let now = Instant::now();
        Ranges {
            slots: (0..SLOTS)
                .map(|_| Slot {
                    word: AtomicU64::new(TAKEN),
                    event: OnceLock::new(),
                    info: UnsafeCell::new(Info {
                        oldest: None,
                        since: now,
                    }),
                })
                .collect(),
            head: AtomicU64::new(0),
            marked: AtomicU64::new(0),
            newest: AtomicU64::new(TAKEN),
        }
    }

    fn slot(&self, pos: u64) -> &Slot {
        &self.slots[(pos % SLOTS as u64) as usize]
    }

    // ---- the producer's side --------------------------------------------------------

    /// Positions of the queue's work below this are in a range (the producer's).
    pub(crate) fn marked(&self) -> u64 {
        self.marked.load(Ordering::Relaxed)
    }

    /// The event of the slot the next range goes into, when that slot is free; `None` when
    /// every slot is in use.
    pub(crate) fn free_event(&self) -> Option<&OnceLock<Marker>> {
        let slot = self.slot(self.head.load(Ordering::Relaxed));
        (slot.word.load(Ordering::Acquire) == TAKEN).then_some(&slot.event)
    }

    /// The newest range's event and whether the range is marked, unless the producer knows
    /// it retired.
    pub(crate) fn newest(&self) -> Option<(&OnceLock<Marker>, bool)> {
        let w = self.newest.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Relaxed);
        (w != TAKEN).then(|| (&self.slot(head - 1).event, w & MARKED != 0))
    }

    /// Publishes a range of the queue's work below `upto`, in the slot
    /// [`free_event`](Self::free_event) gave (its event recorded when `marked`).
    pub(crate) fn push(&self, upto: u64, marked: bool, info: Info) {
        let head = self.head.load(Ordering::Relaxed);
        let slot = self.slot(head);
        debug_assert_eq!(slot.word.load(Ordering::Relaxed), TAKEN);
        // SAFETY: the slot is free (the caller read it so with `Acquire` in `free_event`):
        // no consumer reads it until `head` below publishes it.
        unsafe { *slot.info.get() = info };
        let word = upto << 1 | if marked { MARKED } else { 0 };
        slot.word.store(word, Ordering::Relaxed);
        self.head.store(head + 1, Ordering::Release);
        self.newest.store(word, Ordering::Relaxed);
        self.marked.store(upto, Ordering::Relaxed);
    }

    /// Extends the newest range to `upto` (marked when `marked`: its event was just
    /// recorded again, or for the first time; else it keeps its marker, if any). `false`
    /// when the consumer had retired that range: then the ring is empty, and the caller
    /// pushes a range instead.
    pub(crate) fn extend(&self, upto: u64, marked: bool) -> bool {
        let old = self.newest.load(Ordering::Relaxed);
        debug_assert_ne!(old, TAKEN);
        let head = self.head.load(Ordering::Relaxed);
        let slot = self.slot(head - 1);
        let word = upto << 1 | if marked { MARKED } else { old & MARKED };
        // `Release`: the record again (or the event set) before the word; `Acquire`: a
        // retirement seen here frees every slot (they are retired in order).
        if slot.word.swap(word, Ordering::AcqRel) == TAKEN {
            slot.word.store(TAKEN, Ordering::Relaxed);
            self.newest.store(TAKEN, Ordering::Relaxed);
            return false;
        }
        self.newest.store(word, Ordering::Relaxed);
        self.marked.store(upto, Ordering::Relaxed);
        true
    }

    // ---- the consumer's side (under the queue's `Watch` lock) -----------------------

    /// Positions below it are published.
    pub(crate) fn head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// The word of published position `pos` (not retired).
    pub(crate) fn word(&self, pos: u64) -> u64 {
        self.slot(pos).word.load(Ordering::Acquire)
    }

    /// The marker of published position `pos`, once its word read [`MARKED`].
    pub(crate) fn marker(&self, pos: u64) -> Option<&Marker> {
        self.slot(pos).event.get()
    }

    /// The info of published position `pos` (not retired).
    pub(crate) fn info(&self, pos: u64) -> Info {
        // SAFETY: `pos` is published (below `head`, read `Acquire` by the caller) and not
        // retired (the caller holds the `Watch` lock, under which alone ranges retire): the
        // producer does not write its slot until it is freed.
        unsafe { *self.slot(pos).info.get() }
    }

    /// Retires position `pos` whose word read `word`: `false` when the producer changed
    /// the word meanwhile (it stays).
    pub(crate) fn retire(&self, pos: u64, word: u64) -> bool {
        (self.slot(pos).word)
            .compare_exchange(word, TAKEN, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The events of the slots, taken out (when the queue's watch is dropped).
    pub(crate) fn take_events(&mut self) -> impl Iterator<Item = Marker> + '_ {
        self.slots.iter_mut().filter_map(|s| s.event.take())
    }
}
