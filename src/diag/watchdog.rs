//! The watchdog: one thread per process, started with the first communicator, that aborts
//! the communicators of a clique whose operation ran out of time.
//!
//! It also advances the coarse diagnostics clock each tick (`clock`), records and queries
//! the completion markers of queued work (`tracker`), and applies the abort bound
//! (`aborter`).
//!
//! Order on a timeout: first the clique is marked timed out, so every rank of it in this
//! process fails fast (`is_failed()`, and every later call returns [`crate::Error::Timeout`]
//! without reaching NCCL or CUDA); then the handles are claimed and taken; then they are
//! aborted on a thread of their own, so a blocking abort stalls neither a caller nor the
//! watchdog's service of other cliques.
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

use super::clique::TimeoutReport;
use super::shared::Shared;
use super::{aborter, clock, exit};
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
                    // Once the process exits, no more calls into NCCL or CUDA.
                    let Some(_busy) = exit::busy() else {
                        continue;
                    };
                    let now = Instant::now();
                    sweep(now, &mut list);
                    list.clear();
                    aborter::check_overdue(now);
                }
            })
            .is_ok()
    });
    // After the first communicator's init, so after the CUDA runtime's own exit handlers.
    exit::install();
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
    for s in list.iter() {
        s.track();
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
        let text = s
            .clique
            .report(s.rank, &rec, s.settings.timeout, "did not complete in time");
        let report = TimeoutReport::of(s.rank, &rec, text);
        // Fail fast first: from here on every rank of the clique in this process gets the
        // report without reaching NCCL, whatever the abort below does.
        let report = s.clique.set_timed_out(&report);
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
        abort_together(taken, s);
    }
}

/// Aborts the handles inside one NCCL group per library (NCCL 2.22+ requires communicators
/// that may wait on each other to be aborted together), each group on an abort thread of
/// its own, bounded by the expired communicator's `abort_timeout`.
fn abort_together(mut taken: Vec<(Arc<Library>, usize)>, s: &Shared) {
    while let Some((lib, _)) = taken.first() {
        let lib = Arc::clone(lib);
        let (same, rest): (Vec<_>, Vec<_>) =
            taken.into_iter().partition(|(l, _)| Arc::ptr_eq(l, &lib));
        let what = format!(
            "{} communicator(s) of the clique of rank {} (timed out)",
            same.len(),
            s.rank
        );
        aborter::spawn(
            lib,
            same.into_iter().map(|(_, h)| h).collect(),
            s.settings.abort_timeout,
            s.settings.on_abort_timeout,
            what,
        );
        taken = rest;
    }
}
