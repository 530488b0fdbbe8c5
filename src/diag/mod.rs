//! Diagnostics: a watchdog that turns hangs into errors, a flight recorder of recent
//! operations, a desync report, an opt-in collective fingerprint check, and per-rank wait
//! times (DESIGN.md, decision 8).
//!
//! Everything hooks into the one path every operation takes (`Communicator::issue`):
//!
//! * **Watchdog.** Each communicator has a timeout ([`Config::timeout`], else
//!   `NCCL_SAFE_TIMEOUT_MS`, else [`DEFAULT_TIMEOUT`]). An operation is registered before
//!   its NCCL call and deregistered when it completes (host provider: when the call returns;
//!   CUDA: when an event recorded after it completes). One process-wide thread (started
//!   with the first communicator) aborts, inside one NCCL group, every in-flight
//!   communicator of a clique whose operation ran out of time. The watchdog *takes* each
//!   handle it aborts out of the communicator's shared slot, so the communicator's own
//!   teardown skips it: every handle is torn down exactly once. The calls that were woken
//!   (and any later call on that clique in this process) return [`Error::Timeout`] with the
//!   desync report.
//! * **Flight recorder.** A preallocated ring of the last N operations
//!   ([`Config::flight_record_len`], default 64) of `Copy` entries: recording never
//!   allocates. [`Communicator::flight_record`] copies it; it is printed to stderr on a
//!   timeout or error with `NCCL_SAFE_DEBUG=info|detail` or [`Config::dump_on_failure`], and
//!   written as JSON to [`Config::flight_record_dir`] (or `NCCL_SAFE_FLIGHT_RECORD_DIR`).
//! * **Desync report.** Ranks of one clique in this process read each other's last operation; a
//!   timeout reports which ranks are behind, what each was last doing and from which line.
//!   Ranks in other processes come from the job's desync board ([`Config::desync_board`],
//!   set by `ProcessLauncher::init`): the report posts this process's ranks to it and reads
//!   the others' posts (only then: nothing is sent per operation).
//! * **Fingerprint check** (opt-in: [`Config::check_collectives`] or
//!   `NCCL_SAFE_DEBUG=detail`): before each collective the ranks compare (sequence number,
//!   operation, type, count, root); on a mismatch every rank gets
//!   [`Error::CollectiveMismatch`] with a table of what each rank called and where, and
//!   nothing reaches NCCL. Off, none of it runs.
//! * **Straggler view.** [`Communicator::diagnostics`] reports the time spent inside
//!   collectives.
//!
//! **Cost.** The per-operation path takes no lock, makes no read-modify-write, reads no
//! system clock and allocates nothing: about a dozen plain stores into the record's ring
//! slot (a sequence lock: `journal`), a load of the coarse clock (`clock`, advanced by the
//! watchdog every 10 ms; [`Config::timing`] switches to `Instant::now()`), and a compiler
//! fence paired with the watchdog's `membarrier(2)` (`fence`) to keep the owner and the
//! watchdog from ever both using a handle (where membarrier is refused, or with
//! `NCCL_SAFE_NO_MEMBARRIER=1`, a full fence on each side instead). An operation on a
//! CUDA stream also records an event after itself (events are reused) and queues it under
//! a per-communicator lock that only the watchdog shares. `cargo bench --bench overhead`
//! measures the host path against a raw call.
//!
//! Not done: the cross-process fingerprint exchange, watching `ncclGroupEnd`, and
//! fingerprints of operations inside a [`crate::Group`] (they are recorded, not compared).

mod aborter;
mod clique;
mod clock;
pub(crate) mod exit;
mod fence;
mod journal;
mod recorder;
pub(crate) mod remote;
mod tracker;
mod watchdog;

use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::Location;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use nccl_sys::ncclComm_t;

pub use aborter::{OnAbortTimeout, ABORT_TIMEOUT_EXIT_STATUS, DEFAULT_ABORT_TIMEOUT};
pub use exit::EXIT_GRACE;
pub use recorder::{FlightRecord, OpRecord, OpState};
pub use remote::{DesyncPost, MAX_POST_TEXT};

/// Whether the owner's side of the watchdog handshake is a compiler fence paired with the
/// watchdog's `membarrier(2)` (`true`), or a full memory fence on every operation
/// (`false`: membarrier is unavailable or refused, e.g. by a container's seccomp filter,
/// or `NCCL_SAFE_NO_MEMBARRIER` is set). For the overhead benchmark, which prints it.
#[doc(hidden)]
pub fn asymmetric_fence() -> bool {
    fence::asymmetric()
}

use crate::comm::Communicator;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::id::UniqueId;
use crate::library::{Library, Provider};
use crate::stream::StreamRef;
use crate::types::DataType;
use clique::{Agreement, Clique, CliqueKey, RankView};
use journal::{Entry, Journal};
use tracker::{Mark, Marker, Queue, Tracker};

/// The watchdog's default timeout: 10 minutes, as PyTorch's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The flight recorder's default length.
pub const DEFAULT_FLIGHT_RECORD_LEN: usize = 64;

/// The diagnostics options of a [`Config`] (unset: environment, then defaults).
#[derive(Debug, Clone, Default)]
pub(crate) struct DiagConfig {
    timeout: Option<Duration>,
    check: Option<bool>,
    ring: Option<usize>,
    dump_dir: Option<PathBuf>,
    dump_stderr: Option<bool>,
    precise: Option<bool>,
    abort_timeout: Option<Duration>,
    on_abort_timeout: Option<OnAbortTimeout>,
    /// The job's desync board in another process (not inherited by children).
    board: Option<Arc<dyn remote::RemoteBoard>>,
}

impl Config {
    /// [`timing`](Self::timing), unless it was set.
    pub(crate) fn timing_unless_set(mut self, precise: bool) -> Config {
        self.diag.precise.get_or_insert(precise);
        self
    }

    /// Sets the remote desync board (see `launch::desync`).
    pub(crate) fn remote_board(mut self, board: Arc<dyn remote::RemoteBoard>) -> Config {
        self.diag.board = Some(board);
        self
    }

    /// The watchdog's timeout for every operation of the communicator (default
    /// `NCCL_SAFE_TIMEOUT_MS`, else 10 minutes). Children from split/shrink inherit it.
    pub fn timeout(mut self, timeout: Duration) -> Config {
        self.diag.timeout = Some(timeout);
        self
    }

    /// Turns the collective fingerprint check on or off (default: on with
    /// `NCCL_SAFE_DEBUG=detail`). Every rank must use the same setting.
    pub fn check_collectives(mut self, on: bool) -> Config {
        self.diag.check = Some(on);
        self
    }

    /// How many operations the flight recorder keeps (default 64, or
    /// `NCCL_SAFE_FLIGHT_RECORD_LEN`; 0 turns recording off).
    pub fn flight_record_len(mut self, len: usize) -> Config {
        self.diag.ring = Some(len);
        self
    }

    /// Writes the flight record as JSON into `dir` on a timeout or error (default
    /// `NCCL_SAFE_FLIGHT_RECORD_DIR`, else nowhere).
    pub fn flight_record_dir(mut self, dir: impl Into<PathBuf>) -> Config {
        self.diag.dump_dir = Some(dir.into());
        self
    }

    /// Prints the flight record to stderr on a timeout or error (default: with
    /// `NCCL_SAFE_DEBUG=info` or `detail`).
    pub fn dump_on_failure(mut self, on: bool) -> Config {
        self.diag.dump_stderr = Some(on);
        self
    }

    /// Times every operation with the precise clock (default: with `NCCL_SAFE_TIMING=1` or
    /// `NCCL_SAFE_DEBUG=info|detail`; children inherit it).
    ///
    /// Off, the watchdog, the flight recorder and [`Diagnostics::wait`] use a coarse clock
    /// that the watchdog advances every 10 ms: a load of about 1 ns instead of two
    /// `Instant::now()` calls (which add about 50 ns an operation: `cargo bench --bench
    /// overhead`). Timeouts still fire within a tick of their deadline; per-operation times read as whole ticks, and sums over many
    /// operations are right on average. [`crate::launch::Launcher::run_report`] turns it
    /// on for its communicators.
    pub fn timing(mut self, precise: bool) -> Config {
        self.diag.precise = Some(precise);
        self
    }

    /// The bound on an abort (default `NCCL_SAFE_ABORT_TIMEOUT_MS`, else
    /// [`DEFAULT_ABORT_TIMEOUT`], 30 s). NVIDIA's `ncclCommAbort` can block for ever
    /// behind a stuck stream, so aborts run on a thread of their own: the watchdog never
    /// waits for one, and a communicator's drop waits at most this long. Past it,
    /// [`on_abort_timeout`](Self::on_abort_timeout) applies. Children inherit it.
    pub fn abort_timeout(mut self, bound: Duration) -> Config {
        self.diag.abort_timeout = Some(bound);
        self
    }

    /// What happens to an abort still running at its
    /// [`abort_timeout`](Self::abort_timeout) (default `NCCL_SAFE_ON_ABORT_TIMEOUT=report|exit`,
    /// else [`OnAbortTimeout::Report`]). Children inherit it.
    pub fn on_abort_timeout(mut self, action: OnAbortTimeout) -> Config {
        self.diag.on_abort_timeout = Some(action);
        self
    }
}

/// A config's options resolved against the environment.
#[derive(Debug, Clone)]
struct Settings {
    timeout: Duration,
    check: bool,
    ring: usize,
    dump_dir: Option<PathBuf>,
    dump_stderr: bool,
    precise: bool,
    abort_timeout: Duration,
    on_abort_timeout: OnAbortTimeout,
}

impl Settings {
    fn resolve(c: &DiagConfig) -> Settings {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let debug = env("NCCL_SAFE_DEBUG").map(|v| v.trim().to_ascii_lowercase());
        let detail = debug.as_deref() == Some("detail");
        let info = detail || debug.as_deref() == Some("info");
        Settings {
            timeout: c.timeout.unwrap_or_else(|| {
                env("NCCL_SAFE_TIMEOUT_MS")
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map_or(DEFAULT_TIMEOUT, Duration::from_millis)
            }),
            check: c.check.unwrap_or(detail),
            ring: c.ring.unwrap_or_else(|| {
                env("NCCL_SAFE_FLIGHT_RECORD_LEN")
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(DEFAULT_FLIGHT_RECORD_LEN)
            }),
            dump_dir: c
                .dump_dir
                .clone()
                .or_else(|| env("NCCL_SAFE_FLIGHT_RECORD_DIR").map(PathBuf::from)),
            dump_stderr: c.dump_stderr.unwrap_or(info),
            precise: c.precise.unwrap_or_else(|| {
                info || env("NCCL_SAFE_TIMING").is_some_and(|v| {
                    matches!(
                        v.trim().to_ascii_lowercase().as_str(),
                        "1" | "true" | "on" | "yes"
                    )
                })
            }),
            abort_timeout: c.abort_timeout.unwrap_or_else(|| {
                env("NCCL_SAFE_ABORT_TIMEOUT_MS")
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map_or(DEFAULT_ABORT_TIMEOUT, Duration::from_millis)
            }),
            on_abort_timeout: c.on_abort_timeout.unwrap_or_else(|| {
                match env("NCCL_SAFE_ON_ABORT_TIMEOUT")
                    .map(|v| v.trim().to_ascii_lowercase())
                    .as_deref()
                {
                    Some("exit") => OnAbortTimeout::ExitProcess,
                    _ => OnAbortTimeout::Report,
                }
            }),
        }
    }
}

thread_local! {
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Called after `ncclGroupStart` by [`crate::Group`]: operations are only queued until the
/// group ends, so they are not fingerprint-checked (one thread may drive several ranks).
pub(crate) fn group_started() {
    GROUP_DEPTH.with(|d| d.set(d.get() + 1));
}

/// Called after `ncclGroupEnd` by [`crate::Group`].
pub(crate) fn group_ended() {
    GROUP_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
}

fn in_group() -> bool {
    GROUP_DEPTH.with(|d| d.get() > 0)
}

/// What an operation is, as `issue` records and checks it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpInfo<'a> {
    name: &'static &'static str,
    collective: bool,
    dtype: Option<DataType>,
    count: usize,
    root: Option<usize>,
    stream: StreamRef<'a>,
}

impl<'a> OpInfo<'a> {
    /// An operation moving `count` elements of `dtype` on `stream`, with its root or peer.
    #[inline]
    pub(crate) fn new(
        name: &'static &'static str,
        dtype: DataType,
        count: usize,
        root: Option<usize>,
        stream: StreamRef<'a>,
    ) -> OpInfo<'a> {
        OpInfo {
            name,
            collective: is_collective(name),
            dtype: Some(dtype),
            count,
            root,
            stream,
        }
    }

    /// The NCCL call.
    #[inline]
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }
}

/// Collectives get a sequence number and a fingerprint; send/recv (called by two ranks)
/// and shrink (not called by the excluded ranks) do not.
#[inline]
fn is_collective(name: &str) -> bool {
    !matches!(name, "ncclSend" | "ncclRecv" | "ncclCommShrink")
}

impl From<&'static &'static str> for OpInfo<'static> {
    #[inline]
    fn from(name: &'static &'static str) -> Self {
        OpInfo {
            name,
            collective: is_collective(name),
            dtype: None,
            count: 0,
            root: None,
            stream: StreamRef::Host,
        }
    }
}

/// At most this many unique ids' arrival boards are kept (see `CommDiag::arrive`).
const MAX_ARRIVAL_BOARDS: usize = 256;

/// Per clique key: which ranks began their init in this process.
fn arrivals() -> &'static Mutex<std::collections::HashMap<CliqueKey, Vec<bool>>> {
    static A: OnceLock<Mutex<std::collections::HashMap<CliqueKey, Vec<bool>>>> = OnceLock::new();
    A.get_or_init(|| Mutex::new(std::collections::HashMap::new()))
}

/// `Shared::current` while no operation of the communicator is inside its NCCL call.
const IDLE: u64 = 0;

/// `Shared::claim`: the watchdog leaves the communicator alone.
const UNCLAIMED: u8 = 0;
/// `Shared::claim`: the watchdog is deciding whether to abort it (for microseconds).
const DECIDING: u8 = 1;
/// `Shared::claim`: the watchdog aborts it; its handle must not be used again.
const ABORTING: u8 = 2;

/// Work in flight as the watchdog tracks it (see `tracker`).
#[derive(Debug, Default)]
struct Watch {
    /// Positions below this have markers recorded after them (or were retired).
    marked: u64,
    /// Marked ranges not yet known complete, oldest first.
    pending: VecDeque<Pending>,
    /// A queue was capturing into a CUDA graph at the last attempt to mark.
    capturing: bool,
}

/// The operations at journal positions `from..upto`, with one marker per queue.
#[derive(Debug)]
struct Pending {
    from: u64,
    upto: u64,
    /// The oldest operation's enqueue time (diagnostics clock) and record, if still known.
    oldest: Option<OpRecord>,
    markers: Vec<Marker>,
}

/// One communicator's diagnostics state, shared with the watchdog thread and its clique.
///
/// The per-operation path (the owning thread) takes no lock and makes no read-modify-write:
/// the journal is a sequence-locked ring, the counters have one writer, and the owner and
/// the watchdog agree on who may use the handle through an asymmetric fence (`fence`).
#[derive(Debug)]
pub(crate) struct Shared {
    rank: usize,
    world_size: usize,
    settings: Settings,
    lib: Arc<Library>,
    clique: Arc<Clique>,
    /// Learns when queued work finished (the watchdog's and teardown's only).
    tracker: Arc<dyn Tracker>,
    /// The queues (streams) this communicator's operations used.
    queues: Mutex<Vec<Queue>>,
    /// Positions below this have had their work queued (the owner's plain store after
    /// each operation; a group's at its end).
    published: AtomicU64,
    /// Positions below this are known complete.
    retired: AtomicU64,
    watch: Mutex<Watch>,
    journal: Journal,
    /// The raw handle while it may be torn down; 0 once taken. Whoever swaps it out (the
    /// owner's teardown or the watchdog's abort) is its one teardown.
    handle: AtomicUsize,
    /// [`IDLE`], or the journal position + 1 of the operation inside its NCCL call.
    /// Written only by the owner.
    current: AtomicU64,
    /// [`UNCLAIMED`], [`DECIDING`] or [`ABORTING`]. Written only by the watchdog. The
    /// owner stores `current`, fences ([`fence::light`]) and loads this before each NCCL
    /// call; the watchdog stores this, fences ([`fence::heavy`]) and loads `current`
    /// before it aborts. So either the owner sees the claim and does not make the call, or
    /// the watchdog sees the owner's new operation and lets it be.
    claim: AtomicU8,
    /// Whether [`fence::asymmetric`] is in use.
    asym: bool,
    /// The report of the timeout that made the watchdog abort this communicator.
    report: Mutex<Option<Arc<str>>>,
    aborted_by_watchdog: AtomicBool,
    /// Torn down by its owner.
    gone: AtomicBool,
    seq: AtomicU64,
    wait_ns: AtomicU64,
    checks: AtomicU64,
}

impl Shared {
    /// Diagnostics clock time (coarse unless precise timing is on).
    #[inline]
    fn now(&self) -> u64 {
        if self.settings.precise {
            clock::precise()
        } else {
            clock::coarse()
        }
    }

    /// How far past its nominal deadline the watchdog may see an operation's clock time
    /// (the coarse clock lags by up to a tick).
    fn slack(&self) -> Duration {
        if self.settings.precise {
            Duration::ZERO
        } else {
            clock::TICK
        }
    }

    fn watch(&self) -> MutexGuard<'_, Watch> {
        self.watch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether published work is not yet known complete.
    fn in_flight(&self) -> bool {
        self.retired.load(Ordering::Acquire) < self.published.load(Ordering::Acquire)
    }

    /// The watchdog's tick for this communicator: retires ranges whose markers completed,
    /// then records one marker per queue after whatever was published since the last tick.
    fn track(&self) {
        let published = self.published.load(Ordering::Acquire);
        let mut w = self.watch();
        if w.pending.is_empty() && w.marked >= published {
            return;
        }
        self.retire_done(&mut w);
        if published > w.marked {
            let queues = self
                .queues
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let mut markers = Vec::with_capacity(queues.len());
            w.capturing = false;
            for q in &queues {
                match self.tracker.mark(q) {
                    Mark::Marker(m) => markers.push(m),
                    Mark::Capturing => w.capturing = true,
                    Mark::Unwatched => {}
                }
            }
            if w.capturing {
                // Nothing of this range reaches the stream before the capture ends: try
                // again next tick.
                for m in markers {
                    self.tracker.recycle(m);
                }
                return;
            }
            let from = w.marked;
            w.pending.push_back(Pending {
                from,
                upto: published,
                oldest: self.journal.get(from),
                markers,
            });
            w.marked = published;
            self.retire_done(&mut w);
        }
    }

    /// Retires the oldest ranges whose markers all completed.
    fn retire_done(&self, w: &mut Watch) {
        while let Some(p) = w.pending.front() {
            if !p.markers.iter().all(|m| self.tracker.done(m)) {
                break;
            }
            let Some(p) = w.pending.pop_front() else {
                break;
            };
            self.retired.store(p.upto, Ordering::Release);
            for m in p.markers {
                self.tracker.recycle(m);
            }
        }
    }

    /// The oldest tracked operation not known complete, if it is older than `limit`.
    fn late_work(&self, now: Instant, limit: Duration) -> Option<OpRecord> {
        let w = self.watch();
        if w.capturing {
            return None;
        }
        let p = w.pending.front()?;
        let rec = p.oldest.or_else(|| self.journal.get(p.from))?;
        (now.saturating_duration_since(rec.enqueued) >= limit).then_some(rec)
    }

    /// The queue of a host-provider communicator is the communicator itself.
    fn note_host_queue(&self, raw: ncclComm_t) {
        self.queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Queue::Host(raw as usize));
    }

    /// Adds a queue the owner has not used before.
    #[cold]
    fn note_queue(&self, q: Queue) {
        let mut qs = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if !qs.iter().any(|x| x.key() == q.key()) {
            qs.push(q);
        }
    }

    /// The owner's wait for its own work, at teardown: records a marker on each queue and
    /// polls it until `limit`, an abort, or a timeout of the clique. `true` when done.
    fn wait_own_work(&self, limit: Instant) -> bool {
        if !self.in_flight() {
            return true;
        }
        let queues = self
            .queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let markers: Vec<Marker> = queues
            .iter()
            .filter_map(|q| match self.tracker.mark(q) {
                Mark::Marker(m) => Some(m),
                Mark::Capturing | Mark::Unwatched => None,
            })
            .collect();
        let done = loop {
            if markers.iter().all(|m| self.tracker.done(m)) {
                self.retired
                    .store(self.published.load(Ordering::Acquire), Ordering::Release);
                break true;
            }
            if self.aborted_by_watchdog.load(Ordering::Acquire)
                || self.clique.any_timeout()
                || Instant::now() >= limit
            {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        for m in markers {
            self.tracker.recycle(m);
        }
        done
    }

    /// The record at journal position `pos`, with completion of tracked work applied.
    fn record(&self, pos: u64) -> Option<OpRecord> {
        let mut r = self.journal.get(pos)?;
        if r.state == OpState::Enqueued && pos < self.retired.load(Ordering::Acquire) {
            r.state = OpState::Completed;
        }
        Some(r)
    }

    /// What the clique's desync report shows for this rank.
    fn view(&self) -> RankView {
        RankView {
            present: true,
            gone: self.gone.load(Ordering::Acquire),
            issued: self.seq.load(Ordering::Relaxed),
            last: self.journal.last_pos().and_then(|p| self.record(p)),
        }
    }

    fn flight_record(&self) -> FlightRecord {
        FlightRecord {
            rank: self.rank,
            world_size: self.world_size,
            clique: self.clique.key,
            entries: self
                .journal
                .shown()
                .filter_map(|p| self.record(p))
                .collect(),
            taken: Instant::now(),
        }
    }

    /// Prints and/or writes the flight record, as configured.
    #[cold]
    fn dump(&self) {
        if !self.settings.dump_stderr && self.settings.dump_dir.is_none() {
            return;
        }
        let fr = self.flight_record();
        if self.settings.dump_stderr {
            eprintln!("nccl-safe: {fr}");
        }
        if let Some(dir) = &self.settings.dump_dir {
            match fr.write_json(dir) {
                Ok(p) if self.settings.dump_stderr => {
                    eprintln!("nccl-safe: flight record written to {}", p.display())
                }
                Ok(_) => {}
                Err(e) => eprintln!(
                    "nccl-safe: cannot write the flight record to {}: {e}",
                    dir.display()
                ),
            }
        }
    }

    #[cold]
    fn timeout_error(&self, report: &str) -> Error {
        Error::Timeout {
            what: report.to_string(),
            timeout: self.settings.timeout,
        }
    }

    /// The report this communicator's failure is about, if the clique timed out.
    fn timed_out(&self) -> Option<Arc<str>> {
        if self.aborted_by_watchdog.load(Ordering::Acquire) {
            let r = self
                .report
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if r.is_some() {
                return r;
            }
        }
        self.clique.timed_out()
    }

    /// The report of the watchdog's abort of this communicator.
    fn abort_report(&self) -> Arc<str> {
        self.timed_out()
            .unwrap_or_else(|| "the watchdog aborted it".into())
    }

    /// The report for an operation of this rank that was not run (or was woken) because the
    /// clique already timed out.
    #[cold]
    fn peer_timeout(&self, rec: &OpRecord, first: &str) -> Error {
        let what = format!(
            "{} (seq {}) on rank {}, called at {}: a peer timed out, so the watchdog aborted this communicator. The first timeout:\n{first}\n=> {} seq {} on rank {}",
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

    /// Waits for the watchdog's decision on its claim (it takes microseconds): `true`
    /// when it let the communicator be, `false` when it aborts it (then once the abort is
    /// visible, so the error carries its report).
    #[cold]
    fn await_decision(&self) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            match self.claim.load(Ordering::Acquire) {
                UNCLAIMED => return true,
                ABORTING if self.aborted_by_watchdog.load(Ordering::Acquire) => return false,
                _ if Instant::now() >= until => return false,
                _ => std::thread::yield_now(),
            }
        }
    }

    // ---- the watchdog's side ------------------------------------------------------------

    /// The operation that ran out of time at `now` (diagnostics clock), if any.
    fn late(&self, now: Instant) -> Option<OpRecord> {
        let limit = self.settings.timeout + self.slack();
        let cur = self.current.load(Ordering::Acquire);
        if cur != IDLE {
            if let Some(r) = self.journal.get(cur - 1) {
                if now.saturating_duration_since(r.enqueued) >= limit {
                    return Some(r);
                }
            }
        }
        self.late_work(now, limit)
    }

    /// Claims this communicator for an abort at `now`: an operation inside its NCCL call
    /// for at least `min_age` (so its thread is blocked in NCCL, not about to enter), or
    /// idle with CUDA work in flight. `false` when it may not be aborted now.
    fn claim(&self, now: Instant, min_age: Duration) -> bool {
        self.claim_seen(self.current.load(Ordering::Acquire), now, min_age)
    }

    /// [`claim`](Self::claim) from the value `cur` of `current` the watchdog saw.
    fn claim_seen(&self, cur: u64, now: Instant, min_age: Duration) -> bool {
        if cur != IDLE {
            let old = self
                .journal
                .get(cur - 1)
                .is_some_and(|r| now.saturating_duration_since(r.enqueued) >= min_age);
            if !old {
                return false;
            }
        } else if !self.in_flight() {
            return false;
        }
        self.claim.store(DECIDING, Ordering::SeqCst);
        let fenced = fence::heavy(self.asym);
        // Still the same operation (or still idle: then any operation begun meanwhile has
        // already ended) means the owner has not passed a check since the claim was
        // visible, and its next check will see it.
        let same = fenced && self.current.load(Ordering::SeqCst) == cur;
        let verdict = if same { ABORTING } else { UNCLAIMED };
        self.claim.store(verdict, Ordering::Release);
        same
    }

    /// After a successful [`claim`](Self::claim): takes the handle (0 when the owner's
    /// teardown already has it) and marks the communicator aborted with `report`.
    fn take_for_abort(&self, report: &Arc<str>) -> usize {
        let h = self.handle.swap(0, Ordering::AcqRel);
        *self.report.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(report));
        self.aborted_by_watchdog.store(true, Ordering::Release);
        h
    }
}

/// A communicator's diagnostics: its settings and clique, attached (with its handle, rank
/// and size) once they are known.
#[derive(Debug)]
pub(crate) struct CommDiag {
    settings: Settings,
    key: CliqueKey,
    shared: OnceLock<Arc<Shared>>,
    /// The job's desync board, given to the clique on attach.
    board: Option<Arc<dyn remote::RemoteBoard>>,
    /// The key of the queue (stream) the last operation used: the owner's cache, so only a
    /// new stream takes the slow path.
    last_queue: Cell<usize>,
}

#[cfg(test)]
thread_local! {
    /// The tracker communicators attached on this thread use instead of their provider's.
    static TEST_TRACKER: std::cell::RefCell<Option<Arc<dyn Tracker>>> =
        const { std::cell::RefCell::new(None) };
}

/// What [`CommDiag::begin`] hands to [`CommDiag::end`].
#[derive(Debug)]
pub(crate) struct Ticket<'a> {
    /// The operation's journal position.
    pos: u64,
    /// Its start (diagnostics clock).
    start: u64,
    stream: StreamRef<'a>,
}

impl CommDiag {
    /// For a communicator joined through `id`.
    pub(crate) fn for_id(config: &Config, id: &UniqueId) -> CommDiag {
        CommDiag {
            settings: Settings::resolve(&config.diag),
            key: clique::key_of(id.as_bytes()),
            shared: OnceLock::new(),
            board: config.diag.board.clone(),
            last_queue: Cell::new(0),
        }
    }

    /// For one of the communicators of one `ncclCommInitAll` (pass the same `key`).
    pub(crate) fn for_init_all(key: u64) -> CommDiag {
        CommDiag {
            settings: Settings::resolve(&DiagConfig::default()),
            key,
            shared: OnceLock::new(),
            board: None,
            last_queue: Cell::new(0),
        }
    }

    /// A fresh key for [`for_init_all`](Self::for_init_all).
    pub(crate) fn init_all_key() -> u64 {
        clique::fresh_key()
    }

    /// For a child from split (`tag` = color) or shrink: same settings, the key derived
    /// from the parent's, its last collective's sequence number and `tag`.
    pub(crate) fn child(&self, tag: u64) -> CommDiag {
        let seq = self
            .shared
            .get()
            .map_or(0, |s| s.seq.load(Ordering::Relaxed));
        CommDiag {
            settings: self.settings.clone(),
            key: clique::key_of((self.key, seq, tag)),
            shared: OnceLock::new(),
            board: None,
            last_queue: Cell::new(0),
        }
    }

    /// Attaches the communicator once its handle, rank and size are known: it joins its
    /// clique and the watchdog's registry. Allocates the flight recorder.
    pub(crate) fn attach(
        &self,
        raw: ncclComm_t,
        rank: usize,
        world_size: usize,
        lib: &Arc<Library>,
    ) -> &Arc<Shared> {
        self.shared.get_or_init(|| {
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
            let s = Arc::new(Shared {
                rank,
                world_size,
                settings: self.settings.clone(),
                lib: Arc::clone(lib),
                clique: Arc::clone(&clique),
                tracker,
                queues: Mutex::new(Vec::new()),
                published: AtomicU64::new(0),
                retired: AtomicU64::new(0),
                watch: Mutex::new(Watch::default()),
                journal: Journal::new(self.settings.ring),
                handle: AtomicUsize::new(raw as usize),
                current: AtomicU64::new(IDLE),
                claim: AtomicU8::new(UNCLAIMED),
                asym: fence::asymmetric(),
                report: Mutex::new(None),
                aborted_by_watchdog: AtomicBool::new(false),
                gone: AtomicBool::new(false),
                seq: AtomicU64::new(0),
                wait_ns: AtomicU64::new(0),
                checks: AtomicU64::new(0),
            });
            if lib.provider() == Provider::Host {
                s.note_host_queue(raw);
            }
            clique.attach(rank, &s);
            watchdog::watch(&s);
            s
        })
    }

    #[inline(always)]
    fn shared(&self, comm: &Communicator) -> &Arc<Shared> {
        match self.shared.get() {
            Some(s) => s,
            None => self.attach_late(comm),
        }
    }

    #[cold]
    fn attach_late(&self, comm: &Communicator) -> &Arc<Shared> {
        match self.shared.get() {
            Some(s) => s,
            None => self.attach(
                comm.as_raw(),
                comm.rank(),
                comm.world_size(),
                comm.library(),
            ),
        }
    }

    /// Fails when the watchdog aborted this communicator (its handle is gone).
    #[inline]
    pub(crate) fn check_alive(&self) -> Result<()> {
        match self.shared.get() {
            Some(s) if s.aborted_by_watchdog.load(Ordering::Acquire) || s.clique.any_timeout() => {
                Err(self.aborted_error(s))
            }
            _ => Ok(()),
        }
    }

    /// Whether the watchdog failed this communicator: its clique timed out (set before any
    /// abort starts) or it was aborted. Two loads; no NCCL call.
    #[inline]
    pub(crate) fn failed(&self) -> bool {
        self.shared.get().is_some_and(|s| {
            s.clique.any_timeout() || s.aborted_by_watchdog.load(Ordering::Acquire)
        })
    }

    /// After `ncclGroupEnd` enqueued a group's operations: they are now on their streams.
    pub(crate) fn publish_group(&self) {
        if let Some(s) = self.shared.get() {
            s.published.store(s.journal.len(), Ordering::Release);
        }
    }

    /// The abort bound and policy of this communicator.
    pub(crate) fn abort_policy(&self) -> (Duration, OnAbortTimeout) {
        (self.settings.abort_timeout, self.settings.on_abort_timeout)
    }

    /// The timeout of this communicator's operations (and of its init).
    pub(crate) fn timeout(&self) -> Duration {
        self.settings.timeout
    }

    /// Aborts the handle `raw` (taken out of its communicator) on an abort thread and waits
    /// at most the abort bound: the bound, and `ncclCommAbort`'s result if it returned.
    pub(crate) fn abort_off_thread(
        &self,
        lib: &Arc<Library>,
        raw: ncclComm_t,
        what: String,
    ) -> (Duration, Option<nccl_sys::ncclResult_t>) {
        let (bound, action) = self.abort_policy();
        let job = aborter::spawn(Arc::clone(lib), vec![raw as usize], bound, action, what);
        let done = job.wait_bounded();
        (bound, done.then(|| job.result()))
    }

    /// Notes that rank `rank` of `world_size` began its init in this process.
    pub(crate) fn arrive(&self, rank: usize, world_size: usize) {
        let mut a = arrivals().lock().unwrap_or_else(|e| e.into_inner());
        if a.len() >= MAX_ARRIVAL_BOARDS && !a.contains_key(&self.key) {
            a.clear(); // old jobs' boards: bounded memory in a long run
        }
        let seen = a.entry(self.key).or_insert_with(|| vec![false; world_size]);
        if seen.len() == world_size && rank < world_size {
            seen[rank] = true;
        }
    }

    /// The report of a wait for `op` (an init, a split child) that ran out of time.
    pub(crate) fn wait_timeout_report(&self, op: &str, rank: usize, world_size: usize) -> String {
        let a = arrivals().lock().unwrap_or_else(|e| e.into_inner());
        match a
            .get(&self.key)
            .filter(|v| v.len() == world_size && world_size > 0)
        {
            Some(seen) => {
                let (yes, no): (Vec<usize>, Vec<usize>) = (0..world_size).partition(|&r| seen[r]);
                format!(
                    "{op} on rank {rank} of {world_size} did not complete: ranks never seen here: {no:?} (not started, dead, or in another process); ranks that began their init in this process: {yes:?}"
                )
            }
            None => format!("{op} on rank {rank} of {world_size} did not complete"),
        }
    }

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
        comm: &Communicator,
        op: OpInfo<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Ticket<'a>> {
        let s = self.shared(comm);
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
            root: op.root,
            caller,
            enqueued: start,
        });
        if s.clique.any_timeout() {
            return Err(self.begin_timed_out(comm, s, pos, start));
        }
        if s.settings.check && op.collective && !in_group() {
            self.fingerprint(comm, s, pos, start)?;
        }
        s.current.store(pos + 1, Ordering::Release);
        fence::light(s.asym);
        if s.claim.load(Ordering::Acquire) != UNCLAIMED {
            self.begin_claimed(comm, s, pos, start)?;
        }
        Ok(Ticket {
            pos,
            start,
            stream: op.stream,
        })
    }

    /// The clique timed out before this operation reached NCCL.
    #[cold]
    fn begin_timed_out(&self, comm: &Communicator, s: &Shared, pos: u64, start: u64) -> Error {
        let first = s.timed_out().unwrap_or_else(|| "a timeout".into());
        let rec = s.journal.get(pos);
        let e = match &rec {
            Some(r) => s.peer_timeout(r, &first),
            None => s.timeout_error(&first),
        };
        self.fail(comm, s, pos, start, e)
    }

    /// The watchdog claimed this communicator as the operation began: waits for its
    /// decision. `Ok` when it let the communicator be.
    #[cold]
    fn begin_claimed(&self, comm: &Communicator, s: &Shared, pos: u64, start: u64) -> Result<()> {
        if s.await_decision() {
            return Ok(());
        }
        s.current.store(IDLE, Ordering::Release);
        let e = self.aborted_error(s);
        Err(self.fail(comm, s, pos, start, e))
    }

    /// The opt-in fingerprint check: waits for every rank of the clique in this process to
    /// post the same collective.
    #[inline(never)]
    fn fingerprint(&self, comm: &Communicator, s: &Shared, pos: u64, start: u64) -> Result<()> {
        let Some(rec) = s.journal.get(pos) else {
            return Ok(());
        };
        bump(&s.checks, 1);
        let deadline = rec.enqueued + s.settings.timeout;
        let e = match s.clique.agree(s.rank, rec, deadline) {
            Agreement::Agree => return Ok(()),
            Agreement::Mismatch(table) => Error::CollectiveMismatch {
                op: rec.op,
                rank: s.rank,
                seq: rec.seq,
                table,
            },
            Agreement::TimedOut(Some(first)) => s.peer_timeout(&rec, &first),
            Agreement::TimedOut(None) => {
                let report = s.clique.report(
                    s.rank,
                    &rec,
                    s.settings.timeout,
                    "waited for the other ranks in the fingerprint check",
                );
                let report = s.clique.set_timed_out(&Arc::from(report));
                s.timeout_error(&report)
            }
        };
        Err(self.fail(comm, s, pos, start, e))
    }

    /// Marks the operation and the communicator failed, dumps the record, returns `e`.
    #[cold]
    fn fail(&self, comm: &Communicator, s: &Shared, pos: u64, start: u64, e: Error) -> Error {
        let took = s.now().saturating_sub(start);
        s.journal.finish(pos, OpState::Failed, took);
        bump(&s.wait_ns, took);
        comm.mark_failed(&e);
        s.dump();
        e
    }

    /// After the NCCL call: deregisters the operation from the watchdog (CUDA: hands it
    /// over as an event), records its outcome and time, and turns an error caused by a
    /// watchdog abort into [`Error::Timeout`] with the report.
    #[inline(always)]
    pub(crate) fn end(&self, comm: &Communicator, t: Ticket<'_>, r: Result<()>) -> Result<()> {
        let Some(s) = self.shared.get() else {
            return r;
        };
        let now = s.now();
        // Leaving the call needs no fence: a claim made meanwhile is seen by the next
        // operation's check (and teardown takes the handle with a swap).
        s.current.store(IDLE, Ordering::Release);
        let took = now.saturating_sub(t.start);
        let mut state = if r.is_ok() {
            OpState::Completed
        } else {
            OpState::Failed
        };
        if r.is_ok() {
            // Hand the work to the watchdog: plain stores, no call into CUDA.
            if let StreamRef::Cuda(stream) = t.stream {
                let key = stream.cu_stream() as usize;
                if self.last_queue.get() != key {
                    self.last_queue.set(key);
                    s.note_queue(Queue::Cuda(Arc::clone(stream)));
                }
                state = OpState::Enqueued;
            }
            if !in_group() {
                s.published.store(t.pos + 1, Ordering::Release);
            }
        }
        s.journal.finish(t.pos, state, took);
        bump(&s.wait_ns, took);
        match r {
            Ok(()) => Ok(()),
            Err(e) => Err(self.end_error(comm, s, t.pos, e)),
        }
    }

    #[cold]
    fn end_error(&self, comm: &Communicator, s: &Shared, pos: u64, e: Error) -> Error {
        let rec = s.journal.get(pos);
        let e = match (&rec, s.aborted_by_watchdog.load(Ordering::Acquire)) {
            (Some(rec), true) => {
                let r = s.abort_report();
                if r.contains(&format!(
                    "because {} seq {} on rank {} ",
                    rec.op, rec.seq, s.rank
                )) {
                    s.timeout_error(&r)
                } else {
                    s.peer_timeout(rec, &r)
                }
            }
            (Some(rec), false) => match s.clique.timed_out() {
                Some(first) => s.peer_timeout(rec, &first),
                None => e,
            },
            (None, _) => e,
        };
        comm.mark_failed(&e);
        s.dump();
        e
    }

    /// Before teardown: waits (bounded by the watchdog) until no work of this communicator
    /// is in flight. `false` when it must be aborted rather than destroyed (its clique
    /// timed out, or the watchdog already took it).
    pub(crate) fn drain(&self) -> bool {
        let Some(s) = self.shared.get() else {
            return true;
        };
        if s.current.load(Ordering::Acquire) != IDLE {
            return false; // left inside a call (an unwinding panic): abort
        }
        let limit = Instant::now() + s.settings.timeout + s.slack() + Duration::from_secs(1);
        let done = s.wait_own_work(limit);
        done && !s.aborted_by_watchdog.load(Ordering::Acquire) && s.clique.timed_out().is_none()
    }

    /// Before `destroy`: drains, and refuses (marking the communicator failed, so dropping
    /// it aborts) when its clique timed out.
    pub(crate) fn before_teardown(&self, comm: &Communicator) -> Result<()> {
        if self.drain() {
            return Ok(());
        }
        let Some(s) = self.shared.get() else {
            return Ok(());
        };
        let first = s
            .timed_out()
            .unwrap_or_else(|| "work did not complete".into());
        let e = s.timeout_error(&format!(
            "ncclCommDestroy on rank {}: refused (drop the communicator to abort it) because its clique timed out:\n{first}\n=> the communicator's work",
            s.rank
        ));
        comm.mark_failed(&e);
        Err(e)
    }

    /// Takes the right to tear the handle down: `false` when the watchdog already aborted
    /// it (then nobody may use it again).
    pub(crate) fn release(&self) -> bool {
        let Some(s) = self.shared.get() else {
            return true;
        };
        s.gone.store(true, Ordering::Release);
        s.clique.detach(s.rank, s.view());
        s.handle.swap(0, Ordering::AcqRel) != 0
    }
}

/// A rank's diagnostics counters (the straggler view).
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
    /// Whether times come from the precise clock ([`Config::timing`]); otherwise `wait`
    /// has the coarse clock's 10 ms resolution (right on average over many operations).
    pub precise_timing: bool,
    /// The watchdog's timeout.
    pub timeout: Duration,
    /// Whether the watchdog aborted this communicator.
    pub aborted_by_watchdog: bool,
}

impl Communicator {
    /// A copy of the flight recorder: the last operations on this communicator, oldest
    /// first (no NCCL call).
    pub fn flight_record(&self) -> FlightRecord {
        self.diag.shared(self).flight_record()
    }

    /// Writes the flight record as JSON into `dir`; returns the file's path.
    pub fn dump_flight_record(&self, dir: impl AsRef<Path>) -> std::io::Result<PathBuf> {
        self.flight_record().write_json(dir.as_ref())
    }

    /// The diagnostics counters of this rank (no NCCL call).
    pub fn diagnostics(&self) -> Diagnostics {
        let s = self.diag.shared(self);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Communicator, Config, Device, HostStream, ReduceOp};

    fn comm() -> (Communicator, UniqueId) {
        let id = Device::Host.unique_id().unwrap();
        let c = Communicator::init_rank(&Device::Host, 1, 0, &id, &Config::new()).unwrap();
        (c, id)
    }

    fn sum(c: &Communicator) -> Result<()> {
        let mut x = vec![1.0f32; 4];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &HostStream)
    }

    /// The owner's side of the claim: an operation that finds the watchdog deciding waits
    /// for the verdict; let be, it runs; aborted, it fails without reaching NCCL.
    #[test]
    fn an_operation_waits_for_the_watchdogs_verdict() {
        let (c, id) = comm();
        let s = Arc::clone(c.diag.shared(&c));
        s.claim.store(DECIDING, Ordering::SeqCst);
        let decide = |verdict: u8| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                if verdict == ABORTING {
                    s.claim.store(ABORTING, Ordering::Release);
                    let h = s.take_for_abort(&Arc::from("the test's report"));
                    assert_ne!(h, 0);
                    // SAFETY: the handle was taken out of the communicator above: this is
                    // its one teardown.
                    let r = unsafe { (s.lib.table().ncclCommAbort)(h as ncclComm_t) };
                    assert_eq!(r, nccl_sys::bindings::ncclSuccess);
                } else {
                    s.claim.store(verdict, Ordering::Release);
                }
            })
        };
        let t = decide(UNCLAIMED);
        let start = Instant::now();
        sum(&c).expect("the watchdog let it be");
        assert!(start.elapsed() >= Duration::from_millis(25));
        t.join().unwrap();
        assert_eq!(crate::host::stats_for(&id.to_raw()).misused, 0);

        s.claim.store(DECIDING, Ordering::SeqCst);
        let t = decide(ABORTING);
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
        let st = crate::host::stats_for(&id.to_raw());
        assert_eq!(
            (st.created, st.destroyed, st.aborted, st.misused),
            (1, 0, 1, 0)
        );
    }

    /// A one-rank host communicator whose watched work goes through `counting`.
    fn counted(
        counting: &Arc<tracker::counting::Counting>,
        timeout: Duration,
    ) -> (Communicator, UniqueId) {
        let id = Device::Host.unique_id().unwrap();
        TEST_TRACKER.with(|t| *t.borrow_mut() = Some(Arc::clone(counting) as Arc<dyn Tracker>));
        let c = Communicator::init_rank(&Device::Host, 1, 0, &id, &Config::new().timeout(timeout));
        TEST_TRACKER.with(|t| *t.borrow_mut() = None);
        (c.unwrap(), id)
    }

    /// The per-operation path makes no tracker call (no CUDA event record or query on a
    /// CUDA stream) on the caller's thread: the watchdog records at most one marker per
    /// queue per tick, on its own thread, and the work is still seen to complete.
    #[test]
    fn the_per_operation_path_never_calls_the_tracker() {
        let counting = Arc::new(tracker::counting::Counting::new(
            std::thread::current().id(),
        ));
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
        let s = Arc::clone(c.diag.shared(&c));
        let retired = || s.retired.load(Ordering::Acquire);
        let limit = Instant::now() + Duration::from_secs(10);
        while retired() < OPS && Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
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

    /// Work on a queue that is being captured into a CUDA graph is never timed out, and is
    /// tracked again once the capture ends.
    #[test]
    fn captured_work_is_never_timed_out() {
        let counting = Arc::new(tracker::counting::Counting::new(
            std::thread::current().id(),
        ));
        counting.capturing.store(true, Ordering::SeqCst);
        counting.complete.store(false, Ordering::SeqCst);
        let (c, id) = counted(&counting, Duration::from_millis(50));
        sum(&c).unwrap();
        std::thread::sleep(Duration::from_millis(400)); // 8 timeouts' worth
        assert!(!c.is_failed(), "captured work must not time out");
        let s = Arc::clone(c.diag.shared(&c));
        assert_eq!(s.retired.load(Ordering::Acquire), 0);
        // The capture ends; the work it captured never runs on the stream, so the first
        // marker after it completes.
        counting.capturing.store(false, Ordering::SeqCst);
        counting.complete.store(true, Ordering::SeqCst);
        let limit = Instant::now() + Duration::from_secs(10);
        while s.retired.load(Ordering::Acquire) < 1 && Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(s.retired.load(Ordering::Acquire), 1);
        assert!(!c.is_failed());
        drop(s);
        c.destroy().map_err(|(_, e)| e).unwrap();
        let st = crate::host::stats_for(&id.to_raw());
        assert_eq!((st.created, st.destroyed, st.aborted), (1, 1, 0));
    }

    /// Work that never completes is timed out by the watchdog, and the communicator fails.
    #[test]
    fn incomplete_work_times_out() {
        let counting = Arc::new(tracker::counting::Counting::new(
            std::thread::current().id(),
        ));
        counting.complete.store(false, Ordering::SeqCst);
        let (c, id) = counted(&counting, Duration::from_millis(50));
        sum(&c).unwrap();
        let limit = Instant::now() + Duration::from_secs(2);
        while !c.is_failed() && Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(c.is_failed());
        assert!(matches!(sum(&c), Err(Error::Timeout { .. })));
        drop(c);
        let st = crate::host::stats_for(&id.to_raw());
        assert_eq!(
            (st.created, st.destroyed, st.aborted, st.misused),
            (1, 0, 1, 0)
        );
    }

    /// The watchdog's side: an idle host communicator is never claimed, an operation only
    /// once it is old enough, and a claim ends in a verdict.
    #[test]
    fn the_watchdog_claims_only_an_old_operation() {
        let (c, id) = comm();
        let s = Arc::clone(c.diag.shared(&c));
        let later = Instant::now() + Duration::from_secs(3600);
        assert!(!s.claim(later, Duration::ZERO));
        let push = || {
            s.journal.push(&Entry {
                seq: 0,
                name: &"ncclAllReduce",
                dtype: None,
                count: 0,
                root: None,
                caller: Location::caller(),
                enqueued: clock::precise(),
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
        let st = crate::host::stats_for(&id.to_raw());
        assert_eq!((st.created, st.destroyed, st.aborted), (1, 1, 0));
    }
}
