//! The claim: who may use a communicator's handle (ARCHITECTURE.md, "Who may use a handle:
//! the claim"). The owner publishes the operation inside its NCCL call (`Shared::current`);
//! the watchdog claims the communicator (`UNCLAIMED` -> `DECIDING` -> `ABORTING` or back),
//! across the asymmetric fence (`fence`), and then takes the handle for an abort or
//! revokes it where it is (`Config::elastic`, a grow), the owner's teardown waiting for
//! that revoke at most its bound (`lock_in_place`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use nccl_sys::{ncclComm_t, EntryPoint};

use super::clique::TimeoutReport;
use super::fence;
use super::shared::{Shared, IDLE, PINNED};
use crate::teardown::lock;

/// `Shared::revoking`: no revoke of the watchdog's runs.
pub(in crate::diag) const NOT_REVOKING: u8 = 0;
/// `Shared::revoking`: a worker of the watchdog is inside NCCL's revoke, holding `in_place`.
pub(in crate::diag) const REVOKING: u8 = 1;
/// `Shared::revoking`: the owner's teardown gave up waiting for that revoke: the worker
/// aborts the handle when it returns.
pub(in crate::diag) const OWNER_LEFT: u8 = 2;

/// What [`Shared::revoke_in_place`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::diag) enum Revoked {
    /// Revoked in place: the handle stays with its owner.
    Yes,
    /// Nothing done (no revoke, the handle gone, or NCCL refused it): the claim holds.
    No,
    /// Revoked (or refused) while the owner's teardown gave up waiting for it: the
    /// handle, out of its holder, is the caller's to abort (its one teardown).
    OwnerLeft(usize),
}

/// `Shared::claim`: the watchdog leaves the communicator alone.
pub(in crate::diag) const UNCLAIMED: u8 = 0;
/// `Shared::claim`: the watchdog is deciding whether to abort it (for microseconds).
pub(in crate::diag) const DECIDING: u8 = 1;
/// `Shared::claim`: the watchdog aborts it; its handle must not be used again.
pub(in crate::diag) const ABORTING: u8 = 2;

impl Shared {
    /// Waits for the watchdog's decision on its claim (it takes microseconds): `true`
    /// when it let the communicator be, `false` when it aborts it (then once the abort is
    /// visible, so the error carries its report).
    #[cold]
    pub(in crate::diag) fn await_decision(&self) -> bool {
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

    /// Claims this communicator for an abort at `now`: an operation inside its NCCL call
    /// for at least `min_age` (so its thread is blocked in NCCL, not about to enter; its age
    /// read with the clock's lag at its start added), or idle with CUDA work in flight.
    /// `false` when it may not be aborted now.
    pub(in crate::diag) fn claim(&self, now: Instant, min_age: Duration) -> bool {
        self.claim_seen(self.current.load(Ordering::Acquire), now, min_age)
    }

    /// [`claim`](Self::claim) from the value `cur` of `current` the watchdog saw.
    pub(in crate::diag) fn claim_seen(&self, cur: u64, now: Instant, min_age: Duration) -> bool {
        if cur == PINNED {
            return false;
        }
        if cur != IDLE {
            let old = self.journal.get(cur - 1).is_some_and(|r| {
                now.saturating_duration_since(r.enqueued) >= min_age + self.slack(r.enqueued)
            });
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

    /// Whether the operation inside its call is a shrink: the watchdog leaves it be, with
    /// or without `Config::elastic` (the recovery a rank left already began; in NCCL's
    /// abort mode the call waits for the device stream with the abort flags it set itself,
    /// init.cc:2844-2848 of v2.29.7-1, and an abort would free the communicator under it;
    /// the wait for the child after the call is bounded by the shrink itself).
    pub(in crate::diag) fn in_shrink(&self) -> bool {
        self.in_call()
            .is_some_and(|r| r.op == EntryPoint::ncclCommShrink)
    }

    /// Whether the operation inside its call is a grow: a boundary rank waits there for
    /// the root's id through this communicator (init.cc:2913-2924 of v2.29.7-1) and uses
    /// it after the wait, so an abort would free it under the call; the watchdog revokes
    /// it instead, with or without `Config::elastic` (the abort flags end the wait).
    pub(in crate::diag) fn in_grow(&self) -> bool {
        self.in_call()
            .is_some_and(|r| r.op == EntryPoint::ncclCommGrow)
    }

    /// Whether the watchdog aborted or revoked this communicator (it is done with it).
    pub(in crate::diag) fn watchdog_took(&self) -> bool {
        self.aborted_by_watchdog.load(Ordering::Acquire)
            || self.revoked_by_watchdog.load(Ordering::Acquire)
    }

    /// After a successful [`claim`](Self::claim), with `Config::elastic`: revokes the
    /// handle where it is (`ncclCommRevoke`: its work in flight ends, its owner's call
    /// returns) and leaves it with its owner, whose teardown stays its one teardown.
    /// [`Revoked::No`] (nothing done, the claim still held) when the library has no
    /// revoke, the owner already took the handle, or NCCL refused the revoke: then the
    /// caller aborts. Runs on a worker of the watchdog (the revoke may block in NCCL);
    /// an owner's teardown waits for it at most its abort bound (`lock_in_place`) and
    /// then leaves the handle here: [`Revoked::OwnerLeft`], the caller's to abort.
    pub(in crate::diag) fn revoke_in_place(&self, report: &Arc<TimeoutReport>) -> Revoked {
        let Some(revoke) = self.lib.table().ncclCommRevoke else {
            return Revoked::No;
        };
        let _held = lock(&self.in_place);
        let h = self.handle.load(Ordering::Acquire);
        if h == 0 || self.gone.load(Ordering::Acquire) {
            return Revoked::No;
        }
        // Sound only with no NCCL group job linked to the handle
        // (`Communicator::revocable`): a poll that reads ncclSuccess unlinks one; one that
        // reads ncclInProgress (the launch in flight), or an error after a launch no poll
        // saw succeed, leaves it linked, and then the handle is aborted instead. The owner
        // cannot poll meanwhile: the claim keeps it from pinning.
        let mut state = nccl_sys::bindings::ncclInProgress;
        // SAFETY: the handle is live (see the revoke below); `state` is writable.
        let polled =
            unsafe { (self.lib.table().ncclCommGetAsyncError)(h as ncclComm_t, &mut state) };
        if polled == nccl_sys::bindings::ncclSuccess && state == nccl_sys::bindings::ncclSuccess {
            self.job_linked.store(false, Ordering::Release);
        }
        let linked = polled != nccl_sys::bindings::ncclSuccess
            || state == nccl_sys::bindings::ncclInProgress
            || self.job_linked.load(Ordering::Acquire);
        if linked {
            self.unrevocable.store(true, Ordering::Release);
            return Revoked::No;
        }
        // Marked first, so that the owner's call, woken by the revoke, reports it.
        *lock(&self.report) = Some(Arc::clone(report));
        self.revoked_by_watchdog.store(true, Ordering::Release);
        self.revoking.store(REVOKING, Ordering::SeqCst);
        // SAFETY: the handle is live: its owner takes it for a teardown only under
        // `in_place`, held here (an owner that gives up waiting leaves it in its holder,
        // see below), and the claim keeps the owner from any other call (it is blocked
        // inside one, or idle with work in flight, which a revoke may stop).
        let r = unsafe {
            revoke(
                h as ncclComm_t,
                nccl_sys::bindings::NCCL_REVOKE_DEFAULT as std::ffi::c_int,
            )
        };
        let ok = r == nccl_sys::bindings::ncclSuccess || r == nccl_sys::bindings::ncclInProgress;
        if self.revoking.swap(NOT_REVOKING, Ordering::AcqRel) == OWNER_LEFT {
            // The owner's teardown gave up waiting while the revoke ran (`lock_in_place`):
            // the handle is still in its holder, and this is its one teardown.
            self.aborted_by_watchdog.store(true, Ordering::Release);
            let h = self.handle.swap(0, Ordering::AcqRel);
            self.claim.store(UNCLAIMED, Ordering::Release);
            return if h == 0 {
                Revoked::Yes
            } else {
                Revoked::OwnerLeft(h)
            };
        }
        if !ok {
            self.revoked_by_watchdog.store(false, Ordering::Release);
            return Revoked::No;
        }
        self.claim.store(UNCLAIMED, Ordering::Release);
        Revoked::Yes
    }

    /// The owner's own `ncclCommRevoke` (`Communicator::revoke`, and a failed wait's or
    /// group's revoke), run on a thread of its own under `in_place` as the watchdog's
    /// revoke runs (NCCL's revoke may block: it joins the group job, group.cc:875-877 of
    /// v2.29.7-1), so that the owner waits for it at most `bound`. The owner holds its pin
    /// (the watchdog claims nothing meanwhile) and judged the revoke sound first
    /// (`Communicator::revocable`). `Ok(None)`: the handle had been taken. `Err(())`: past
    /// the bound, the revoke still runs: the owner must not call NCCL on the handle again;
    /// its teardown hands the handle over (`lock_in_place`), and this thread aborts it once
    /// the revoke returned.
    pub(crate) fn revoke_for_owner(
        self: &Arc<Self>,
        bound: Duration,
    ) -> Result<Option<nccl_sys::ncclResult_t>, ()> {
        let Some(revoke) = self.lib.table().ncclCommRevoke else {
            return Ok(None);
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let s = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("nccl-safe-revoke".into())
            .spawn(move || {
                let held = lock(&s.in_place);
                let h = s.handle.load(Ordering::Acquire);
                if h == 0 || s.gone.load(Ordering::Acquire) {
                    let _ = tx.send(None);
                    return;
                }
                s.revoking.store(REVOKING, Ordering::SeqCst);
                // SAFETY: the handle is live: its owner takes it for a teardown only under
                // `in_place`, held here (an owner that gives up waiting leaves it in its
                // holder); the owner makes no other call on it meanwhile (it waits for this
                // one, or, past its bound, never calls NCCL on it again).
                let r = unsafe {
                    revoke(
                        h as ncclComm_t,
                        nccl_sys::bindings::NCCL_REVOKE_DEFAULT as std::ffi::c_int,
                    )
                };
                if s.revoking.swap(NOT_REVOKING, Ordering::AcqRel) == OWNER_LEFT {
                    // The owner's teardown gave up waiting: this is the handle's one
                    // teardown, an abort its `abort()` waits for as for the watchdog's.
                    s.aborted_by_watchdog.store(true, Ordering::Release);
                    let h = s.handle.swap(0, Ordering::AcqRel);
                    if h != 0 {
                        let what = format!(
                            "the communicator of rank {} whose revoke outlasted its owner's bound",
                            s.rank
                        );
                        let task = crate::teardown::abort(
                            s.lane,
                            Arc::clone(&s.lib),
                            vec![h],
                            s.teardown_bound(),
                            what,
                        );
                        *lock(&s.abort_task) = Some(task);
                    }
                }
                drop(held);
                let _ = tx.send(Some(r));
            });
        if spawned.is_err() {
            return Ok(None);
        }
        rx.recv_timeout(bound).map_err(|_| ())
    }

    /// The owner's teardown takes `in_place`, waiting at most `bound` (a worker of the
    /// watchdog holds it while NCCL's revoke runs, which may block). `None` past it:
    /// then the communicator is marked gone and its handle left to the worker, which
    /// aborts it once the revoke returned ([`Revoked::OwnerLeft`]; `revoking` decides
    /// which side has it, exactly once): the owner must not touch the handle again.
    pub(crate) fn lock_in_place(&self, bound: Duration) -> Option<MutexGuard<'_, ()>> {
        let until = Instant::now() + bound;
        loop {
            match self.in_place.try_lock() {
                Ok(g) => return Some(g),
                Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
            // Past the bound, while NCCL's revoke runs: hand the handle to the worker.
            // (Outside the revoke, the worker holds the lock for microseconds: wait on.)
            let late = Instant::now() >= until;
            if late
                && (self.revoking)
                    .compare_exchange(REVOKING, OWNER_LEFT, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                // Marked aborted: the owner's `abort()` waits (bounded) for the worker's
                // abort of the handle, as for any the watchdog took.
                self.aborted_by_watchdog.store(true, Ordering::Release);
                self.gone.store(true, Ordering::Release);
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Gives a successful [`claim`](Self::claim) up: the owner carries on.
    pub(in crate::diag) fn release_claim(&self) {
        self.claim.store(UNCLAIMED, Ordering::Release);
    }

    /// After a successful [`claim`](Self::claim): takes the handle (0 when the owner's
    /// teardown already has it) and marks the communicator aborted with `report`.
    ///
    /// The report and the flag are set before the handle leaves its holder (`handle`), so an
    /// owner's `abort()` that finds it empty always sees that the watchdog took it (and
    /// waits for its abort) rather than returning `Ok` at once.
    pub(in crate::diag) fn take_for_abort(&self, report: &Arc<TimeoutReport>) -> usize {
        *lock(&self.report) = Some(Arc::clone(report));
        self.aborted_by_watchdog.store(true, Ordering::Release);
        self.handle.swap(0, Ordering::AcqRel)
    }
}
