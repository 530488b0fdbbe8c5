//! The watchdog: one thread per process, started with the first communicator, that aborts
//! the communicators of a clique whose operation ran out of time. Each tick it also
//! advances the coarse clock (`clock`), records and queries the completion markers of
//! queued work (`tracker`), and applies the teardown bound (`crate::teardown`).
//!
//! On a timeout it first marks the clique timed out, so every rank of it in this process
//! fails fast (`is_failed()`, and every later call returns [`crate::Error::Timeout`] without
//! reaching NCCL or CUDA); then it claims and takes the handles (ARCHITECTURE.md, "Who may
//! use a handle: the claim"); then it aborts them on a teardown lane, so a blocking abort
//! stalls neither a caller nor the watchdog's service of other cliques.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::claim::Revoked;
use super::clique::TimeoutReport;
use super::clock;
use super::record::OpRecord;
use super::shared::Shared;
use crate::library::Library;
use crate::teardown::{self, exit, lock};

/// The communicators under watch.
static REGISTRY: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());

/// Puts `s` under watch (and starts the thread on first use).
pub(in crate::diag) fn watch(s: &Arc<Shared>) {
    {
        let mut r = lock(&REGISTRY);
        r.retain(|w| w.strong_count() > 0);
        r.push(Arc::downgrade(s));
    }
    static STARTED: OnceLock<bool> = OnceLock::new();
    STARTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("nccl-safe-watchdog".into())
            .spawn(|| {
                super::tracker::on_the_watchdogs_thread();
                // Reused every tick: a quiet sweep allocates nothing.
                let mut list = Vec::with_capacity(64);
                loop {
                    std::thread::sleep(clock::TICK);
                    clock::advance();
                    let now = Instant::now();
                    let live = sweep(now, &mut list); // false: the process is exiting
                    list.clear();
                    if live {
                        teardown::check_overdue(now);
                    }
                }
            })
            .is_ok()
    });
    // After the first communicator's init, so after the CUDA runtime's own exit handlers.
    exit::install();
}

/// Operations younger than this are not aborted along with an expired peer: their thread
/// may not have entered its NCCL call yet (it gets the timeout from the clique instead).
/// The claim adds the clock's lag at the operation's start (`Shared::slack`).
fn grace(s: &Shared) -> Duration {
    (s.settings.timeout / 4).min(Duration::from_millis(50))
}

/// One tick: `false` once the process is exiting (then nothing was done).
fn sweep(now: Instant, list: &mut Vec<Arc<Shared>>) -> bool {
    {
        let r = lock(&REGISTRY);
        list.extend(r.iter().filter_map(Weak::upgrade));
    }
    // The tracker's calls into CUDA count as busy for the exit guard (bounded like a
    // teardown); the reports below (the desync board's network I/O) do not.
    let bound = list
        .iter()
        .map(|s| s.settings.abort_timeout)
        .min()
        .unwrap_or(teardown::DEFAULT_ABORT_TIMEOUT);
    {
        let Some(_busy) = exit::busy(bound) else {
            return false;
        };
        for s in list.iter() {
            s.track();
        }
    }
    // Work that has waited long: a notice on stderr, once per operation, long before its
    // timeout (a stuck rank shows within a minute).
    for s in list.iter() {
        if !s.aborted_by_watchdog.load(Ordering::Acquire) {
            if let Some(n) = s.notice(now) {
                eprintln!("{n}");
                s.clique.post_waiting();
            }
        }
    }
    // Late work, work whose stream the driver failed (at once), or work that waits for a
    // collective a departed rank never issued (that one at once too).
    let expired: Vec<(usize, _, Expiry)> = (list.iter().enumerate())
        .filter(|(_, s)| !s.watchdog_took())
        .filter_map(|(i, s)| match (s.faulted(), s.late(now)) {
            (Some((rec, e)), _) => Some((i, rec, Expiry::Fault(e))),
            (None, Some(rec)) => Some((i, rec, Expiry::Late)),
            (None, None) => Some((i, s.waits_for_departed(now)?, Expiry::Departed)),
        })
        .collect();
    for (i, rec, why) in expired {
        let s = &list[i];
        if s.watchdog_took() || s.clique.expiring.swap(true, Ordering::AcqRel) {
            // Aborted (or revoked) with an earlier one, or a worker handles its clique.
            continue;
        }
        // The expired one first: when it completed after all, nothing is aborted.
        let members: Vec<Arc<Shared>> = std::iter::once(Arc::clone(s))
            .chain(
                (list.iter())
                    .filter(|t| !Arc::ptr_eq(t, s) && Arc::ptr_eq(&t.clique, &s.clique))
                    .cloned(),
            )
            .collect();
        // Off this thread: the report reads the desync board (network I/O, bounded) and a
        // revoke may block in NCCL (it joins the group job, group.cc:875-877 of
        // v2.29.7-1); meanwhile this thread goes on timing out other cliques, tracking
        // work and bounding teardowns. One worker per clique at a time (`expiring`).
        let work = Arc::new(CliqueExpiry { members, rec, why });
        let spawned = std::thread::Builder::new()
            .name("nccl-safe-expiry".into())
            .spawn({
                let work = Arc::clone(&work);
                move || run(&work)
            });
        if spawned.is_err() {
            run(&work); // no thread: here, as before
        }
    }
    true
}

/// One timeout of a clique, handed to a worker (`expire`), which clears the clique's
/// `expiring` at its end, whatever happened.
struct CliqueExpiry {
    members: Vec<Arc<Shared>>,
    rec: OpRecord,
    why: Expiry,
}

/// Runs `work` (on the worker's thread, or the watchdog's when none started).
fn run(work: &CliqueExpiry) {
    struct Done<'a>(&'a Shared);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.clique.expiring.store(false, Ordering::Release);
        }
    }
    let _done = Done(&work.members[0]);
    expire(&work.members, &work.rec, work.why);
}

/// Fails the clique of `members[0]`, whose operation `rec` expired (`why`), and revokes
/// or aborts its communicators in this process (`members`, `members[0]` first).
fn expire(members: &[Arc<Shared>], rec: &OpRecord, why: Expiry) {
    let s = &members[0];
    let departed = matches!(why, Expiry::Departed);
    // Fail fast first: from here on every rank of the clique in this process gets the
    // report without reaching NCCL, whatever the abort below does.
    let report = match (departed, s.clique.waits_for_departed(s.rank, rec)) {
        (true, Some(d)) => {
            let d = d.clone();
            s.clique.fail_for_departure(&d, Some(s.rank), Some(rec))
        }
        _ => {
            let what = match why {
                Expiry::Fault(e) => format!(
                    "failed on the GPU: the CUDA driver reports {e:?} for its stream's work (a sticky error: the context can run no more work)"
                ),
                _ => "did not complete in time".to_string(),
            };
            let host = s.host_behind();
            let mut report = (s.clique).report(
                s.rank,
                rec,
                s.settings.timeout,
                &what,
                true,
                host.as_deref(),
            );
            if matches!(why, Expiry::Fault(_)) {
                report.behind = None; // this rank's GPU failed: no peer is to blame
            }
            s.clique
                .set_timed_out(&TimeoutReport::of(s.rank, rec, report))
        }
    };
    let now = Instant::now();
    let mut taken: Vec<(Arc<Library>, usize, Arc<Shared>)> = Vec::new();
    for t in members {
        if t.watchdog_took() {
            continue;
        }
        let elastic = t.settings.elastic && !matches!(why, Expiry::Fault(_));
        if t.in_shrink() {
            // Its rank already recovers (shrink_after_failure), or shrinks: never
            // aborted under the call (`Shared::in_shrink`).
            continue;
        }
        // A grow's call uses the handle after its wait: revoked, never aborted under
        // it (`Shared::in_grow`), in either mode.
        let in_place = elastic || t.in_grow();
        let min_age = match why {
            _ if !Arc::ptr_eq(t, s) => grace(t),
            Expiry::Late => t.settings.timeout,
            Expiry::Fault(_) => Duration::ZERO,
            Expiry::Departed => grace(t),
        };
        if !t.claim(now, min_age) {
            continue;
        }
        // `Config::elastic`: revoked where it is, the handle left to its owner for a
        // shrink (a GPU fault leaves nothing to shrink: aborted).
        if in_place {
            match t.revoke_in_place(&report) {
                Revoked::Yes => continue,
                Revoked::OwnerLeft(h) => {
                    // The owner's teardown gave up waiting for the revoke (its bound):
                    // this abort is the handle's one teardown.
                    taken.push((Arc::clone(&t.lib), h, Arc::clone(t)));
                    continue;
                }
                Revoked::No => {}
            }
        }
        if t.in_grow() {
            // NCCL refused the revoke (it was revoked already: its abort flags end the
            // wait) or has none: let the call end on its own, not abort under it.
            t.release_claim();
            continue;
        }
        let h = t.take_for_abort(&report);
        if h != 0 {
            taken.push((Arc::clone(&t.lib), h, Arc::clone(t)));
        }
    }
    if !taken.is_empty() {
        abort_together(taken, s);
    }
}

/// Why the watchdog fails a communicator's clique.
#[derive(Debug, Clone, Copy)]
enum Expiry {
    /// Its work did not complete within the timeout.
    Late,
    /// The driver failed its stream's work.
    Fault(cudarc::driver::DriverError),
    /// It waits for a collective a departed rank never issued.
    Departed,
}

/// Aborts the handles inside one NCCL group per library (NCCL 2.22+ requires communicators
/// that may wait on each other to be aborted together), each group as one task on the
/// expired communicator's teardown lane, bounded by its `abort_timeout`. Each
/// communicator keeps its task, so its owner's `abort()` can wait for it.
fn abort_together(mut taken: Vec<(Arc<Library>, usize, Arc<Shared>)>, s: &Shared) {
    while let Some((lib, _, _)) = taken.first() {
        let lib = Arc::clone(lib);
        let (same, rest): (Vec<_>, Vec<_>) = taken
            .into_iter()
            .partition(|(l, _, _)| Arc::ptr_eq(l, &lib));
        let what = format!(
            "{} communicator(s) of the clique of rank {} (timed out)",
            same.len(),
            s.rank
        );
        let task = teardown::abort(
            s.lane,
            lib,
            same.iter().map(|(_, h, _)| *h).collect(),
            s.teardown_bound(),
            what,
        );
        for (_, _, t) in &same {
            *lock(&t.abort_task) = Some(Arc::clone(&task));
        }
        taken = rest;
    }
}
