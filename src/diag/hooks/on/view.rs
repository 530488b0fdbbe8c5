//! What the user reads of a communicator's diagnostics (`Communicator::flight_record`,
//! `Communicator::diagnostics`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::diag::hooks::{CommDiag, CommView};
use crate::diag::observe::flight::{self, FlightRecord};

impl CommDiag {
    /// A copy of the flight recorder.
    pub(crate) fn flight_record(&self, h: CommView<'_>) -> FlightRecord {
        flight::of(self.shared(h))
    }

    /// The diagnostics counters.
    pub(crate) fn diagnostics(&self, h: CommView<'_>) -> Diagnostics {
        let s = self.shared(h);
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
    /// Whether times come from the precise clock ([`Config::timing`](crate::Config::timing)); otherwise `wait`
    /// has the coarse clock's 10 ms resolution (right on average over many operations).
    pub precise_timing: bool,
    /// The watchdog's timeout.
    pub timeout: Duration,
    /// Whether the watchdog aborted this communicator.
    pub aborted_by_watchdog: bool,
}
