//! The diagnostics options a [`crate::Config`] carries, and their resolution against the
//! environment (`NCCL_SAFE_*`). The builders live on `Config` (src/config.rs).

use std::path::PathBuf;
#[cfg(feature = "diag")]
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "diag")]
use super::remote;
use crate::teardown::{Bound, OnAbortTimeout, DEFAULT_ABORT_TIMEOUT, MIN_NCCL_ABORT_TIMEOUT};

/// The default bound on a communicator's waits, 10 minutes as PyTorch's: the watchdog's
/// timeout of an operation (`Config::timeout`, `NCCL_SAFE_TIMEOUT_MS`) and the wait for a
/// non-blocking init, split or finalize (also `nccl_safe::DEFAULT_TIMEOUT`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The longest flight record a communicator keeps (its ring is allocated up front).
pub const MAX_FLIGHT_RECORD_LEN: usize = 1 << 20;

/// The flight recorder's default length.
pub const DEFAULT_FLIGHT_RECORD_LEN: usize = 64;

/// The diagnostics options of a [`Config`] (unset: environment, then defaults).
#[derive(Debug, Clone, Default)]
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(crate) struct DiagConfig {
    pub(crate) timeout: Option<Duration>,
    pub(crate) check: Option<bool>,
    pub(crate) ring: Option<usize>,
    pub(crate) dump_dir: Option<PathBuf>,
    pub(crate) dump_stderr: Option<bool>,
    pub(crate) precise: Option<bool>,
    pub(crate) exact: Option<bool>,
    pub(crate) abort_timeout: Option<Duration>,
    pub(crate) on_abort_timeout: Option<OnAbortTimeout>,
    /// `Config::elastic`: the watchdog revokes instead of aborting.
    pub(crate) elastic: Option<bool>,
    /// The job's desync board in another process (not inherited by children).
    #[cfg(feature = "diag")]
    pub(crate) board: Option<Arc<dyn remote::RemoteBoard>>,
}

/// A config's options resolved against the environment.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(super) struct Settings {
    pub(super) timeout: Duration,
    pub(super) check: bool,
    pub(super) ring: usize,
    pub(super) dump_dir: Option<PathBuf>,
    pub(super) dump_stderr: bool,
    pub(super) precise: bool,
    /// Completion markers recorded at enqueue (`Config::exact_completion`), else lazily.
    pub(super) exact: bool,
    pub(super) abort_timeout: Duration,
    pub(super) on_abort_timeout: OnAbortTimeout,
    /// `Config::elastic`: the watchdog revokes a failed clique's handles rather than
    /// aborting them.
    pub(super) elastic: bool,
}

impl Settings {
    /// The bound on teardowns and the policy past it.
    pub(super) fn bound(&self) -> Bound {
        Bound {
            bound: self.abort_timeout,
            action: self.on_abort_timeout,
        }
    }

    pub(super) fn resolve(c: &DiagConfig) -> Settings {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        // A word or a number: trimmed and lower-cased (not the flight record's directory).
        let word = |k: &str| env(k).map(|v| v.trim().to_ascii_lowercase());
        let ms = |k: &str| word(k)?.parse::<u64>().ok().map(Duration::from_millis);
        const RING_VAR: &str = "NCCL_SAFE_FLIGHT_RECORD_LEN";
        let debug = word("NCCL_SAFE_DEBUG");
        let detail = debug.as_deref() == Some("detail");
        let info = detail || debug.as_deref() == Some("info");
        Settings {
            timeout: (c.timeout.or_else(|| ms("NCCL_SAFE_TIMEOUT_MS"))).unwrap_or(DEFAULT_TIMEOUT),
            check: c.check.unwrap_or(detail),
            ring: (c.ring.or_else(|| word(RING_VAR)?.parse().ok()))
                .unwrap_or(DEFAULT_FLIGHT_RECORD_LEN),
            dump_dir: (c.dump_dir.clone())
                .or_else(|| env("NCCL_SAFE_FLIGHT_RECORD_DIR").map(PathBuf::from)),
            dump_stderr: c.dump_stderr.unwrap_or(info),
            precise: c.precise.unwrap_or_else(|| {
                info || matches!(
                    word("NCCL_SAFE_TIMING").as_deref(),
                    Some("1" | "true" | "on" | "yes")
                )
            }),
            exact: c.exact.unwrap_or_else(|| {
                !matches!(
                    word("NCCL_SAFE_EXACT_COMPLETION").as_deref(),
                    Some("0" | "false" | "off" | "no")
                )
            }),
            abort_timeout: (c.abort_timeout.or_else(|| ms("NCCL_SAFE_ABORT_TIMEOUT_MS")))
                .unwrap_or(DEFAULT_ABORT_TIMEOUT),
            on_abort_timeout: c.on_abort_timeout.unwrap_or_else(|| {
                match word("NCCL_SAFE_ON_ABORT_TIMEOUT").as_deref() {
                    Some("exit") => OnAbortTimeout::ExitProcess,
                    _ => OnAbortTimeout::Report,
                }
            }),
            elastic: c.elastic.unwrap_or(false),
        }
    }
}

/// Refuses `call` (a communicator's creation or adoption) for options no communicator can
/// work with: a zero timeout or abort bound, an abort bound below
/// [`MIN_NCCL_ABORT_TIMEOUT`] for NVIDIA's NCCL (`provider`), or a flight record longer than
/// [`MAX_FLIGHT_RECORD_LEN`]. The error names where the value came from.
pub(crate) fn check_settings(
    call: &'static str,
    c: &DiagConfig,
    provider: crate::Provider,
) -> crate::error::Result<()> {
    let s = Settings::resolve(c);
    let from = |set: bool, var: &'static str| if set { "Config" } else { var };
    let timeout_from = from(c.timeout.is_some(), "NCCL_SAFE_TIMEOUT_MS");
    let abort_from = from(c.abort_timeout.is_some(), "NCCL_SAFE_ABORT_TIMEOUT_MS");
    let ring_from = from(c.ring.is_some(), "NCCL_SAFE_FLIGHT_RECORD_LEN");
    let (abort, ring) = (s.abort_timeout, s.ring);
    let reason = if s.timeout.is_zero() {
        format!("the timeout ({timeout_from}) is zero: every operation would time out at once")
    } else if abort.is_zero() {
        format!("the abort timeout ({abort_from}) is zero: no teardown could ever complete in time")
    } else if provider == crate::Provider::Nccl && abort < MIN_NCCL_ABORT_TIMEOUT {
        format!("the abort timeout {abort:?} ({abort_from}) is below the minimum of {MIN_NCCL_ABORT_TIMEOUT:?} for NVIDIA's NCCL: its destroy takes about 0.5 s and its abort about 1 s even for an idle communicator (NCCL 2.28.9 on an H100), so healthy teardowns would be reported as timed out")
    } else if ring > MAX_FLIGHT_RECORD_LEN {
        format!("the flight record length {ring} ({ring_from}) is above the maximum of {MAX_FLIGHT_RECORD_LEN}")
    } else {
        return Ok(());
    };
    Err(crate::error::invalid(call, reason))
}

/// The bound of teardowns that belong to no communicator (NCCL memory): the
/// `NCCL_SAFE_ABORT_TIMEOUT_MS` and `NCCL_SAFE_ON_ABORT_TIMEOUT` settings, or their
/// defaults.
pub(crate) fn default_bound() -> Bound {
    Settings::resolve(&DiagConfig::default()).bound()
}
