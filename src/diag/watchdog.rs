//! The watchdog: one thread per process, started with the first communicator, that aborts
//! the communicators of a clique whose operation ran out of time.
//!
//! It also advances the coarse diagnostics clock each tick (`clock`).
//!
//! Ownership: the watchdog first *claims* a communicator (`Shared::claim`): it may, when an
//! operation has been inside its NCCL call long enough or the communicator is idle with
//! CUDA work in flight; it marks the claim, fences against the owner (`fence`), and keeps
//! the claim only if the owner is still where it saw it; an owner that moved on meanwhile
//! sees the claim before its next call and waits for the verdict. Then the watchdog
//! *takes* the handle out of the shared slot with a swap. The owner's teardown takes the
//! handle with a swap of the same slot, so whichever comes first tears it down and the
//! other does nothing.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use nccl_sys::ncclComm_t;

use super::{clock, Shared};
use crate::library::Library;

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
            .spawn(|| {
                // Reused every tick: a quiet sweep allocates nothing.
                let mut list = Vec::with_capacity(64);
                loop {
                    std::thread::sleep(clock::TICK);
                    clock::advance();
                    sweep(Instant::now(), &mut list);
                    list.clear();
                }
            })
            .is_ok()
    });
}

/// Operations younger than this are not aborted along with an expired peer: their thread
/// may not have entered its NCCL call yet (it gets the timeout from the clique instead).
fn grace(s: &Shared) -> Duration {
    (s.settings.timeout / 4).min(Duration::from_millis(50)) + s.slack()
}

fn sweep(now: Instant, list: &mut Vec<Arc<Shared>>) {
    {
        let r = registry().lock().unwrap_or_else(|e| e.into_inner());
        list.extend(r.iter().filter_map(Weak::upgrade));
    }
    let expired: Vec<(usize, _)> = (list.iter().enumerate())
        .filter(|(_, s)| !s.aborted_by_watchdog.load(Ordering::Acquire))
        .filter_map(|(i, s)| Some((i, s.late(now)?)))
        .collect();
    for (i, rec) in expired {
        let s = &list[i];
        if s.aborted_by_watchdog.load(Ordering::Acquire) {
            continue; // aborted with an earlier one of this sweep
        }
        let report: Arc<str> = Arc::from(s.clique.report(
            s.rank,
            &rec,
            s.settings.timeout,
            "did not complete in time",
        ));
        let mut taken: Vec<(Arc<Library>, usize)> = Vec::new();
        // The expired one first: when it completed after all, nothing is aborted.
        let others = list.iter().filter(|t| !Arc::ptr_eq(t, s));
        for t in std::iter::once(s).chain(others) {
            if !Arc::ptr_eq(&t.clique, &s.clique) || t.aborted_by_watchdog.load(Ordering::Acquire) {
                continue;
            }
            let min_age = if Arc::ptr_eq(t, s) {
                t.settings.timeout
            } else {
                grace(t)
            };
            if !t.claim(now, min_age) {
                if Arc::ptr_eq(t, s) {
                    break; // it completed after all: nothing to abort
                }
                continue;
            }
            let h = t.take_for_abort(&report);
            if h != 0 {
                taken.push((Arc::clone(&t.lib), h));
            }
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
