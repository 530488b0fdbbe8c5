//! The hooks with the diagnostics on (the `diag` feature), a file per stage that calls
//! them (see `hooks`' docs). Here: joining (the communicator's attach, its init's arrival
//! and the report of an init that never completed) and [`Watched`], what the owner keeps.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::{CommDiag, CommView};
use crate::diag::key::{self, CliqueKey};
use crate::diag::observe;
use crate::diag::remote;
use crate::diag::settings::DiagConfig;
use crate::diag::supervise::claim::UNCLAIMED;
use crate::diag::supervise::clique::{self, LiveRank};
use crate::diag::supervise::journal::Journal;
use crate::diag::supervise::shared::{QueueWatch, Shared, IDLE, MAX_QUEUES};
#[cfg(test)]
use crate::diag::supervise::tracker::Tracker;
use crate::diag::supervise::tracker::{self, Queue};
use crate::diag::supervise::{clock, fence, watchdog};
use crate::error::Error;
use crate::library::Provider;
use crate::teardown::lock;

mod family;
mod group;
mod op;
mod teardown;
mod view;

#[cfg(all(test, feature = "host"))]
mod tests;

pub use view::Diagnostics;

/// At most this many unique ids' arrival tables are kept (see `CommDiag::arrive`).
const MAX_ARRIVAL_TABLES: usize = 256;

/// Per clique key: which ranks began their init in this process.
static ARRIVALS: Mutex<std::collections::BTreeMap<CliqueKey, Vec<bool>>> =
    Mutex::new(std::collections::BTreeMap::new());

/// What the diagnostics keep of a communicator: the state it shares with the watchdog and
/// its clique (once attached), and its owner's own.
#[derive(Debug)]
pub(in crate::diag::hooks) struct Watched {
    shared: OnceLock<Arc<Shared>>,
    /// The job's desync board, given to the clique on attach.
    board: Option<Arc<dyn remote::RemoteBoard>>,
    /// The last queues (streams) the owner noted, newest first: only a stream not among
    /// them takes the slow path. Each is among the [`RECENT_QUEUES`] most recently noted
    /// in the shared list, which keeps more, so none is dropped there while cached here.
    recent_queues: RefCell<[Option<Arc<QueueWatch>>; RECENT_QUEUES]>,
    /// A queue left `recent_queues` with work staged on it and not yet published: the next
    /// group's end publishes by the walk over every queue (under the list's lock) instead
    /// of over the recent ones, and clears this.
    staged_evicted: Cell<bool>,
    /// The shrinks made from this communicator so far, counted per exclude list
    /// ([`shrink_tag`](super::shrink_tag)): part of each shrink child's clique key, so two
    /// shrinks at the same sequence number never share one.
    children: RefCell<std::collections::BTreeMap<u64, u64>>,
    /// Inside `shrink_after_failure` (see [`CommDiag::set_recovering`]).
    recovering: Cell<bool>,
    /// What `current` held when the pin in place began (an operation's position, or
    /// `IDLE`): [`CommDiag::unpin`] puts it back.
    pinned_from: Cell<u64>,
}

impl Watched {
    /// A communicator's before its attach.
    pub(in crate::diag::hooks) fn unattached() -> Watched {
        Watched {
            shared: OnceLock::new(),
            board: None,
            recent_queues: RefCell::new(Default::default()),
            staged_evicted: Cell::new(false),
            children: RefCell::default(),
            recovering: Cell::new(false),
            pinned_from: Cell::new(IDLE),
        }
    }

    /// A communicator's of a config (its desync board: children inherit none).
    pub(in crate::diag::hooks) fn for_config(config: &DiagConfig) -> Watched {
        Watched {
            board: config.board.clone(),
            ..Watched::unattached()
        }
    }
}

#[cfg(test)]
thread_local! {
    /// The tracker communicators attached on this thread use instead of their provider's.
    static TEST_TRACKER: std::cell::RefCell<Option<Arc<dyn Tracker>>> =
        const { std::cell::RefCell::new(None) };
}

/// How many recent queues a communicator's owner caches (see `Watched::recent_queues`).
/// A stream past them takes the slow path, with two locks the watchdog takes too (the
/// queue list's, and the spare events' as the stream it evicts gives its event back): 4
/// made every operation of a loop over 5 to 8 streams take it (the overhead bench's tail
/// section, 8 streams: p50 0.92x with 8). A hit costs a compare per stream before it.
const RECENT_QUEUES: usize = 8;
const _: () = assert!(RECENT_QUEUES <= MAX_QUEUES);

impl CommDiag {
    /// The key of a child (see [`child`](Self::child)). A split is a collective (its own
    /// sequence number), and its excluded ranks call it too. A shrink does not advance the
    /// sequence number, and the ranks left after a failure may differ in the collectives
    /// they issued on the parent: its child is numbered by the shrinks of its exclude list
    /// alone (every rank of the child made the parent's shrinks of that list, in the same
    /// order; a rank excluded from another list never made that one).
    pub(super) fn child_key(&self, tag: u64) -> CliqueKey {
        let (seq, nth) = if tag & super::SHRINK_TAG == 0 {
            let seq = (self.watched.shared.get()).map(|s| s.seq.load(Ordering::Relaxed));
            (seq.unwrap_or(0), 0)
        } else {
            let mut made = self.watched.children.borrow_mut();
            let n = made.entry(tag).or_insert(0);
            *n += 1;
            (0, *n - 1)
        };
        key::key_of((self.key, seq, tag, nth))
    }

    /// Attaches the communicator once its handle, rank and size are known: it joins its
    /// clique and the watchdog's registry. Allocates the flight recorder.
    pub(crate) fn attach(&self, h: CommView<'_>) {
        self.watched.shared.get_or_init(|| self.watch(h));
    }

    /// The shared state of a communicator being attached: joins its clique and the
    /// watchdog's registry.
    fn watch(&self, h: CommView<'_>) -> Arc<Shared> {
        let CommView {
            raw,
            rank,
            world_size,
            lib,
            lane,
        } = h;
        clock::advance();
        let clique = clique::join(self.key, world_size.max(1), &observe::OBSERVERS);
        if let Some(b) = &self.watched.board {
            clique.set_board(b);
        }
        #[cfg(test)]
        let (tracker, cuda_tracker) = match TEST_TRACKER.with(|t| t.borrow().clone()) {
            Some(t) => (t, None),
            None => tracker::for_provider(lib.provider()),
        };
        #[cfg(not(test))]
        let (tracker, cuda_tracker) = tracker::for_provider(lib.provider());
        // The queue of a host-provider communicator is the communicator itself.
        let host_queue = (lib.provider() == Provider::Host).then(|| {
            let q = Queue::Host(raw as usize);
            Arc::new(QueueWatch::new(q, false, Arc::clone(&tracker)))
        });
        let s = Arc::new(Shared {
            rank,
            world_size,
            settings: self.settings.clone(),
            lib: Arc::clone(lib),
            clique: Arc::clone(&clique),
            tracker,
            cuda_tracker,
            queues: Mutex::new(host_queue.iter().cloned().collect()),
            host_queue,
            journal: Journal::new(self.settings.ring),
            handle: AtomicUsize::new(raw as usize),
            current: AtomicU64::new(IDLE),
            claim: AtomicU8::new(UNCLAIMED),
            asym: fence::asymmetric(),
            report: Mutex::new(None),
            lane,
            abort_task: Mutex::new(None),
            aborted_by_watchdog: AtomicBool::new(false),
            revoked_by_watchdog: AtomicBool::new(false),
            job_linked: AtomicBool::new(false),
            unrevocable: AtomicBool::new(false),
            in_place: Mutex::new(()),
            revoking: AtomicU8::new(crate::diag::supervise::claim::NOT_REVOKING),
            cuda_fault: std::sync::OnceLock::new(),
            gone: AtomicBool::new(false),
            noticed: AtomicU64::new(0),
            group_ending: AtomicBool::new(false),
            captured: AtomicBool::new(false),
            seq: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
            checks: AtomicU64::new(0),
        });
        clique.attach(rank, Arc::downgrade(&s) as Weak<dyn LiveRank>);
        watchdog::watch(&s);
        s
    }

    #[inline(always)]
    pub(crate) fn shared(&self, h: CommView<'_>) -> &Arc<Shared> {
        match self.watched.shared.get() {
            Some(s) => s,
            None => self.attach_late(h),
        }
    }

    #[cold]
    fn attach_late(&self, h: CommView<'_>) -> &Arc<Shared> {
        self.watched.shared.get_or_init(|| self.watch(h))
    }

    /// The shared state, once attached.
    #[inline(always)]
    fn attached(&self) -> Option<&Arc<Shared>> {
        self.watched.shared.get()
    }

    /// Notes that rank `rank` of `world_size` began its init in this process.
    pub(crate) fn arrive(&self, rank: usize, world_size: usize) {
        let mut a = lock(&ARRIVALS);
        if a.len() >= MAX_ARRIVAL_TABLES && !a.contains_key(&self.key) {
            a.clear(); // old ids' tables: bounded memory in a long run
        }
        let seen = a.entry(self.key).or_insert_with(|| vec![false; world_size]);
        if seen.len() == world_size && rank < world_size {
            seen[rank] = true;
        }
    }

    /// The report of a wait for `call` (an init, a split child) that ran out of time.
    pub(crate) fn wait_timeout_report(&self, call: &str, rank: usize, world_size: usize) -> String {
        if let Some(seen) = lock(&ARRIVALS)
            .get(&self.key)
            .filter(|v| v.len() == world_size && world_size > 0)
        {
            let (yes, no): (Vec<usize>, Vec<usize>) = (0..world_size).partition(|&r| seen[r]);
            return format!(
                "{call} on rank {rank} of {world_size} did not complete: ranks never seen here: {no:?} (not started, dead, or in another process); ranks that began their init in this process: {yes:?}"
            );
        }
        super::wait_timeout_plain(call, rank, world_size)
    }

    /// The watchdog aborted the communicator: the error its calls get.
    #[cold]
    fn aborted_error(&self, s: &Shared) -> Error {
        s.timeout_error(&s.abort_report())
    }
}

/// Adds `by` to a counter that only the communicator's owning thread writes (others only
/// read it): a load and a store, no read-modify-write, so no locked instruction on the
/// per-operation path. Returns the old value.
#[inline]
fn bump(counter: &AtomicU64, by: u64) -> u64 {
    let old = counter.load(Ordering::Relaxed);
    counter.store(old.wrapping_add(by), Ordering::Relaxed);
    old
}
