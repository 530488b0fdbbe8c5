//! The per-operation hooks and a communicator's diagnostics: what `Communicator::issue`
//! calls before and after each NCCL call, and what teardown asks. Without the `diag`
//! feature a `CommDiag` keeps only its settings and its family's key (the host provider's
//! teardown lane): nothing is recorded or watched, each hook returns at once (the
//! compiler removes it), and the timeout still bounds init and every wait for
//! `ncclInProgress`.

use std::panic::Location;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys::ncclComm_t;

use super::key::{self, CliqueKey};
use super::op::OpInfo;
use super::settings::{DiagConfig, Settings};
#[cfg(all(test, feature = "diag"))]
use super::tracker::Tracker;
use crate::error::{Error, Result};
use crate::id::UniqueId;
use crate::library::Library;
use crate::stream::StreamRef;
use crate::teardown::{Bound, TeardownLane};
#[cfg(feature = "diag")]
use {
    super::clique::{self, Agreement, LiveRank, RankView, TimeoutReport},
    super::journal::{Entry, Journal},
    super::op::in_group,
    super::recorder::{FlightRecord, OpRecord, OpState},
    super::remote,
    super::shared::{QueueWatch, Shared, IDLE, MAX_QUEUES, PINNED, UNCLAIMED},
    super::tracker::{self, Queue},
    super::{clock, fence, watchdog},
    crate::library::Provider,
    crate::teardown::{self, lock, Task},
    std::cell::{Cell, RefCell},
    std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering},
    std::sync::{Mutex, OnceLock, Weak},
};

/// At most this many unique ids' arrival tables are kept (see `CommDiag::arrive`).
#[cfg(feature = "diag")]
const MAX_ARRIVAL_TABLES: usize = 256;

/// Per clique key: which ranks began their init in this process.
#[cfg(feature = "diag")]
static ARRIVALS: Mutex<std::collections::BTreeMap<CliqueKey, Vec<bool>>> =
    Mutex::new(std::collections::BTreeMap::new());

/// A communicator's diagnostics: its settings and clique, attached (with its handle, rank
/// and size) once they are known.
#[derive(Debug)]
pub(crate) struct CommDiag {
    settings: Settings,
    #[cfg_attr(not(feature = "diag"), allow(dead_code))]
    key: CliqueKey,
    /// The clique key of the unique id (or `ncclCommInitAll`) the communicator's family
    /// was born from: its teardown lane on the host provider.
    root: u64,
    #[cfg(feature = "diag")]
    shared: OnceLock<Arc<Shared>>,
    /// The job's desync board, given to the clique on attach.
    #[cfg(feature = "diag")]
    board: Option<Arc<dyn remote::RemoteBoard>>,
    /// The last queues (streams) the owner noted, newest first: only a stream not among
    /// them takes the slow path. Each is among the [`RECENT_QUEUES`] most recently noted
    /// in the shared list, which keeps more, so none is dropped there while cached here.
    #[cfg(feature = "diag")]
    recent_queues: RefCell<[Option<Arc<QueueWatch>>; RECENT_QUEUES]>,
    /// The shrinks made from this communicator so far, counted per exclude list
    /// ([`shrink_tag`]): part of each shrink child's clique key, so two shrinks at the same
    /// sequence number never share one.
    #[cfg(feature = "diag")]
    children: RefCell<std::collections::BTreeMap<u64, u64>>,
    /// Inside `shrink_after_failure` (see [`CommDiag::set_recovering`]).
    #[cfg(feature = "diag")]
    recovering: Cell<bool>,
    /// What `current` held when the pin in place began (an operation's position, or
    /// `IDLE`): [`CommDiag::unpin`] puts it back.
    #[cfg(feature = "diag")]
    pinned_from: Cell<u64>,
}

#[cfg(all(test, feature = "diag"))]
thread_local! {
    /// The tracker communicators attached on this thread use instead of their provider's.
    static TEST_TRACKER: std::cell::RefCell<Option<Arc<dyn Tracker>>> =
        const { std::cell::RefCell::new(None) };
}

/// How many recent queues a communicator's owner caches (see `CommDiag::recent_queues`).
/// A stream past them takes the slow path, with two locks the watchdog takes too (the
/// queue list's, and the spare events' as the stream it evicts gives its event back): 4
/// made every operation of a loop over 5 to 8 streams take it (the overhead bench's tail
/// section, 8 streams: p50 0.92x with 8). A hit costs a compare per stream before it.
#[cfg(feature = "diag")]
const RECENT_QUEUES: usize = 8;
#[cfg(feature = "diag")]
const _: () = assert!(RECENT_QUEUES <= MAX_QUEUES);

/// What the diagnostics know of a communicator when they attach it late (communicators of
/// `ncclCommInitAll`, adopted handles): diagnostics never see the `Communicator` itself.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(crate) struct CommView<'a> {
    pub raw: ncclComm_t,
    pub rank: usize,
    pub world_size: usize,
    pub lib: &'a Arc<Library>,
    /// Where its teardowns run.
    pub lane: TeardownLane,
}

/// What [`CommDiag::begin`] hands to [`CommDiag::end`].
#[derive(Debug)]
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(crate) struct InFlight<'a> {
    /// The operation's journal position.
    pos: u64,
    /// Its start (diagnostics clock).
    start: u64,
    stream: StreamRef<'a>,
}

/// The bit that marks a child's tag as a shrink's ([`shrink_tag`]); a split's tag is its
/// color, a non-negative `c_int`.
pub(crate) const SHRINK_TAG: u64 = 1 << 63;

/// The tag of a shrink's child: its exclude list, whatever its order.
pub(crate) fn shrink_tag(exclude: &[std::ffi::c_int]) -> u64 {
    let mut list = exclude.to_vec();
    list.sort_unstable();
    key::key_of(("shrink", list)) | SHRINK_TAG
}

#[cfg_attr(not(feature = "diag"), allow(unused_variables))]
impl CommDiag {
    fn new(settings: Settings, key: CliqueKey, root: u64) -> CommDiag {
        CommDiag {
            settings,
            key,
            root,
            #[cfg(feature = "diag")]
            shared: OnceLock::new(),
            #[cfg(feature = "diag")]
            board: None,
            #[cfg(feature = "diag")]
            recent_queues: RefCell::new(Default::default()),
            #[cfg(feature = "diag")]
            children: RefCell::default(),
            #[cfg(feature = "diag")]
            recovering: Cell::new(false),
            #[cfg(feature = "diag")]
            pinned_from: Cell::new(IDLE),
        }
    }

    /// For rank `rank` of a `world_size`-rank communicator joined through `id`.
    pub(crate) fn for_id(
        config: &DiagConfig,
        id: &UniqueId,
        rank: usize,
        world_size: usize,
    ) -> CommDiag {
        let key = key::of_id(id.as_bytes(), rank, world_size);
        #[allow(unused_mut)]
        let mut d = CommDiag::new(Settings::resolve(config), key, key);
        #[cfg(feature = "diag")]
        {
            d.board = config.board.clone();
        }
        d
    }

    /// For the communicators of one `ncclCommInitAll`: one clique, of a fresh key.
    pub(crate) fn for_init_all() -> impl Fn() -> CommDiag {
        let key = key::fresh_key();
        move || CommDiag::new(Settings::resolve(&DiagConfig::default()), key, key)
    }

    /// For a child from split (`tag` = color) or shrink ([`shrink_tag`]): same settings,
    /// the key derived from the parent's, its last collective's sequence number and `tag`.
    pub(crate) fn child(&self, tag: u64) -> CommDiag {
        #[cfg(feature = "diag")]
        let key = self.child_key(tag);
        #[cfg(not(feature = "diag"))]
        let key = self.key;
        CommDiag::new(self.settings.clone(), key, self.root)
    }

    #[cfg(feature = "diag")]
    fn child_key(&self, tag: u64) -> CliqueKey {
        // A split is a collective (its own sequence number), and its excluded ranks call it
        // too. A shrink does not advance the sequence number, and the ranks left after a
        // failure may differ in the collectives they issued on the parent: its child is
        // numbered by the shrinks of its exclude list alone (every rank of the child made
        // the parent's shrinks of that list, in the same order; a rank excluded from
        // another list never made that one).
        let (seq, nth) = if tag & SHRINK_TAG == 0 {
            let seq = self.shared.get().map(|s| s.seq.load(Ordering::Relaxed));
            (seq.unwrap_or(0), 0)
        } else {
            let mut made = self.children.borrow_mut();
            let n = made.entry(tag).or_insert(0);
            *n += 1;
            (0, *n - 1)
        };
        key::key_of((self.key, seq, tag, nth))
    }

    /// Attaches the communicator once its handle, rank and size are known: it joins its
    /// clique and the watchdog's registry. Allocates the flight recorder.
    pub(crate) fn attach(&self, h: CommView<'_>) {
        #[cfg(feature = "diag")]
        self.shared.get_or_init(|| self.watch(h));
    }

    /// The shared state of a communicator being attached: joins its clique and the
    /// watchdog's registry.
    #[cfg(feature = "diag")]
    fn watch(&self, h: CommView<'_>) -> Arc<Shared> {
        let CommView {
            raw,
            rank,
            world_size,
            lib,
            lane,
        } = h;
        clock::advance();
        let clique = clique::join(self.key, world_size.max(1));
        if let Some(b) = &self.board {
            clique.set_board(b);
        }
        #[cfg(test)]
        let tracker = TEST_TRACKER
            .with(|t| t.borrow().clone())
            .unwrap_or_else(|| tracker::for_provider(lib.provider()));
        #[cfg(not(test))]
        let tracker = tracker::for_provider(lib.provider());
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
            revoking: AtomicU8::new(super::shared::NOT_REVOKING),
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

    #[cfg(feature = "diag")]
    #[inline(always)]
    pub(crate) fn shared(&self, h: CommView<'_>) -> &Arc<Shared> {
        match self.shared.get() {
            Some(s) => s,
            None => self.attach_late(h),
        }
    }

    #[cfg(feature = "diag")]
    #[cold]
    fn attach_late(&self, h: CommView<'_>) -> &Arc<Shared> {
        self.shared.get_or_init(|| self.watch(h))
    }

    /// A copy of the flight recorder.
    #[cfg(feature = "diag")]
    pub(crate) fn flight_record(&self, h: CommView<'_>) -> FlightRecord {
        self.shared(h).flight_record()
    }

    /// The diagnostics counters.
    #[cfg(feature = "diag")]
    pub(crate) fn diagnostics(&self, h: CommView<'_>) -> Diagnostics {
        let s = self.shared(h);
        Diagnostics {
            rank: s.rank,
            collectives: s.seq.load(Ordering::Relaxed),
            operations: s.journal.len(),
            wait: Duration::from_nanos(s.wait_ns.load(Ordering::Relaxed)),
            fingerprint_checks: s.checks.load(Ordering::Relaxed),
            check_enabled: s.settings.check,
            precise_timing: s.settings.precise,
            timeout: s.settings.timeout,
            aborted_by_watchdog: s.aborted_by_watchdog.load(Ordering::Acquire),
        }
    }

    /// Fails when the watchdog aborted this communicator (its handle is gone).
    #[inline]
    pub(crate) fn check_alive(&self) -> Result<()> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            if s.aborted_by_watchdog.load(Ordering::Acquire)
                || (s.clique.any_timeout() && !self.recovering.get())
            {
                return Err(self.aborted_error(s));
            }
        }
        Ok(())
    }

    /// While `on`: a failed clique no longer fails this communicator's checks and calls,
    /// only a handle the watchdog took does (for `shrink_after_failure`, which runs on a
    /// communicator whose clique failed).
    pub(crate) fn set_recovering(&self, on: bool) {
        #[cfg(feature = "diag")]
        self.recovering.set(on);
    }

    /// Whether the communicator was made with `Config::elastic` (a failed clique's handles
    /// are revoked rather than aborted, for a shrink).
    pub(crate) fn elastic(&self) -> bool {
        self.settings.elastic
    }

    /// The owner revoked the handle where it is ([`Communicator::revoke`](crate::Communicator::revoke), or a failed wait
    /// of an elastic communicator): the watchdog leaves it be, as after a revoke of its own (NCCL would
    /// refuse the watchdog's second revoke, init.cc:2655-2657 of v2.29.7-1, and it would
    /// abort instead, taking the handle a shrink needs).
    pub(crate) fn revoked_in_place(&self) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            s.revoked_by_watchdog.store(true, Ordering::Release);
        }
    }

    /// Notes whether an NCCL group job may be linked to the communicator
    /// (`Communicator::set_job_linked`): the watchdog then aborts it rather than revoke it.
    #[inline]
    pub(crate) fn set_job_linked(&self, linked: bool) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            s.job_linked.store(linked, Ordering::Release);
        }
        #[cfg(not(feature = "diag"))]
        let _ = linked;
    }

    /// The stream whose tracked work is the oldest not known complete, and that work, in
    /// words (`None`: all of it is complete, or nothing is tracked without `diag`).
    pub(crate) fn stream_behind(&self) -> Option<String> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            let (key, rec) = s.stream_behind()?;
            let what = if s.host_queue.as_ref().is_some_and(|q| q.key == key) {
                format!("the host communicator's queue ({key:#x})")
            } else {
                format!("stream {key:#x}")
            };
            return Some(format!(
                "{what}: the work up to {} (seq {}, called at {})",
                rec.signature(),
                rec.seq,
                rec.caller
            ));
        }
        None
    }

    /// Runs the owner's `ncclCommRevoke` on a thread of its own, waiting at most the abort
    /// bound ([`Shared::revoke_for_owner`]); without the diagnostics, `call` here.
    /// `Err(())`: the revoke still runs past the bound (the owner must not call NCCL on
    /// the handle again; its teardown hands it over). `Ok(None)`: not called.
    pub(crate) fn revoke_bounded(
        &self,
        call: impl FnOnce() -> nccl_sys::ncclResult_t,
    ) -> std::result::Result<Option<nccl_sys::ncclResult_t>, ()> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            return s.revoke_for_owner(self.abort_timeout());
        }
        Ok(Some(call()))
    }

    /// The owner's revoke, marked by [`revoked_in_place`](Self::revoked_in_place), was
    /// refused by NCCL (nothing changed): the handle is the watchdog's to act on again.
    pub(crate) fn revoke_refused(&self) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            s.revoked_by_watchdog.store(false, Ordering::Release);
        }
    }

    /// Whether the watchdog aborted the handle (it took it: only its abort tears it down).
    pub(crate) fn aborted_by_watchdog(&self) -> bool {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            return s.aborted_by_watchdog.load(Ordering::Acquire);
        }
        false
    }

    /// Whether the watchdog found the handle unsound to revoke (a group job linked) and
    /// aborted it instead: it cannot be shrunk.
    pub(crate) fn unrevocable(&self) -> bool {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            return s.unrevocable.load(Ordering::Acquire);
        }
        false
    }

    /// Whether the watchdog revoked the handle in place (`Config::elastic`).
    pub(crate) fn revoked_by_watchdog(&self) -> bool {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            return s.revoked_by_watchdog.load(Ordering::Acquire);
        }
        false
    }

    /// The rank whose departure failed this communicator's clique, else the first rank
    /// of the clique that left (other than this one), if any.
    pub(crate) fn lost_rank(&self) -> Option<usize> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            return s
                .clique
                .timed_out()
                .and_then(|r| r.left.or(r.behind))
                .filter(|&r| r != s.rank)
                .or_else(|| s.clique.departed_other_than(s.rank).map(|d| d.rank));
        }
        None
    }

    /// Every rank of this communicator's clique known gone, other than this one, sorted:
    /// [`lost_rank`](Self::lost_rank), every rank of this process whose communicator of the
    /// clique was torn down, every rank of another process that posted its departure on
    /// the job's desync board (read once, bounded), and every rank the host provider saw
    /// gone (its process died, or it tore its communicator down).
    pub(crate) fn lost_ranks(&self) -> Vec<usize> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            let mut v: Vec<usize> = self.lost_rank().into_iter().collect();
            v.extend(s.clique.torn_down());
            v.extend(s.clique.departed_on_board());
            v.extend(dead_ranks(s));
            v.retain(|&r| r != s.rank && r < s.world_size);
            v.sort_unstable();
            v.dedup();
            return v;
        }
        Vec::new()
    }

    /// [`lost_ranks`](Self::lost_ranks), agreed with the ranks of this process that
    /// recover too (`Clique::agree_lost`), waiting for them until `deadline` at most.
    pub(crate) fn agree_lost_ranks(&self, deadline: std::time::Instant) -> Vec<usize> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            let mut v = s.clique.agree_lost(s.rank, || self.lost_ranks(), deadline);
            v.retain(|&r| r < s.world_size);
            return v;
        }
        let _ = deadline;
        Vec::new()
    }

    /// Before the NCCL call of a shrink (`call`) excluding `exclude` (checked, unsorted):
    /// `Ok` when every other rank of this process that stays by this list shrinks with the
    /// same list (`Clique::agree_exclude`, waiting until the timeout at most);
    /// [`Error::ExcludeMismatch`] naming each rank's list when two ranks disagree (NCCL
    /// does not compare them and its shrink would wait until a timeout); a timeout naming
    /// the ranks that never called their shrink. Then, with a desync board, with the ranks
    /// of other processes it keeps (`Clique::agree_exclude_remote`: a mismatch fails the
    /// same way; a board that cannot be read, or a rank that posts nothing within 2 s,
    /// leaves it to NCCL). Nothing to compare without the `diag` feature.
    pub(crate) fn agree_exclude(&self, call: &'static str, exclude: &[usize]) -> Result<()> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            let mut list = exclude.to_vec();
            list.sort_unstable();
            let deadline = std::time::Instant::now() + s.settings.timeout;
            let here = s.clique.agree_exclude(s.rank, &list, deadline);
            let agreed = match here {
                // Then with the ranks of other processes, through the desync board.
                clique::ExcludeAgreement::Agree => {
                    s.clique.agree_exclude_remote(s.rank, &list, deadline)
                }
                other => other,
            };
            return match agreed {
                clique::ExcludeAgreement::Agree => Ok(()),
                clique::ExcludeAgreement::Mismatch(lists) => Err(Error::ExcludeMismatch {
                    call,
                    rank: s.rank,
                    lists,
                }),
                clique::ExcludeAgreement::Missing(ranks) => Err(Error::Timeout {
                    what: format!("{call} on rank {}: {} of this process, staying by this rank's exclude list {list:?}, never called the shrink (stuck, or not told to recover); nothing was called, the communicator is as it was", s.rank, (ranks.iter().map(|r| format!("rank {r}"))).collect::<Vec<_>>().join(", ")),
                    timeout: s.settings.timeout,
                }),
            };
        }
        let _ = (call, exclude);
        Ok(())
    }

    /// Whether the watchdog failed this communicator: its clique timed out (set before any
    /// abort starts) or it was aborted. Two loads; no NCCL call.
    #[inline]
    pub(crate) fn failed(&self) -> bool {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            return s.clique.any_timeout() || s.aborted_by_watchdog.load(Ordering::Acquire);
        }
        false
    }

    /// Whether work of this communicator was seen captured into a CUDA graph (a capturing
    /// stream, or a marker that read back as a captured event: `Shared::captured`). One
    /// load; no driver call.
    pub(crate) fn captured(&self) -> bool {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            return s.captured.load(Ordering::Relaxed);
        }
        false
    }

    /// A group's call ran out of time with its communicators pinned (so the watchdog could
    /// not time it out): the clique is timed out here as the watchdog would have (every rank
    /// fails fast with this report), and the caller gets the error.
    ///
    /// The report is the desync report of the group's first collective on this
    /// communicator, as the watchdog's for a single collective: it names the ranks behind
    /// (so [`lost_rank`](Self::lost_rank) names the one rank behind, for a shrink).
    #[cold]
    pub(crate) fn group_timed_out(&self, what: String) -> Error {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            let first = s.staged().into_iter().min_by_key(|r| (r.seq, r.enqueued));
            let report = match first {
                Some(rec) => s.time_out(&rec, &what, true),
                None => s.clique.set_timed_out(&TimeoutReport::text(&what)),
            };
            return s.timeout_error(&report.text);
        }
        Error::Timeout {
            what,
            timeout: self.timeout(),
        }
    }

    /// A group's end failed with `e`, not a timeout (its communicators were pinned through
    /// the call). NCCL's remote error (a peer's abort broke the clique while the group
    /// waited) after a rank left (here, or in a process that posted its departure to the
    /// board) fails the clique for that departure, as [`end_error`](Self::end_error) does
    /// for a single call, so every rank, an idle one too, sees `is_failed()`: even if the
    /// departed rank issued the group's collectives, a communicator that returned NCCL's
    /// remote error can run no collective any more. The caller keeps its error.
    ///
    /// When the clique had already timed out (another rank's group or operation timed out,
    /// and its abort or revoke failed this group), returns the error the crate gives for
    /// such a peer timeout ([`Error::Timeout`] with the first report), as for a single
    /// call, in place of NCCL's remote error.
    #[cold]
    pub(crate) fn group_failed(&self, e: &Error) -> Option<Error> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            if let Some(first) = s.clique.timed_out() {
                if e.code() == Some(crate::error::ResultCode::Timeout) {
                    return None;
                }
                let rec = s.staged().into_iter().min_by_key(|r| (r.seq, r.enqueued))?;
                return Some(s.peer_timeout(&rec, &first));
            }
        }
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            if e.code() != Some(crate::error::ResultCode::RemoteError) {
                return None;
            }
            let c = &s.clique;
            let d = (c.departed_other_than(s.rank))
                .or_else(|| c.remote_departure(s.rank))
                .cloned()?;
            // The group's first operation on this communicator, still staged (the failed
            // end published nothing), for the report.
            let rec = s.staged().into_iter().next();
            c.fail_for_departure(&d, Some(s.rank), rec.as_ref());
        }
        let _ = e;
        None
    }

    /// Polled during a host-provider group's end (run inside the call, its communicators
    /// pinned, so the watchdog cannot abort them): `true` once an operation of the group
    /// (staged on a queue, not yet published) needs a rank that left, the clique failed
    /// for that departure, once, naming the rank. Reads only the diagnostics' own state
    /// (never the provider's), so a provider's wait may poll it.
    #[cfg_attr(not(feature = "host"), allow(dead_code))]
    pub(crate) fn peer_departed(&self) -> bool {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get().filter(|s| s.clique.has_departure()) {
            if s.clique.any_timeout() {
                return true;
            }
            for rec in s.staged() {
                if let Some(d) = s.clique.waits_for_departed(s.rank, &rec) {
                    let d = d.clone();
                    s.clique.fail_for_departure(&d, Some(s.rank), Some(&rec));
                    return true;
                }
            }
        }
        false
    }

    /// After `ncclGroupEnd` enqueued a group's operations: they are now on their streams,
    /// published on every queue they used (marked first, with exact completion).
    /// On the host provider, whose group's end ran the work inside the call, the group's
    /// operations are marked completed.
    pub(crate) fn publish_group(&self) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            let ran = s.host_queue.as_ref().map(|q| {
                let from = q.published.load(Ordering::Acquire);
                from..q.staged.load(Ordering::Acquire)
            });
            s.publish_staged();
            if let Some(ran) = ran {
                finish_queued(s, ran, OpState::Completed);
            }
        }
    }

    /// A group's end failed (NCCL launched nothing of it, or its wait timed out or was
    /// broken): its operations still queued on this communicator are marked failed, so its
    /// flight record and reports never show them completed.
    pub(crate) fn group_end_failed(&self) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            for q in s.queue_list().iter() {
                let from = q.published.load(Ordering::Acquire);
                finish_queued(s, from..q.staged.load(Ordering::Acquire), OpState::Failed);
            }
        }
    }

    /// Claims the handle for an NCCL call that is not an operation (a poll, a
    /// registration, a destroy, a group's end): the watchdog never aborts it until
    /// [`unpin`](Self::unpin). `Ok(false)` when nothing was pinned here (not attached yet,
    /// or already pinned); an error when the watchdog aborts it.
    ///
    /// Inside an operation it pins too: `wait_ready`'s polls of an operation that left
    /// NCCL asynchronous work are calls of their own, and an old operation may be claimed
    /// between two of them, so each poll stands in for the operation (and `unpin` gives it
    /// back). Without that, a poll past its `check_alive` reached an aborted handle
    /// (`tests/claim_model.rs`, `mutant_pin_inside_an_operation_pins_nothing_is_caught`).
    pub(crate) fn pin(&self) -> Result<bool> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            if s.aborted_by_watchdog.load(Ordering::Acquire) {
                return Err(self.aborted_error(s));
            }
            let cur = s.current.load(Ordering::Relaxed);
            if cur == PINNED {
                return Ok(false);
            }
            s.current.store(PINNED, Ordering::Release);
            fence::light(s.asym);
            if s.claim.load(Ordering::Acquire) != UNCLAIMED && !s.await_decision() {
                s.current.store(cur, Ordering::Release);
                return Err(self.aborted_error(s));
            }
            self.pinned_from.set(cur);
            return Ok(true);
        }
        Ok(false)
    }

    /// A group's end begins with this communicator pinned: until
    /// [`group_end_done`](Self::group_end_done), the watchdog's notice looks at the
    /// group's operations (staged, not yet published) as at an operation inside its call.
    pub(crate) fn group_end_begins(&self) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            s.group_ending.store(true, Ordering::Release);
        }
    }

    /// The group's end is over (launched, or failed).
    pub(crate) fn group_end_done(&self) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            s.group_ending.store(false, Ordering::Release);
        }
    }

    /// Ends a [`pin`](Self::pin) that returned `Ok(true)`: `current` is again what it was
    /// (idle, or the operation the pin stood in for).
    pub(crate) fn unpin(&self) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            if s.current.load(Ordering::Relaxed) == PINNED {
                s.current
                    .store(self.pinned_from.replace(IDLE), Ordering::Release);
            }
        }
    }

    /// The timeout of this communicator's operations (and of its init).
    pub(crate) fn timeout(&self) -> Duration {
        self.settings.timeout
    }

    /// The lane of the communicator's teardowns: its CUDA device (`cuda`: its ordinal), or
    /// on the host provider the unique id its family was born from.
    pub(crate) fn lane(&self, cuda: Option<usize>) -> TeardownLane {
        cuda.map_or(TeardownLane::Host(self.root), TeardownLane::Device)
    }

    /// The bound on its teardowns ([`Config::abort_timeout`](crate::Config::abort_timeout),
    /// extended as [`bound`](Self::bound) says).
    pub(crate) fn abort_timeout(&self) -> Duration {
        self.bound().bound
    }

    /// The bound and the policy past it (extended for the other ranks of its clique in
    /// this process, with NVIDIA's NCCL: see `Shared::teardown_bound`).
    pub(crate) fn bound(&self) -> Bound {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            return s.teardown_bound();
        }
        self.settings.bound()
    }

    /// When the watchdog took this communicator's handle: waits until `until` for its
    /// abort. `None` when the watchdog did not take it; `Some(None)` when its abort is
    /// still running at `until`.
    pub(crate) fn watchdog_abort(
        &self,
        until: Instant,
    ) -> Option<(Duration, Option<nccl_sys::ncclResult_t>)> {
        #[cfg(feature = "diag")]
        if let Some(s) = self
            .shared
            .get()
            .filter(|s| s.aborted_by_watchdog.load(Ordering::Acquire))
        {
            // The watchdog queues the job right after it takes the handle.
            let job: Arc<Task> = loop {
                let job = lock(&s.abort_task).clone();
                match job {
                    Some(j) => break j,
                    None if Instant::now() >= until => {
                        return Some((self.settings.abort_timeout, None));
                    }
                    None => std::thread::sleep(Duration::from_millis(1)),
                }
            };
            let done = job.wait(until.max(Instant::now() + teardown::MIN_WAIT));
            return Some((job.bound, done.then(|| job.result())));
        }
        None
    }

    /// A stream not among the recent ones: noted in the shared list, cached here.
    #[cfg(feature = "diag")]
    #[cold]
    #[inline(never)]
    fn note_stream(&self, s: &Shared, stream: &Arc<cudarc::driver::CudaStream>) -> Arc<QueueWatch> {
        let q = s.note_queue(Queue::Cuda(Arc::clone(stream)));
        let mut recent = self.recent_queues.borrow_mut();
        if let Some(old) = recent[RECENT_QUEUES - 1].take() {
            // Leaving the cache: the events its retired ranges kept are spare again (else
            // every stream used once would keep them).
            s.reclaim_parked(&old);
        }
        recent.rotate_right(1);
        recent[0] = Some(Arc::clone(&q));
        q
    }

    /// The watch of `stream`'s queue: one of the recent ones, or noted now.
    #[cfg(feature = "diag")]
    #[inline(always)]
    fn publish_on(&self, s: &Shared, stream: &Arc<cudarc::driver::CudaStream>, upto: u64) {
        let key = stream.cu_stream() as usize;
        {
            let recent = self.recent_queues.borrow();
            if let Some(q) = recent.iter().flatten().find(|q| q.key == key) {
                mark_then_publish(s, q, upto);
                return;
            }
        }
        let q = self.note_stream(s, stream);
        mark_then_publish(s, &q, upto);
    }

    /// Notes that rank `rank` of `world_size` began its init in this process.
    pub(crate) fn arrive(&self, rank: usize, world_size: usize) {
        #[cfg(feature = "diag")]
        {
            let mut a = lock(&ARRIVALS);
            if a.len() >= MAX_ARRIVAL_TABLES && !a.contains_key(&self.key) {
                a.clear(); // old ids' tables: bounded memory in a long run
            }
            let seen = a.entry(self.key).or_insert_with(|| vec![false; world_size]);
            if seen.len() == world_size && rank < world_size {
                seen[rank] = true;
            }
        }
    }

    /// The report of a wait for `call` (an init, a split child) that ran out of time.
    pub(crate) fn wait_timeout_report(&self, call: &str, rank: usize, world_size: usize) -> String {
        #[cfg(feature = "diag")]
        if let Some(seen) = lock(&ARRIVALS)
            .get(&self.key)
            .filter(|v| v.len() == world_size && world_size > 0)
        {
            let (yes, no): (Vec<usize>, Vec<usize>) = (0..world_size).partition(|&r| seen[r]);
            return format!(
                "{call} on rank {rank} of {world_size} did not complete: ranks never seen here: {no:?} (not started, dead, or in another process); ranks that began their init in this process: {yes:?}"
            );
        }
        format!("{call} on rank {rank} of {world_size} did not complete")
    }

    #[cfg(feature = "diag")]
    #[cold]
    fn aborted_error(&self, s: &Shared) -> Error {
        s.timeout_error(&s.abort_report())
    }

    /// Before the NCCL call of `op`: fails when the watchdog aborted the communicator,
    /// records the operation, runs the fingerprint check (when on) and registers it with
    /// the watchdog. No lock and no allocation unless it fails.
    #[inline(always)]
    pub(crate) fn begin<'a>(
        &self,
        h: CommView<'_>,
        op: OpInfo<'a>,
        caller: &'static Location<'static>,
    ) -> Result<InFlight<'a>> {
        #[cfg(not(feature = "diag"))]
        let (pos, start) = (0, 0);
        #[cfg(feature = "diag")]
        let (pos, start) = {
            let s = self.shared(h);
            if s.aborted_by_watchdog.load(Ordering::Acquire) {
                return Err(self.aborted_error(s));
            }
            let seq = if op.collective {
                bump(&s.seq, 1)
            } else {
                s.seq.load(Ordering::Relaxed)
            };
            let start = s.now();
            let pos = s.journal.push(&Entry {
                seq,
                name: op.name,
                dtype: op.dtype,
                count: op.count,
                root: op.root.map(|r| r as usize),
                caller,
                enqueued: start,
                queue: match op.stream {
                    StreamRef::Cuda(stream) => stream.cu_stream() as usize,
                    StreamRef::Host => s.host_queue.as_ref().map_or(0, |q| q.key),
                },
            });
            if s.clique.any_timeout() && !self.recovering.get() {
                return Err(self.begin_timed_out(s, pos, start));
            }
            if s.settings.check && op.collective && !in_group() {
                self.fingerprint(s, pos, start)?;
            }
            // Inside an open group the communicator is pinned (claimed) until the group ends.
            if s.current.load(Ordering::Relaxed) != PINNED {
                s.current.store(pos + 1, Ordering::Release);
                fence::light(s.asym);
                if s.claim.load(Ordering::Acquire) != UNCLAIMED {
                    self.begin_claimed(s, pos, start)?;
                }
            }
            (pos, start)
        };
        Ok(InFlight {
            pos,
            start,
            stream: op.stream,
        })
    }

    /// The clique timed out before this operation reached NCCL.
    #[cfg(feature = "diag")]
    #[cold]
    fn begin_timed_out(&self, s: &Shared, pos: u64, start: u64) -> Error {
        let first = s
            .timed_out()
            .unwrap_or_else(|| TimeoutReport::text("a timeout"));
        let rec = s.journal.get(pos);
        let e = match &rec {
            Some(r) => s.peer_timeout(r, &first),
            None => s.timeout_error(&first),
        };
        self.fail(s, pos, start, e)
    }

    /// The watchdog claimed this communicator as the operation began: waits for its
    /// decision. `Ok` when it let the communicator be.
    #[cfg(feature = "diag")]
    #[cold]
    fn begin_claimed(&self, s: &Shared, pos: u64, start: u64) -> Result<()> {
        if s.await_decision() {
            return Ok(());
        }
        s.current.store(IDLE, Ordering::Release);
        let e = self.aborted_error(s);
        Err(self.fail(s, pos, start, e))
    }

    /// The opt-in fingerprint check: waits for every rank of the clique in this process to
    /// post the same collective.
    #[cfg(feature = "diag")]
    #[inline(never)]
    fn fingerprint(&self, s: &Shared, pos: u64, start: u64) -> Result<()> {
        let Some(rec) = s.journal.get(pos) else {
            return Ok(());
        };
        bump(&s.checks, 1);
        let deadline = rec.enqueued + s.settings.timeout;
        let e = match s.clique.agree(s.rank, rec, deadline) {
            Agreement::Agree => return Ok(()),
            Agreement::Mismatch(table) => Error::CollectiveMismatch {
                call: rec.op.name(),
                rank: s.rank,
                seq: rec.seq,
                table,
            },
            Agreement::TimedOut(Some(first)) => s.peer_timeout(&rec, &first),
            Agreement::TimedOut(None) => {
                let what = "waited for the other ranks in the fingerprint check";
                s.timeout_error(&s.time_out(&rec, what, true))
            }
        };
        Err(self.fail(s, pos, start, e))
    }

    /// Marks the operation and the communicator failed, dumps the record, returns `e`.
    #[cfg(feature = "diag")]
    #[cold]
    fn fail(&self, s: &Shared, pos: u64, start: u64, e: Error) -> Error {
        let took = s.now().saturating_sub(start);
        s.journal.finish(pos, OpState::Failed, took);
        bump(&s.wait_ns, took);
        s.dump();
        e
    }

    /// After the NCCL call: deregisters the operation from the watchdog (CUDA: hands it
    /// over as an event), records its outcome and time, and turns an error caused by a
    /// watchdog abort into [`Error::Timeout`] with the report.
    #[inline(always)]
    pub(crate) fn end(&self, t: InFlight<'_>, r: Result<()>) -> Result<()> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            let now = s.now();
            // Leaving the call needs no fence: a claim made meanwhile is seen by the next
            // operation's check (and teardown takes the handle with a swap). A pinned
            // communicator (an open group) stays pinned.
            if s.current.load(Ordering::Relaxed) != PINNED {
                s.current.store(IDLE, Ordering::Release);
            }
            let took = now.saturating_sub(t.start);
            // Hand the work to the watchdog, on its own queue: plain stores, no call into CUDA.
            let state = match (&r, t.stream) {
                (Err(_), _) => OpState::Failed,
                (Ok(()), StreamRef::Cuda(stream)) => {
                    self.publish_on(s, stream, t.pos + 1);
                    OpState::Enqueued
                }
                (Ok(()), StreamRef::Host) => {
                    if let Some(q) = &s.host_queue {
                        publish(q, t.pos + 1);
                    }
                    // Inside an open group the operation is only queued: the group's end
                    // runs it, and marks it (`publish_group`, `group_end_failed`).
                    if in_group() {
                        OpState::Enqueued
                    } else {
                        OpState::Completed
                    }
                }
            };
            s.journal.finish(t.pos, state, took);
            bump(&s.wait_ns, took);
            return r.map_err(|e| self.end_error(s, t.pos, e));
        }
        r
    }

    #[cfg(feature = "diag")]
    #[cold]
    fn end_error(&self, s: &Shared, pos: u64, e: Error) -> Error {
        let e = match s.journal.get(pos) {
            Some(rec) => explain(s, &rec, e),
            None => e,
        };
        s.dump();
        e
    }

    /// Before teardown: the owner's wait for its own work, until `limit`, an abort, or a
    /// timeout of the clique. On each queue with work in flight (only those: another
    /// stream's backlog is not this communicator's) it marks what is not marked yet
    /// (nothing, with exact completion) and polls the markers; a queue capturing into a
    /// graph is not waited for. `false` when the communicator must be aborted rather than
    /// destroyed (its work did not complete, a driver error, its clique timed out, or the
    /// watchdog took it).
    pub(crate) fn drain(&self, limit: Instant) -> bool {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            if s.current.load(Ordering::Acquire) != IDLE {
                return false; // left inside a call (an unwinding panic): abort
            }
            let busy: Vec<(Arc<QueueWatch>, u64)> = (s.queue_list().iter())
                .filter(|q| q.in_flight())
                .map(|q| (Arc::clone(q), q.published.load(Ordering::Acquire)))
                .collect();
            loop {
                let mut all = true;
                for (q, upto) in &busy {
                    s.track_queue(q);
                    let capturing = q.watch().capturing;
                    all &= capturing || q.retired.load(Ordering::Acquire) >= *upto;
                }
                let failed = s.cuda_fault.get().is_some()
                    || s.aborted_by_watchdog.load(Ordering::Acquire)
                    || s.clique.any_timeout();
                if all || failed || Instant::now() >= limit {
                    return all && !failed;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        true
    }

    /// Before `destroy`: drains, and refuses (marking the communicator failed, so dropping
    /// it aborts) when its clique timed out.
    pub(crate) fn before_teardown(&self) -> Result<()> {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            let limit =
                Instant::now() + self.settings.timeout + clock::TICK + Duration::from_secs(1);
            if self.drain(limit) {
                return Ok(());
            }
            let first = s
                .timed_out()
                .unwrap_or_else(|| TimeoutReport::text("work did not complete"));
            return Err(s.timeout_error(&format!(
                "ncclCommDestroy on rank {}: refused (drop the communicator to abort it) because its clique timed out:\n{first}\n=> the communicator's work",
                s.rank
            )));
        }
        Ok(())
    }

    /// Takes the right to tear the handle down: `false` when the watchdog already aborted
    /// it (then nobody may use it again).
    ///
    /// `departing`: how the rank leaves its clique (a teardown; `None` for `into_raw`), so
    /// peers that wait for a collective it never issued fail at once, and whether by an
    /// abort (then the clique fails at once: no collective of it can complete again).
    pub(crate) fn release(&self, departing: Option<(&str, bool)>) -> bool {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            // Under `in_place`: a watchdog's revoke in place never meets a handle taken here.
            // A revoke that blocks in NCCL holds it: waited for at most the abort bound,
            // then the handle is the watchdog's worker's to abort once the revoke returns
            // (`Shared::lock_in_place`), and `abort()` waits for that as for any it took.
            let mine = match s.lock_in_place(self.settings.abort_timeout) {
                Some(held) => {
                    s.gone.store(true, Ordering::Release);
                    let mine = s.handle.swap(0, Ordering::AcqRel) != 0;
                    drop(held);
                    mine
                }
                None => false,
            };
            let view = s.view();
            s.clique.detach(s.rank, view);
            if let Some((how, broken)) = departing {
                s.clique
                    .depart(s.rank, view, s.recent_collectives(), how, broken);
            }
            return mine;
        }
        true
    }

    /// The communicator's init failed (`why`): this rank never joins its clique, so no
    /// collective of it can complete, and the clique fails at once (every rank's
    /// `is_failed()`), as for a rank that left by a panic. Its drop then aborts it.
    pub(crate) fn init_failed(&self, rank: usize, world_size: usize, why: &str) {
        // Not attached yet (that follows a complete init): the clique of the ranks whose
        // init completed, found by its key.
        #[cfg(feature = "diag")]
        {
            let clique = match self.shared.get() {
                Some(s) => Arc::clone(&s.clique),
                None => clique::join(self.key, world_size.max(1)),
            };
            let how = format!("its init failed ({why})");
            clique.depart(rank, RankView::default(), Vec::new(), &how, true);
        }
    }

    /// The rank's code is done with its communicator (its launcher closure returned): a
    /// peer that waits for a collective it never issued fails at once, naming it.
    pub(crate) fn leave(&self, how: &str) {
        #[cfg(feature = "diag")]
        if let Some(s) = self.shared.get() {
            s.clique
                .depart(s.rank, s.view(), s.recent_collectives(), how, false);
        }
    }
}

/// The error of `rec`, this rank's operation that NCCL failed with `e`: the watchdog's
/// report when it aborted the communicator or its clique timed out, else `e`, having failed
/// the clique for a departure the failure shows.
#[cfg(feature = "diag")]
#[cold]
fn explain(s: &Shared, rec: &OpRecord, e: Error) -> Error {
    if s.aborted_by_watchdog.load(Ordering::Acquire) {
        let r = s.abort_report();
        if r.is_about(s.rank, rec.op, rec.seq) {
            return s.timeout_error(&r);
        }
        return s.peer_timeout(rec, &r);
    }
    if let Some(first) = s.clique.timed_out() {
        return s.peer_timeout(rec, &first);
    }
    // A collective that a departed rank never issued failed at once (a provider that breaks
    // the clique with a peer's abort, as the host provider does): no collective of the
    // clique can complete any more, as when the departure finds a rank already waiting.
    // Fail the clique so that every rank sees it (`is_failed()`); the caller keeps the
    // provider's own error. The same for a call the departed rank did issue that NCCL
    // failed with its remote error (a peer's abort, say, while this rank's part of it was
    // still in flight): a communicator that returned an error can run no collective any
    // more.
    let remote = e.code() == Some(crate::error::ResultCode::RemoteError);
    let departed = s.clique.waits_for_departed(s.rank, rec).or_else(|| {
        remote
            .then(|| s.clique.departed_other_than(s.rank))
            .flatten()
    });
    if let Some(d) = departed {
        s.clique.fail_for_departure(d, Some(s.rank), Some(rec));
        return e;
    }
    if !remote {
        return e;
    }
    let died = died_rank(s);
    // A peer's remote error with no departure known here: a rank of another process that
    // left (say, it panicked) posted why to the job's desync board before its teardown woke
    // this rank. Then the error names it and how it left, as for a rank of this process.
    if let Some(d) = s.clique.remote_departure(s.rank) {
        let first = s.clique.fail_for_departure(d, Some(s.rank), Some(rec));
        return s.peer_timeout(rec, &first);
    }
    // No departure on the board, but the provider names a rank whose process is gone (a
    // SIGKILLed process posts nothing): that rank is the clique's departure, so that every
    // survivor knows which rank it lost (`lost_rank()`); the provider's words stand.
    if let Some((r, how)) = died {
        let d = s.clique.depart_elsewhere(r, rec.seq, how);
        s.clique.fail_for_departure(d, Some(s.rank), Some(rec));
        return e;
    }
    // No departure on the board either, but ranks of other processes posted that they wait
    // in this collective: one of them aborted the clique, its watchdog timed out (say) a
    // moment before this rank's would have. The board tells whom they waited for: this
    // rank's report names the rank behind, as theirs do, rather than "rank N called
    // ncclCommAbort". (With no such post, the provider's error stands: "rank N died", say.)
    if s.clique.remote_waiting(rec.seq) {
        let first = s.time_out(rec, "failed with a peer's remote error", false);
        return s.peer_timeout(rec, &first);
    }
    e
}

/// The rank whose process the host provider saw gone while this communicator's clique
/// waited for it (a SIGKILLed process posts nothing on the desync board), and how it left.
/// NVIDIA's NCCL names no rank in its remote errors: `None` there, and for a handle the
/// watchdog already took.
#[cfg(feature = "diag")]
fn died_rank(s: &Shared) -> Option<(usize, String)> {
    #[cfg(feature = "host")]
    if s.lib.provider() == Provider::Host {
        let raw = s.handle.load(Ordering::Acquire) as ncclComm_t;
        let (rank, pid) = (!raw.is_null())
            .then(|| crate::host::dead_peer(raw))
            .flatten()?;
        return (rank < s.world_size && rank != s.rank).then(|| {
            let how = format!("its process (pid {pid}) is gone (it died or was killed)");
            (rank, how)
        });
    }
    #[cfg(not(feature = "host"))]
    let _ = s;
    None
}

/// Every rank of this communicator's clique that the host provider knows gone (across
/// processes: a process that died, a communicator torn down). Empty for NVIDIA's NCCL,
/// which names no rank, and for a handle the watchdog already took.
#[cfg(feature = "diag")]
fn dead_ranks(s: &Shared) -> Vec<usize> {
    #[cfg(feature = "host")]
    if s.lib.provider() == Provider::Host {
        let raw = s.handle.load(Ordering::Acquire) as ncclComm_t;
        if raw.is_null() {
            return Vec::new();
        }
        return crate::host::dead_peers(raw)
            .into_iter()
            .map(|(r, _)| r)
            .collect();
    }
    #[cfg(not(feature = "host"))]
    let _ = s;
    Vec::new()
}

/// [`publish`] of a CUDA operation's work: marked first, at enqueue, when completion is
/// exact and no group is open (a group's work is marked when it ends).
#[cfg(feature = "diag")]
#[inline(always)]
fn mark_then_publish(s: &Shared, q: &QueueWatch, upto: u64) {
    if s.settings.exact && !in_group() {
        s.mark_at_enqueue(q, upto);
    }
    publish(q, upto);
}

/// Marks the operations at journal positions `range` that are still enqueued (a group's,
/// whose end decided their fate) `state`, with the time since they were issued: one read
/// of the diagnostics clock for the whole group (coarse by default, as a single
/// operation's), none of the system clock.
#[cfg(feature = "diag")]
#[inline]
fn finish_queued(s: &Shared, range: std::ops::Range<u64>, state: OpState) {
    if range.is_empty() {
        return;
    }
    let now = s.now();
    for pos in range {
        s.journal.finish_enqueued(pos, state, now);
    }
}

/// Publishes an operation's work on its queue (staged until the end of an open group).
#[cfg(feature = "diag")]
#[inline(always)]
fn publish(q: &QueueWatch, upto: u64) {
    if in_group() {
        q.staged.store(upto, Ordering::Release);
    } else {
        q.published.store(upto, Ordering::Release);
    }
}

/// A rank's diagnostics counters (the straggler view).
#[cfg(feature = "diag")]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Diagnostics {
    /// The communicator's rank.
    pub rank: usize,
    /// Collectives issued (the next one's sequence number).
    pub collectives: u64,
    /// Operations issued (collectives, send/recv, split, ...).
    pub operations: u64,
    /// Time spent inside operations (waiting for peers, the fingerprint check and the
    /// work; on CUDA only the enqueue).
    pub wait: Duration,
    /// Fingerprint checks run (0 when the check is off).
    pub fingerprint_checks: u64,
    /// Whether the fingerprint check is on.
    pub check_enabled: bool,
    /// Whether times come from the precise clock ([`Config::timing`](crate::Config::timing)); otherwise `wait`
    /// has the coarse clock's 10 ms resolution (right on average over many operations).
    pub precise_timing: bool,
    /// The watchdog's timeout.
    pub timeout: Duration,
    /// Whether the watchdog aborted this communicator.
    pub aborted_by_watchdog: bool,
}

/// Adds `by` to a counter that only the communicator's owning thread writes (others only
/// read it): a load and a store, no read-modify-write, so no locked instruction on the
/// per-operation path. Returns the old value.
#[cfg(feature = "diag")]
#[inline]
fn bump(counter: &AtomicU64, by: u64) -> u64 {
    let old = counter.load(Ordering::Relaxed);
    counter.store(old.wrapping_add(by), Ordering::Relaxed);
    old
}

#[cfg(all(test, feature = "host", feature = "diag"))]
mod tests {
    use super::*;
    use crate::diag::journal::Entry;
    use crate::diag::shared::{ABORTING, DECIDING};
    use crate::{CommDevice, Communicator, Config, ReduceOp, Stream};

    /// Polls `done` every `every` until it holds or `within` has passed.
    fn wait_for(within: Duration, every: Duration, done: impl Fn() -> bool) {
        let limit = Instant::now() + within;
        while !done() && Instant::now() < limit {
            std::thread::sleep(every);
        }
    }

    /// The host provider's (created, destroyed, aborted, misused) of `id`'s communicators.
    fn counts(id: &UniqueId) -> (u64, u64, u64, u64) {
        let s = crate::host::stats_for(&id.to_raw());
        (s.created, s.destroyed, s.aborted, s.misused)
    }

    fn comm() -> (Communicator, UniqueId) {
        let id = CommDevice::Host.unique_id().unwrap();
        let c = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new()).unwrap();
        (c, id)
    }

    fn sum(c: &Communicator) -> Result<()> {
        let mut x = vec![1.0f32; 4];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
    }

    /// In 30 ms, the watchdog's verdict on a claim of `s`: it aborts the communicator with
    /// `report`, as its sweep would.
    fn abort_soon(s: &Arc<Shared>, report: &'static str) -> std::thread::JoinHandle<()> {
        let s = Arc::clone(s);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            s.claim.store(ABORTING, Ordering::Release);
            let h = s.take_for_abort(&TimeoutReport::text(report));
            assert_ne!(h, 0);
            // SAFETY: the handle was taken out of the communicator above: its one teardown.
            let r = unsafe { (s.lib.table().ncclCommAbort)(h as ncclComm_t) };
            assert_eq!(r, nccl_sys::bindings::ncclSuccess);
        })
    }

    /// The owner's side of the claim: an operation that finds the watchdog deciding waits
    /// for the verdict; let be, it runs; aborted, it fails without reaching NCCL.
    #[test]
    fn an_operation_waits_for_the_watchdogs_verdict() {
        let (c, id) = comm();
        let s = Arc::clone(c.diag.shared(c.diag_view()));
        s.claim.store(DECIDING, Ordering::SeqCst);
        let t = {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                s.claim.store(UNCLAIMED, Ordering::Release);
            })
        };
        let start = Instant::now();
        sum(&c).expect("the watchdog let it be");
        assert!(start.elapsed() >= Duration::from_millis(25));
        t.join().unwrap();
        assert_eq!(crate::host::stats_for(&id.to_raw()).misused, 0);

        s.claim.store(DECIDING, Ordering::SeqCst);
        let t = abort_soon(&s, "the test's report");
        let e = sum(&c).expect_err("aborted");
        t.join().unwrap();
        assert!(
            matches!(&e, Error::Timeout { what, .. } if what.contains("the test's report")),
            "{e}"
        );
        assert!(matches!(sum(&c), Err(Error::Timeout { .. })));
        let last = c.flight_record().entries.last().copied().unwrap();
        assert_eq!(last.state, OpState::Failed);
        drop(c);
        assert_eq!(counts(&id), (1, 0, 1, 0));
    }

    /// A counting tracker that expects its calls on this thread.
    fn counting_here() -> Arc<tracker::counting::Counting> {
        Arc::new(tracker::counting::Counting::new(
            std::thread::current().id(),
        ))
    }

    /// A one-rank host communicator whose watched work goes through `counting`.
    fn counted(
        counting: &Arc<tracker::counting::Counting>,
        timeout: Duration,
    ) -> (Communicator, UniqueId) {
        let id = CommDevice::Host.unique_id().unwrap();
        TEST_TRACKER.with(|t| *t.borrow_mut() = Some(Arc::clone(counting) as Arc<dyn Tracker>));
        let c = Communicator::init_rank(
            &CommDevice::Host,
            1,
            0,
            &id,
            &Config::new().timeout(timeout),
        );
        TEST_TRACKER.with(|t| *t.borrow_mut() = None);
        (c.unwrap(), id)
    }

    /// The per-operation path makes no tracker call (no CUDA event record or query on a
    /// CUDA stream) on the caller's thread: the watchdog records at most one marker per
    /// queue per tick, on its own thread, and the work is still seen to complete.
    #[test]
    fn the_per_operation_path_never_calls_the_tracker() {
        let counting = counting_here();
        let (c, _id) = counted(&counting, Duration::from_secs(600));
        let ticks_before = clock::coarse();
        const OPS: u64 = 2000;
        for _ in 0..OPS {
            sum(&c).unwrap();
        }
        let marks_during_ops = counting.marks.load(Ordering::SeqCst);
        let ticks = (clock::coarse() - ticks_before) / clock::TICK.as_nanos() as u64;
        assert_eq!(counting.owner_marks.load(Ordering::SeqCst), 0);
        assert_eq!(counting.owner_queries.load(Ordering::SeqCst), 0);
        assert!(
            marks_during_ops <= ticks + 2,
            "{marks_during_ops} markers in {ticks} ticks for {OPS} operations"
        );
        let s = Arc::clone(c.diag.shared(c.diag_view()));
        let retired = || (s.host_queue.as_ref()).map_or(0, |q| q.retired.load(Ordering::Acquire));
        wait_for(Duration::from_secs(10), Duration::from_millis(5), || {
            retired() >= OPS
        });
        assert_eq!(retired(), OPS, "the watchdog retired every operation");
        assert!(counting.marks.load(Ordering::SeqCst) >= 1);
        eprintln!(
            "{OPS} operations: {} markers and {} queries, all on the watchdog's thread, over {ticks} ticks",
            counting.marks.load(Ordering::SeqCst),
            counting.queries.load(Ordering::SeqCst)
        );
        drop(s);
        c.destroy().map_err(|(_, e)| e).unwrap();
    }

    /// Markers recorded at enqueue (exact completion) stay bounded when the work runs far
    /// behind: past `MAX_PENDING` in flight on a queue, the newest is recorded again and its
    /// range extended; once they complete, every position is retired.
    #[test]
    fn markers_at_enqueue_are_bounded_and_retire_everything() {
        let counting = counting_here();
        counting.complete.store(false, Ordering::SeqCst);
        let (c, _id) = counted(&counting, Duration::from_secs(600));
        let s = Arc::clone(c.diag.shared(c.diag_view()));
        let q = Arc::new(QueueWatch::new(
            Queue::Host(7),
            true,
            Arc::clone(&s.tracker),
        ));
        const N: u64 = 3 * tracker::MAX_PENDING as u64;
        for upto in 1..=N {
            s.mark_at_enqueue(&q, upto);
            q.published.store(upto, Ordering::Release);
        }
        let pending = q.pending();
        assert_eq!(pending.len(), tracker::MAX_PENDING);
        assert_eq!(q.ranges.marked(), N);
        assert_eq!(pending.last(), Some(&(N, true)));
        assert_eq!(counting.owner_now_marks.load(Ordering::SeqCst), N);
        // Marked already: the watchdog's tick records nothing for this queue.
        let marks = counting.marks.load(Ordering::SeqCst);
        s.track_queue(&q);
        assert_eq!(counting.marks.load(Ordering::SeqCst), marks);
        assert_eq!(q.retired.load(Ordering::Acquire), 0);
        counting.complete.store(true, Ordering::SeqCst);
        s.track_queue(&q);
        assert_eq!(q.retired.load(Ordering::Acquire), N);
        assert!(q.pending().is_empty());
        drop(s);
        c.destroy().map_err(|(_, e)| e).unwrap();
    }

    /// Past `MAX_PENDING` in flight, on a stream whose captures alternate with work that
    /// runs: a marker is not recorded again into a capture (the tracker refuses, and the
    /// captured operation joins the newest range as it is), and the next one recorded again
    /// outside covers it, so the queue stays within `MAX_PENDING` ranges, each with a
    /// marker, and everything retires once complete; while the watchdog retires some of
    /// them, the owner's next ranges take the freed slots.
    #[test]
    fn markers_at_enqueue_stay_bounded_when_captures_alternate_with_work() {
        let counting = counting_here();
        counting.complete.store(false, Ordering::SeqCst);
        let (c, _id) = counted(&counting, Duration::from_secs(600));
        let s = Arc::clone(c.diag.shared(c.diag_view()));
        let q = Arc::new(QueueWatch::new(
            Queue::Host(7),
            true,
            Arc::clone(&s.tracker),
        ));
        const N: u64 = 4 * tracker::MAX_PENDING as u64;
        for upto in 1..=N {
            // Work first, then alternately one captured operation and one that runs.
            let captured = upto > tracker::MAX_PENDING as u64 && upto % 2 == 0;
            counting.capturing.store(captured, Ordering::SeqCst);
            s.mark_at_enqueue(&q, upto);
            q.published.store(upto, Ordering::Release);
            let pending = q.pending();
            assert!(
                pending.len() <= tracker::MAX_PENDING,
                "{} ranges after operation {upto}",
                pending.len()
            );
            assert!(pending.iter().all(|p| p.1), "a range without a marker");
            assert_eq!(pending.last().map(|p| p.0), Some(upto));
            if upto == 2 * tracker::MAX_PENDING as u64 {
                // The watchdog retires everything so far: the ring empties and refills.
                counting.complete.store(true, Ordering::SeqCst);
                s.track_queue(&q);
                assert_eq!(q.retired.load(Ordering::Acquire), upto);
                counting.complete.store(false, Ordering::SeqCst);
            }
        }
        counting.capturing.store(false, Ordering::SeqCst);
        counting.complete.store(true, Ordering::SeqCst);
        s.track_queue(&q);
        assert_eq!(q.retired.load(Ordering::Acquire), N);
        assert!(q.pending().is_empty());
        drop(s);
        c.destroy().map_err(|(_, e)| e).unwrap();
    }

    /// The queues a communicator's watch keeps are bounded, the least recently noted going
    /// first: a rank that makes a new stream per step leaks nothing.
    #[test]
    fn the_watched_queues_are_bounded_and_least_recently_noted_go_first() {
        let (c, _id) = comm();
        let s = Arc::clone(c.diag.shared(c.diag_view()));
        let keys =
            |s: &Shared| -> Vec<usize> { s.queues.lock().unwrap().iter().map(|q| q.key).collect() };
        for k in 1..=40 {
            s.note_queue(Queue::Host(k));
        }
        assert_eq!(keys(&s), (25..=40).collect::<Vec<_>>());
        s.note_queue(Queue::Host(25)); // noted again: now the most recent
        s.note_queue(Queue::Host(41)); // drops 26, the least recent
        let k = keys(&s);
        assert_eq!(k.len(), MAX_QUEUES);
        assert!(!k.contains(&26) && k.ends_with(&[25, 41]), "{k:?}");
        drop(s);
        c.destroy().map_err(|(_, e)| e).unwrap();
    }

    /// The watchdog's side: an idle host communicator is never claimed, an operation only
    /// once it is old enough, and a claim ends in a verdict.
    #[test]
    fn the_watchdog_claims_only_an_old_operation() {
        let (c, id) = comm();
        let s = Arc::clone(c.diag.shared(c.diag_view()));
        let later = Instant::now() + Duration::from_secs(3600);
        assert!(!s.claim(later, Duration::ZERO));
        let push = || {
            s.journal.push(&Entry {
                seq: 0,
                name: nccl_sys::EntryPoint::ncclAllReduce,
                dtype: None,
                count: 0,
                root: None,
                caller: Location::caller(),
                enqueued: clock::precise(),
                queue: 0,
            })
        };
        let first = push();
        let pos = push();
        s.current.store(pos + 1, Ordering::Release);
        assert!(!s.claim(Instant::now(), Duration::from_secs(60)));
        assert_eq!(s.claim.load(Ordering::Acquire), UNCLAIMED);
        // The watchdog saw the first operation in its call, but the owner has moved on to
        // the next one since: after the fence it sees that and withdraws the claim.
        assert!(!s.claim_seen(first + 1, later, Duration::from_secs(60)));
        assert_eq!(s.claim.load(Ordering::Acquire), UNCLAIMED);
        assert!(s.claim(later, Duration::from_secs(60)));
        assert_eq!(s.claim.load(Ordering::Acquire), ABORTING);
        // Undo the claim (nothing was taken) for an ordinary teardown.
        s.claim.store(UNCLAIMED, Ordering::Release);
        s.current.store(IDLE, Ordering::Release);
        drop(s);
        c.destroy().map_err(|(_, e)| e).unwrap();
        assert_eq!(counts(&id), (1, 1, 0, 0));
    }

    /// Two children of one parent made at the same sequence number with the same tag
    /// (two shrinks of one exclude list) get distinct clique keys, the same on every rank;
    /// a rank that was excluded from an earlier shrink (so never made it) still derives the
    /// keys of the later ones as its peers do.
    #[test]
    fn children_made_at_one_point_get_distinct_keys() {
        let (c, _id) = comm();
        let (drop3, drop2) = (shrink_tag(&[3]), shrink_tag(&[2]));
        assert_ne!(drop3, drop2);
        assert_eq!(
            shrink_tag(&[1, 3]),
            shrink_tag(&[3, 1]),
            "the order of the list"
        );
        let a = c.diag.child(drop3);
        let b = c.diag.child(drop3);
        assert_ne!(a.key, b.key);
        let d = c.diag.child(drop2);
        assert_ne!(d.key, a.key);
        assert_ne!(d.key, b.key);
        assert_eq!(
            a.root, b.root,
            "children share the teardown lane of their family"
        );
        let other = || CommDiag::new(c.diag.settings.clone(), c.diag.key, c.diag.root);
        // Another rank of the parent (same parent key, same order) derives the same keys.
        let o = other();
        assert_eq!(o.child(drop3).key, a.key);
        assert_eq!(o.child(drop3).key, b.key);
        assert_eq!(o.child(drop2).key, d.key);
        // Rank 3, excluded from the shrinks that drop it, made only the one dropping 2.
        assert_eq!(other().child(drop2).key, d.key);
        c.destroy().map_err(|(_, e)| e).unwrap();
    }

    /// A pinned communicator (inside a call on its handle that is not an operation, or
    /// an open group) is never claimed by the watchdog, even with work in flight; a pin
    /// taken while the watchdog decides waits for the verdict, and fails when it aborts.
    #[test]
    fn a_pinned_communicator_is_never_claimed() {
        let counting = counting_here();
        counting.complete.store(false, Ordering::SeqCst);
        let (c, id) = counted(&counting, Duration::from_secs(600));
        sum(&c).unwrap();
        let s = Arc::clone(c.diag.shared(c.diag_view()));
        wait_for(Duration::from_secs(5), Duration::from_millis(2), || {
            s.in_flight()
        });
        assert!(s.in_flight());
        let later = Instant::now() + Duration::from_secs(3600);
        assert!(c.diag.pin().unwrap(), "pinned");
        assert!(!c.diag.pin().unwrap(), "a pin inside a pin is a no-op");
        assert!(!s.claim(later, Duration::ZERO), "claimed while pinned");
        assert_eq!(s.claim.load(Ordering::Acquire), UNCLAIMED);
        c.diag.unpin();
        // Idle with work in flight: claimable again (then the claim is undone).
        assert!(s.claim(later, Duration::ZERO));
        s.claim.store(DECIDING, Ordering::SeqCst);
        let t = abort_soon(&s, "the test's abort");
        let e = c.diag.pin().expect_err("the watchdog aborts it");
        assert!(
            matches!(&e, Error::Timeout { what, .. } if what.contains("the test's abort")),
            "{e}"
        );
        t.join().unwrap();
        counting.complete.store(true, Ordering::SeqCst);
        drop(s);
        drop(c);
        assert_eq!(counts(&id), (1, 0, 1, 0));
    }

    /// A user's revoke is the watchdog's too: three ranks with `Config::elastic` and a
    /// 200 ms timeout whose work stays in flight after the revoke (markers that never
    /// complete, as a GPU's may not by the watchdog's next tick). Ranks 0 and 1 revoke;
    /// past the timeout the watchdog leaves their handles be (NCCL would refuse its own
    /// revoke, init.cc:2655-2657 of v2.29.7-1, and it would abort them instead), and their
    /// `shrink_after_failure(&[2])` makes a working communicator of two. Before, the
    /// watchdog's revoke was refused (a misuse the host provider counts), it aborted the
    /// handles, and the shrink failed.
    #[test]
    fn the_watchdog_leaves_a_users_revoke_be() {
        let id = CommDevice::Host.unique_id().unwrap();
        let cfg = Config::new()
            .elastic(true)
            .timeout(Duration::from_millis(200));
        // Ranks 0 and 1 count themselves done; rank 2 waits for them (bounded: a rank
        // that panicked never counts).
        let done = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for rank in 0..3 {
                let (cfg, done) = (cfg.clone(), &done);
                sc.spawn(move || {
                    let counting = counting_here();
                    counting.complete.store(false, Ordering::SeqCst);
                    TEST_TRACKER.with(|t| {
                        *t.borrow_mut() = Some(Arc::clone(&counting) as Arc<dyn Tracker>)
                    });
                    let c = Communicator::init_rank(&CommDevice::Host, 3, rank, &id, &cfg);
                    TEST_TRACKER.with(|t| *t.borrow_mut() = None);
                    let c = c.unwrap();
                    let mut x = vec![1.0f32; 4];
                    c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
                        .unwrap();
                    if rank < 2 {
                        c.revoke().unwrap();
                    }
                    // Past the timeout, with the work still in flight to the watchdog.
                    std::thread::sleep(Duration::from_millis(800));
                    if rank < 2 {
                        assert!(!c.diag.aborted_by_watchdog(), "rank {rank}: aborted");
                        let small = c.shrink_after_failure(&[2]).unwrap();
                        let mut y = vec![rank as f32 + 1.0; 4];
                        small
                            .all_reduce_in_place(&mut y, ReduceOp::Sum, &Stream::Host)
                            .unwrap();
                        assert_eq!(y, vec![3.0; 4]);
                        small.destroy().map_err(|(_, e)| e).unwrap();
                        done.fetch_add(1, Ordering::SeqCst);
                    } else {
                        wait_for(Duration::from_secs(10), Duration::from_millis(5), || {
                            done.load(Ordering::SeqCst) == 2
                        });
                    }
                    drop(c);
                });
            }
        });
        let (created, _, _, misused) = counts(&id);
        assert_eq!((created, misused), (5, 0));
    }
}
