//! A model of the handle-claim protocol, checked with `shuttle`: who may call NCCL on a
//! communicator's handle, and who tears it down, when its owner and the watchdog race.
//!
//! # What is modelled
//!
//! One handle and the parties that touch it, each step as in the crate:
//!
//! * **The handle's holder and flags** (`src/diag/supervise/shared.rs`, the claim's states
//!   and steps in `src/diag/supervise/claim.rs`): `handle` (the handle while it may be torn
//!   down, 0 once taken), `current` (`IDLE`, `PINNED` or the operation inside its call),
//!   `claim` (`UNCLAIMED`, `DECIDING`, `ABORTING`), `aborted_by_watchdog`, the
//!   clique's timed-out flag, whether published work is still in flight, and the
//!   watchdog's abort task.
//! * **The owner** (`src/comm/`, `src/diag/hooks/on/`): a few calls, each either an
//!   operation (`begin`: the aborted and timed-out checks, `current` stored, the fence,
//!   the claim checked and `await_decision`; the NCCL call; for an operation that left
//!   NCCL asynchronous work, `wait_ready`'s polls, each after `check_alive` and under a
//!   pin that stands in for the operation and gives it back; `end`: `current` back to
//!   `IDLE`, the work published) or a pinned call (`pin`/`unpin`, as `async_error` and
//!   registrations do); then one of: `Drop` (healthy: `drain` then destroy; failed or
//!   unwinding: abort), `abort()` (`take`, or wait for the watchdog's abort task),
//!   `destroy` (`before_teardown`, `ensure_usable`, the destroy call under a pin, then
//!   `take`; on an error the communicator comes back and is dropped) and `into_raw`
//!   (`release_handle`; the caller then tears the handle down itself).
//! * **A borrowed view** (`src/comm_ref.rs`): its diagnostics hold no handle (the holder
//!   starts at 0); it runs calls like an owner and is dropped with `release_handle`; its
//!   owner (outside the crate) destroys the handle after the view is gone.
//! * **The watchdog** (`src/diag/supervise/watchdog.rs`): up to two sweeps, each marking the clique
//!   timed out, then `claim` (`claim_seen`: never a pinned communicator; an idle one only
//!   with work in flight; `DECIDING`, the fence, `current` read again, the verdict) and
//!   `take_for_abort`; a taken handle is aborted on a thread of its own (the teardown
//!   lane), whose task the owner's `abort()` waits for.
//! * **NCCL** as a checker: a call asserts that the handle's teardown has not begun; a
//!   teardown asserts that it is the first; `ncclCommDestroy` asserts that no call is in
//!   progress (`ncclCommAbort` may interrupt one: that is how a blocked call is woken).
//!
//! Why shuttle rather than loom: the protocol's one cross-location ordering is the fence
//! pair, which loom cannot express either (it has no membarrier; it would be two `SeqCst`
//! fences, i.e. the sequential consistency shuttle gives), while the parties spin
//! (`await_decision`, waiting for the abort task), which blows up loom's exhaustive search
//! and which shuttle's randomized and PCT schedulers take in their stride, for four
//! threads and 108 scenarios in seconds.
//!
//! # What is abstracted
//!
//! * **Memory order.** shuttle runs the threads sequentially consistently. That is what
//!   the asymmetric fence (`src/diag/supervise/fence.rs`) provides at the two places it is used:
//!   the owner's compiler fence paired with the watchdog's `membarrier` orders like two
//!   `SeqCst` fences (and where membarrier is refused, both sides use one). Every other
//!   access of the protocol is an acquire/release pair on one location.
//! * **Time.** Ages and bounds are gone. The watchdog may act at any step, whatever the
//!   clock says (its decision to time a clique out is taken as given). Two timing facts
//!   remain, as assumptions: an operation counts as old enough to be claimed inside its
//!   call only once its thread has entered the NCCL call (what `min_age` is for: see
//!   [`the_age_of_an_operation_is_a_timing_assumption`]), and the owner's bounded waits
//!   (`await_decision`'s 5 s, `abort()`'s bound) wait until the event comes.
//! * **Work.** Published work either completes when the owner drains it, never completes
//!   (stuck: the drain gives up), or cannot be watched (its stream is capturing, or no
//!   marker could be recorded: the drain counts it as done although it stays in flight).
//! * Journal, reports, queues, groups (an open group is a pin) and the lane's queue are not
//!   modelled; the owner's own teardown runs inline (the lane only bounds the wait).
//!
//! # What is explored and asserted
//!
//! Every scenario of [`scenarios`]: 6 call sequences x 3 kinds of work x 5 endings for an
//! owned handle, and 6 x 3 for a borrowed one (108), each under shuttle's random scheduler
//! and its PCT scheduler (depth 3), [`ITERATIONS`] schedules each with fixed seeds: 216 000
//! interleavings of the owner's, the watchdog's and the abort thread's steps (about 8 s).
//! The watchdog's first sweep comes after a random number of steps (drawn by shuttle, so a
//! failing schedule replays), so its claim meets the owner at every point of its run. In
//! each interleaving, at every step and at the end:
//!
//! * no NCCL call starts on a handle after its teardown began;
//! * an owned handle is torn down exactly once (by its owner or by the watchdog; after
//!   `into_raw` returned it, by the caller only); a borrowed one zero times by us;
//! * `abort()` returns `Ok` only once the handle's teardown returned.
//!
//! # The model can fail
//!
//! Each mutant test takes one step out of the protocol and asserts that shuttle finds a
//! violation: the owner not checking the claim after its fence, the watchdog not reading
//! `current` again after its fence, a teardown taking the handle with a load and a store
//! instead of a swap, a pin not checking the claim. [`KNOWN_GAPS`] lists what the model
//! finds in the protocol as implemented today ([`TODAY`]); each gap has a test that
//! asserts it is found while it is listed (and not found once it is removed), and the
//! other tests check the rest of the protocol with the gap's fix applied, which the model
//! thereby checks too. The model is a copy of the protocol: a change in `src/diag` or
//! `src/comm/` is mirrored here by hand.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use shuttle::rand::{thread_rng, Rng};
use shuttle::scheduler::{PctScheduler, RandomScheduler};
use shuttle::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use shuttle::sync::Mutex;
use shuttle::thread;
use shuttle::{Config, FailurePersistence, Runner};

/// Schedules per scenario and scheduler.
const ITERATIONS: usize = 1000;

/// The most steps the watchdog waits before its first sweep (an owner's run is shorter).
const MAX_DELAY: u32 = 48;

const SC: Ordering = Ordering::SeqCst;

/// `current`: no operation inside its call.
const IDLE: u64 = 0;
/// `current`: a pinned call (or an open group).
const PINNED: u64 = u64::MAX;
const UNCLAIMED: u8 = 0;
const DECIDING: u8 = 1;
const ABORTING: u8 = 2;
/// The handle's value.
const H: usize = 0x5eed;

/// Gaps the model finds in the protocol as implemented today, by name. Each has a test
/// that asserts it is found while it is listed here, and that it is not once the name is
/// removed (after `src/` is fixed and [`TODAY`] is set to match).
///
/// * `destroy-takes-after-unpin`: `Communicator::destroy` calls `ncclCommDestroy` under a
///   pin but takes the handle out of its holder only after unpinning. When the
///   watchdog claims the communicator in between (idle, with work it still counts in
///   flight: a stream that was capturing, or a marker that could not be recorded, which
///   the drain counts as done), it takes the destroyed handle and aborts it. Fix: take
///   the handle before the pin ends.
/// * `abort-returns-before-the-watchdogs-abort`: `take_for_abort` swaps the handle out
///   before it sets `aborted_by_watchdog`; an `abort()` that finds the holder empty in
///   between reads "not aborted by the watchdog" and returns `Ok(())` at once, while the
///   watchdog's abort has not even started. Fix: set `aborted_by_watchdog` (after the
///   report) before the swap.
///
/// Both are fixed in `src/` (and [`TODAY`] says so); the list is empty.
const KNOWN_GAPS: &[&str] = &[];

/// One version of the protocol: today's, a mutant, or one with a gap fixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Protocol {
    /// Gap: `destroy` unpins before it takes the handle (today's code).
    destroy_takes_after_unpin: bool,
    /// Gap: the watchdog marks `aborted_by_watchdog` after its swap (today's code).
    watchdog_marks_after_take: bool,
    /// Mutant: the owner does not check the claim after storing `current`.
    owner_skips_claim_check: bool,
    /// Mutant: the watchdog keeps its claim without reading `current` again.
    watchdog_skips_reread: bool,
    /// Mutant: teardowns take the handle with a load and a store, not a swap.
    take_without_swap: bool,
    /// Mutant: a pin does not check the claim.
    pin_skips_claim_check: bool,
    /// Mutant (the code before the fix of the flake it explains): a pin inside an
    /// operation pins nothing, so `wait_ready`'s polls run under the operation alone.
    pin_inside_an_operation_pins_nothing: bool,
    /// Relaxed timing assumption: an operation counts as old as soon as it is in
    /// `current`, before its thread entered the call.
    old_before_the_call: bool,
}

/// The protocol as `src/` implements it today.
const TODAY: Protocol = Protocol {
    destroy_takes_after_unpin: false,
    watchdog_marks_after_take: false,
    owner_skips_claim_check: false,
    watchdog_skips_reread: false,
    take_without_swap: false,
    pin_skips_claim_check: false,
    pin_inside_an_operation_pins_nothing: false,
    old_before_the_call: false,
};

impl Protocol {
    /// Today's protocol with the fixes of the gaps listed in [`KNOWN_GAPS`].
    fn with_known_gaps_fixed() -> Protocol {
        let mut p = TODAY;
        if KNOWN_GAPS.contains(&"destroy-takes-after-unpin") {
            p.destroy_takes_after_unpin = false;
        }
        if KNOWN_GAPS.contains(&"abort-returns-before-the-watchdogs-abort") {
            p.watchdog_marks_after_take = false;
        }
        p
    }
}

/// A call the owner makes before its ending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// An operation through `Communicator::issue` (a collective).
    Op,
    /// An operation whose call left NCCL's asynchronous work (ncclInProgress, or a split's
    /// async job): still inside it, `wait_ready` polls `ncclCommGetAsyncError` until the work
    /// ends, each poll after `check_alive` and under `pinned`.
    OpThenPolls,
    /// A call under a pin (`async_error`, a registration).
    Pinned,
}

/// What becomes of the work the operations published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// Completes when the owner drains it.
    Completes,
    /// Never completes: the drain gives up.
    Stuck,
    /// Cannot be watched (a capturing stream, no marker): the drain counts it as done, and
    /// it stays in flight for the watchdog.
    Unwatched,
}

/// How the owner ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Drop,
    /// Dropped while its thread unwinds (aborts).
    DropUnwinding,
    Abort,
    Destroy,
    IntoRaw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Scenario {
    calls: &'static [Call],
    work: Work,
    /// `None`: a borrowed view (`CommRef`).
    ending: Option<Ending>,
}

const CALLS: [&[Call]; 6] = [
    &[Call::Op],
    &[Call::Op, Call::Op],
    &[Call::Pinned, Call::Op],
    &[Call::Op, Call::Pinned],
    &[Call::OpThenPolls],
    &[Call::OpThenPolls, Call::Op],
];
const WORK: [Work; 3] = [Work::Completes, Work::Stuck, Work::Unwatched];
const ENDINGS: [Ending; 5] = [
    Ending::Drop,
    Ending::DropUnwinding,
    Ending::Abort,
    Ending::Destroy,
    Ending::IntoRaw,
];

/// Every scenario: owned handles with each ending, and borrowed views.
fn scenarios() -> Vec<Scenario> {
    let mut v = Vec::new();
    for calls in CALLS {
        for work in WORK {
            for ending in ENDINGS.map(Some).into_iter().chain([None]) {
                v.push(Scenario {
                    calls,
                    work,
                    ending,
                });
            }
        }
    }
    v
}

/// NCCL, as a checker of how the handle is used.
struct Nccl {
    /// A teardown began.
    torn: AtomicBool,
    /// A teardown returned.
    finished: AtomicBool,
    /// Teardowns by the crate (owner or watchdog).
    ours: AtomicU32,
    /// Teardowns by the handle's outside owner (after `into_raw`, or of a borrowed handle).
    theirs: AtomicU32,
    in_call: AtomicU32,
}

impl Nccl {
    fn new() -> Nccl {
        Nccl {
            torn: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            ours: AtomicU32::new(0),
            theirs: AtomicU32::new(0),
            in_call: AtomicU32::new(0),
        }
    }

    /// An NCCL call on the handle (a collective, a poll). `entered`: where to note, once
    /// inside, that operation `pos` entered its call.
    fn call(&self, raw: usize, what: &str, entered: Option<(&AtomicU64, u64)>) {
        assert_eq!(raw, H, "violation: {what} on a null handle");
        assert!(
            !self.torn.load(SC),
            "violation: used after teardown: {what} began after the handle's teardown began"
        );
        if let Some((e, pos)) = entered {
            e.store(pos, SC);
        }
        self.in_call.fetch_add(1, SC);
        thread::yield_now();
        self.in_call.fetch_sub(1, SC);
    }

    /// `ncclCommDestroy` or `ncclCommAbort` of the handle.
    fn teardown(&self, raw: usize, abort: bool, ours: bool) {
        assert_eq!(raw, H, "violation: a teardown of a null handle");
        assert!(
            !self.torn.swap(true, SC),
            "violation: torn down twice ({} after another teardown)",
            if abort { "an abort" } else { "a destroy" }
        );
        if !abort {
            assert_eq!(
                self.in_call.load(SC),
                0,
                "violation: ncclCommDestroy while a call is inside NCCL"
            );
        }
        (if ours { &self.ours } else { &self.theirs }).fetch_add(1, SC);
        thread::yield_now();
        self.finished.store(true, SC);
    }
}

/// The watchdog's abort of a taken handle (`teardown::Task`).
struct Task {
    done: AtomicBool,
}

/// `src/diag/supervise/shared.rs`'s `Shared`, the parts the protocol uses.
struct Shared {
    handle: AtomicUsize,
    current: AtomicU64,
    claim: AtomicU8,
    aborted_by_watchdog: AtomicBool,
    /// The clique's `any_timeout()`.
    timed_out: AtomicBool,
    /// Published work not yet known complete (`in_flight()`).
    in_flight: AtomicBool,
    /// Model only: the operation whose thread has entered its NCCL call (see the module
    /// docs: what the age check of a claim stands for).
    entered: AtomicU64,
    abort_task: Mutex<Option<Arc<Task>>>,
}

impl Shared {
    fn new(handle: usize) -> Shared {
        Shared {
            handle: AtomicUsize::new(handle),
            current: AtomicU64::new(IDLE),
            claim: AtomicU8::new(UNCLAIMED),
            aborted_by_watchdog: AtomicBool::new(false),
            timed_out: AtomicBool::new(false),
            in_flight: AtomicBool::new(false),
            entered: AtomicU64::new(IDLE),
            abort_task: Mutex::new(None),
        }
    }

    /// Takes the handle out of its holder: a swap (or, mutated, a load and a store).
    fn take_handle(&self, p: Protocol) -> usize {
        if p.take_without_swap {
            let h = self.handle.load(SC);
            thread::yield_now();
            self.handle.store(0, SC);
            h
        } else {
            self.handle.swap(0, SC)
        }
    }

    /// `Shared::await_decision`: `true` when the watchdog let the communicator be.
    fn await_decision(&self) -> bool {
        loop {
            match self.claim.load(SC) {
                UNCLAIMED => return true,
                ABORTING if self.aborted_by_watchdog.load(SC) => return false,
                _ => thread::yield_now(),
            }
        }
    }

    /// `Shared::claim_seen`, with the fence as a sequentially consistent step.
    fn claim_seen(&self, cur: u64, p: Protocol) -> bool {
        if cur == PINNED {
            return false;
        }
        if cur != IDLE {
            let old = p.old_before_the_call || self.entered.load(SC) == cur;
            if !old {
                return false;
            }
        } else if !self.in_flight.load(SC) {
            return false;
        }
        self.claim.store(DECIDING, SC);
        // fence::heavy: with the owner's fence::light, a SeqCst fence pair.
        let same = p.watchdog_skips_reread || self.current.load(SC) == cur;
        self.claim
            .store(if same { ABORTING } else { UNCLAIMED }, SC);
        same
    }

    /// `Shared::take_for_abort`.
    fn take_for_abort(&self, p: Protocol) -> usize {
        if p.watchdog_marks_after_take {
            let h = self.take_handle(p);
            self.aborted_by_watchdog.store(true, SC);
            h
        } else {
            self.aborted_by_watchdog.store(true, SC);
            self.take_handle(p)
        }
    }
}

/// A `Communicator` (or the one inside a `CommRef`) on its owner's thread.
struct Owner {
    s: Arc<Shared>,
    n: Arc<Nccl>,
    p: Protocol,
    work: Work,
    /// `Communicator::raw`.
    raw: usize,
    /// `Communicator::failure` is set.
    failed: bool,
    /// The journal position + 1 of the last operation.
    pos: u64,
    /// What `current` was when the pin began (`CommDiag::pinned_from`).
    pinned_from: std::cell::Cell<u64>,
}

impl Owner {
    fn is_failed(&self) -> bool {
        self.failed || self.s.timed_out.load(SC) || self.s.aborted_by_watchdog.load(SC)
    }

    /// `ensure_usable`: `check_alive`, then the communicator's own failure.
    fn ensure_usable(&self) -> bool {
        !(self.s.aborted_by_watchdog.load(SC) || self.s.timed_out.load(SC) || self.failed)
    }

    fn call(&mut self, c: Call) {
        let ok = match c {
            Call::Op => self.issue(0),
            Call::OpThenPolls => self.issue(2),
            Call::Pinned => self.pinned_call(),
        };
        if !ok {
            self.failed = true;
        }
    }

    /// `Communicator::issue` with `CommDiag::begin` and `end`, and `polls` rounds of
    /// `wait_ready` between the call and `end`.
    fn issue(&mut self, polls: usize) -> bool {
        if self.failed && !self.ensure_usable() {
            return false;
        }
        let s = &*self.s;
        if s.aborted_by_watchdog.load(SC) {
            return false;
        }
        self.pos += 1;
        let pos = self.pos;
        if s.timed_out.load(SC) {
            return false;
        }
        if s.current.load(SC) != PINNED {
            s.current.store(pos, SC);
            // fence::light
            if !self.p.owner_skips_claim_check
                && s.claim.load(SC) != UNCLAIMED
                && !s.await_decision()
            {
                s.current.store(IDLE, SC);
                return false;
            }
        }
        self.n
            .call(self.raw, "an operation", Some((&s.entered, pos)));
        let mut ok = true;
        for _ in 0..polls {
            // `wait_ready_for`: `check_alive`, then `poll_async` under `pinned`.
            if s.aborted_by_watchdog.load(SC) || s.timed_out.load(SC) {
                ok = false;
                break;
            }
            let Ok(pinned) = self.pin() else {
                ok = false;
                break;
            };
            self.n.call(self.raw, "a poll inside an operation", None);
            if pinned {
                self.unpin();
            }
        }
        // end: out of the call, then the work published.
        if s.current.load(SC) != PINNED {
            s.current.store(IDLE, SC);
        }
        s.in_flight.store(true, SC);
        ok
    }

    /// `CommDiag::pin`: `Err` when the watchdog aborts it, `Ok(false)` when nothing was
    /// pinned here (already pinned). Inside an operation it pins too, and
    /// [`unpin`](Self::unpin) puts the operation back.
    fn pin(&self) -> Result<bool, ()> {
        let s = &*self.s;
        if s.aborted_by_watchdog.load(SC) {
            return Err(());
        }
        let cur = s.current.load(SC);
        if cur == PINNED || (cur != IDLE && self.p.pin_inside_an_operation_pins_nothing) {
            return Ok(false);
        }
        s.current.store(PINNED, SC);
        // fence::light
        if !self.p.pin_skips_claim_check && s.claim.load(SC) != UNCLAIMED && !s.await_decision() {
            s.current.store(cur, SC);
            return Err(());
        }
        self.pinned_from.set(cur);
        Ok(true)
    }

    fn unpin(&self) {
        if self.s.current.load(SC) == PINNED {
            self.s.current.store(self.pinned_from.get(), SC);
        }
    }

    /// `Communicator::async_error` (a call under a pin).
    fn pinned_call(&mut self) -> bool {
        // `check_alive`
        if self.s.aborted_by_watchdog.load(SC) || self.s.timed_out.load(SC) {
            return false;
        }
        let Ok(pinned) = self.pin() else {
            return false;
        };
        self.n.call(self.raw, "a pinned call", None);
        if pinned {
            self.unpin();
        }
        true
    }

    /// `CommDiag::drain`.
    fn drain(&self) -> bool {
        let s = &*self.s;
        if s.current.load(SC) != IDLE {
            return false;
        }
        let done = if !s.in_flight.load(SC) {
            true
        } else {
            match self.work {
                Work::Completes => {
                    s.in_flight.store(false, SC);
                    true
                }
                Work::Stuck => false,
                Work::Unwatched => true,
            }
        };
        done && !s.aborted_by_watchdog.load(SC) && !s.timed_out.load(SC)
    }

    /// `CommDiag::release`: whether the handle was still ours to tear down.
    fn release(&self) -> bool {
        self.s.take_handle(self.p) != 0
    }

    /// `Communicator::take`.
    fn take(&mut self) -> usize {
        let raw = std::mem::replace(&mut self.raw, 0);
        if self.release() {
            raw
        } else {
            0
        }
    }

    /// `Drop for Communicator`.
    fn drop_comm(&mut self, unwinding: bool) {
        if self.raw == 0 {
            return;
        }
        let failed = unwinding || self.is_failed();
        let drained = !failed && self.drain();
        let raw = self.take();
        if raw == 0 {
            return; // the watchdog took it
        }
        self.n.teardown(raw, !drained, true);
    }

    /// `Communicator::abort`; returns when it returned `Ok`.
    fn abort(&mut self) -> bool {
        let raw = self.take();
        if raw != 0 {
            self.n.teardown(raw, true, true);
            return true;
        }
        // `watchdog_abort`
        if !self.s.aborted_by_watchdog.load(SC) {
            return true; // "nothing left to tear down"
        }
        let task = loop {
            if let Some(j) = self.s.abort_task.lock().unwrap().clone() {
                break j;
            }
            thread::yield_now();
        };
        while !task.done.load(SC) {
            thread::yield_now();
        }
        true
    }

    /// `Communicator::destroy`; an error hands the communicator back, which is dropped.
    fn destroy(&mut self) {
        if !self.drain() {
            self.failed = true; // before_teardown refused
            return self.drop_comm(false);
        }
        if !self.ensure_usable() {
            return self.drop_comm(false);
        }
        let pinned = match self.pin() {
            Ok(p) => p,
            Err(()) => return self.drop_comm(false),
        };
        self.n.teardown(self.raw, false, true);
        if self.p.destroy_takes_after_unpin {
            if pinned {
                self.unpin();
            }
            self.take();
        } else {
            self.take();
            if pinned {
                self.unpin();
            }
        }
    }

    /// `release_handle` (`into_raw`, and a view's drop): the handle, when it was ours to give.
    fn release_handle(&mut self) -> usize {
        let raw = std::mem::replace(&mut self.raw, 0);
        if self.release() {
            raw
        } else {
            0
        }
    }
}

/// The watchdog thread: up to two sweeps; a taken handle is aborted on a thread of its own.
fn watchdog(s: Arc<Shared>, n: Arc<Nccl>, p: Protocol) -> Option<thread::JoinHandle<()>> {
    // The timeout comes at any point of the owner's run: a random number of steps (drawn
    // by shuttle, so a schedule replays) before the first sweep.
    for _ in 0..thread_rng().gen_range(0..MAX_DELAY) {
        thread::yield_now();
    }
    for _ in 0..2 {
        // set_timed_out comes first: every rank of the clique fails fast from here on.
        s.timed_out.store(true, SC);
        if s.aborted_by_watchdog.load(SC) {
            return None;
        }
        let cur = s.current.load(SC);
        if s.claim_seen(cur, p) {
            let h = s.take_for_abort(p);
            if h == 0 {
                return None;
            }
            let task = Arc::new(Task {
                done: AtomicBool::new(false),
            });
            let j = Arc::clone(&task);
            let lane = thread::spawn(move || {
                n.teardown(h, true, true);
                j.done.store(true, SC);
            });
            *s.abort_task.lock().unwrap() = Some(task);
            return Some(lane);
        }
        thread::yield_now();
    }
    None
}

/// One execution of `sc` under protocol `p`: panics on a violation.
fn run(sc: Scenario, p: Protocol) {
    let handle = if sc.ending.is_some() { H } else { 0 };
    let s = Arc::new(Shared::new(handle));
    let n = Arc::new(Nccl::new());
    let wd = {
        let (s, n) = (Arc::clone(&s), Arc::clone(&n));
        thread::spawn(move || watchdog(s, n, p))
    };
    let owner = {
        let (s, n) = (Arc::clone(&s), Arc::clone(&n));
        thread::spawn(move || {
            let mut o = Owner {
                s,
                n: Arc::clone(&n),
                p,
                work: sc.work,
                raw: H,
                failed: false,
                pos: 0,
                pinned_from: std::cell::Cell::new(IDLE),
            };
            for &c in sc.calls {
                o.call(c);
            }
            match sc.ending {
                None => {
                    // `Drop for CommRef`: release_handle, never a teardown.
                    let given = o.release_handle();
                    assert_eq!(given, 0, "violation: a view gave a handle back");
                }
                Some(Ending::Drop) => o.drop_comm(false),
                Some(Ending::DropUnwinding) => o.drop_comm(true),
                Some(Ending::Abort) => {
                    if o.abort() {
                        assert!(
                            n.finished.load(SC),
                            "violation: abort() returned Ok before the handle's teardown returned"
                        );
                    }
                }
                Some(Ending::Destroy) => o.destroy(),
                Some(Ending::IntoRaw) => {
                    let raw = o.release_handle();
                    if raw != 0 {
                        n.teardown(raw, false, false); // the caller's, once
                    }
                }
            }
        })
    };
    owner.join().unwrap();
    if sc.ending.is_none() {
        n.teardown(H, false, false); // the view's owner, after the view is gone
    }
    if let Some(lane) = wd.join().unwrap() {
        lane.join().unwrap();
    }
    let (ours, theirs) = (n.ours.load(SC), n.theirs.load(SC));
    match sc.ending {
        None => assert_eq!(
            (ours, theirs),
            (0, 1),
            "violation: a borrowed handle was torn down by us"
        ),
        Some(Ending::IntoRaw) => assert_eq!(
            ours + theirs,
            1,
            "violation: not torn down exactly once ({ours} by us, {theirs} by the caller)"
        ),
        Some(_) => assert_eq!(
            (ours, theirs),
            (1, 0),
            "violation: not torn down exactly once by us"
        ),
    }
}

/// Which scheduler explores the interleavings.
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

/// The first violation over `scs` under `p` (both schedulers), with its scenario.
fn first_violation(scs: &[Scenario], p: Protocol) -> Option<(Scenario, Sched, String)> {
    for (i, &sc) in scs.iter().enumerate() {
        for sched in [Sched::Random, Sched::Pct] {
            if let Some(m) = explore(sc, p, sched, 0x00c1_a1a0 + i as u64) {
                return Some((sc, sched, m));
            }
        }
    }
    None
}

/// Asserts that `p` (a mutant) is caught over `scs`, with a message containing `what`.
#[track_caller]
fn assert_caught(p: Protocol, scs: &[Scenario], what: &str) {
    match first_violation(scs, p) {
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

/// The protocol holds in every scenario (with the fixes of the gaps in [`KNOWN_GAPS`]).
#[test]
fn the_protocol_holds_in_every_scenario() {
    let p = Protocol::with_known_gaps_fixed();
    let scs = scenarios();
    assert_eq!(scs.len(), 108);
    let start = std::time::Instant::now();
    if let Some((sc, sched, m)) = first_violation(&scs, p) {
        panic!("{m}\nin {sc:?} under {p:?} ({sched:?} scheduler)");
    }
    eprintln!(
        "{} scenarios x 2 schedulers x {ITERATIONS} schedules: no violation ({:.1?})",
        scs.len(),
        start.elapsed()
    );
}

/// A known gap is found in today's protocol while it is listed, and not once it is not.
#[track_caller]
fn check_gap(name: &str, p: Protocol, scs: &[Scenario], what: &str) {
    let found = first_violation(scs, p);
    if KNOWN_GAPS.contains(&name) {
        match found {
            Some((sc, sched, m)) => {
                assert!(m.contains(what), "{name}: found {m:?} in {sc:?}");
                eprintln!("known gap {name}: found in {sc:?} by the {sched:?} scheduler: {m}");
            }
            None => panic!("{name} is no longer found: remove it from KNOWN_GAPS"),
        }
    } else if let Some((sc, sched, m)) = found {
        panic!("{m}\nin {sc:?} under {p:?} ({sched:?} scheduler)");
    }
}

fn scenarios_where(f: impl Fn(&Scenario) -> bool) -> Vec<Scenario> {
    scenarios().into_iter().filter(|s| f(s)).collect()
}

#[test]
fn gap_destroy_takes_after_unpin() {
    let mut p = Protocol::with_known_gaps_fixed();
    p.destroy_takes_after_unpin = TODAY.destroy_takes_after_unpin;
    let scs = scenarios_where(|s| s.ending == Some(Ending::Destroy));
    check_gap("destroy-takes-after-unpin", p, &scs, "torn down twice");
}

#[test]
fn gap_abort_returns_before_the_watchdogs_abort() {
    let mut p = Protocol::with_known_gaps_fixed();
    p.watchdog_marks_after_take = TODAY.watchdog_marks_after_take;
    let scs = scenarios_where(|s| s.ending == Some(Ending::Abort));
    check_gap(
        "abort-returns-before-the-watchdogs-abort",
        p,
        &scs,
        "abort() returned Ok before",
    );
}

/// Without the claim check after the owner's fence, an operation enters NCCL on a
/// handle the watchdog is aborting.
#[test]
fn mutant_owner_skips_the_claim_check_is_caught() {
    let mut p = Protocol::with_known_gaps_fixed();
    p.owner_skips_claim_check = true;
    assert_caught(p, &scenarios(), "used after teardown");
}

/// Without reading `current` again after its fence, the watchdog aborts a handle whose
/// owner moved on: into a new call, or into a pinned destroy.
#[test]
fn mutant_watchdog_skips_the_reread_is_caught() {
    let mut p = Protocol::with_known_gaps_fixed();
    p.watchdog_skips_reread = true;
    assert_caught(p, &scenarios(), "violation");
    let calls_then_drop = scenarios_where(|s| s.ending == Some(Ending::Drop));
    assert_caught(p, &calls_then_drop, "used after teardown");
}

/// Taking the handle with a load and a store lets both the owner and the watchdog
/// believe it is theirs.
#[test]
fn mutant_take_without_swap_is_caught() {
    let mut p = Protocol::with_known_gaps_fixed();
    p.take_without_swap = true;
    assert_caught(p, &scenarios(), "torn down twice");
}

/// A pin that does not check the claim lets a pinned call (or a destroy) run on a handle
/// the watchdog is aborting.
#[test]
fn mutant_pin_skips_the_claim_check_is_caught() {
    let mut p = Protocol::with_known_gaps_fixed();
    p.pin_skips_claim_check = true;
    assert_caught(p, &scenarios(), "violation");
    let polls_then_drop =
        scenarios_where(|s| s.ending == Some(Ending::Drop) && s.calls.contains(&Call::Pinned));
    assert_caught(p, &polls_then_drop, "used after teardown");
}

/// A pin inside an operation that pins nothing (the code before this model had polls)
/// leaves `wait_ready`'s polls to the operation's claim: the watchdog claims the old
/// operation between two polls and aborts the handle, and the next poll (or one already
/// past its `check_alive`) calls NCCL on it. A stress run of the host provider's tests
/// found it as a misuse (a call on an aborted handle), once in about 200 runs.
#[test]
fn mutant_pin_inside_an_operation_pins_nothing_is_caught() {
    let mut p = Protocol::with_known_gaps_fixed();
    p.pin_inside_an_operation_pins_nothing = true;
    let polls = scenarios_where(|s| s.calls.contains(&Call::OpThenPolls));
    assert_caught(p, &polls, "used after teardown: a poll inside an operation");
}

/// The claim of an operation inside its call is safe only because the operation is old
/// enough (`min_age`) for its thread to be inside NCCL: an operation claimed between its
/// claim check and its call would enter NCCL after the abort began. This documents the
/// assumption: without it the model finds exactly that. (The age counts from the
/// operation's `enqueued` time, taken before the fingerprint check's wait; an operation
/// that waited there longer than `min_age` is "old" from the moment it stores `current`.)
#[test]
fn the_age_of_an_operation_is_a_timing_assumption() {
    let mut p = Protocol::with_known_gaps_fixed();
    p.old_before_the_call = true;
    assert_caught(p, &scenarios(), "used after teardown");
}

// ---- The revoke hand-off -------------------------------------------------------------
//
// With `Config::elastic` a worker of the watchdog revokes a claimed handle in place, under
// the communicator's `in_place` lock (`Shared::revoke_in_place`); NCCL's revoke may block
// there. The owner's teardown takes `in_place` to swap the handle out, waiting at most its
// abort bound (`Shared::lock_in_place`); past it, it hands the handle to the worker with a
// compare-exchange on `revoking` (`REVOKING` -> `OWNER_LEFT`), and the worker, when NCCL's
// revoke returns, swaps `revoking` back and aborts the handle if it was handed over. The
// bound is a choice shuttle makes at each failed try. Asserted: no revoke runs on a handle
// whose teardown began, and the handle is torn down exactly once (the revoke returns).

const NOT_REVOKING: u8 = 0;
const REVOKING: u8 = 1;
const OWNER_LEFT: u8 = 2;

#[derive(Default)]
struct InPlace {
    lock: Mutex<()>,
    handle: AtomicUsize,
    gone: AtomicBool,
    revoking: AtomicU8,
    aborted_by_watchdog: AtomicBool,
    torn: AtomicBool,
    teardowns: AtomicU32,
}

impl InPlace {
    fn teardown(&self) {
        assert!(!self.torn.swap(true, SC), "the handle was torn down twice");
        self.teardowns.fetch_add(1, SC);
    }
}

/// The owner's give-up: atomic (as in `src/`), or a load then a store (a mutant).
#[derive(Clone, Copy, Debug)]
enum GiveUp {
    CompareExchange,
    LoadThenStore,
}

fn revoke_handoff(give_up: GiveUp) {
    let s = Arc::new(InPlace::default());
    s.handle.store(H, SC);
    s.revoking.store(NOT_REVOKING, SC);
    let worker = {
        let s = Arc::clone(&s);
        thread::spawn(move || {
            let _held = s.lock.lock().unwrap();
            if s.handle.load(SC) == 0 || s.gone.load(SC) {
                return;
            }
            s.revoking.store(REVOKING, SC);
            // NCCL's revoke, which may take long.
            for _ in 0..3 {
                assert!(!s.torn.load(SC), "a revoke ran on a torn-down handle");
                thread::yield_now();
            }
            if s.revoking.swap(NOT_REVOKING, SC) == OWNER_LEFT {
                s.aborted_by_watchdog.store(true, SC);
                if s.handle.swap(0, SC) != 0 {
                    s.teardown();
                }
            }
        })
    };
    let owner = {
        let s = Arc::clone(&s);
        thread::spawn(move || loop {
            if let Ok(held) = s.lock.try_lock() {
                s.gone.store(true, SC);
                let mine = s.handle.swap(0, SC) != 0;
                drop(held);
                if mine {
                    s.teardown();
                }
                return;
            }
            let late = thread_rng().gen_bool(0.5);
            let handed = late
                && match give_up {
                    GiveUp::CompareExchange => s
                        .revoking
                        .compare_exchange(REVOKING, OWNER_LEFT, SC, SC)
                        .is_ok(),
                    GiveUp::LoadThenStore => {
                        let revoking = s.revoking.load(SC) == REVOKING;
                        if revoking {
                            s.revoking.store(OWNER_LEFT, SC);
                        }
                        revoking
                    }
                };
            if handed {
                s.aborted_by_watchdog.store(true, SC);
                s.gone.store(true, SC);
                return;
            }
            thread::yield_now();
        })
    };
    worker.join().unwrap();
    owner.join().unwrap();
    assert_eq!(s.teardowns.load(SC), 1, "the handle was leaked");
}

fn explore_handoff(give_up: GiveUp) -> Option<String> {
    let mut found = None;
    for sched in [Sched::Random, Sched::Pct] {
        let mut config = Config::default();
        config.failure_persistence = FailurePersistence::None;
        let f = move || revoke_handoff(give_up);
        let r = catch_unwind(AssertUnwindSafe(|| match sched {
            Sched::Random => {
                Runner::new(RandomScheduler::new_from_seed(0x4e0c, ITERATIONS), config).run(f);
            }
            Sched::Pct => {
                Runner::new(PctScheduler::new_from_seed(0x4e0c, 3, ITERATIONS), config).run(f);
            }
        }));
        if let Err(e) = r {
            found = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            break;
        }
    }
    found
}

/// The revoke hand-off tears the handle down exactly once, never under a revoke.
#[test]
fn the_revoke_hand_off_tears_down_exactly_once() {
    if let Some(m) = explore_handoff(GiveUp::CompareExchange) {
        panic!("{m}");
    }
}

/// With a load then a store for the give-up, the worker can swap `revoking` back between
/// them: nobody aborts the handle.
#[test]
fn mutant_give_up_without_compare_exchange_is_caught() {
    let m = explore_handoff(GiveUp::LoadThenStore).expect("the model found no violation");
    assert!(m.contains("leaked"), "{m}");
}
