//! The observers: what the crate says about what happened, built from what supervision
//! keeps (`diag::supervise`), never the other way round. The flight record
//! ([`FlightRecord`](flight::FlightRecord), printed and written as JSON), the desync report
//! (`desync`: who is behind and what each rank was doing, with the desync board's posts)
//! and the fingerprint check (`fingerprint`). The straggler view is the hooks'
//! ([`Diagnostics`](crate::diag::Diagnostics)).

use crate::diag::supervise::clique::Observers;

pub(crate) mod desync;
pub(crate) mod fingerprint;
pub(crate) mod flight;

/// What the observers say about a failure, as supervision calls it (the hooks give it to
/// every clique a communicator joins).
pub(crate) static OBSERVERS: Observers = Observers {
    report: desync::report,
    post_waiting: desync::post_waiting,
};
