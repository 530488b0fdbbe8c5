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
//! * **Desync report.** Ranks of one clique in this process share their last operation; a
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
//! Not done: the cross-process fingerprint exchange, watching `ncclGroupEnd`, and fingerprints of operations inside a
//! [`crate::Group`] (they are recorded, not compared).

mod clique;
mod recorder;
pub(crate) mod remote;
mod watchdog;

use std::cell::Cell;
use std::panic::Location;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};
use nccl_sys::ncclComm_t;

pub use recorder::{FlightRecord, OpRecord, OpState};
pub use remote::{DesyncPost, MAX_POST_TEXT};

use crate::comm::Communicator;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::id::UniqueId;
use crate::library::Library;
use crate::stream::StreamRef;
use crate::types::DataType;
use clique::{Agreement, Clique, CliqueKey};
use recorder::Ring;

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
    /// The job's desync board in another process (not inherited by children).
    board: Option<Arc<dyn remote::RemoteBoard>>,
}

impl Config {
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
}

/// A config's options resolved against the environment.
#[derive(Debug, Clone)]
struct Settings {
    timeout: Duration,
    check: bool,
    ring: usize,
    dump_dir: Option<PathBuf>,
    dump_stderr: bool,
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
    name: &'static str,
    dtype: Option<DataType>,
    count: usize,
    root: Option<usize>,
    stream: StreamRef<'a>,
}

impl<'a> OpInfo<'a> {
    /// An operation moving `count` elements of `dtype` on `stream`, with its root or peer.
    pub(crate) fn new(
        name: &'static str,
        dtype: DataType,
        count: usize,
        root: Option<usize>,
        stream: StreamRef<'a>,
    ) -> OpInfo<'a> {
        OpInfo {
            name,
            dtype: Some(dtype),
            count,
            root,
            stream,
        }
    }

    /// The NCCL call.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// Collectives get a sequence number and a fingerprint; send/recv (called by two ranks)
    /// and shrink (not called by the excluded ranks) do not.
    fn is_collective(&self) -> bool {
        !matches!(self.name, "ncclSend" | "ncclRecv" | "ncclCommShrink")
    }
}

impl From<&'static str> for OpInfo<'static> {
    fn from(name: &'static str) -> Self {
        OpInfo {
            name,
            dtype: None,
            count: 0,
            root: None,
            stream: StreamRef::Host,
        }
    }
}

/// An operation the watchdog watches.
#[derive(Debug, Clone, Copy)]
struct Pending {
    rec: OpRecord,
    ring_id: u64,
    /// The operation's index on its communicator (for the clique's state word).
    id: u64,
    deadline: Instant,
}

#[derive(Debug)]
struct Inner {
    /// The raw handle while this side may tear it down; 0 once taken (by the owner's
    /// teardown or by the watchdog's abort).
    handle: usize,
    /// The operation inside its NCCL call.
    current: Option<Pending>,
    /// CUDA: enqueued operations and the events recorded after them.
    cuda: std::collections::VecDeque<(Pending, CudaEvent)>,
    ring: Ring,
    /// The report of the timeout that made the watchdog abort this communicator.
    report: Option<Arc<str>>,
}

/// One communicator's diagnostics state, shared with the watchdog thread.
#[derive(Debug)]
pub(crate) struct Shared {
    rank: usize,
    world_size: usize,
    settings: Settings,
    lib: Arc<Library>,
    clique: Arc<Clique>,
    inner: Mutex<Inner>,
    aborted_by_watchdog: AtomicBool,
    seq: AtomicU64,
    ops: AtomicU64,
    wait_ns: AtomicU64,
    checks: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Retires completed CUDA work (oldest first).
    fn retire(&self, inner: &mut Inner) {
        while inner.cuda.front().is_some_and(|(_, ev)| ev.is_complete()) {
            let Some((p, _event)) = inner.cuda.pop_front() else {
                break;
            };
            inner
                .ring
                .finish(p.ring_id, OpState::Completed, Instant::now());
            self.clique.set_state(self.rank, p.id, OpState::Completed);
        }
    }

    fn flight_record(&self) -> FlightRecord {
        FlightRecord {
            rank: self.rank,
            world_size: self.world_size,
            clique: self.clique.key,
            entries: self.lock().ring.snapshot(),
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
            if let Some(r) = self.lock().report.clone() {
                return Some(r);
            }
        }
        self.clique.timed_out()
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
}

/// What [`CommDiag::begin`] hands to [`CommDiag::end`].
#[derive(Debug)]
pub(crate) struct Ticket<'a> {
    pending: Option<Pending>,
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
        }
    }

    /// For one of the communicators of one `ncclCommInitAll` (pass the same `key`).
    pub(crate) fn for_init_all(key: u64) -> CommDiag {
        CommDiag {
            settings: Settings::resolve(&DiagConfig::default()),
            key,
            shared: OnceLock::new(),
            board: None,
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
            let clique = clique::join(self.key, world_size.max(1));
            clique.update(rank, |v| v.present = true);
            if let Some(b) = &self.board {
                clique.set_board(b);
            }
            let s = Arc::new(Shared {
                rank,
                world_size,
                settings: self.settings.clone(),
                lib: Arc::clone(lib),
                clique,
                inner: Mutex::new(Inner {
                    handle: raw as usize,
                    current: None,
                    cuda: std::collections::VecDeque::new(),
                    ring: Ring::new(self.settings.ring),
                    report: None,
                }),
                aborted_by_watchdog: AtomicBool::new(false),
                seq: AtomicU64::new(0),
                ops: AtomicU64::new(0),
                wait_ns: AtomicU64::new(0),
                checks: AtomicU64::new(0),
            });
            watchdog::watch(&s);
            s
        })
    }

    fn shared(&self, comm: &Communicator) -> &Arc<Shared> {
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
            Some(s) if s.aborted_by_watchdog.load(Ordering::Acquire) => {
                let r = s
                    .timed_out()
                    .unwrap_or_else(|| "the watchdog aborted it".into());
                Err(s.timeout_error(&r))
            }
            _ => Ok(()),
        }
    }

    /// Before the NCCL call of `op`: records it, runs the fingerprint check (when on) and
    /// registers it with the watchdog. No allocation unless it fails.
    pub(crate) fn begin<'a>(
        &self,
        comm: &Communicator,
        op: OpInfo<'a>,
        caller: &'static Location<'static>,
    ) -> Result<Ticket<'a>> {
        let s = self.shared(comm);
        let collective = op.is_collective();
        let seq = if collective {
            bump(&s.seq, 1)
        } else {
            s.seq.load(Ordering::Relaxed)
        };
        // Operations on one communicator are sequential: the count of ended ones is this
        // one's index.
        let op_id = s.ops.load(Ordering::Relaxed);
        let start = Instant::now();
        let rec = OpRecord {
            seq,
            op: op.name,
            dtype: op.dtype,
            count: op.count,
            root: op.root,
            caller,
            enqueued: start,
            took: None,
            state: OpState::Enqueued,
        };
        let check = s.settings.check && collective && !in_group();
        let deadline = start + s.settings.timeout;
        let ring_id = {
            let mut inner = s.lock();
            s.retire(&mut inner);
            let ring_id = inner.ring.push(rec);
            if !check {
                // Fast path: one lock records the operation and arms the watchdog.
                inner.current = Some(Pending {
                    rec,
                    ring_id,
                    id: op_id,
                    deadline,
                });
            }
            ring_id
        };
        s.clique.update(s.rank, |v| {
            v.present = true;
            if collective {
                v.issued = seq + 1;
            }
            v.last = Some(rec);
            v.last_id = op_id;
        });
        let pending = Pending {
            rec,
            ring_id,
            id: op_id,
            deadline,
        };
        if let Some(first) = s.timed_out() {
            s.lock().current = None;
            return Err(self.fail(comm, s, &pending, s.peer_timeout(&rec, &first)));
        }
        if check {
            bump(&s.checks, 1);
            match s.clique.agree(s.rank, rec, pending.deadline) {
                Agreement::Agree => {}
                Agreement::Mismatch(table) => {
                    let e = Error::CollectiveMismatch {
                        op: op.name,
                        rank: s.rank,
                        seq,
                        table,
                    };
                    return Err(self.fail(comm, s, &pending, e));
                }
                Agreement::TimedOut(Some(first)) => {
                    return Err(self.fail(comm, s, &pending, s.peer_timeout(&rec, &first)));
                }
                Agreement::TimedOut(None) => {
                    let report = s.clique.report(
                        s.rank,
                        &rec,
                        s.settings.timeout,
                        "waited for the other ranks in the fingerprint check",
                    );
                    let report = s.clique.set_timed_out(&Arc::from(report));
                    let e = s.timeout_error(&report);
                    return Err(self.fail(comm, s, &pending, e));
                }
            }
        }
        if check {
            s.lock().current = Some(pending);
        }
        Ok(Ticket {
            pending: Some(pending),
            stream: op.stream,
        })
    }

    /// Marks the operation and the communicator failed, dumps the record, returns `e`.
    #[cold]
    fn fail(&self, comm: &Communicator, s: &Shared, p: &Pending, e: Error) -> Error {
        let now = Instant::now();
        s.lock().ring.finish(p.ring_id, OpState::Failed, now);
        s.clique.set_state(s.rank, p.id, OpState::Failed);
        bump(
            &s.wait_ns,
            now.saturating_duration_since(p.rec.enqueued).as_nanos() as u64,
        );
        bump(&s.ops, 1);
        comm.mark_failed(&e);
        s.dump();
        e
    }

    /// After the NCCL call: deregisters (host) or hands the work to the watchdog as a CUDA
    /// event, records the outcome and the time spent, and turns an error caused by a
    /// watchdog abort into [`Error::Timeout`] with the report.
    pub(crate) fn end(&self, comm: &Communicator, t: Ticket<'_>, r: Result<()>) -> Result<()> {
        let (Some(s), Some(p)) = (self.shared.get(), t.pending) else {
            return r;
        };
        let now = Instant::now();
        let mut inner = s.lock();
        inner.current = None;
        let mut state = if r.is_ok() {
            OpState::Completed
        } else {
            OpState::Failed
        };
        if let (Ok(()), StreamRef::Cuda(stream)) = (&r, t.stream) {
            if !in_group() && !s.aborted_by_watchdog.load(Ordering::Acquire) {
                if let Ok(ev) = record_event(stream) {
                    inner.cuda.push_back((p, ev));
                    state = OpState::Enqueued;
                }
            }
        }
        if state != OpState::Enqueued {
            inner.ring.finish(p.ring_id, state, now);
        }
        drop(inner);
        s.clique.set_state(s.rank, p.id, state);
        bump(
            &s.wait_ns,
            now.saturating_duration_since(p.rec.enqueued).as_nanos() as u64,
        );
        bump(&s.ops, 1);
        match r {
            Ok(()) => Ok(()),
            Err(e) => Err(self.end_error(comm, s, &p, e)),
        }
    }

    #[cold]
    fn end_error(&self, comm: &Communicator, s: &Shared, p: &Pending, e: Error) -> Error {
        let e = if s.aborted_by_watchdog.load(Ordering::Acquire) {
            let r = s
                .timed_out()
                .unwrap_or_else(|| "the watchdog aborted it".into());
            if r.contains(&format!(
                "because {} seq {} on rank {} ",
                p.rec.op, p.rec.seq, s.rank
            )) {
                s.timeout_error(&r)
            } else {
                s.peer_timeout(&p.rec, &r)
            }
        } else if let Some(first) = s.clique.timed_out() {
            s.peer_timeout(&p.rec, &first)
        } else {
            e
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
        let limit = Instant::now() + s.settings.timeout + Duration::from_secs(1);
        loop {
            {
                let mut inner = s.lock();
                s.retire(&mut inner);
                if (inner.current.is_none() && inner.cuda.is_empty())
                    || s.aborted_by_watchdog.load(Ordering::Acquire)
                    || Instant::now() >= limit
                {
                    let busy = inner.current.is_some() || !inner.cuda.is_empty();
                    drop(inner);
                    return !busy
                        && !s.aborted_by_watchdog.load(Ordering::Acquire)
                        && s.clique.timed_out().is_none();
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
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
        s.clique.update(s.rank, |v| v.gone = true);
        let mut inner = s.lock();
        if inner.handle == 0 {
            return false;
        }
        inner.handle = 0;
        true
    }
}

fn record_event(stream: &CudaStream) -> Result<CudaEvent> {
    let ev = stream.context().new_event(None)?;
    ev.record(stream)?;
    Ok(ev)
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
            operations: s.ops.load(Ordering::Relaxed),
            wait: Duration::from_nanos(s.wait_ns.load(Ordering::Relaxed)),
            fingerprint_checks: s.checks.load(Ordering::Relaxed),
            check_enabled: s.settings.check,
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
