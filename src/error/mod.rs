//! The one error type of the crate.
//!
//! Errors come in two layers, as in rusqlite: [`ResultCode`] is NCCL's raw `ncclResult_t`,
//! and [`Error`] adds what a person needs to act on it: NCCL's error string, the text of
//! `ncclGetLastError`, which call failed, on which rank, and from which line of the caller.
//! [`NcclError`] values are built in one `#[cold]` function ([`crate::Library::error_for`]).

use std::fmt;
use std::panic::Location;
use std::path::PathBuf;

use crate::discovery::fmt_not_found;
pub use crate::discovery::{Source, Tried};
use crate::version::Version;

/// Why a communicator was aborted rather than revoked, and what to do instead: the
/// revoke was not sound on it (`Communicator::revocable`). The owner's error paths and
/// the watchdog's timeout report both say it, so it lives with the errors, below both.
pub(crate) const UNREVOCABLE: &str = "it could not be revoked: NCCL's launch of its last operation had not ended, or had failed, and NCCL 2.29-2.30's ncclCommRevoke then leaves the communicator's group job dangling (init.cc:2664 -> 404, group.cc:873-884, init.cc:3105-3110 of v2.29.7-1: a use after free), so it was aborted instead and cannot be shrunk (shrink_after_failure): make a new communicator over the ranks left (init_rank with a new id, as an elastic job re-initializes after a failed recovery)";

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Declares [`ResultCode`], one row per failure code (the variant and its C name); each
/// conversion below is a column.
macro_rules! result_codes {
    ($($(#[$doc:meta])* $v:ident = $c:ident;)*) => {
        /// NCCL's `ncclResult_t`, one variant per failure code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ResultCode {
            $($(#[$doc])* $v,)*
            /// A code this crate does not know (a newer NCCL).
            Unknown(u32),
        }

        impl ResultCode {
            /// The code for a raw `ncclResult_t`; `None` for `ncclSuccess`.
            pub fn from_raw(raw: nccl_sys::ncclResult_t) -> Option<ResultCode> {
                Some(match raw {
                    nccl_sys::bindings::ncclSuccess => return None,
                    $(nccl_sys::bindings::$c => ResultCode::$v,)*
                    other => ResultCode::Unknown(other),
                })
            }

            /// The raw `ncclResult_t`.
            pub fn to_raw(self) -> nccl_sys::ncclResult_t {
                match self {
                    $(ResultCode::$v => nccl_sys::bindings::$c,)*
                    ResultCode::Unknown(raw) => raw,
                }
            }
        }
    };
}

result_codes! {
    /// `ncclUnhandledCudaError` (1): a CUDA call inside NCCL failed.
    UnhandledCudaError = ncclUnhandledCudaError;
    /// `ncclSystemError` (2): a system call (socket, memory, ...) failed.
    SystemError = ncclSystemError;
    /// `ncclInternalError` (3): a bug or inconsistency inside NCCL.
    InternalError = ncclInternalError;
    /// `ncclInvalidArgument` (4): a bad argument reached NCCL.
    InvalidArgument = ncclInvalidArgument;
    /// `ncclInvalidUsage` (5): a call made in a state that does not allow it.
    InvalidUsage = ncclInvalidUsage;
    /// `ncclRemoteError` (6): a peer failed or the network broke.
    RemoteError = ncclRemoteError;
    /// `ncclInProgress` (7): a non-blocking operation has not finished.
    InProgress = ncclInProgress;
    /// `ncclTimeout` (8): NCCL gave up waiting.
    Timeout = ncclTimeout;
}

/// A failed NCCL call: the code and everything NCCL said about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclError {
    /// The NCCL function that failed, e.g. `"ncclCommInitRank"`.
    pub call: &'static str,
    /// NCCL's result code.
    pub code: ResultCode,
    /// `ncclGetErrorString(code)`.
    pub message: String,
    /// `ncclGetLastError(comm)`, when NCCL had something to say.
    pub last_error: Option<String>,
    /// The communicator's rank, when the call was made on one.
    pub rank: Option<usize>,
    /// The line of user code that issued the operation, when known.
    pub caller: Option<&'static Location<'static>>,
}

impl fmt::Display for NcclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed", self.call)?;
        if let Some(rank) = self.rank {
            write!(f, " on rank {rank}")?;
        }
        if let Some(caller) = self.caller {
            write!(f, " (called at {}:{})", caller.file(), caller.line())?;
        }
        write!(f, ": {} [{:?}]", self.message, self.code)?;
        if let Some(last) = &self.last_error {
            write!(f, "; NCCL's last error: {last}")?;
        }
        Ok(())
    }
}

impl std::error::Error for NcclError {}

/// Which buffer argument of a collective a length error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BufferRole {
    /// The send (input) buffer.
    Send,
    /// The receive (output) buffer.
    Recv,
}

impl fmt::Display for BufferRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BufferRole::Send => "send buffer",
            BufferRole::Recv => "receive buffer",
        })
    }
}

/// Every error of nccl-safe: the one error type of its API. The launchers (the crate
/// nccl-launch) have their own error, which wraps this one. Each variant's documentation
/// says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No loadable NCCL was found; `tried` lists every place looked at. Install one
    /// (`pip install nvidia-nccl-cu12`), or point `NCCL_LIBRARY` (or
    /// [`Library::load_from`](crate::Library::load_from)) at a `libnccl.so.2`; the message
    /// says why each candidate was passed over.
    #[error("{}", fmt_not_found(.tried))]
    LibraryNotFound {
        /// Every candidate, in search order, with why it was not used.
        tried: Vec<Tried>,
    },
    /// The library loaded but is older than the oldest release this crate supports: install
    /// NCCL `min` or newer (the message says how), or point `NCCL_LIBRARY` at one.
    #[error("NCCL {found} at {path} is too old: nccl-safe needs NCCL {min} or newer (`pip install -U nvidia-nccl-cu12`)")]
    VersionTooOld {
        /// Where the library was loaded from.
        path: PathBuf,
        /// Its version.
        found: Version,
        /// The oldest supported version.
        min: Version,
    },
    /// The library lacks entry points that every supported NCCL has: it is not a complete
    /// NCCL (a stub, a truncated file); point `NCCL_LIBRARY` at NVIDIA's `libnccl.so.2`.
    #[error("{path} is not a usable NCCL: missing required symbol(s) {}", .names.join(", "))]
    MissingSymbols {
        /// Where the library was loaded from.
        path: PathBuf,
        /// The missing names.
        names: Vec<&'static str>,
    },
    /// A call (or a [`Config`](crate::Config) field) needs an entry point that the loaded
    /// NCCL does not have: upgrade NCCL to `needs`, or do without the feature (check
    /// [`Library::version`](crate::Library::version) before calling).
    #[error("{symbol} needs NCCL {needs} or newer, but the loaded library is NCCL {found}")]
    Unsupported {
        /// The missing entry point (or config field).
        symbol: &'static str,
        /// The release that introduced it.
        needs: Version,
        /// The loaded release.
        found: Version,
    },
    /// An NCCL call returned an error. [`NcclError`] says which call, on which rank, from
    /// which line, and what NCCL said (its code and `ncclGetLastError`). After an error on
    /// a communicator, drop the communicator (it is aborted) and make a new one; a
    /// [`ResultCode::RemoteError`] means a peer failed, whose own error says why.
    #[error(transparent)]
    Nccl(Box<NcclError>),
    /// A buffer's length does not fit the operation (nothing was run): size the buffer as
    /// `rule` says.
    #[error("{call}: {role} holds {actual} elements but {expected} are needed ({rule})")]
    LengthMismatch {
        /// The operation.
        call: &'static str,
        /// Which buffer.
        role: BufferRole,
        /// What the operation needs.
        expected: usize,
        /// What was given.
        actual: usize,
        /// The rule, e.g. "recv = world_size x send".
        rule: &'static str,
    },
    /// A root or peer rank outside `0..world_size` (nothing was run): pass a rank below the
    /// communicator's [`world_size`](crate::Communicator::world_size).
    #[error("{call}: {what} {rank} is out of range for a communicator of {world_size} ranks")]
    RankOutOfRange {
        /// The operation.
        call: &'static str,
        /// "root" or "peer".
        what: &'static str,
        /// The rank given.
        rank: usize,
        /// The communicator's size.
        world_size: usize,
    },
    /// Any other argument that NCCL would reject or misuse (nothing was run): `reason`
    /// says what is wrong; fix the call.
    #[error("{call}: {reason}")]
    InvalidArgument {
        /// The operation.
        call: &'static str,
        /// What is wrong, in a sentence.
        reason: String,
    },
    /// The communicator failed earlier (`cause`, the first error it saw), so the call was
    /// refused: drop it (which aborts it) and create a new one, with every rank.
    #[error("{call} on rank {rank}: the communicator already failed ({cause}); drop it (it will be aborted) and create a new one")]
    CommunicatorFailed {
        /// The operation attempted now.
        call: &'static str,
        /// The communicator's rank.
        rank: usize,
        /// The first error it saw.
        cause: String,
    },
    /// A wait ran out of time (an init, a teardown, a launcher waiting for its ranks).
    /// `what` says what was waited for: a peer that never came is the usual cause (its own
    /// error says why); a slow start may need a longer timeout in [`Config`](crate::Config)
    /// or on the launcher.
    #[error("{what} did not complete within {timeout:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The limit.
        timeout: std::time::Duration,
    },
    /// A rank of the communicator left (its communicator was torn down, or its launcher
    /// closure returned) while this rank waited in a collective that it never called: the
    /// clique was aborted at once instead of waiting out the timeout. `what` names the rank,
    /// how and where it left, and the operation this rank was in: make every rank call the
    /// same collectives (or look at why that rank left); drop this communicator.
    #[error("{what}")]
    RankLeft {
        /// The rank that left.
        rank: usize,
        /// The report.
        what: String,
    },
    /// A teardown (an abort, a destroy, a release of NCCL memory) on this device has been
    /// blocked past its bound ([`Config::abort_timeout`](crate::Config::abort_timeout)),
    /// typically behind a stalled stream: a new communicator there would queue its own
    /// teardown behind it, so none is made. Find what stalls the stream (a kernel waiting
    /// for a peer); the device stays refused until the teardown ends, else restart the
    /// process.
    #[error("{call}: refused because a teardown on {lane} is wedged: {what}")]
    TeardownWedged {
        /// The call that was refused.
        call: &'static str,
        /// The device (or host-provider id) whose teardown lane is blocked.
        lane: String,
        /// The blocked teardown.
        what: String,
    },
    /// Ranks called different collectives at the same position (opt-in fingerprint check,
    /// see [`crate::diag`]): nothing was handed to NCCL, every rank gets this error. `table`
    /// shows what each rank called and from where: make the ranks call the same
    /// collectives in the same order.
    #[error("{call} (seq {seq}) on rank {rank}: ranks disagree on the collective; nothing was run\n{table}")]
    CollectiveMismatch {
        /// The operation this rank called.
        call: &'static str,
        /// This rank.
        rank: usize,
        /// The collective's sequence number on this communicator.
        seq: u64,
        /// What every rank called, and from which line.
        table: String,
    },
    /// Ranks of one communicator shrank it with different exclude lists (compared among
    /// the ranks of this process before NCCL's call; NCCL compares nothing and its shrink
    /// would wait until the timeout): nothing was called and the communicator is as it
    /// was. `lists` has each rank's list (sorted) for this shrink: agree on one list
    /// (say with [`Communicator::agree_lost_ranks`](crate::Communicator::agree_lost_ranks))
    /// and shrink again.
    #[error("{call} on rank {rank}: the ranks disagree on the ranks to exclude ({}); nothing was called and the communicator is as it was: agree on one list (agree_lost_ranks) and shrink again", fmt_lists(.lists))]
    ExcludeMismatch {
        /// The shrink.
        call: &'static str,
        /// This rank.
        rank: usize,
        /// Each rank's exclude list for this shrink, by rank (this process's ranks that
        /// called it so far).
        lists: Vec<(usize, Vec<usize>)>,
    },
    /// A CUDA driver call failed (making a context or a stream, binding a device): check
    /// that the device exists and is visible (`CUDA_VISIBLE_DEVICES`) and that the driver
    /// works (`nvidia-smi`).
    #[error("CUDA: {0}")]
    Cuda(#[from] cudarc::driver::DriverError),
    /// The process already holds an NCCL (loaded by other code: PyTorch, another crate, a
    /// C++ library) and a pin names a different file. Loading it too would put two NCCLs in
    /// one process, where a handle from one reaching the other is undefined behaviour.
    /// Point the pin at the loaded file (or unset it), or load nccl-safe's NCCL before the
    /// code that loads the other one.
    #[error(
        "NCCL at {} is already loaded by this process, and {pin} names another file, {}: a \
         process can hold only one NCCL. Point {pin} at the loaded file (or unset it), or load \
         nccl-safe's NCCL before the code that loads the other one",
        loaded.display(),
        requested.display()
    )]
    AnotherNcclLoaded {
        /// The library the process had mapped.
        loaded: PathBuf,
        /// The file the pin names.
        requested: PathBuf,
        /// Which pin named it ([`Source::Explicit`] or [`Source::NcclLibrary`]).
        pin: Source,
    },
    /// The library could not be opened for a reason other than absence (`reason` is the
    /// loader's): a file of another architecture, a missing dependency such as the CUDA
    /// runtime, no permission; fix that, or point `NCCL_LIBRARY` at another NCCL.
    #[error("cannot load NCCL from {path}: {reason}")]
    LibraryLoad {
        /// The path tried.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// NCCL's parameter registry holds no parameter of this name
    /// ([`Library::param`](crate::Library::param), [`Library::bind_param`](crate::Library::bind_param)):
    /// check the spelling against [`Library::param_names`](crate::Library::param_names)
    /// (many `NCCL_*` variables are read without being registered, NCCL 2.30.7 registers few).
    #[error("NCCL has no parameter named {name:?} in its registry (Library::param_names lists those it has)")]
    UnknownParam {
        /// The name asked for.
        name: String,
    },
}

/// "rank 0 excludes [3], rank 1 excludes [2, 3]".
fn fmt_lists(lists: &[(usize, Vec<usize>)]) -> String {
    (lists.iter())
        .map(|(r, l)| format!("rank {r} excludes {l:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// [`Error::InvalidArgument`] of `call`, for `reason`.
pub(crate) fn invalid(call: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        call,
        reason: reason.into(),
    }
}

impl Error {
    /// NCCL's result code, when the error came from NCCL.
    pub fn code(&self) -> Option<ResultCode> {
        match self {
            Error::Nccl(e) => Some(e.code),
            // What NCCL reports when a peer failed or went away.
            Error::RankLeft { .. } => Some(ResultCode::RemoteError),
            _ => None,
        }
    }

    /// The NCCL error, when the error came from NCCL.
    pub fn as_nccl(&self) -> Option<&NcclError> {
        match self {
            Error::Nccl(e) => Some(e),
            _ => None,
        }
    }
}

impl From<NcclError> for Error {
    fn from(e: NcclError) -> Self {
        Error::Nccl(Box::new(e))
    }
}

/// `Ok` when a buffer of `call` holds the `expected` number of elements, else
/// [`Error::LengthMismatch`] naming `rule`.
pub(crate) fn check_len(
    call: &'static str,
    role: BufferRole,
    actual: usize,
    expected: usize,
    rule: &'static str,
) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            call,
            role,
            expected,
            actual,
            rule,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every call of the crate returns a `Result<_, Error>`: the launchers' errors are boxed
    /// (as `Nccl` is) so that they do not make it larger than it was before them (nor push
    /// a wrapper such as nccl-safe-candle's `DistError` over clippy's `result_large_err`).
    #[test]
    fn the_error_stays_small() {
        assert!(
            std::mem::size_of::<Error>() <= 72,
            "{}",
            std::mem::size_of::<Error>()
        );
    }
}
