//! Supervision: what keeps the crate correct when a rank hangs, fails or leaves. The
//! watchdog (`watchdog`) and what it reads and decides with: each communicator's watched
//! state and the claim on its handle (`shared`), the ledger of its operations (`journal`,
//! of [`record`] entries), the completion of its work on CUDA streams (`tracker`, and the
//! marker hand-off `ranges`), the coarse clock (`clock`) and the asymmetric fence
//! (`fence`); and what the ranks of a clique in this process know of each other
//! (`clique`: the timed-out report every rank fails fast with, departures, lost ranks,
//! the agreements of a recovery, the fingerprint exchange), with the job's desync board
//! that carries it between processes (`remote`).
//!
//! It never imports the observers (`diag::observe`: scripts/check-layers.py checks it).
//! Where it needs their words, at a clique's failure, it calls the clique's
//! [`Observers`](clique::Observers) table, which the hooks give it when a communicator
//! joins its clique: on the cold path only, never on an operation's.

pub(crate) mod claim;
pub(crate) mod clique;
pub(crate) mod clock;
pub(crate) mod fence;
pub(crate) mod journal;
pub(crate) mod ranges;
pub(crate) mod record;
pub(crate) mod shared;
pub(crate) mod tracker;
pub(crate) mod watchdog;
