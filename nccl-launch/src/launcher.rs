//! [`Launcher`]: one rank per device, each in its own thread (and [`Launcher::from_env`],
//! which hands over to [`ProcessLauncher`](super::ProcessLauncher) for one rank per
//! process).

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;

use crate::desync::DesyncBoard;
use crate::error::{invalid, Error, Result};
use crate::lock;
use nccl_safe::Config;
use nccl_safe::Provider;
use nccl_safe::Stream;
use nccl_safe::{scalable_roots, UniqueId};
use nccl_safe::{CommDevice, Communicator};

/// How many CUDA devices this process can use: 0 when the CUDA driver library is absent
/// or reports none (never panics).
pub fn cuda_device_count() -> usize {
    if !crate::cuda_probe::driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Starts one rank per device, each in its own thread with its own device context,
/// stream and communicator.
///
/// ```
/// use nccl_launch::Launcher;
/// use nccl_safe::ReduceOp;
/// let sums = Launcher::host(4).run(|rank| {
///     let mut x = vec![rank.rank() as f32; 8];
///     rank.comm().all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
///     Ok(x[0])
/// })?;
/// assert_eq!(sums, vec![6.0; 4]);
/// # Ok::<(), nccl_launch::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Launcher {
    devices: Vec<CommDevice>,
    config: Config,
    timeout: Duration,
    /// The number of unique ids (roots) of the init; `None`: [`scalable_roots`].
    roots: Option<usize>,
}

/// What each rank's closure receives.
#[derive(Debug)]
pub struct Rank {
    pub(super) comm: Communicator,
    pub(super) stream: Stream,
    /// Rank 0 of [`ProcessLauncher::init`](super::ProcessLauncher::init): the job's desync
    /// board, served while it lives.
    pub(super) board: Option<DesyncBoard>,
    /// The unique ids its communicator was made from, one per root.
    pub(super) ids: Vec<UniqueId>,
}

impl Rank {
    /// Rank `rank` of `world_size` on `device`: a stream of its own (made in the device's
    /// context, bound to this thread), then its communicator, made with `ids`: one id is
    /// `init_rank`'s init, several `init_rank_scalable`'s.
    pub(super) fn init(
        device: &CommDevice,
        world_size: usize,
        rank: usize,
        ids: &[UniqueId],
        config: &Config,
    ) -> Result<Rank> {
        let stream = match device {
            // cudarc's `new_stream` binds the context to this thread, and that bind would
            // take an error recorded on it by the rank's code of an earlier run: the
            // user's, kept for its `check_err`.
            CommDevice::Cuda(ctx) => {
                Stream::Cuda(nccl_safe::seam::keeping_recorded_error(ctx, || {
                    ctx.new_stream()
                })?)
            }
            CommDevice::Host => Stream::Host,
        };
        let comm = match ids {
            [id] => Communicator::init_rank(device, world_size, rank, id, config)?,
            ids => Communicator::init_rank_scalable(device, world_size, rank, ids, config)?,
        };
        Ok(Rank {
            comm,
            stream,
            board: None,
            ids: ids.to_vec(),
        })
    }

    /// The unique ids its communicator was made from, in root order: one for
    /// `ncclCommInitRankConfig`'s init, several for `ncclCommInitRankScalable`'s (see
    /// [`Launcher::roots`], [`ProcessLauncher::roots`](super::ProcessLauncher::roots)).
    pub fn unique_ids(&self) -> &[UniqueId] {
        &self.ids
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The rank's communicator.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// The rank's stream (a CUDA stream of its device, or [`Stream::Host`]).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The rank's device.
    pub fn device(&self) -> &CommDevice {
        self.comm.device()
    }

    /// The CUDA stream, when the rank runs on a GPU.
    pub fn cuda_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        match &self.stream {
            Stream::Cuda(s) => Some(s),
            Stream::Host => None,
        }
    }

    /// Takes the communicator out (to destroy it yourself, say). On rank 0 of a
    /// multi-process job the job's desync board that this rank serves stays up for the
    /// rest of the process: the other ranks' timeout reports and departures go through it.
    pub fn into_comm(self) -> Communicator {
        if let Some(board) = self.board {
            std::mem::forget(board);
        }
        self.comm
    }
}

#[derive(Debug)]
enum Outcome {
    Running,
    Done,
    Failed(String),
}

/// A run's tally of its ranks, in this process; the ranks wait on it for each other (not
/// the desync board, which ranks in other processes read).
struct Tally {
    ranks: Mutex<Ranks>,
    changed: Condvar,
}

struct Ranks {
    outcomes: Vec<Outcome>,
    /// The ranks that failed, in the order they did.
    failed: Vec<usize>,
    /// Per rank, once its closure ended: the collectives it called and issued, and whether it failed
    /// on its own (an error or a panic while its communicator was healthy).
    ends: Vec<Option<End>>,
}

/// What the ranks of one run share.
struct Run {
    config: Config,
    ids: Vec<UniqueId>,
    tally: Tally,
}

/// How a rank's closure ended, for [`culprit`].
#[derive(Debug, Clone, Copy)]
struct End {
    /// Collectives its program called (issued, or refused once its communicator failed).
    called: u64,
    /// Collectives NCCL received from it.
    issued: u64,
    returned: bool,
    own_failure: bool,
}

impl Tally {
    fn new(n: usize) -> Tally {
        let ranks = Ranks {
            outcomes: (0..n).map(|_| Outcome::Running).collect(),
            failed: Vec::new(),
            ends: vec![None; n],
        };
        Tally {
            ranks: Mutex::new(ranks),
            changed: Condvar::new(),
        }
    }

    /// Rank `rank` ended with `outcome` (and, once its closure ended, `end`).
    fn set(&self, rank: usize, outcome: Outcome, end: Option<End>) {
        let mut s = lock(&self.ranks);
        if matches!(outcome, Outcome::Failed(_)) {
            s.failed.push(rank);
        }
        s.outcomes[rank] = outcome;
        s.ends[rank] = end;
        self.changed.notify_all();
    }

    /// Waits until no rank is running or one failed (a finished rank need not wait for the
    /// others to abort), until `deadline`: whether one failed, `None` when it passed.
    fn wait_all(&self, deadline: Instant) -> Option<bool> {
        let mut s = lock(&self.ranks);
        loop {
            let failed = s.outcomes.iter().any(|x| matches!(x, Outcome::Failed(_)));
            if failed || !s.outcomes.iter().any(|x| matches!(x, Outcome::Running)) {
                return Some(failed);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = (self.changed.wait_timeout(s, deadline - now))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits until no rank is running. Ranks still running [`STUCK_AFTER`] after every
    /// other rank ended, one of them failed, are stuck in their own code: a note on stderr
    /// names them, once, and with `detach` it stops waiting for them and returns them.
    fn wait_settled(&self, detach: bool) -> Vec<usize> {
        let mut s = lock(&self.ranks);
        // Since when the ranks running now are the only ones left, after a failure.
        let mut since: Option<(Instant, usize)> = None;
        let mut told = false;
        loop {
            let running: Vec<usize> = (s.outcomes.iter().enumerate())
                .filter(|(_, x)| matches!(x, Outcome::Running))
                .map(|(r, _)| r)
                .collect();
            if running.is_empty() {
                return running;
            }
            let failed = s.outcomes.iter().any(|x| matches!(x, Outcome::Failed(_)));
            let wait = if failed {
                if since.is_none_or(|(_, n)| n != running.len()) {
                    since = Some((Instant::now(), running.len()));
                }
                let t0 = since.map_or_else(Instant::now, |(t, _)| t);
                match STUCK_AFTER.checked_sub(t0.elapsed()) {
                    Some(left) if !left.is_zero() => left,
                    _ if told => Duration::from_secs(3600),
                    _ => {
                        told = true;
                        eprintln!("nccl-safe: {}", stuck_note(&running, detach));
                        if detach {
                            return running;
                        }
                        Duration::from_secs(3600)
                    }
                }
            } else {
                since = None;
                Duration::from_secs(3600)
            };
            s = (self.changed.wait_timeout(s, wait))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// One line per rank: a failed rank shows its error's first line (the full report is
    /// the error's `cause`, once per job).
    fn summary(&self) -> Vec<String> {
        (lock(&self.ranks).outcomes.iter())
            .enumerate()
            .map(|(r, x)| match x {
                Outcome::Running => format!("rank {r}: still running"),
                Outcome::Done => format!("rank {r}: returned"),
                Outcome::Failed(e) => format!("rank {r}: {}", e.lines().next().unwrap_or("")),
            })
            .collect()
    }
}

/// Default bound for [`Launcher::run`]: how long finished ranks wait for the others.
pub const DEFAULT_LAUNCH_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a rank may stay in its closure after every other rank ended and one of them
/// failed before [`Launcher::try_run_detached`] leaves its thread behind (and
/// [`Launcher::run`] says that it waits for it). Its communicator failed with the others',
/// so a collective of its own would have returned an error at once: it is in its own code.
pub const STUCK_AFTER: Duration = Duration::from_secs(2);

impl Launcher {
    /// One rank per visible CUDA device. [`Error::InvalidArgument`](nccl_safe::Error::InvalidArgument) when there is none.
    pub fn all_devices() -> Result<Launcher> {
        let n = cuda_device_count();
        if n == 0 {
            return Err(invalid(
                "Launcher::all_devices",
                "no CUDA device is visible (no driver, or CUDA_VISIBLE_DEVICES is empty); \
                 use Launcher::host(n) to run on the host provider",
            ));
        }
        Launcher::devices(&(0..n).collect::<Vec<_>>())
    }

    /// One rank per listed CUDA device ordinal.
    pub fn devices(ordinals: &[usize]) -> Result<Launcher> {
        if ordinals.is_empty() || cuda_device_count() == 0 {
            return Err(invalid("Launcher::devices", "no CUDA device to launch on"));
        }
        let devices = ordinals
            .iter()
            .map(|&i| Ok(CommDevice::Cuda(CudaContext::new(i)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Launcher::with_devices(devices))
    }

    /// `n` ranks on the in-process host provider.
    pub fn host(n: usize) -> Launcher {
        Launcher::with_devices(vec![CommDevice::Host; n])
    }

    /// Every GPU when there is one, else `host_ranks` ranks on the host provider; and
    /// which of the two it is.
    pub fn auto(host_ranks: usize) -> (Launcher, Provider) {
        match Launcher::all_devices() {
            Ok(l) => (l, Provider::Nccl),
            Err(_) => (Launcher::host(host_ranks), Provider::Host),
        }
    }

    fn with_devices(devices: Vec<CommDevice>) -> Launcher {
        Launcher {
            devices,
            config: Config::new(),
            timeout: DEFAULT_LAUNCH_TIMEOUT,
            roots: None,
        }
    }

    /// The communicators' configuration.
    pub fn config(mut self, config: Config) -> Launcher {
        self.config = config;
        self
    }

    /// How long ranks that finished wait for the others before aborting them (default 10 min).
    pub fn timeout(mut self, timeout: Duration) -> Launcher {
        self.timeout = timeout;
        self
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.devices.len()
    }

    /// How many unique ids (roots) the ranks' init uses (default
    /// [`scalable_roots`]`(world_size)`: one per [`RANKS_PER_ROOT`](nccl_safe::RANKS_PER_ROOT)
    /// ranks). One is `ncclCommInitRankConfig`'s init; more are
    /// [`Communicator::init_rank_scalable`]'s (NCCL 2.23+), each id made by this process.
    /// A run refuses a count of 0 or above the number of ranks
    /// ([`Error::InvalidArgument`](nccl_safe::Error::InvalidArgument)).
    pub fn roots(mut self, roots: usize) -> Launcher {
        self.roots = Some(roots);
        self
    }

    /// Runs `f` on every rank, each in its own thread, and returns each rank's value.
    ///
    /// When a rank returns an error or panics, its communicator is aborted at once, so the
    /// other ranks' pending collectives end with an error instead of hanging (the host
    /// provider wakes every rank of an aborted communicator; on GPUs the communicator's
    /// watchdog bounds the wait). Ranks that return early wait up to [`Self::timeout`] for
    /// the others (or until one fails), then abort. Every communicator is torn down exactly
    /// once on every path. The error names the rank that caused the failure, the first rank
    /// that failed, and what every rank did.
    ///
    /// `run` returns when every rank's thread has ended, since `f` may borrow from the
    /// caller. A rank stuck in its own code (not in a collective: those fail at once after
    /// another rank's failure) keeps it waiting; [`STUCK_AFTER`] after every other rank
    /// ended, a note on stderr names it. [`try_run_detached`](Self::try_run_detached)
    /// returns then instead.
    pub fn run<R, F>(&self, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(&Rank) -> nccl_safe::Result<R> + Sync,
    {
        self.launch(f, false).map(|r| r.values)
    }

    /// [`run`](Self::run) for a closure with its own error type: a candle loop's
    /// `candle_core::Result`, an `anyhow::Error`, a `Box<dyn Error + Send + Sync>`, a
    /// `String`, so that it uses `?` on its own calls. A rank's error fails the run exactly
    /// as in `run` (the others aborted, [`Error::RankFailed`] naming it with its message).
    /// (`run` keeps nccl-safe's error: a generic error there would leave the error type of
    /// every closure that only uses `?` on nccl-safe calls for the caller to spell out.)
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// fn parse(s: &str) -> Result<f32, std::num::ParseFloatError> { s.parse() }
    /// let sums = Launcher::host(2).try_run(|rank| -> Result<f32, Box<dyn std::error::Error + Send + Sync>> {
    ///     let mut x = vec![parse("1.5")?; 4];
    ///     rank.comm().all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
    ///     Ok(x[0])
    /// })?;
    /// assert_eq!(sums, vec![3.0; 2]);
    /// let failed = Launcher::host(2).try_run(|rank| parse(if rank.rank() == 1 { "x" } else { "1" }));
    /// assert!(matches!(failed, Err(nccl_launch::Error::RankFailed { rank: 1, .. })));
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    pub fn try_run<R, E, F>(&self, f: F) -> Result<Vec<R>>
    where
        R: Send,
        E: Into<BoxError>,
        F: Fn(&Rank) -> std::result::Result<R, E> + Sync,
    {
        // The rank's error is reported by its text (in `RankFailed`), as `run`'s are.
        let f = |rank: &Rank| f(rank).map_err(Into::<BoxError>::into);
        self.launch(f, false).map(|r| r.values)
    }

    /// [`run`](Self::run), also returning each rank's [`RankStats`]: the straggler view.
    /// A rank that is slower than the others (a slow data loader, a misplaced pause) spends
    /// *less* time waiting in collectives, because the others wait for it. The
    /// communicators time their operations precisely ([`Config::timing`]) unless the
    /// launcher's config says otherwise.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// let report = Launcher::host(2).run_report(|rank| {
    ///     let mut x = vec![1u8; 4];
    ///     rank.comm().all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
    ///     Ok(())
    /// })?;
    /// assert_eq!(report.ranks[1].collectives, 1);
    /// println!("{report}");
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    pub fn run_report<R, F>(&self, f: F) -> Result<LaunchReport<R>>
    where
        R: Send,
        F: Fn(&Rank) -> nccl_safe::Result<R> + Sync,
    {
        self.launch(f, true)
    }

    /// [`try_run`](Self::try_run) for a closure that owns what it uses (`'static`), so
    /// that the run returns when every other rank has ended, one of them failed, and a rank
    /// is still in its own code [`STUCK_AFTER`] later (a sleep, a deadlock of its own, a
    /// loop that never calls a collective): that rank is the culprit in
    /// [`Error::RankFailed`], and its thread is left running, detached, with a note on
    /// stderr. Its communicator failed with the others', so any collective it calls later
    /// returns an error at once, and it is torn down when its closure returns.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::{Config, ReduceOp};
    /// use std::time::Duration;
    /// let stuck = Launcher::host(2)
    ///     .config(Config::new().timeout(Duration::from_millis(500)))
    ///     .try_run_detached(|rank| -> nccl_safe::Result<()> {
    ///         if rank.rank() == 1 {
    ///             std::thread::sleep(Duration::from_secs(20)); // stuck in its own code
    ///         }
    ///         let mut x = vec![1u8; 4];
    ///         rank.comm().all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
    ///         Ok(())
    ///     });
    /// assert!(matches!(stuck, Err(nccl_launch::Error::RankFailed { rank: 1, .. })));
    /// ```
    pub fn try_run_detached<R, E, F>(&self, f: F) -> Result<Vec<R>>
    where
        R: Send + 'static,
        E: Into<BoxError>,
        F: Fn(&Rank) -> std::result::Result<R, E> + Send + Sync + 'static,
    {
        let f = move |rank: &Rank| f(rank).map_err(Into::<BoxError>::into);
        let shared = Arc::new((self.clone(), self.prepare(false)?, f));
        let tally = &shared.1.tally;
        let handles: Vec<_> = (0..self.devices.len())
            .map(|rank| {
                let mine = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("nccl-rank-{rank}"))
                    .spawn(move || mine.0.rank_main(rank, &mine.1, &mine.2))
                    .map_err(|e| spawn_failed(tally, rank, e))
            })
            .collect();
        let stuck = tally.wait_settled(true);
        let results = (handles.into_iter().enumerate())
            .map(|(rank, h)| match h {
                // Dropping its handle detaches the thread.
                Ok(_) if stuck.contains(&rank) => None,
                Ok(h) => Some(h.join()),
                Err(e) => Some(Ok(Err(e.to_string()))),
            })
            .collect();
        report(results, tally).map(|r| r.values)
    }

    /// The communicators' configuration (timed when `timing`), the unique id and a fresh
    /// tally for a run.
    fn prepare(&self, timing: bool) -> Result<Run> {
        let config = if timing {
            nccl_safe::seam::timing_unless_set(self.config.clone(), true)
        } else {
            self.config.clone()
        };
        let n = self.devices.len();
        let Some(first) = self.devices.first() else {
            return Err(invalid("Launcher::run", "no ranks to launch"));
        };
        let roots = self.roots.unwrap_or_else(|| scalable_roots(n));
        if roots == 0 || roots > n {
            let m = format!("{roots} roots for {n} ranks: pass 1 to {n}");
            return Err(invalid("Launcher::roots", m));
        }
        let ids = (0..roots)
            .map(|_| first.unique_id())
            .collect::<nccl_safe::Result<Vec<_>>>()?;
        let tally = Tally::new(n);
        Ok(Run { config, ids, tally })
    }

    /// Runs `f` on every rank; a rank's error, of any type, fails the run with its text.
    fn launch<R, E, F>(&self, f: F, timing: bool) -> Result<LaunchReport<R>>
    where
        R: Send,
        E: fmt::Display,
        F: Fn(&Rank) -> std::result::Result<R, E> + Sync,
    {
        let run = self.prepare(timing)?;
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.devices.len())
                .map(|rank| {
                    let (run, f) = (&run, &f);
                    std::thread::Builder::new()
                        .name(format!("nccl-rank-{rank}"))
                        .spawn_scoped(s, move || self.rank_main(rank, run, f))
                        .map_err(|e| spawn_failed(&run.tally, rank, e))
                })
                .collect();
            run.tally.wait_settled(false);
            (handles.into_iter())
                .map(|h| match h {
                    Ok(h) => Some(h.join()),
                    Err(e) => Some(Ok(Err(e.to_string()))),
                })
                .collect()
        });
        report(results, &run.tally)
    }

    fn rank_main<R, E, F>(&self, rank: usize, run: &Run, f: &F) -> RankResult<R>
    where
        E: fmt::Display,
        F: Fn(&Rank) -> std::result::Result<R, E>,
    {
        let (tally, n) = (&run.tally, self.devices.len());
        let r = match Rank::init(&self.devices[rank], n, rank, &run.ids, &run.config) {
            Ok(r) => r,
            Err(e) => {
                tally.set(rank, Outcome::Failed(format!("init failed: {e}")), None);
                return Err(e.to_string());
            }
        };
        let started = Instant::now();
        match catch_unwind(AssertUnwindSafe(|| f(&r))) {
            Ok(Ok(v)) => {
                // Peers waiting for a collective this rank never called fail at once.
                nccl_safe::seam::leave(&r.comm, "its launcher closure returned");
                let d = r.comm.diagnostics();
                let end = End {
                    called: nccl_safe::seam::collectives_called(&r.comm),
                    issued: d.collectives,
                    returned: true,
                    own_failure: false,
                };
                let stats = RankStats {
                    rank,
                    busy: started.elapsed(),
                    waiting: d.wait,
                    collectives: d.collectives,
                };
                tally.set(rank, Outcome::Done, Some(end));
                match tally.wait_all(Instant::now() + self.timeout) {
                    Some(false) => {
                        r.comm.destroy().map_err(|(_, e)| e.to_string())?;
                        Ok((v, stats))
                    }
                    // Peers failed, or are stuck (maybe waiting for a collective this rank
                    // skipped): abort so that none of them hangs.
                    failed => {
                        let _ = r.comm.abort();
                        failed.map(|_| (v, stats)).ok_or_else(|| {
                            nccl_safe::Error::Timeout {
                                what: format!(
                                    "rank {rank} returned, but other ranks did not finish (a collective this rank did not call?)"
                                ),
                                timeout: self.timeout,
                            }
                            .to_string()
                        })
                    }
                }
            }
            Ok(Err(e)) => {
                let text = strip_backtrace(&e.to_string());
                failed(r, rank, tally, "failed", &text, text.clone());
                Err(e.to_string())
            }
            Err(panic) => {
                let text = panic_text(&panic);
                failed(
                    r,
                    rank,
                    tally,
                    "panicked",
                    &text,
                    format!("panicked: {text}"),
                );
                std::panic::resume_unwind(panic)
            }
        }
    }
}

/// What one rank did in [`Launcher::run_report`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankStats {
    /// The rank.
    pub rank: usize,
    /// Time in the rank's closure.
    pub busy: Duration,
    /// Of that, time inside NCCL operations (mostly waiting for peers on the host
    /// provider; only the enqueue on GPUs).
    pub waiting: Duration,
    /// Collectives the rank issued.
    pub collectives: u64,
}

/// The values and per-rank statistics of a [`Launcher::run_report`].
#[derive(Debug, Clone)]
pub struct LaunchReport<R> {
    /// Each rank's return value, in rank order.
    pub values: Vec<R>,
    /// Each rank's statistics, in rank order.
    pub ranks: Vec<RankStats>,
}

impl<R> LaunchReport<R> {
    /// The rank that waited least in collectives, when it waited clearly less than the
    /// median (under half): the others were waiting for it.
    pub fn straggler(&self) -> Option<usize> {
        if self.ranks.len() < 2 {
            return None;
        }
        let mut waits: Vec<Duration> = self.ranks.iter().map(|r| r.waiting).collect();
        waits.sort();
        let median = waits[waits.len() / 2];
        let least = self.ranks.iter().min_by_key(|r| r.waiting)?;
        (least.waiting * 2 < median && median > Duration::from_millis(1)).then_some(least.rank)
    }
}

impl<R> std::fmt::Display for LaunchReport<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:>5} {:>11} {:>12} {:>8} {:>12}",
            "rank", "collectives", "busy (ms)", "waiting", "working (ms)"
        )?;
        let straggler = self.straggler();
        for r in &self.ranks {
            let busy = r.busy.as_secs_f64() * 1e3;
            let wait = r.waiting.as_secs_f64() * 1e3;
            let pct = if busy > 0.0 { 100.0 * wait / busy } else { 0.0 };
            write!(
                f,
                "{:>5} {:>11} {:>12.1} {:>7.0}% {:>12.1}",
                r.rank,
                r.collectives,
                busy,
                pct,
                busy - wait
            )?;
            if straggler == Some(r.rank) {
                write!(f, "   <-- straggler: the others waited for it")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// One rank's thread's end: its value and stats, its error, or its panic.
type RankEnd<R> = std::thread::Result<RankResult<R>>;

/// A rank's values, or the text of its error (all a failed run reports of it).
type RankResult<R> = std::result::Result<(R, RankStats), String>;

/// A `try_run` closure's error, whatever its type (`Display` is all that is used).
type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A rank whose thread could not be spawned: failed on the tally (so no one waits for it).
fn spawn_failed(tally: &Tally, rank: usize, e: std::io::Error) -> Error {
    let reason = format!("cannot spawn a rank thread: {e}");
    tally.set(rank, Outcome::Failed(reason.clone()), None);
    invalid("Launcher::run", reason)
}

/// [`Tally::wait_settled`]'s note on the ranks it found stuck.
fn stuck_note(stuck: &[usize], detach: bool) -> String {
    let (call, then) = if detach {
        ("try_run_detached", "their threads are left running, detached (each tears its communicator down when its closure returns)")
    } else {
        ("run", "run and try_run wait for their threads, since a closure may borrow from the caller (Launcher::try_run_detached returns instead)")
    };
    format!(
        "Launcher::{call}: rank(s) {stuck:?} still in their closure {STUCK_AFTER:?} after every other rank ended and one failed: stuck in their own code (their communicator failed, so a collective would have returned an error at once): {then}"
    )
}

/// The run's result from each rank's end (`None`: stuck, its thread detached).
fn report<R>(results: Vec<Option<RankEnd<R>>>, tally: &Tally) -> Result<LaunchReport<R>> {
    let n = results.len();
    let mut values = Vec::with_capacity(n);
    let mut ranks = Vec::with_capacity(n);
    let mut failures: Vec<(usize, String)> = Vec::new();
    let mut stuck = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok(Ok((v, stats)))) => {
                values.push(v);
                ranks.push(stats);
            }
            Some(Ok(Err(e))) => failures.push((rank, e)),
            Some(Err(p)) => failures.push((rank, format!("panicked: {}", panic_text(&p)))),
            None => {
                stuck.push(rank);
                failures.push((
                    rank,
                    format!("still in its closure {STUCK_AFTER:?} after every other rank ended: its thread was left running, detached"),
                ));
            }
        }
    }
    if failures.is_empty() {
        return Ok(LaunchReport { values, ranks });
    }
    // The first rank to fail, not the lowest-numbered; and the rank that caused it,
    // which may be another (one that left early, ran an extra collective, was behind, or
    // is stuck in its own code: the others failed waiting for it).
    let s = lock(&tally.ranks);
    let first = (s.failed.first().copied())
        .filter(|r| failures.iter().any(|(f, _)| f == r))
        .unwrap_or(failures[0].0);
    let (rank, why) = culprit(&s.ends, &s.failed, &stuck).unwrap_or((first, None));
    drop(s);
    let own = (failures.iter())
        .find(|(r, _)| *r == rank)
        .map(|(_, c)| c.clone());
    let cause = match (own, why) {
        (Some(c), Some(why)) => format!("{why}. Its error: {c}"),
        (Some(c), None) => c,
        (None, Some(why)) => why,
        (None, None) => String::from("it returned"),
    };
    Err(Error::RankFailed {
        rank,
        first,
        ranks: tally.summary(),
        cause: strip_backtrace(&cause),
    })
}

/// A rank whose closure `how` ("failed", "panicked") with `text`: notes its end (on its own
/// when its communicator was still healthy: a user error or panic; then its peers learn why
/// it left, in its words), fails the run with `outcome` and aborts its communicator.
fn failed(r: Rank, rank: usize, tally: &Tally, how: &str, text: &str, outcome: String) {
    let end = End {
        called: nccl_safe::seam::collectives_called(&r.comm),
        issued: r.comm.diagnostics().collectives,
        returned: false,
        own_failure: !r.comm.is_failed(),
    };
    if end.own_failure {
        let first = text.lines().next().unwrap_or("");
        nccl_safe::seam::leave(
            &r.comm,
            &format!("its launcher closure {how} (\"{first}\")"),
        );
    }
    tally.set(rank, Outcome::Failed(outcome), Some(end));
    let _ = r.comm.abort();
}

/// The rank that caused a failed run, and why when that is not its own error: the first
/// rank (in the order they failed) whose closure failed on its own; else the rank whose
/// count of collectives called differs from the others' (it returned early or ran an extra
/// one); else the rank that got fewer collectives to NCCL (its late call was refused: the
/// others had timed out waiting for it); none when nothing tells. A rank in `stuck` (still
/// in its closure, its thread detached) comes right after the first to fail on its own.
fn culprit(
    ends: &[Option<End>],
    failed_order: &[usize],
    stuck: &[usize],
) -> Option<(usize, Option<String>)> {
    if let Some(&r) = failed_order.iter().find(|&&r| {
        ends.get(r)
            .copied()
            .flatten()
            .is_some_and(|e| e.own_failure)
    }) {
        return Some((r, None));
    }
    if let Some(&r) = stuck.first() {
        return Some((
            r,
            Some(format!(
                "it was stuck in its own code: still in its closure {STUCK_AFTER:?} after every other rank had ended (the others failed waiting for it)"
            )),
        ));
    }
    let known: Vec<(usize, End)> = (ends.iter().enumerate())
        .filter_map(|(r, e)| e.map(|e| (r, e)))
        .collect();
    if let Some((r, e, others)) = odd_one(&known, |e| e.called) {
        let why = if e.returned {
            format!(
                "it returned after {} collective(s) while the others called {others}: it skipped a collective, or they ran an extra one",
                e.called
            )
        } else if e.called > others {
            format!(
                "it called {} collective(s) and the others {others}: an extra collective on rank {r}",
                e.called
            )
        } else {
            format!(
                "it called {} collective(s) and the others {others}: the others waited for rank {r}, which was behind",
                e.called
            )
        };
        return Some((r, Some(why)));
    }
    let (r, e, others) = odd_one(&known, |e| e.issued)?;
    (e.issued < others).then(|| {
        (
            r,
            Some(format!(
                "it was behind: the others timed out waiting in collective #{} for rank {r}, whose own call came too late",
                e.issued
            )),
        )
    })
}

/// The rank whose `key` differs from the others', with its end and the others' value: the
/// one off a majority; with no majority (two ranks, say), the one that returned (it left
/// the others waiting), else the one with the least.
fn odd_one(known: &[(usize, End)], key: impl Fn(&End) -> u64) -> Option<(usize, End, u64)> {
    let mut tally: Vec<(u64, usize)> = Vec::new();
    for (_, e) in known {
        match tally.iter_mut().find(|(c, _)| *c == key(e)) {
            Some(t) => t.1 += 1,
            None => tally.push((key(e), 1)),
        }
    }
    if tally.len() < 2 {
        return None;
    }
    tally.sort_by_key(|t| std::cmp::Reverse(t.1));
    let (usual, how_many) = tally[0];
    if tally[1].1 < how_many {
        let &(r, e) = known.iter().find(|(_, e)| key(e) != usual)?;
        return Some((r, e, usual));
    }
    let least = known.iter().map(|(_, e)| key(e)).min()?;
    let returned: Vec<_> = known.iter().filter(|(_, e)| e.returned).collect();
    let &(r, e) = match returned.as_slice() {
        [one] => *one,
        _ => known.iter().find(|(_, e)| key(e) == least)?,
    };
    let others = (known.iter().map(|(_, o)| key(o)))
        .find(|&k| k != key(&e))
        .unwrap_or(usual);
    Some((r, e, others))
}

/// `text` without a backtrace some error types print in their message (candle's, with
/// `RUST_BACKTRACE=1`): from the first line that starts one.
fn strip_backtrace(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim_start().to_ascii_lowercase();
        if t.starts_with("stack backtrace:") || t.starts_with("backtrace:") {
            break;
        }
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(line);
    }
    out
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic".into()
    }
}
