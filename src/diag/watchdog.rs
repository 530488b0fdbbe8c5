//! The watchdog: one thread per process, started with the first communicator, that aborts
//! the communicators of a clique whose operation ran out of time.
//!
//! Ownership: the watchdog only aborts a handle it has *taken* out of the communicator's
//! shared slot (under the slot's lock, and only while an operation is in flight on it); the
//! communicator's teardown takes the handle through the same slot, so whichever comes first
//! tears it down and the other does nothing.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use nccl_sys::ncclComm_t;

use super::Shared;
use crate::library::Library;

/// How often in-flight operations are checked.
const POLL: Duration = Duration::from_millis(10);

fn registry() -> &'static Mutex<Vec<Weak<Shared>>> {
    static R: OnceLock<Mutex<Vec<Weak<Shared>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Vec::new()))
}

/// Puts `s` under watch (and starts the thread on first use).
pub(super) fn watch(s: &Arc<Shared>) {
    {
        let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|w| w.strong_count() > 0);
        r.push(Arc::downgrade(s));
    }
    static STARTED: OnceLock<bool> = OnceLock::new();
    STARTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("nccl-safe-watchdog".into())
            .spawn(|| loop {
                std::thread::sleep(POLL);
                sweep(Instant::now());
            })
            .is_ok()
    });
}

/// Operations younger than this are not aborted along with an expired peer: their thread
/// may not have entered its NCCL call yet (it gets the timeout from the clique instead).
fn grace(s: &Shared) -> Duration {
    (s.settings.timeout / 4).min(Duration::from_millis(50))
}

fn sweep(now: Instant) {
    let list: Vec<Arc<Shared>> = {
        let r = registry().lock().unwrap_or_else(|e| e.into_inner());
        r.iter().filter_map(Weak::upgrade).collect()
    };
    let mut expired = Vec::new();
    for (i, s) in list.iter().enumerate() {
        if s.aborted_by_watchdog.load(Ordering::Acquire) {
            continue;
        }
        let mut inner = s.lock();
        s.retire(&mut inner);
        let late = inner
            .current
            .filter(|p| now >= p.deadline)
            .or_else(|| inner.cuda.front().map(|(p, _)| *p))
            .filter(|p| now >= p.deadline);
        if let Some(p) = late {
            expired.push((i, p));
        }
    }
    for (i, p) in expired {
        let s = &list[i];
        if s.aborted_by_watchdog.load(Ordering::Acquire) {
            continue; // aborted with an earlier one of this sweep
        }
        let report: Arc<str> = Arc::from(s.clique.report(
            s.rank,
            &p.rec,
            s.settings.timeout,
            "did not complete in time",
        ));
        let mut taken: Vec<(Arc<Library>, usize)> = Vec::new();
        // The expired one first: when it completed after all, nothing is aborted.
        let others = list.iter().filter(|t| !Arc::ptr_eq(t, s));
        for t in std::iter::once(s).chain(others) {
            if !Arc::ptr_eq(&t.clique, &s.clique) {
                continue;
            }
            let mut inner = t.lock();
            let in_flight = if Arc::ptr_eq(t, s) {
                inner.current.is_some_and(|c| c.ring_id == p.ring_id) || !inner.cuda.is_empty()
            } else {
                inner
                    .current
                    .is_some_and(|c| now.saturating_duration_since(c.rec.enqueued) >= grace(t))
                    || !inner.cuda.is_empty()
            };
            if !in_flight || inner.handle == 0 {
                if Arc::ptr_eq(t, s) {
                    break; // it completed after all: nothing to abort
                }
                continue;
            }
            let h = std::mem::replace(&mut inner.handle, 0);
            inner.report = Some(Arc::clone(&report));
            t.aborted_by_watchdog.store(true, Ordering::Release);
            taken.push((Arc::clone(&t.lib), h));
        }
        if taken.is_empty() {
            continue;
        }
        s.clique.set_timed_out(&report);
        abort_together(taken);
    }
}

/// Aborts the handles inside one NCCL group per library (NCCL 2.22+ requires communicators
/// that may wait on each other to be aborted together).
fn abort_together(mut taken: Vec<(Arc<Library>, usize)>) {
    while let Some((lib, _)) = taken.first() {
        let lib = Arc::clone(lib);
        let (same, rest): (Vec<_>, Vec<_>) =
            taken.into_iter().partition(|(l, _)| Arc::ptr_eq(l, &lib));
        let t = lib.table();
        // SAFETY: each handle was taken out of its communicator's slot above, so this is
        // its one teardown and no one uses it afterwards; group start/end are paired.
        unsafe {
            let _ = (t.ncclGroupStart)();
            for (_, h) in &same {
                let _ = (t.ncclCommAbort)(*h as ncclComm_t);
            }
            let _ = (t.ncclGroupEnd)();
        }
        taken = rest;
    }
}
