//! Diagnostics: a watchdog that turns hangs into errors, a flight recorder of recent
//! operations, a desync report, an opt-in collective fingerprint check, and per-rank wait
//! times.
//!
//! Everything hooks into the one path every operation takes (`Communicator::issue`):
//!
//! * **Watchdog.** Each communicator has a timeout ([`Config::timeout`](crate::Config::timeout), else
//!   `NCCL_SAFE_TIMEOUT_MS`, else [`DEFAULT_TIMEOUT`]). An operation is registered before
//!   its NCCL call and deregistered when it completes (host provider: when the call returns;
//!   CUDA: when an event recorded after it completes). One process-wide thread (started
//!   with the first communicator) aborts, inside one NCCL group, every in-flight
//!   communicator of a clique whose operation ran out of time. The watchdog *takes* each
//!   handle it aborts out of the communicator's holder (`Shared::handle`), so the communicator's own
//!   teardown skips it: every handle is torn down exactly once. The calls that were woken
//!   (and any later call on that clique in this process) return [`Error::Timeout`](crate::Error::Timeout) with the
//!   desync report.
//! * **Flight recorder.** A preallocated ring of the last N operations
//!   ([`Config::flight_record_len`](crate::Config::flight_record_len), default 64) of `Copy` entries: recording never
//!   allocates. [`Communicator::flight_record`](crate::Communicator::flight_record) copies it; it is printed to stderr on a
//!   timeout or error with `NCCL_SAFE_DEBUG=info|detail` or [`Config::dump_on_failure`](crate::Config::dump_on_failure), and
//!   written as JSON to [`Config::flight_record_dir`](crate::Config::flight_record_dir) (or `NCCL_SAFE_FLIGHT_RECORD_DIR`).
//! * **Desync report.** Ranks of one clique in this process read each other's last operation; a
//!   timeout reports which ranks are behind, what each was last doing and from which line.
//!   Ranks in other processes come from the job's desync board ([`Config::desync_board`](crate::Config::desync_board),
//!   set by `ProcessLauncher::init`): the report posts this process's ranks to it and reads
//!   the others' posts (only then: nothing is sent per operation).
//! * **Fingerprint check** (opt-in: [`Config::check_collectives`](crate::Config::check_collectives) or
//!   `NCCL_SAFE_DEBUG=detail`): before each collective the ranks compare (sequence number,
//!   operation, type, count, root); on a mismatch every rank gets
//!   [`Error::CollectiveMismatch`](crate::Error::CollectiveMismatch) with a table of what each rank called and where, and
//!   nothing reaches NCCL. Off, none of it runs.
//! * **Straggler view.** [`Communicator::diagnostics`](crate::Communicator::diagnostics) reports the time spent inside
//!   collectives.
//!
//! **Cost.** The per-operation path takes no lock, reads no system clock and allocates
//! nothing: a sequence-locked ring slot (`supervise::journal`), the coarse clock (`clock`;
//! [`Config::timing`](crate::Config::timing) switches to `Instant::now()`) and an
//! asymmetric fence (`fence`), each measured in ARCHITECTURE.md. An operation on a CUDA
//! stream also records an event after itself (events are reused: `tracker`) and hands it
//! to the watchdog through the stream's lock-free ring (`ranges`), which makes a
//! read-modify-write only while 64 markers are in flight on the stream (or a slot never
//! used needs a spare event). A group's end takes the list of streams' lock, which the watchdog holds
//! only to copy the list.
//!
//! A [`crate::Group`]'s end pins its communicators (the watchdog cannot abort them under
//! it): the watchdog's notice reads the group's operations as it reads one inside its call,
//! and the end's own timeout (host provider) or wait for the launch makes the same report,
//! naming the ranks behind, and revokes a `Config::elastic` communicator as the watchdog
//! would.
//!
//! **Layers.** What keeps the crate correct (the watchdog, the claim, the clique's state,
//! the journal, the tracker, the clock, the fence) is `supervise`; what the crate says
//! about what happened (the flight record, the desync report, the fingerprint check) is
//! `observe`, above it: `supervise` never imports `observe` (scripts/check-layers.py).
//! Where supervision needs the observers' words, at a clique's failure or the watchdog's
//! notice, it calls the clique's `Observers` table, which `hooks` gives every clique it
//! joins: on those cold paths only, never on an operation's. `hooks` (the seam) uses both;
//! `key`, `op`, `settings` and the desync board (`remote`) are below both.
//!
//! Not done: the cross-process fingerprint exchange, and
//! fingerprints of operations inside a [`crate::Group`] (they are recorded, not compared).

mod hooks;
mod key;
mod op;
mod settings;

#[cfg(feature = "diag")]
mod observe;
#[cfg(feature = "diag")]
mod supervise;

#[cfg(feature = "diag")]
pub(crate) mod remote;

// The teardown options keep their public paths here (they are `Config`'s); the lanes
// themselves are `crate::teardown`.
pub use crate::teardown::{
    OnAbortTimeout, ABORT_TIMEOUT_EXIT_STATUS, DEFAULT_ABORT_TIMEOUT, MIN_NCCL_ABORT_TIMEOUT,
    NCCL_RECLAIM_PER_LOCAL_RANK,
};
pub use settings::DEFAULT_TIMEOUT;

pub(crate) use op::{is_collective, OpInfo};
pub(crate) use settings::{check_settings, default_bound, DiagConfig};

#[cfg(feature = "diag")]
pub use hooks::Diagnostics;
pub(crate) use hooks::{shrink_tag, CommDiag, CommView};
#[cfg(feature = "diag")]
pub use observe::flight::FlightRecord;
#[cfg(feature = "diag")]
pub use remote::{BoardError, BoardResult, DesyncPost, RemoteBoard, MAX_POST_TEXT};
#[cfg(feature = "diag")]
pub use settings::{DEFAULT_FLIGHT_RECORD_LEN, MAX_FLIGHT_RECORD_LEN};
#[cfg(feature = "diag")]
pub use supervise::record::{EntryPoint, OpRecord, OpState};

/// Whether the owner's side of the watchdog handshake is a compiler fence paired with the
/// watchdog's `membarrier(2)` (`true`), or a full memory fence on every operation
/// (`false`: membarrier is unavailable or refused, e.g. by a container's seccomp filter,
/// or `NCCL_SAFE_NO_MEMBARRIER` is set). For the overhead benchmark, which prints it.
#[cfg(feature = "diag")]
#[doc(hidden)]
pub fn asymmetric_fence() -> bool {
    supervise::fence::asymmetric()
}
