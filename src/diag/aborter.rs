//! Aborts that cannot block anyone: `ncclCommAbort` runs on a thread of its own, bounded by
//! [`Config::abort_timeout`](crate::Config::abort_timeout).
//!
//! NVIDIA's abort can block for ever: it frees device memory, and `cudaFree` waits for a
//! stream that a stuck kernel holds. So neither the watchdog (which serves every clique of
//! the process) nor a caller ever makes the call itself. The watchdog hands the handles of
//! a timed-out clique to a new abort thread and goes on; a communicator's `Drop` (and
//! [`Communicator::abort`](crate::Communicator::abort)) hands its handle over and waits at
//! most the bound. An abort still running at its bound gets the configured
//! [`OnAbortTimeout`] once: a report on stderr (the handle and its thread are left; every
//! communicator involved stays failed), or the end of the process with
//! [`ABORT_TIMEOUT_EXIT_STATUS`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nccl_sys::{ncclComm_t, ncclResult_t};

use super::exit;
use crate::library::Library;

/// The default bound on an abort ([`Config::abort_timeout`](crate::Config::abort_timeout)).
pub const DEFAULT_ABORT_TIMEOUT: Duration = Duration::from_secs(30);

/// The exit status of a process ended by [`OnAbortTimeout::ExitProcess`] (as `timeout(1)`'s).
pub const ABORT_TIMEOUT_EXIT_STATUS: i32 = 124;

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

/// One abort in flight.
#[derive(Debug)]
pub(crate) struct Job {
    what: String,
    bound: Duration,
    deadline: Instant,
    action: OnAbortTimeout,
    done: Mutex<bool>,
    cv: Condvar,
    overdue: AtomicBool,
    /// The first failed result of the abort calls (success when none failed).
    result: Mutex<ncclResult_t>,
}

impl Job {
    /// Waits until the abort returned or `until`: `true` when it returned.
    pub(crate) fn wait(&self, until: Instant) -> bool {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            let now = Instant::now();
            if now >= until {
                return false;
            }
            done = match self.cv.wait_timeout(done, until - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        true
    }

    /// Waits up to the bound; past it, applies the policy. `true` when the abort returned.
    pub(crate) fn wait_bounded(&self) -> bool {
        if self.wait(self.deadline) {
            return true;
        }
        self.handle_overdue();
        false
    }

    /// The abort calls' result (meaningful once done).
    pub(crate) fn result(&self) -> ncclResult_t {
        *self.result.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_done(&self) -> bool {
        *self.done.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.cv.notify_all();
    }

    /// Applies the policy once.
    fn handle_overdue(&self) {
        if self.overdue.swap(true, Ordering::AcqRel) {
            return;
        }
        match self.action {
            OnAbortTimeout::Report => eprintln!(
                "nccl-safe: ncclCommAbort of {} did not return within {:?} (Config::abort_timeout, NCCL_SAFE_ABORT_TIMEOUT_MS): its handle and thread are left; the communicators stay failed. NCCL_SAFE_ON_ABORT_TIMEOUT=exit ends the process instead.",
                self.what, self.bound
            ),
            OnAbortTimeout::ExitProcess => {
                eprintln!(
                    "nccl-safe: ncclCommAbort of {} did not return within {:?} (Config::abort_timeout, NCCL_SAFE_ABORT_TIMEOUT_MS): ending the process with status {ABORT_TIMEOUT_EXIT_STATUS} (NCCL_SAFE_ON_ABORT_TIMEOUT=exit)",
                    self.what, self.bound
                );
                // SAFETY: `_exit` ends the process at once. The normal exit path would run
                // the CUDA runtime's teardown under the blocked abort.
                unsafe { libc::_exit(ABORT_TIMEOUT_EXIT_STATUS) }
            }
        }
    }
}

fn jobs() -> &'static Mutex<Vec<Arc<Job>>> {
    static J: OnceLock<Mutex<Vec<Arc<Job>>>> = OnceLock::new();
    J.get_or_init(|| Mutex::new(Vec::new()))
}

/// Aborts `handles` of `lib` together (one NCCL group) on a new thread; returns at once.
/// Each handle must have been taken out of its communicator: this is its one teardown.
pub(crate) fn spawn(
    lib: Arc<Library>,
    handles: Vec<usize>,
    bound: Duration,
    action: OnAbortTimeout,
    what: String,
) -> Arc<Job> {
    exit::install();
    let job = Arc::new(Job {
        what,
        bound,
        deadline: Instant::now() + bound,
        action,
        done: Mutex::new(false),
        cv: Condvar::new(),
        overdue: AtomicBool::new(false),
        result: Mutex::new(nccl_sys::bindings::ncclSuccess),
    });
    {
        let mut j = jobs().lock().unwrap_or_else(|e| e.into_inner());
        j.retain(|j| !j.is_done());
        j.push(Arc::clone(&job));
    }
    let work = Arc::new(Mutex::new(Some((lib, handles))));
    let (job2, work2) = (Arc::clone(&job), Arc::clone(&work));
    let spawned = std::thread::Builder::new()
        .name("nccl-safe-abort".into())
        .spawn(move || run(&job2, &work2));
    if spawned.is_err() {
        // No thread to be had: abort here rather than never.
        run(&job, &work);
    }
    job
}

fn run(job: &Job, work: &Mutex<Option<(Arc<Library>, Vec<usize>)>>) {
    let taken = work.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let (Some((lib, handles)), Some(_busy)) = (taken, exit::busy()) {
        let t = lib.table();
        // SAFETY: each handle was taken out of its communicator's slot, so this is its
        // one teardown and no one uses it afterwards; group start/end are paired.
        unsafe {
            if handles.len() > 1 {
                let _ = (t.ncclGroupStart)();
            }
            for &h in &handles {
                let r = (t.ncclCommAbort)(h as ncclComm_t);
                let mut first = job.result.lock().unwrap_or_else(|e| e.into_inner());
                if *first == nccl_sys::bindings::ncclSuccess {
                    *first = r;
                }
            }
            if handles.len() > 1 {
                let _ = (t.ncclGroupEnd)();
            }
        }
    }
    job.finish();
}

/// Aborts the handle `raw` (taken out of its communicator) of `lib` on an abort thread and
/// waits at most the bound of `settings`: the bound, and `ncclCommAbort`'s result if it
/// returned (past the bound, the policy has been applied).
pub(super) fn abort_bounded(
    settings: &super::settings::Settings,
    lib: &Arc<Library>,
    raw: ncclComm_t,
    what: String,
) -> (Duration, Option<ncclResult_t>) {
    let bound = settings.abort_timeout;
    let job = spawn(
        Arc::clone(lib),
        vec![raw as usize],
        bound,
        settings.on_abort_timeout,
        what,
    );
    let done = job.wait_bounded();
    (bound, done.then(|| job.result()))
}

/// Applies the policy to every abort past its bound (the watchdog calls it each tick).
#[cfg(feature = "diag")]
pub(crate) fn check_overdue(now: Instant) {
    let overdue: Vec<Arc<Job>> = {
        let mut j = jobs().lock().unwrap_or_else(|e| e.into_inner());
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
