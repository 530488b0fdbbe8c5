//! The seam between the wrapper and the diagnostics: one [`CommDiag`] per communicator,
//! whose methods the wrapper calls at each stage of the communicator's life, and what
//! they answer.
//!
//! This file is what both builds share: the struct, what the wrapper hands in
//! ([`CommView`]) and gets back per operation ([`InFlight`]), construction (`for_id`,
//! `for_init_all`, `child`) and the settings' getters. The rest comes in one of two
//! modules, chosen by the `diag` feature here, on the module lines, never inside a
//! function:
//!
//! * `on/` (with `diag`): the hooks, a file per stage that calls them:
//!   * `on/mod.rs`: joining (`attach`, init's `arrive` and `wait_timeout_report`), and
//!     the owner's side of the state ([`Watched`]: the state shared with the watchdog once
//!     attached, the owner's caches);
//!   * `on/op.rs`: an operation's path (`Communicator::issue`: `check_alive`, `begin`,
//!     `end`, `failed`) and the pin of a call on the handle that is not an operation
//!     (`pin`, `unpin`);
//!   * `on/group.rs`: a `Group`'s end (`group_end_begins`/`_done`, `publish_group`,
//!     `group_end_failed`, `group_failed`, `group_timed_out`, `peer_departed`);
//!   * `on/teardown.rs`: the communicator's end (`drain`, `before_teardown`, `release`,
//!     `leave`, `init_failed`, `watchdog_abort`, `bound`, and what the teardown asks:
//!     `aborted_by_watchdog`, `captured`);
//!   * `on/family.rs`: revoke, shrink and grow (`comm/elastic.rs`, `comm/family.rs`:
//!     `revoked_in_place`, `revoke_bounded`, `revoke_refused`, `revoked_by_watchdog`,
//!     `unrevocable`, `set_job_linked`, `set_recovering`, `lost_rank(s)`,
//!     `agree_lost_ranks`, `agree_exclude`, `stream_behind`);
//!   * `on/view.rs`: what the user reads (`flight_record`, `diagnostics`, [`Diagnostics`]).
//! * `off.rs` (without `diag`): the same methods, each doing nothing, so a `CommDiag`
//!   keeps only its settings and its family's key (the host provider's teardown lane):
//!   nothing is recorded or watched, each hook returns at once (the compiler removes it),
//!   and the timeout still bounds init and every wait for `ncclInProgress`.
//!
//! The methods are documented where they do something, in `on/`.

use std::sync::Arc;
use std::time::Duration;

use nccl_sys::ncclComm_t;

use super::key::{self, CliqueKey};
use super::settings::{DiagConfig, Settings};
use crate::error::Error;
use crate::id::UniqueId;
use crate::library::Library;
use crate::stream::StreamRef;
use crate::teardown::TeardownLane;

#[cfg(not(feature = "diag"))]
mod off;
#[cfg(feature = "diag")]
mod on;

#[cfg(not(feature = "diag"))]
use off::Watched;
#[cfg(feature = "diag")]
pub use on::Diagnostics;
#[cfg(feature = "diag")]
use on::Watched;

/// A communicator's diagnostics: its settings and clique, attached (with its handle, rank
/// and size) once they are known.
#[derive(Debug)]
pub(crate) struct CommDiag {
    settings: Settings,
    key: CliqueKey,
    /// The clique key of the unique id (or `ncclCommInitAll`) the communicator's family
    /// was born from: its teardown lane on the host provider.
    root: u64,
    /// What the diagnostics keep of the communicator (nothing without them).
    watched: Watched,
}

/// What the diagnostics know of a communicator when they attach it late (communicators of
/// `ncclCommInitAll`, adopted handles): diagnostics never see the `Communicator` itself.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(crate) struct CommView<'a> {
    pub raw: ncclComm_t,
    pub rank: usize,
    pub world_size: usize,
    pub lib: &'a Arc<Library>,
    /// Where its teardowns run.
    pub lane: TeardownLane,
}

/// What [`CommDiag::begin`] hands to [`CommDiag::end`].
#[derive(Debug)]
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(crate) struct InFlight<'a> {
    /// The operation's journal position.
    pos: u64,
    /// Its start (diagnostics clock).
    start: u64,
    stream: StreamRef<'a>,
    /// Issued by a group's end ([`OpInfo`]'s `grouped`).
    grouped: bool,
}

/// The bit that marks a child's tag as a shrink's ([`shrink_tag`]); a split's tag is its
/// color, a non-negative `c_int`.
pub(crate) const SHRINK_TAG: u64 = 1 << 63;

/// The tag of a shrink's child: its exclude list, whatever its order.
pub(crate) fn shrink_tag(exclude: &[std::ffi::c_int]) -> u64 {
    let mut list = exclude.to_vec();
    list.sort_unstable();
    key::key_of(("shrink", list)) | SHRINK_TAG
}

impl CommDiag {
    fn new(settings: Settings, key: CliqueKey, root: u64) -> CommDiag {
        CommDiag {
            settings,
            key,
            root,
            watched: Watched::unattached(),
        }
    }

    /// For rank `rank` of a `world_size`-rank communicator joined through `id`.
    pub(crate) fn for_id(
        config: &DiagConfig,
        id: &UniqueId,
        rank: usize,
        world_size: usize,
    ) -> CommDiag {
        let key = key::of_id(id.as_bytes(), rank, world_size);
        let mut d = CommDiag::new(Settings::resolve(config), key, key);
        d.watched = Watched::for_config(config);
        d
    }

    /// For the communicators of one `ncclCommInitAll`: one clique, of a fresh key.
    pub(crate) fn for_init_all() -> impl Fn() -> CommDiag {
        let key = key::fresh_key();
        move || CommDiag::new(Settings::resolve(&DiagConfig::default()), key, key)
    }

    /// For a child from split (`tag` = color) or shrink ([`shrink_tag`]): same settings,
    /// the key derived from the parent's, its last collective's sequence number and `tag`
    /// (without the diagnostics, which key no clique, the parent's).
    pub(crate) fn child(&self, tag: u64) -> CommDiag {
        CommDiag::new(self.settings.clone(), self.child_key(tag), self.root)
    }

    /// Whether the communicator was made with `Config::elastic` (a failed clique's handles
    /// are revoked rather than aborted, for a shrink).
    pub(crate) fn elastic(&self) -> bool {
        self.settings.elastic
    }

    /// The timeout of this communicator's operations (and of its init).
    pub(crate) fn timeout(&self) -> Duration {
        self.settings.timeout
    }

    /// The lane of the communicator's teardowns: its CUDA device (`cuda`: its ordinal), or
    /// on the host provider the unique id its family was born from.
    pub(crate) fn lane(&self, cuda: Option<usize>) -> TeardownLane {
        cuda.map_or(TeardownLane::Host(self.root), TeardownLane::Device)
    }

    /// The bound on its teardowns ([`Config::abort_timeout`](crate::Config::abort_timeout),
    /// extended as [`bound`](Self::bound) says).
    pub(crate) fn abort_timeout(&self) -> Duration {
        self.bound().bound
    }

    /// The error of a group's call that ran out of time (`group_timed_out`), when the
    /// diagnostics know nothing of the communicator.
    fn group_timed_out_plain(&self, what: String) -> Error {
        Error::Timeout {
            what,
            timeout: self.timeout(),
        }
    }
}

/// The report of a wait for `call` that ran out of time, when nothing more is known (no
/// rank of its clique was seen arriving, or the diagnostics are off).
fn wait_timeout_plain(call: &str, rank: usize, world_size: usize) -> String {
    format!("{call} on rank {rank} of {world_size} did not complete")
}
