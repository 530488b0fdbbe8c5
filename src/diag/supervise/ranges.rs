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
use std::time::Instant;

use super::record::OpRecord;
use super::tracker::{Event, Marker, MAX_PENDING};

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
    /// The range's marker. The producer has it while the slot is free (it fills it, or
    /// moves the newest retired range's event here), and records it again, shared, while
    /// its range is the newest. The consumer queries it, shared, once it read the word as
    /// [`MARKED`], and leaves it in the slot: a retired range's event is the producer's
    /// for the next range in that slot, so no event passes between the threads (each
    /// had cost the producer an event made or cache lines the consumer had just written,
    /// and a tracker's spare ring of 64 overflowed with two streams refilling, making and
    /// destroying an event per range).
    event: UnsafeCell<Option<Marker>>,
    /// Written by the producer while the slot is free; read by the consumer while the
    /// slot's position is in `tail..head`.
    info: UnsafeCell<Info>,
}

/// A queue's ranges: see the module docs.
#[derive(Debug)]
pub(crate) struct Ranges {
    /// A fixed array: a position's slot is found without a bounds check.
    slots: Box<[Slot; SLOTS]>,
    /// Positions below it were published by the producer.
    head: AtomicU64,
    /// The producer's own: positions of the queue's work below it are in a range.
    marked: AtomicU64,
    /// The producer's own: the word it last wrote into the newest range's slot (position
    /// `head - 1`), or [`TAKEN`] once it learned that range was retired.
    newest: AtomicU64,
}

// SAFETY: a slot's `info` and `event` are what is not `Sync`; who may touch them when is
// the protocol of the module docs, whose two parties are the one producer (the owner, a
// `CommDiag` being `!Sync`; or the holder of the queue's `Watch` lock, when the owner
// does not mark) and the one consumer (the holder of that lock):
// * the producer writes `info`, and uses `event` as its own, only while the slot is free:
//   its word read as `TAKEN` with `Acquire`, which synchronizes with the consumer's
//   exchange that freed it, after the consumer's last use of them; it publishes the slot
//   by `head` (`Release`);
// * while its range is the newest, the producer uses `event` shared when the range is
//   marked (the consumer may query it), and as its own when it is not (the consumer
//   touches the event of a range it read as marked only, and the producer marks it with a
//   `Release` swap after);
// * the consumer reads `info` and uses `event` shared for a published position not yet
//   retired (under the lock, which alone retires), and takes `event` only from a range
//   that is not the newest (it read `head` past it with `Acquire`: the producer is done
//   with it until it is freed).
unsafe impl Sync for Ranges {}

impl Ranges {
    pub(crate) fn new() -> Ranges {
        let now = Instant::now();
        Ranges {
            slots: Box::new(std::array::from_fn(|_| Slot {
                word: AtomicU64::new(TAKEN),
                event: UnsafeCell::new(None),
                info: UnsafeCell::new(Info {
                    oldest: None,
                    since: now,
                }),
            })),
            head: AtomicU64::new(0),
            marked: AtomicU64::new(0),
            newest: AtomicU64::new(TAKEN),
        }
    }

    #[inline(always)]
    fn slot(&self, pos: u64) -> &Slot {
        &self.slots[(pos % SLOTS as u64) as usize]
    }

    // ---- the producer's side --------------------------------------------------------

    /// Positions of the queue's work below this are in a range (the producer's).
    pub(crate) fn marked(&self) -> u64 {
        self.marked.load(Ordering::Relaxed)
    }

    /// Whether the slot the next range goes into is free (else every slot is in use).
    pub(crate) fn has_free(&self) -> bool {
        let slot = self.slot(self.head.load(Ordering::Relaxed));
        slot.word.load(Ordering::Acquire) == TAKEN
    }

    /// Runs `f` with the event of the slot the next range goes into (free: see
    /// [`has_free`](Self::has_free)). A slot without one takes the event the newest range
    /// kept, if that range retired: a steady run reuses one event.
    pub(crate) fn with_free_event<R>(&self, f: impl FnOnce(Event<'_>) -> R) -> R {
        let head = self.head.load(Ordering::Relaxed);
        let slot = self.slot(head);
        debug_assert_eq!(slot.word.load(Ordering::Relaxed), TAKEN);
        // SAFETY: the slot is free (the caller saw it so in `has_free`, `Acquire`): the
        // producer's own (the `Sync` impl's first point), and this is the producer.
        let ev = unsafe { &mut *slot.event.get() };
        if ev.is_none() && head > 0 && SLOTS > 1 {
            let prev = self.slot(head - 1);
            if prev.word.load(Ordering::Acquire) == TAKEN {
                // SAFETY: as above: that slot is free too.
                *ev = unsafe { &mut *prev.event.get() }.take();
            }
        }
        f(Event::Own(ev))
    }

    /// Gives `give` the events of the free slots (the producer's), for a queue it no longer
    /// uses often: the events its retired ranges kept.
    pub(crate) fn take_free_events(&self, mut give: impl FnMut(Marker)) {
        let head = self.head.load(Ordering::Relaxed);
        let newest = head.checked_sub(1).map(|p| (p % SLOTS as u64) as usize);
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.word.load(Ordering::Acquire) != TAKEN {
                continue;
            }
            if Some(i) == newest {
                self.newest.store(TAKEN, Ordering::Relaxed);
            }
            // SAFETY: the slot is free: the producer's own (the `Sync` impl's first point).
            if let Some(m) = unsafe { &mut *slot.event.get() }.take() {
                give(m);
            }
        }
    }

    /// Whether there is a newest range the producer does not know retired.
    pub(crate) fn has_newest(&self) -> bool {
        self.newest.load(Ordering::Relaxed) != TAKEN
    }

    /// Runs `f` with the newest range's event, unless the producer knows that range
    /// retired (`None`).
    pub(crate) fn with_newest_event<R>(&self, f: impl FnOnce(Event<'_>) -> R) -> Option<R> {
        let w = self.newest.load(Ordering::Relaxed);
        if w == TAKEN {
            return None;
        }
        let slot = self.slot(self.head.load(Ordering::Relaxed) - 1);
        let ev = if w & MARKED != 0 {
            // SAFETY: the newest range, marked: shared with the consumer, which only
            // queries it (the `Sync` impl's second point). A marked range has its marker.
            match unsafe { &*slot.event.get() } {
                Some(m) => Event::Shared(m),
                None => return None,
            }
        } else {
            // SAFETY: the newest range, not marked: the producer's own until it marks it.
            Event::Own(unsafe { &mut *slot.event.get() })
        };
        Some(f(ev))
    }

    /// Publishes a range of the queue's work below `upto`, in the slot
    /// [`with_free_event`](Self::with_free_event) gave (its event recorded when `marked`).
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
        // SAFETY: published, not retired, read as marked: the consumer's to query, shared
        // with the producer's record again (the `Sync` impl's third point).
        unsafe { (*self.slot(pos).event.get()).as_ref() }
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
        self.slots
            .iter_mut()
            .filter_map(|s| s.event.get_mut().take())
    }
}
