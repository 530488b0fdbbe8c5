//! Teardowns that cannot block anyone: `ncclCommAbort`, `ncclCommDestroy` and the release
//! of NCCL memory run on a *teardown lane*, bounded by
//! [`Config::abort_timeout`](crate::Config::abort_timeout).
//!
//! NVIDIA's abort and destroy free device memory, and `cudaFree` (like `cuCtxSynchronize`)
//! waits for every stream of the device, a stalled one included. So neither the watchdog
//! (which serves every clique of the process) nor a caller's `Drop` makes these calls
//! itself: it queues a task on the lane of the communicator's device and waits for it at
//! most until its deadline. A task still running at its bound gets the configured
//! [`OnAbortTimeout`] once: a report on stderr (the handle is left; every communicator
//! involved stays failed), or the end of the process with [`ABORT_TIMEOUT_EXIT_STATUS`].
//!
//! **One thread per lane.** A lane is one CUDA device (a wait behind a stalled stream
//! blocks every teardown of that device anyway) or, on the host provider, the unique id
//! the communicators were born from (the scope of its injected faults). Each lane runs at
//! most one thread, which takes its tasks in order and ends when the queue is empty. So a
//! wedged GPU holds one blocked thread, not one per failed drop or restart: the tasks
//! behind it wait in the queue, each caller gives up at its own bound, and a new
//! communicator on a wedged lane is refused with a typed error ([`wedged`]). The order
//! also keeps a handle's calls in sequence: a teardown queued after a deregistration of
//! the same communicator runs after it.
//!
//! `exit` is the process-exit guard every call on a lane (and each watchdog query) enters.

pub(crate) mod exit;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nccl_sys::bindings::{ncclInProgress, ncclSuccess};
use nccl_sys::{ncclComm_t, ncclResult_t};

use crate::library::Library;

/// The default bound on an abort ([`Config::abort_timeout`](crate::Config::abort_timeout)).
pub const DEFAULT_ABORT_TIMEOUT: Duration = Duration::from_secs(30);

/// The shortest [`crate::Config::abort_timeout`] a communicator of NVIDIA's NCCL accepts.
/// NCCL 2.28.9's teardown is slow even for an idle communicator: `ncclCommDestroy` took
/// about 0.5 s and `ncclCommAbort` about 1 s on an H100 (commReclaim joins NCCL's proxy
/// threads and frees through the driver). A shorter bound would report healthy teardowns
/// as timed out, count their lane as wedged and make the process-exit guard end the
/// process early, so init refuses it. The host provider, whose teardown is immediate,
/// takes any bound above zero.
pub const MIN_NCCL_ABORT_TIMEOUT: Duration = Duration::from_secs(2);

/// What each other rank of a communicator in the same process adds to the bound on its
/// teardowns with NVIDIA's NCCL: the last of them to be destroyed or aborted frees them all,
/// each on its own device (init.cc `commReclaim`, 2304-2354), so its teardown takes about
/// their number times one communicator's. The same margin as [`MIN_NCCL_ABORT_TIMEOUT`]
/// per rank.
pub const NCCL_RECLAIM_PER_LOCAL_RANK: Duration = MIN_NCCL_ABORT_TIMEOUT;

/// The exit status of a process ended by [`OnAbortTimeout::ExitProcess`] (as `timeout(1)`'s).
pub const ABORT_TIMEOUT_EXIT_STATUS: i32 = 124;

/// The least time a teardown queued at (or past) its deadline is still waited for, so
/// that one that would return at once is not reported as overdue.
pub(crate) const MIN_WAIT: Duration = Duration::from_millis(50);

/// What happens when an abort has not returned within its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnAbortTimeout {
    /// Report it on stderr and leave the handle and its abort thread: the communicators
    /// involved stay failed, every call on them returns an error at once, and the process
    /// can still end normally (its exit is guarded). The default, and
    /// `NCCL_SAFE_ON_ABORT_TIMEOUT=report`.
    #[default]
    Report,
    /// Report it on stderr and end the process at once with [`ABORT_TIMEOUT_EXIT_STATUS`],
    /// so a launcher can restart the job (`NCCL_SAFE_ON_ABORT_TIMEOUT=exit`). PyTorch's
    /// `TORCH_NCCL_ASYNC_ERROR_HANDLING` tears the process down the same way, but only
    /// after the callers' errors are lost; here every caller has its error before.
    ExitProcess,
}

/// Which lane a teardown runs on (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum TeardownLane {
    /// A CUDA device, by ordinal.
    Device(usize),
    /// Host-provider communicators born from one unique id (by its clique key).
    Host(u64),
}

impl std::fmt::Display for TeardownLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TeardownLane::Device(d) => write!(f, "CUDA device {d}"),
            TeardownLane::Host(k) => write!(f, "host-provider clique {k:016x}"),
        }
    }
}

/// One teardown, queued or running.
#[derive(Debug)]
pub(crate) struct Task {
    what: String,
    lane: TeardownLane,
    pub(crate) bound: Duration,
    #[cfg_attr(not(feature = "diag"), allow(dead_code))]
    deadline: Instant,
    action: OnAbortTimeout,
    /// Its work's result (the first failed NCCL result, or success) once it finished.
    result: Mutex<Option<ncclResult_t>>,
    cv: Condvar,
    overdue: AtomicBool,
    /// When its call began (`None` while queued).
    started: Mutex<Option<Instant>>,
}

impl Task {
    /// Waits until the task finished or `until`: `true` when it finished.
    pub(crate) fn wait(&self, until: Instant) -> bool {
        let left = until.saturating_duration_since(Instant::now());
        let waited = self
            .cv
            .wait_timeout_while(lock(&self.result), left, |r| r.is_none());
        waited.unwrap_or_else(|e| e.into_inner()).0.is_some()
    }

    /// Waits until `until` (at least [`MIN_WAIT`]): its result if it finished in time
    /// (past that, the policy has been applied).
    pub(crate) fn outcome(&self, until: Instant) -> Option<ncclResult_t> {
        let done = self.wait(until.max(Instant::now() + MIN_WAIT));
        if !done {
            self.handle_overdue();
        }
        done.then(|| self.result())
    }

    /// The calls' result (meaningful once done).
    pub(crate) fn result(&self) -> ncclResult_t {
        lock(&self.result).unwrap_or(ncclSuccess)
    }

    pub(crate) fn is_done(&self) -> bool {
        lock(&self.result).is_some()
    }

    fn finish(&self, r: ncclResult_t) {
        *lock(&self.result) = Some(r);
        self.cv.notify_all();
    }

    /// Whether its call has been running for longer than its bound.
    fn wedged(&self, now: Instant) -> bool {
        !self.is_done() && lock(&self.started).is_some_and(|s| now >= s + self.bound)
    }

    /// Applies the policy once.
    fn handle_overdue(&self) {
        if self.overdue.swap(true, Ordering::AcqRel) {
            return;
        }
        let queued = if lock(&self.started).is_none() {
            format!(
                " (it is still queued behind another teardown of {})",
                self.lane
            )
        } else {
            String::new()
        };
        let late = format!(
            "nccl-safe: {} did not return within {:?}{queued} (Config::abort_timeout, NCCL_SAFE_ABORT_TIMEOUT_MS)",
            self.what, self.bound
        );
        match self.action {
            OnAbortTimeout::Report => eprintln!(
                "{late}: what it holds is left, and the communicators stay failed. NCCL_SAFE_ON_ABORT_TIMEOUT=exit ends the process instead."
            ),
            OnAbortTimeout::ExitProcess => {
                eprintln!(
                    "{late}: ending the process with status {ABORT_TIMEOUT_EXIT_STATUS} (NCCL_SAFE_ON_ABORT_TIMEOUT=exit)"
                );
                // SAFETY: `_exit` ends the process at once. The normal exit path would run
                // the CUDA runtime's teardown under the blocked call.
                unsafe { libc::_exit(ABORT_TIMEOUT_EXIT_STATUS) }
            }
        }
    }
}

/// The mutex's data, even if a thread panicked while holding it: every user of this
/// crate's locks keeps its data consistent at each step, and a failure path must still run.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A teardown's calls: the first failed NCCL result, or success.
pub(crate) type Work = Box<dyn FnOnce() -> ncclResult_t + Send>;

/// One lane: its queue, the task its thread runs, whether a thread serves it.
#[derive(Default)]
struct LaneState {
    queue: VecDeque<(Arc<Task>, Work)>,
    running: Option<Arc<Task>>,
    served: bool,
}

/// Every lane with a queue or a task running.
static LANES: Mutex<BTreeMap<TeardownLane, LaneState>> = Mutex::new(BTreeMap::new());

/// Every task not yet finished, for the watchdog's overdue check.
static TASKS: Mutex<Vec<Arc<Task>>> = Mutex::new(Vec::new());

/// A teardown's options: its bound and what happens past it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bound {
    pub(crate) bound: Duration,
    pub(crate) action: OnAbortTimeout,
}

/// Queues `work` on `lane` with a deadline of `bound` from now; returns at once. The
/// lane's thread runs it (`work` returns the first failed NCCL result, or success).
pub(crate) fn submit(lane: TeardownLane, b: Bound, what: String, work: Work) -> Arc<Task> {
    exit::install();
    let task = Arc::new(Task {
        what,
        lane,
        bound: b.bound,
        deadline: Instant::now() + b.bound,
        action: b.action,
        result: Mutex::new(None),
        cv: Condvar::new(),
        overdue: AtomicBool::new(false),
        started: Mutex::new(None),
    });
    {
        let mut j = lock(&TASKS);
        j.retain(|j| !j.is_done());
        j.push(Arc::clone(&task));
    }
    let spawn = {
        let mut l = lock(&LANES);
        let st = l.entry(lane).or_default();
        st.queue.push_back((Arc::clone(&task), work));
        !std::mem::replace(&mut st.served, true)
    };
    if spawn {
        let started = std::thread::Builder::new()
            .name("nccl-safe-teardown".into())
            .spawn(move || serve(lane));
        if started.is_err() {
            // No thread to be had: serve the lane here rather than never.
            serve(lane);
        }
    }
    task
}

/// A lane's thread: runs its tasks in order, ends when the queue is empty.
fn serve(lane: TeardownLane) {
    loop {
        let next = {
            let mut l = lock(&LANES);
            let Some(st) = l.get_mut(&lane) else {
                return;
            };
            match st.queue.pop_front() {
                Some((task, work)) => {
                    st.running = Some(Arc::clone(&task));
                    Some((task, work))
                }
                None => {
                    l.remove(&lane);
                    None
                }
            }
        };
        let Some((task, work)) = next else {
            return;
        };
        *lock(&task.started) = Some(Instant::now());
        // A call that outlives its bound at process exit ends the process early (the
        // exit guard); one within its bound is waited for.
        let r = match exit::busy(task.bound) {
            Some(_busy) => work(),
            None => ncclSuccess, // the process is exiting
        };
        // The lane is free before anyone waiting for the task learns that it finished, so
        // a caller that saw its teardown end never meets that teardown as wedged.
        if let Some(st) = lock(&LANES).get_mut(&lane) {
            st.running = None;
        }
        task.finish(r);
    }
}

/// Refuses `call` when `lane` holds a teardown that has been running past its bound: a new
/// communicator there would queue its own teardown behind it.
pub(crate) fn check_lane(call: &'static str, lane: TeardownLane) -> crate::error::Result<()> {
    let l = lock(&LANES);
    match l.get(&lane).and_then(|st| st.running.as_ref()) {
        Some(task) if task.wedged(Instant::now()) => Err(crate::error::Error::TeardownWedged {
            call,
            lane: lane.to_string(),
            what: format!(
                "{} has been blocked for longer than its bound of {:?}",
                task.what, task.bound
            ),
        }),
        _ => Ok(()),
    }
}

/// Aborts `handles` of `lib` together (one NCCL group) on `lane`; returns at once. Each
/// handle must have been taken out of its communicator: this is its one teardown.
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(crate) fn abort(
    lane: TeardownLane,
    lib: Arc<Library>,
    handles: Vec<usize>,
    b: Bound,
    what: String,
) -> Arc<Task> {
    submit(
        lane,
        b,
        format!("ncclCommAbort of {what}"),
        Box::new(move || {
            let (t, group) = (lib.table(), handles.len() > 1);
            // SAFETY: each handle was taken out of its communicator's holder, so this is its
            // one teardown and no one uses it afterwards; group start/end are paired.
            unsafe {
                if group {
                    let _ = (t.ncclGroupStart)();
                }
                let aborted = handles.iter().map(|&h| (t.ncclCommAbort)(h as ncclComm_t));
                let first = aborted.fold(ncclSuccess, |f, r| if f == ncclSuccess { r } else { f });
                if group {
                    let _ = (t.ncclGroupEnd)();
                }
                first
            }
        }),
    )
}

/// `ncclCommDestroy` of `raw`, or its abort when NCCL refuses to destroy it.
///
/// NCCL 2.28's destroy enters a group level, then returns `ncclCommEnsureReady`'s error
/// (ncclInvalidArgument while work is in flight, else the communicator's asynchronous
/// error) without leaving that level and without tearing anything down (init.cc:2372-2381):
/// the handle would leak, and every later NCCL call of this thread (the lane's) would be
/// queued for a group end that never comes. So a communicator whose asynchronous state is
/// not ncclSuccess is aborted, and a destroy that fails anyway (an error that arrived
/// between the two calls) has its level closed with `ncclGroupEnd` (which, when the error
/// came after the level was left, only reports ncclInvalidUsage) and is aborted.
///
/// # Safety
///
/// `raw` is a live communicator of `t`'s library that nothing else uses, and this is its
/// one teardown.
pub(crate) unsafe fn destroy_or_abort(
    t: &nccl_sys::FunctionTable,
    raw: ncclComm_t,
) -> ncclResult_t {
    let mut state = ncclInProgress;
    // SAFETY: `raw` is live (the caller's contract); `state` is writable.
    let polled = unsafe { (t.ncclCommGetAsyncError)(raw, &mut state) };
    if polled == ncclSuccess && state == ncclSuccess {
        // SAFETY: as above.
        let r = unsafe { destroy_closing_level(t, raw) };
        if r == ncclSuccess {
            return r;
        }
    }
    // SAFETY: not torn down (the destroy was refused or not tried); this is its teardown.
    unsafe { (t.ncclCommAbort)(raw) }
}

/// `ncclCommDestroy` of `raw`, ncclInProgress read as success (a destroy is synchronous
/// even on a non-blocking communicator); a refused one has the group level it left open on
/// this thread closed (init.cc:2372-2381), and nothing was torn down.
///
/// # Safety
///
/// `raw` is a live communicator of `t`'s library that nothing else uses during the call.
pub(crate) unsafe fn destroy_closing_level(
    t: &nccl_sys::FunctionTable,
    raw: ncclComm_t,
) -> ncclResult_t {
    // SAFETY: `raw` is live (the caller's contract).
    let r = unsafe { (t.ncclCommDestroy)(raw) };
    if r == ncclSuccess || r == ncclInProgress {
        return ncclSuccess;
    }
    // SAFETY: closes the level the refused destroy left open; no handle involved.
    let _ = unsafe { (t.ncclGroupEnd)() };
    r
}

/// Queues `work` on `lane` and waits until `until` (at least [`MIN_WAIT`]): its result if
/// it returned in time (past that, the policy has been applied).
pub(crate) fn run_bounded(
    lane: TeardownLane,
    b: Bound,
    what: String,
    work: Work,
    until: Instant,
) -> Option<ncclResult_t> {
    submit(lane, b, what, work).outcome(until)
}

/// Applies the policy to every task past its bound (the watchdog calls it each tick).
#[cfg(feature = "diag")]
pub(crate) fn check_overdue(now: Instant) {
    let overdue: Vec<Arc<Task>> = {
        let mut j = lock(&TASKS);
        j.retain(|j| !j.is_done());
        j.iter()
            .filter(|j| now >= j.deadline && !j.overdue.load(Ordering::Acquire))
            .cloned()
            .collect()
    };
    for j in overdue {
        j.handle_overdue();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(ms: u64) -> Bound {
        Bound {
            bound: Duration::from_millis(ms),
            action: OnAbortTimeout::Report,
        }
    }

    /// One thread per lane: tasks run in order, a blocked one holds the lane (the tasks
    /// behind it wait, their callers give up at their bound) and marks it wedged past its
    /// bound; once it returns, the queue drains and the lane is free again.
    #[test]
    fn a_lane_runs_its_jobs_in_order_on_one_thread() {
        let lane = TeardownLane::Host(0x5eed_0001);
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let order = Arc::new(Mutex::new(Vec::new()));
        let g = Arc::clone(&gate);
        let o = Arc::clone(&order);
        let first = submit(
            lane,
            bound(100),
            "the blocked task".into(),
            Box::new(move || {
                o.lock().unwrap().push((1, std::thread::current().id()));
                let mut open = g.0.lock().unwrap();
                while !*open {
                    open = g.1.wait(open).unwrap();
                }
                ncclSuccess
            }),
        );
        let o = Arc::clone(&order);
        let second = submit(
            lane,
            bound(100),
            "the queued task".into(),
            Box::new(move || {
                o.lock().unwrap().push((2, std::thread::current().id()));
                nccl_sys::bindings::ncclInternalError
            }),
        );
        assert!(
            !second.wait(Instant::now() + Duration::from_millis(150)),
            "queued behind a blocked task"
        );
        assert!(!first.is_done());
        let limit = Instant::now() + Duration::from_secs(5);
        let check = || check_lane("ncclCommInitRankConfig", lane);
        while check().is_ok() && Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
        let e = check().expect_err("the lane is wedged past the bound");
        assert!(
            matches!(&e, crate::Error::TeardownWedged { what, .. } if what.contains("the blocked task")),
            "{e}"
        );
        assert!(check_lane("ncclCommInitRankConfig", TeardownLane::Host(0x5eed_0002)).is_ok());
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        assert!(second.wait(Instant::now() + Duration::from_secs(5)));
        assert_eq!(second.result(), nccl_sys::bindings::ncclInternalError);
        let order = order.lock().unwrap();
        assert_eq!(order.iter().map(|o| o.0).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(order[0].1, order[1].1, "one thread served the lane");
        assert!(check().is_ok());
    }
}
