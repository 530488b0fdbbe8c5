//! The launchers' [`Error`]: the core's [`nccl_safe::Error`] ([`Error::Core`]) and the
//! launchers' own failures ([`EnvError`], [`RendezvousError`], [`StoreError`], a rank of a
//! [`Launcher`](crate::Launcher) run that failed). Each is re-exported where users meet it
//! (`env`, `rendezvous`, `store`).

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// `Result` with the launchers' [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Default name of the environment variable holding the job token.
pub const TOKEN_VAR: &str = "NCCL_SAFE_RENDEZVOUS_TOKEN";
/// Shortest job token accepted, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;
/// The variable that sets how many unique ids (roots) a process job's scalable init uses
/// (`ProcessLauncher::roots` overrides it; unset: `scalable_roots(world_size)`). Every
/// rank must see the same value.
pub const ROOTS_VAR: &str = "NCCL_SAFE_ROOTS";

/// Largest value (or key) the client sends or accepts, in bytes.
pub const MAX_VALUE_LEN: usize = 1 << 20;

/// Which launcher started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EnvSource {
    /// PyTorch's `torchrun` (or anything setting `RANK`/`WORLD_SIZE`/`MASTER_ADDR`).
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun`/`mpiexec`.
    OpenMpi,
}

impl fmt::Display for EnvSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EnvSource::Torchrun => "torchrun",
            EnvSource::Slurm => "Slurm",
            EnvSource::OpenMpi => "Open MPI",
        })
    }
}

/// Why the launcher's environment could not be read. Every variant names the variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// None of the launchers' marker variables is set.
    #[error(
        "no launcher environment found (none of RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK, SLURM_PROCID is set): \
         start the processes with torchrun, srun or mpirun, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
    )]
    NotLaunched,
    /// A variable the launcher should have set is absent.
    #[error("{launcher} launch detected but the environment variable {var} is not set: {hint}")]
    Missing {
        /// The launcher that was detected.
        launcher: EnvSource,
        /// The missing variable.
        var: &'static str,
        /// What to do about it.
        hint: &'static str,
    },
    /// An elastic communicator (`Config::elastic(true)`) under a launcher that ends every
    /// rank when one exits, so no rank could survive a loss.
    #[error("Config::elastic(true) under {launcher}, which ends every process of the job when one of them exits: no rank would survive a loss to recover from it; {hint}")]
    EndsSurvivors {
        /// The launcher that was detected.
        launcher: EnvSource,
        /// What to do about it.
        hint: &'static str,
    },
    /// A variable is set to a value that cannot be used.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value, as read.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Why rank 0 refused a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The peer did not prove it holds the job token. A server without the token can send
    /// this refusal as well as rank 0, so a client tries again until its deadline and
    /// reports it as its timeout's last error.
    BadToken,
    /// The peer believes the job has a different number of ranks.
    WorldSizeMismatch {
        /// World size rank 0 serves.
        server: usize,
        /// World size the peer sent.
        client: usize,
    },
    /// The peer claimed rank 0 or a rank outside the job.
    RankOutOfRange {
        /// World size rank 0 serves.
        world_size: usize,
    },
    /// Another peer already fetched the id for this rank.
    DuplicateRank,
    /// Rank 0 had too many authenticated connections open; retried until the deadline.
    Busy,
    /// Another connection for this rank was still being served; retried until the deadline.
    InProgress,
    /// Rank 0 serves a scalable init's ids (several roots) and some root ranks have not
    /// sent theirs yet; retried until the deadline.
    WaitingForRoots {
        /// How many of the ids rank 0 holds.
        have: usize,
        /// How many the job has.
        roots: usize,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::BadToken => write!(
                f,
                "wrong job token: give every process the same {TOKEN_VAR} (or the same configured token)"
            ),
            Refusal::WorldSizeMismatch { server, client } => write!(
                f,
                "world size disagreement: rank 0 serves {server} ranks but this peer says {client}; start every process with the same WORLD_SIZE"
            ),
            Refusal::RankOutOfRange { world_size } => write!(
                f,
                "the rank is not in 1..{world_size} (rank 0 serves the id and does not fetch it); check RANK"
            ),
            Refusal::DuplicateRank => write!(
                f,
                "another process already claimed this rank; check that every process has a distinct RANK"
            ),
            Refusal::Busy => write!(f, "rank 0 has too many connections open"),
            Refusal::InProgress => write!(
                f,
                "another connection for this rank is still being served"
            ),
            Refusal::WaitingForRoots { have, roots } => write!(
                f,
                "rank 0 holds {have} of the job's {roots} unique ids: the other root ranks have not sent theirs yet"
            ),
        }
    }
}

/// Why a rendezvous failed. The message says where, which rank(s), and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// `rank` is not in `0..world_size` (or `world_size` is 0).
    #[error(
        "rank {rank} is not a rank of a job of {world_size} ranks: pass a rank in 0..{world_size}"
    )]
    InvalidRank {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// The job token variable is unset or empty.
    #[error(
        "the rendezvous token variable {var} is not set or is empty: set it to the same secret in every process \
         of the job (e.g. `export {var}=$(openssl rand -hex 16)` before launching)"
    )]
    MissingToken {
        /// The variable that was read.
        var: String,
    },
    /// The job token is too short to resist an offline search.
    #[error(
        "the rendezvous token is {len} bytes, but at least {MIN_TOKEN_LEN} are required: anyone who captures \
         one handshake can search a short token offline and then read the unique id; use a random one \
         (e.g. `export {TOKEN_VAR}=$(openssl rand -hex 16)`)"
    )]
    WeakToken {
        /// Its length in bytes.
        len: usize,
    },
    /// The rendezvous host name did not resolve.
    #[error("could not resolve the rendezvous address {addr}: {source}; check MASTER_ADDR")]
    Resolve {
        /// `host:port` that was looked up.
        addr: String,
        /// The resolver's error.
        source: io::Error,
    },
    /// Rank 0 could not listen on the address it was given.
    #[error(
        "rank 0 could not listen on {addr}: {source}; check that MASTER_ADDR names an address of this host and that MASTER_PORT and the next port (the desync board's) are free"
    )]
    Bind {
        /// `host:port` rank 0 tried to bind.
        addr: String,
        /// The operating system's error.
        source: io::Error,
    },
    /// Rank 0's deadline passed before every rank fetched the id.
    #[error(
        "rank 0 served the unique id at {addr} for {timeout:?} but ranks {missing:?} of {world_size} never fetched it: \
         check that those processes started, reach {addr} and use the same token"
    )]
    ServerTimeout {
        /// Address rank 0 listened on.
        addr: String,
        /// Ranks that never fetched the id.
        missing: Vec<usize>,
        /// World size served.
        world_size: usize,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// A rank could not fetch the id from rank 0 before its deadline.
    #[error(
        "rank {rank} could not reach rank 0 at {addr} within {timeout:?} (gave up after {:.2}s; last error: {last_error}): \
         check that rank 0 is running and that MASTER_ADDR/MASTER_PORT point at it",
        elapsed.as_secs_f64()
    )]
    ClientTimeout {
        /// `host:port` of rank 0.
        addr: String,
        /// The rank that gave up.
        rank: usize,
        /// The deadline that passed.
        timeout: Duration,
        /// How long the rank actually tried.
        elapsed: Duration,
        /// The last error seen, naming the address that gave it.
        last_error: String,
    },
    /// A post to the desync board, or a fetch of it, got no answer that proved the token
    /// before its deadline.
    #[error(
        "could not {action} the desync board at {addr} within {:.2}s (last error: {last_error}): \
         check that rank 0 is running and hosts the board on MASTER_PORT+1",
        elapsed.as_secs_f64()
    )]
    BoardTimeout {
        /// `host:port` of the board.
        addr: String,
        /// "post to" or "fetch".
        action: &'static str,
        /// How long it tried.
        elapsed: Duration,
        /// The last error seen, naming the address that gave it.
        last_error: String,
    },
    /// Rank 0 refused this peer. Returned when rank 0 proved the token with its refusal
    /// (world size, rank out of range, duplicate rank); a refusal that proves nothing (the
    /// wrong token, busy) is tried again and shows in the timeout's last error.
    #[error("rank 0 at {addr} refused rank {rank}: {reason}")]
    Refused {
        /// `host:port` of rank 0.
        addr: String,
        /// The rank this peer claimed.
        rank: usize,
        /// Why.
        reason: Refusal,
    },
    /// The server at the address does not hold the job token (its answer's MAC failed).
    /// Clients try again until their deadline, so it shows as a timeout's last error.
    #[error(
        "the server at {addr} did not prove it holds the job token: another job or program may be listening there; check MASTER_PORT and the token"
    )]
    ServerAuthentication {
        /// `host:port` of the server.
        addr: String,
    },
    /// The rendezvous gives another number of unique ids (roots of a scalable init) than
    /// this rank expects: the ranks disagree on [`ROOTS_VAR`] or
    /// on `ProcessLauncher::roots`, or one runs an older nccl-safe that moves one id.
    /// Returned as soon as a peer that proved the token (or the store, or the file) says
    /// so; never retried.
    #[error(
        "{addr} gives {} unique ids but rank {rank} expects {expected}: give every rank the same number of roots \
         (the same {ROOTS_VAR} or ProcessLauncher::roots, or none) and the same nccl-safe",
        published.map_or_else(|| "several".to_string(), |n| n.to_string())
    )]
    RootsMismatch {
        /// Where the ids come from: rank 0's `host:port`, the store's, or the file.
        addr: String,
        /// The rank that found it.
        rank: usize,
        /// How many ids the rendezvous gives (`None`: more than one, its count not told).
        published: Option<usize>,
        /// How many this rank expects.
        expected: usize,
    },
    /// The server at the address does not speak this protocol.
    #[error("the server at {addr} does not speak the nccl-safe rendezvous protocol ({detail}): check MASTER_PORT")]
    Protocol {
        /// `host:port` of the server.
        addr: String,
        /// What was wrong.
        detail: String,
    },
    /// An operating system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The operating system's error.
        source: io::Error,
    },
    /// The id file did not appear before the deadline.
    #[error(
        "the unique id file {path} did not appear within {timeout:?}: check that rank 0 runs and that every process sees the same shared directory"
    )]
    FileTimeout {
        /// The file waited for.
        path: PathBuf,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// Reading or writing the id file failed.
    #[error("unique id file {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The id file holds something else.
    #[error("unique id file {path} is not usable: {detail}; use a fresh path per job")]
    FileContents {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The user-supplied exchange (`Rendezvous::custom`) failed
    ///: `reason` is its error's message, followed by the messages of its sources.
    #[error("the user-supplied rendezvous failed on rank {rank}: {reason}")]
    Custom {
        /// The rank it failed on.
        rank: usize,
        /// The closure's error as text (`error: source: source ...`).
        reason: String,
    },
    /// The user-supplied exchange returned, on rank 0, an id other than the one it was given.
    #[error("the user-supplied rendezvous returned a different id on rank 0 than the one it was given to send")]
    CustomMismatch,
    /// Rank 0's server thread panicked.
    #[error("rank 0's rendezvous server thread panicked")]
    ServerPanicked,
}

/// Why a store request failed. Every variant names the store's address and the request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No connection could be made.
    #[error(
        "could not connect to the c10d store at {addr}: {source}; check that torchrun's agent is running and MASTER_ADDR/MASTER_PORT"
    )]
    Connect {
        /// `host:port` of the store.
        addr: String,
        /// The last connection error.
        source: io::Error,
    },
    /// The store did not answer before the request's deadline.
    #[error("the c10d store at {addr} did not answer {call} within {timeout:?}")]
    Timeout {
        /// `host:port` of the store.
        addr: String,
        /// The request.
        call: String,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// The keys waited for did not appear before the wait's timeout.
    #[error(
        "waited {timeout:?} on the c10d store at {addr} for {keys:?}, which never appeared: {hint}"
    )]
    WaitTimeout {
        /// `host:port` of the store.
        addr: String,
        /// The keys.
        keys: Vec<String>,
        /// The wait's timeout.
        timeout: Duration,
        /// Who should have set them.
        hint: String,
    },
    /// The store closed the connection in the middle of an answer (or before it).
    #[error("the c10d store at {addr} closed the connection during {call}")]
    Closed {
        /// `host:port` of the store.
        addr: String,
        /// The request.
        call: String,
    },
    /// The store answered something the protocol does not allow.
    #[error("the c10d store at {addr} answered {call} with {detail}: is MASTER_PORT the torchrun agent's store?")]
    Protocol {
        /// `host:port` of the store.
        addr: String,
        /// The request.
        call: String,
        /// What was wrong.
        detail: String,
    },
    /// A key or value is longer than [`MAX_VALUE_LEN`].
    #[error("{call} at the c10d store at {addr}: a {what} of {len} bytes is over the {MAX_VALUE_LEN}-byte limit")]
    TooLarge {
        /// `host:port` of the store.
        addr: String,
        /// The request.
        call: String,
        /// "key", "value" or "answer".
        what: &'static str,
        /// Its length.
        len: u64,
    },
    /// Another socket error.
    #[error("{call} at the c10d store at {addr}: {source}")]
    Io {
        /// `host:port` of the store.
        addr: String,
        /// The request.
        call: String,
        /// The operating system's error.
        source: io::Error,
    },
}

/// Every error of the launchers: the core's errors ([`Error::Core`]: NCCL, a bad argument, a
/// timeout of an init) and the launchers' own, typed and matched like any other; nothing
/// needs a downcast. Each variant's documentation says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of nccl-safe (loading NCCL, an init, a collective, a bad argument): see
    /// [`nccl_safe::Error`].
    #[error(transparent)]
    Core(#[from] nccl_safe::Error),
    /// A rank of a [`Launcher`](crate::Launcher) run failed; the others were aborted. Fix
    /// what `cause` says rank `rank` did (its error, or the collective it skipped or added);
    /// `ranks` says what each rank did.
    #[error("rank {rank} caused the failure: {cause}{}\n{}", if .first == .rank { String::new() } else { format!(" (rank {first} was the first to fail)") }, .ranks.join("\n"))]
    RankFailed {
        /// The rank that caused the failure: the first whose closure failed on its own (an
        /// error or a panic while its communicator was healthy); else the one whose count
        /// of collectives differs from the others' (it returned early, ran an extra
        /// collective, or was behind); else the first to fail.
        rank: usize,
        /// The first rank whose closure failed (often one that waited for `rank`).
        first: usize,
        /// Its error or panic message, or what it did that the others did not.
        cause: String,
        /// One line per rank: what it did.
        ranks: Vec<String>,
    },
    /// The variables a launcher (torchrun, Slurm, Open MPI) sets are absent or unusable
    /// ([`ProcessLauncher`](crate::ProcessLauncher), `ProcessEnv::from_process_env`). The
    /// [`EnvError`] names the variable and says what is wrong with it: start the process
    /// with its launcher, or set the variable as the message says.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// The ranks of a multi-process job could not agree on the unique id (the TCP
    /// rendezvous rank 0 serves, a shared file, a closure of yours) or reach the desync
    /// board rank 0 serves. The [`RendezvousError`] says which step failed, on which rank
    /// and at which address: check that every process started, that `MASTER_ADDR` and
    /// `MASTER_PORT` point at rank 0, and that every process has the same token and world
    /// size, as its message says. A timeout may be retried once the missing ranks run.
    /// (Boxed, as [`nccl_safe::Error::Nccl`] is, so that every `Result` stays small:
    /// match it with `Error::Rendezvous(e)` and then `*e`.)
    #[error(transparent)]
    Rendezvous(Box<RendezvousError>),
    /// A request to torchrun's c10d store (the id exchange, its desync board, or a
    /// [`StoreClient`](crate::store::StoreClient) call) failed. The [`StoreError`]
    /// names the store's address and the request: check that torchrun's agent is running
    /// and that `MASTER_ADDR`/`MASTER_PORT` name its store; a `WaitTimeout` means the rank
    /// that should have set the key (its own error says why) did not. (Boxed, as
    /// [`Error::Rendezvous`] is.)
    #[error(transparent)]
    Store(Box<StoreError>),
}

impl Error {
    /// The core's error, when the error is [`Error::Core`].
    pub fn as_core(&self) -> Option<&nccl_safe::Error> {
        match self {
            Error::Core(e) => Some(e),
            _ => None,
        }
    }

    /// The rendezvous error, when the error is [`Error::Rendezvous`]: for a `match` that
    /// names its variants, `matches!(e.as_rendezvous(), Some(RendezvousError::ClientTimeout { .. }))`.
    pub fn as_rendezvous(&self) -> Option<&RendezvousError> {
        match self {
            Error::Rendezvous(e) => Some(e),
            _ => None,
        }
    }

    /// The store error, when the error is [`Error::Store`].
    pub fn as_store(&self) -> Option<&StoreError> {
        match self {
            Error::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Core(e.into())
    }
}

impl From<RendezvousError> for Error {
    fn from(e: RendezvousError) -> Self {
        Error::Rendezvous(Box::new(e))
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Store(Box::new(e))
    }
}

/// An [`nccl_safe::Error::InvalidArgument`] of `call`.
pub(crate) fn invalid(call: &'static str, reason: impl Into<String>) -> Error {
    Error::Core(nccl_safe::Error::InvalidArgument {
        call,
        reason: reason.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every launcher call returns a `Result<_, Error>`: the rendezvous's and the store's
    /// errors are boxed (as the core's `Nccl` is) so that they do not make it larger than
    /// the core's (nor push a wrapper such as nccl-safe-candle's `DistError` over clippy's
    /// `result_large_err`).
    #[test]
    fn the_error_stays_small() {
        assert!(
            std::mem::size_of::<Error>() <= 80,
            "{}",
            std::mem::size_of::<Error>()
        );
    }
}
