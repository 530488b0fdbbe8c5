//! A model of the marker hand-off, checked with `shuttle`: how the owner gives its marked
//! ranges to the watchdog without a lock (`src/diag/supervise/ranges.rs`, `Shared::produce` and
//! `Shared::retire_done` in `src/diag/supervise/shared.rs`), while the watchdog retires them.
//!
//! # What is modelled
//!
//! * **The ring** of one queue: `slots` slots, each a word ([`TAKEN`] when free, else
//!   `upto << 1 | MARKED`), the position it holds (the crate's `Info`, written while the
//!   slot is free, here a tag the watchdog checks) and its event; `head`, published by the
//!   owner.
//! * **The owner** (`produce` at enqueue): a few operations, some inside a CUDA graph
//!   capture (the owner's thread begins and ends it around the operation). Each is
//!   enqueued, then marked: into the free slot of `head` (a new marker, recorded without
//!   asking whether the stream captures, except on an implicit stream, where a capture's
//!   operation joins the newest range) and published; with every slot in use, the newest
//!   range's marker is recorded again (asked first: not into a capture, where the operation
//!   joins the newest range as it is) and the range extended with a `swap`, which, finding
//!   the slot retired, frees it again and pushes instead.
//! * **The watchdog** (`retire_done`): rounds of: read `head`, ask whether the stream
//!   captures (when a range has a marker), then, oldest first, read a range's word, query
//!   its marker, and retire it with a `compare_exchange` from that word to [`TAKEN`].
//! * **The stream and CUDA** as a checker: the GPU completes the enqueued operations in
//!   order (concurrently, or not before the end); an event recorded outside a capture is
//!   complete once the work before it is; one recorded in a capture reads as complete once
//!   that capture ended, and querying it while the capture is open is a violation (CUDA
//!   calls it invalid).
//!
//! # What is abstracted
//!
//! Memory order: shuttle runs the threads sequentially consistently; every access of the
//! protocol is an acquire/release pair on one location (see `ranges`' module docs), and
//! the slot's info is guarded by the word's and the head's pairs. The lazy mode's producer
//! (the watchdog itself, under the queue's lock) is not modelled: nothing races it. Time,
//! reports and the journal are not modelled.
//!
//! # What is asserted
//!
//! At every retirement: no work that runs on the stream is retired before it completed;
//! no slot of a published, unretired range reads as free or holds another position; no
//! event of an open capture is queried. At the end (captures over, the GPU done): every
//! operation is retired (exact completion, nothing lost) and the ring is empty. At most
//! `slots` ranges are in flight by construction (the slots are the only place a range
//! lives, and the position check catches an overwrite).
//!
//! # The model can fail
//!
//! Each mutant test takes one step out of the protocol, or swaps two, and asserts that
//! shuttle finds a violation.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use shuttle::scheduler::{PctScheduler, RandomScheduler};
use shuttle::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use shuttle::thread;
use shuttle::{Config, FailurePersistence, Runner};

/// Schedules per scenario and scheduler.
const ITERATIONS: usize = 2000;

const SC: Ordering = Ordering::SeqCst;
const TAKEN: u64 = u64::MAX;
const MARKED: u64 = 1;

/// One version of the protocol: the crate's, or a mutant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Protocol {
    /// Mutant: the watchdog retires a range with a store, not a `compare_exchange`.
    retire_with_store: bool,
    /// Mutant: the owner extends the newest range with a store, not a `swap`.
    extend_with_store: bool,
    /// Mutant: the owner publishes `head` before it fills the slot.
    head_before_slot: bool,
    /// Mutant: the watchdog asks whether the stream captures before it reads `head`.
    capture_question_before_head: bool,
    /// Mutant: the owner records the newest marker again without asking about a capture.
    again_into_capture: bool,
    /// Mutant: the owner publishes the extended word before it records the marker again.
    extend_before_record: bool,
    /// Mutant: the watchdog queries a range's marker before it reads its word.
    query_before_word: bool,
    /// Mutant: the owner pushes into the next slot without checking that it is free.
    push_without_free_check: bool,
}

const CRATE: Protocol = Protocol {
    retire_with_store: false,
    extend_with_store: false,
    head_before_slot: false,
    capture_question_before_head: false,
    again_into_capture: false,
    extend_before_record: false,
    query_before_word: false,
    push_without_free_check: false,
};

/// One scenario.
#[derive(Debug, Clone, Copy)]
struct Scenario {
    slots: usize,
    ops: usize,
    /// Bit `i`: operation `i` is captured into a graph.
    captures: u32,
    /// The GPU runs beside the owner (else not before the end: stuck work).
    gpu_runs: bool,
    /// The legacy or per-thread stream: the owner asks about a capture at enqueue too.
    implicit: bool,
}

fn scenarios() -> Vec<Scenario> {
    let mut v = Vec::new();
    // One slot: every range after the first extends the newest, which the watchdog may be
    // querying; two and three: the owner's view of a full ring goes stale as the watchdog
    // frees slots.
    for slots in [1, 2, 3] {
        for captures in [0, 0b0101_0100, 0b0110_1100, 0b1111_0000, 0b1010_0011] {
            for gpu_runs in [false, true] {
                for implicit in [false, true] {
                    v.push(Scenario {
                        slots,
                        ops: 8,
                        captures,
                        gpu_runs,
                        implicit,
                    });
                }
            }
        }
    }
    v
}

/// An event: `epoch << 32 | covers`. Outside a capture (`epoch` 0) it completes once the
/// operations below `covers` did; recorded in capture `epoch`, once that capture ended.
struct Slot {
    word: AtomicU64,
    /// The position whose range the slot holds (the crate's `Info`).
    pos: AtomicU64,
    event: AtomicU64,
}

struct World {
    sc: Scenario,
    p: Protocol,
    slots: Vec<Slot>,
    head: AtomicU64,
    /// Operations enqueued (positions below it).
    enqueued: AtomicU64,
    /// Operations below it complete (captured ones never run: the GPU steps over them).
    gpu: AtomicU64,
    /// The open capture's number, 0 when none.
    capture: AtomicU64,
    retired: AtomicU64,
    published: AtomicU64,
    /// The watchdog's `tail` (it holds the queue's lock: one consumer at a time).
    tail: AtomicU64,
}

/// The owner's own state (`Ranges::marked`, `Ranges::newest`, its view of `head`).
struct Own {
    head: u64,
    newest: u64,
    marked: u64,
}

impl World {
    fn slot(&self, pos: u64) -> &Slot {
        &self.slots[(pos % self.sc.slots as u64) as usize]
    }

    fn captured(&self, op: u64) -> bool {
        self.sc.captures >> op & 1 != 0
    }

    /// `cuEventRecord` after the work enqueued so far.
    fn record(&self, ev: &AtomicU64, upto: u64) {
        let epoch = self.capture.load(SC);
        ev.store(epoch << 32 | if epoch == 0 { upto } else { 0 }, SC);
    }

    /// `cuEventQuery`, as `RawEvent::query` reads it.
    fn query(&self, ev: &AtomicU64) -> bool {
        let v = ev.load(SC);
        let epoch = v >> 32;
        if epoch != 0 {
            assert_ne!(
                self.capture.load(SC),
                epoch,
                "queried an event of an open capture"
            );
            return true;
        }
        self.gpu.load(SC) >= v & 0xffff_ffff
    }

    /// The owner's `produce` for its work below `upto`.
    fn mark(&self, own: &mut Own, upto: u64) {
        let p = self.p;
        loop {
            let s = self.slot(own.head);
            let free = p.push_without_free_check || s.word.load(SC) == TAKEN;
            if free {
                // `How::Enqueue`: on an implicit stream the capture is asked about.
                let capturing = self.sc.implicit && self.capture.load(SC) != 0;
                if capturing && own.newest != TAKEN {
                    if self.extend(own, upto, false) {
                        return;
                    }
                    continue;
                }
                if !capturing {
                    self.record(&s.event, upto);
                }
                let word = upto << 1 | if capturing { 0 } else { MARKED };
                if p.head_before_slot {
                    self.head.store(own.head + 1, SC);
                    s.pos.store(own.head, SC);
                    s.word.store(word, SC);
                } else {
                    s.pos.store(own.head, SC);
                    s.word.store(word, SC);
                    self.head.store(own.head + 1, SC);
                }
                own.head += 1;
                own.newest = word;
                own.marked = upto;
                return;
            }
            // Every slot in use: the newest range's marker again (`How::Again` asks).
            assert_ne!(own.newest, TAKEN, "a full ring without a newest range");
            let capturing = !p.again_into_capture && self.capture.load(SC) != 0;
            if self.extend(own, upto, !capturing) {
                return;
            }
        }
    }

    /// `Ranges::extend`, with the marker recorded again first when `record`.
    fn extend(&self, own: &mut Own, upto: u64, record: bool) -> bool {
        let p = self.p;
        let s = self.slot(own.head - 1);
        let word = upto << 1 | if record { MARKED } else { own.newest & MARKED };
        if record && !p.extend_before_record {
            self.record(&s.event, upto);
        }
        let old = if p.extend_with_store {
            s.word.store(word, SC);
            0
        } else {
            s.word.swap(word, SC)
        };
        if record && p.extend_before_record {
            self.record(&s.event, upto);
        }
        if old == TAKEN {
            s.word.store(TAKEN, SC);
            own.newest = TAKEN;
            return false;
        }
        own.newest = word;
        own.marked = upto;
        true
    }

    /// The owner: its operations, some captured, each enqueued, marked and published.
    fn owner(&self) {
        let mut own = Own {
            head: 0,
            newest: TAKEN,
            marked: 0,
        };
        for op in 0..self.sc.ops as u64 {
            let captured = self.captured(op);
            if captured {
                self.capture.store(op + 1, SC);
            }
            self.enqueued.store(op + 1, SC);
            if op + 1 > own.marked {
                self.mark(&mut own, op + 1);
            }
            self.published.store(op + 1, SC);
            if captured {
                self.capture.store(0, SC);
            }
        }
    }

    /// One round of the watchdog's `retire_done`.
    fn retire_round(&self) {
        let p = self.p;
        let mut tail = self.tail.load(SC);
        let asked_first = p.capture_question_before_head && self.capture.load(SC) != 0;
        let head = self.head.load(SC);
        let marked = (tail..head).any(|pos| {
            let w = self.slot(pos).word.load(SC);
            w != TAKEN && w & MARKED != 0
        });
        if marked {
            let capturing = if p.capture_question_before_head {
                asked_first
            } else {
                self.capture.load(SC) != 0
            };
            if capturing {
                return;
            }
        }
        while tail < head {
            let s = self.slot(tail);
            let early = p.query_before_word.then(|| self.query(&s.event));
            let word = s.word.load(SC);
            assert_ne!(word, TAKEN, "a published range's slot read as free");
            assert_eq!(
                s.pos.load(SC),
                tail,
                "a range's slot was overwritten before it retired"
            );
            let done = word & MARKED == 0 || early.unwrap_or_else(|| self.query(&s.event));
            if !done {
                break;
            }
            if p.retire_with_store {
                s.word.store(TAKEN, SC);
            } else if s.word.compare_exchange(word, TAKEN, SC, SC).is_err() {
                break;
            }
            tail += 1;
            self.tail.store(tail, SC);
            let upto = word >> 1;
            let gpu = self.gpu.load(SC);
            for op in gpu..upto {
                assert!(
                    self.captured(op),
                    "retired operation {op} before it ran (retired below {upto}, the GPU at {gpu})"
                );
            }
            self.retired.store(upto, SC);
        }
    }

    /// The GPU: completes the enqueued operations in order.
    fn gpu(&self) {
        for _ in 0..4 * self.sc.ops {
            let g = self.gpu.load(SC);
            if g < self.enqueued.load(SC) {
                self.gpu.store(g + 1, SC);
            }
            thread::yield_now();
        }
    }
}

fn run(sc: Scenario, p: Protocol) {
    let w = Arc::new(World {
        sc,
        p,
        slots: (0..sc.slots)
            .map(|_| Slot {
                word: AtomicU64::new(TAKEN),
                pos: AtomicU64::new(u64::MAX),
                event: AtomicU64::new(0),
            })
            .collect(),
        head: AtomicU64::new(0),
        enqueued: AtomicU64::new(0),
        gpu: AtomicU64::new(0),
        capture: AtomicU64::new(0),
        retired: AtomicU64::new(0),
        published: AtomicU64::new(0),
        tail: AtomicU64::new(0),
    });
    let owner = {
        let w = Arc::clone(&w);
        thread::spawn(move || w.owner())
    };
    let watchdog = {
        let w = Arc::clone(&w);
        thread::spawn(move || {
            for _ in 0..sc.ops + 2 {
                w.retire_round();
                thread::yield_now();
            }
        })
    };
    let gpu = sc.gpu_runs.then(|| {
        let w = Arc::clone(&w);
        thread::spawn(move || w.gpu())
    });
    owner.join().unwrap();
    watchdog.join().unwrap();
    if let Some(g) = gpu {
        g.join().unwrap();
    }
    // The end: no capture open, the GPU done; the watchdog (or a teardown's wait) retires
    // everything.
    let done = AtomicBool::new(false);
    w.gpu.store(sc.ops as u64, SC);
    for _ in 0..sc.slots + 2 {
        w.retire_round();
        if w.tail.load(SC) == w.head.load(SC) {
            done.store(true, SC);
            break;
        }
    }
    assert!(done.load(SC), "the ring did not empty");
    assert_eq!(
        w.retired.load(SC),
        w.published.load(SC),
        "not every operation retired (a range was lost)"
    );
}

#[derive(Debug, Clone, Copy)]
enum Sched {
    Random,
    Pct,
}

/// Explores `sc` under `p`: the first violation's message, if any.
fn explore(sc: Scenario, p: Protocol, sched: Sched, seed: u64) -> Option<String> {
    let mut config = Config::default();
    config.failure_persistence = FailurePersistence::None;
    let f = move || run(sc, p);
    let r = catch_unwind(AssertUnwindSafe(|| match sched {
        Sched::Random => {
            Runner::new(RandomScheduler::new_from_seed(seed, ITERATIONS), config).run(f);
        }
        Sched::Pct => {
            Runner::new(PctScheduler::new_from_seed(seed, 3, ITERATIONS), config).run(f);
        }
    }));
    r.err().map(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// The first violation over every scenario under `p` (both schedulers).
fn first_violation(p: Protocol) -> Option<(Scenario, Sched, String)> {
    for (i, sc) in scenarios().into_iter().enumerate() {
        for sched in [Sched::Random, Sched::Pct] {
            if let Some(m) = explore(sc, p, sched, 0x0000_4a4d + i as u64) {
                return Some((sc, sched, m));
            }
        }
    }
    None
}

/// Asserts that `p` (a mutant) is caught, with a message containing `what`.
#[track_caller]
fn assert_caught(p: Protocol, what: &str) {
    match first_violation(p) {
        Some((sc, sched, m)) => {
            assert!(
                m.contains(what),
                "caught, but as {m:?} (in {sc:?}, {sched:?})"
            );
            eprintln!("caught in {sc:?} by the {sched:?} scheduler: {m}");
        }
        None => panic!("the model found no violation of {p:?}"),
    }
}

#[test]
fn the_hand_off_holds_in_every_scenario() {
    if let Some((sc, sched, m)) = first_violation(CRATE) {
        panic!("{m} (in {sc:?}, {sched:?})");
    }
}

#[test]
fn mutant_retire_with_a_store_loses_an_extension() {
    assert_caught(
        Protocol {
            retire_with_store: true,
            ..CRATE
        },
        "",
    );
}

#[test]
fn mutant_extend_with_a_store_loses_a_range() {
    assert_caught(
        Protocol {
            extend_with_store: true,
            ..CRATE
        },
        "",
    );
}

#[test]
fn mutant_head_before_the_slot_is_caught() {
    assert_caught(
        Protocol {
            head_before_slot: true,
            ..CRATE
        },
        "read as free",
    );
}

#[test]
fn mutant_capture_question_before_head_queries_an_open_capture() {
    assert_caught(
        Protocol {
            capture_question_before_head: true,
            ..CRATE
        },
        "open capture",
    );
}

#[test]
fn mutant_marker_recorded_again_into_a_capture_is_caught() {
    assert_caught(
        Protocol {
            again_into_capture: true,
            ..CRATE
        },
        "",
    );
}

#[test]
fn mutant_extension_published_before_its_record_retires_unrun_work() {
    assert_caught(
        Protocol {
            extend_before_record: true,
            ..CRATE
        },
        "before it ran",
    );
}

#[test]
fn mutant_query_before_the_word_retires_unrun_work() {
    assert_caught(
        Protocol {
            query_before_word: true,
            ..CRATE
        },
        "before it ran",
    );
}

#[test]
fn mutant_push_without_the_free_check_overwrites_a_range() {
    assert_caught(
        Protocol {
            push_without_free_check: true,
            ..CRATE
        },
        "",
    );
}
