//! [`DistError`]: what went wrong ([`DistErrorKind`]), at which line of the caller, and in
//! which training step.
//!
//! The names carry a `Dist` prefix so that they do not clash with candle's `Error` and
//! `Result` under glob imports (`use candle_core::*; use nccl_safe_candle::*;`). `?` turns a
//! [`DistError`] into a `candle_core::Error` (a candle loop) or an `anyhow::Error`, and
//! a `candle_core::Error` or `nccl_safe::Error` into a [`DistError`].

use std::fmt;
use std::panic::Location;

use candle_core::DType;

/// This crate's result.
pub type DistResult<T, E = DistError> = std::result::Result<T, E>;

/// What can go wrong; every argument check fails before NCCL sees a buffer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistErrorKind {
    /// An NCCL call (or nccl-safe's own check of it) failed.
    #[error(transparent)]
    Nccl(nccl_safe::Error),
    /// Starting the ranks failed: the launcher's environment, the rendezvous, torchrun's
    /// store, or a rank of a `Launcher` run ([`nccl_launch::Error`]; its core errors
    /// become [`DistErrorKind::Nccl`]).
    #[error(transparent)]
    Launch(nccl_launch::Error),
    /// A candle operation failed.
    #[error("candle: {0}")]
    Candle(candle_core::Error),
    /// The collectives take f32, f64, f16 and bf16 tensors.
    #[error("{call}: {dtype:?} tensors are not supported (f32, f64, f16 and bf16 are)")]
    UnsupportedDtype {
        /// The operation.
        call: &'static str,
        /// The tensor's element type.
        dtype: DType,
    },
    /// The collectives run on a tensor's storage in place, which needs it contiguous.
    #[error("{call}: the tensor (shape {shape:?}, stride {stride:?}) is not contiguous; call .contiguous() first")]
    NotContiguous {
        /// The operation.
        call: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Its strides.
        stride: Vec<usize>,
    },
    /// The tensor is not where the communicator works.
    #[error("{call}: the tensor is on {tensor}, but the communicator on {comm}")]
    WrongDevice {
        /// The operation.
        call: &'static str,
        /// Where the tensor is.
        tensor: String,
        /// Where the communicator works.
        comm: String,
    },
    /// A shape the operation cannot take.
    #[error("{call}: {reason}")]
    Shape {
        /// The operation.
        call: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The ranks do not hold the same parameters (names, shapes and element types, in
    /// name order): training them together would silently mix unrelated values. Every
    /// rank gets this error.
    #[error(
        "rank {rank}: the ranks hold different parameters (names, shapes or dtypes); this rank has {count} \
         parameters, fingerprint {fingerprint:016x}, first ones: {first}"
    )]
    ParameterMismatch {
        /// This rank.
        rank: usize,
        /// How many parameters this rank holds.
        count: usize,
        /// The fingerprint of this rank's names, shapes and dtypes.
        fingerprint: u64,
        /// This rank's first parameters, for the report.
        first: String,
    },
    /// A recovery ([`recover`](crate::recover), [`run_elastic`](crate::run_elastic)) made
    /// no communicator of the ranks left: every shrink it tried, each excluding every rank
    /// then known gone, failed (a rank that stays never came, or the ranks left disagreed
    /// on who is gone and no further loss explains it).
    #[error(
        "recover on rank {rank} of {world_size}: rank(s) {lost:?} were lost, and {attempts} shrink(s) \
         excluding them made no communicator of the ranks left; the last failed with: {cause}. \
         A rank this one keeps is unreachable without having left (stuck, or in another network \
         partition): restart the job from its last checkpoint on the ranks that are alive"
    )]
    RecoveryFailed {
        /// This rank, in the communicator that failed.
        rank: usize,
        /// That communicator's number of ranks.
        world_size: usize,
        /// The ranks known gone, in that communicator's numbering: the last exclude list.
        lost: Vec<usize>,
        /// The shrinks tried.
        attempts: usize,
        /// The last shrink's error.
        #[source]
        cause: Box<nccl_safe::Error>,
    },
    /// A recovery ([`recover_with`](crate::recover_with),
    /// [`run_elastic_with`](crate::run_elastic_with), [`ElasticRank::train`](crate::ElasticRank::train))
    /// would leave fewer ranks than its quorum rule ([`MinRanks`](crate::MinRanks)) allows,
    /// so it is refused before any shrink: this rank may be the one cut off (a rank stuck
    /// past the timeout that woke after the others recovered without it sees every other
    /// rank gone), and training on alone would make a second, divergent model.
    #[error(
        "recover on rank {rank} of {world_size}: no quorum: excluding the lost rank(s) {lost:?} \
         would leave {left} rank(s), fewer than the {min_ranks} that the quorum rule {rule} asks for \
         (the min_ranks setting: run_elastic_with, recover_with, ElasticJob::min_ranks). This rank \
         may be the one cut off (stuck past Config::timeout while the others recovered without it), \
         so it stops rather than train a divergent model on its own; MinRanks::AtLeast(1) lets a \
         lone survivor carry on"
    )]
    NoQuorum {
        /// This rank, in the communicator that failed.
        rank: usize,
        /// That communicator's number of ranks.
        world_size: usize,
        /// The ranks it found lost, in that communicator's numbering.
        lost: Vec<usize>,
        /// The ranks the recovery would leave.
        left: usize,
        /// The fewest ranks the rule allows for this recovery.
        min_ranks: usize,
        /// The rule.
        rule: crate::MinRanks,
    },
    /// A rank was lost, but the communicator was made without
    /// [`Config::elastic(true)`](nccl_safe::Config::elastic): the watchdog aborted its
    /// clique's handles rather than keeping them for a shrink, so no recovery
    /// ([`recover`](crate::recover), [`run_elastic`](crate::run_elastic)) can make a
    /// communicator of the ranks left. The same for DDP and ZeRO-1, on every rank left.
    #[error("{}", not_elastic_text(.call, *.rank, *.world_size, .lost, .cause.as_deref()))]
    NotElastic {
        /// The call that refused (`run_elastic` or `recover`).
        call: &'static str,
        /// This rank.
        rank: usize,
        /// The communicator's number of ranks.
        world_size: usize,
        /// The ranks known lost.
        lost: Vec<usize>,
        /// The step's error (`run_elastic`).
        cause: Option<Box<DistError>>,
    },
    /// An argument out of its range.
    #[error("{call}: {reason}")]
    InvalidArgument {
        /// The operation.
        call: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A gradient sync or an optimizer step was asked for while a
    /// [`no_sync`](crate::DistributedDataParallel::no_sync) accumulation is open: stepping
    /// now would apply local, unreduced gradients and the ranks would drift apart.
    #[error(
        "{call} on rank {rank}: a no_sync accumulation of {micro_batches} micro-batches is open \
         ({done} taken); give each micro-batch's loss to the guard's backward(&loss) and end it \
         with its step(), not with a step of your own"
    )]
    AccumulationOpen {
        /// The call that was refused.
        call: &'static str,
        /// This rank.
        rank: usize,
        /// The micro-batches the accumulation was opened for.
        micro_batches: usize,
        /// How many its `backward` took so far.
        done: usize,
    },
    /// An accumulation's `step` came after another number of `backward` calls than the
    /// micro-batches it was opened for: typically `loss.backward()` was called directly
    /// (its gradients never reach the guard), or a micro-batch was skipped. Nothing was
    /// stepped.
    #[error(
        "{call} on rank {rank}: the accumulation was opened for {micro_batches} micro-batches but its \
         backward(&loss) took {done}; every micro-batch's loss must go through the guard's \
         backward (a plain loss.backward() returns gradients the guard never sees). Nothing was stepped"
    )]
    MicroBatchCount {
        /// The call that was refused.
        call: &'static str,
        /// This rank.
        rank: usize,
        /// The micro-batches the accumulation was opened for.
        micro_batches: usize,
        /// How many its `backward` took.
        done: usize,
    },
    /// The previous accumulation guard was dropped without its `step()`: its gradients
    /// were thrown away. Reported once, by the next step.
    #[error(
        "{call} on rank {rank}: the previous no_sync accumulation ({done} of {micro_batches} \
         micro-batches taken) was dropped without its step(), so its gradients were lost; \
         end every accumulation with step()"
    )]
    AccumulationAbandoned {
        /// The call that reported it.
        call: &'static str,
        /// This rank.
        rank: usize,
        /// The micro-batches that accumulation was opened for.
        micro_batches: usize,
        /// How many its `backward` took.
        done: usize,
    },
    /// With the drift check on ([`DistributedDataParallel::with_drift_check`](crate::DistributedDataParallel::with_drift_check)),
    /// the parameters changed between two batches sharded by the data-parallel object
    /// with no step of it in between: an optimizer stepped on this rank's local gradients
    /// (`opt.backward_step(&loss)` on a plain optimizer), so the ranks drift apart and the
    /// drift check, which runs inside the data-parallel object's steps, never ran.
    #[error(
        "{call} on rank {rank}: the parameters changed since the previous batch without a \
         step of the data-parallel object ({steps} step(s) completed): an optimizer stepped \
         on local gradients, so the ranks drift apart. Step through it: \
         ddp.backward_step(&mut opt, &loss), ddp.sync_grads(&mut grads) before opt.step, \
         DdpOptimizer or ZeroRedundancyOptimizer"
    )]
    SteppedOutside {
        /// The call that found it (`shard_batch`).
        call: &'static str,
        /// This rank.
        rank: usize,
        /// The data-parallel object's steps completed.
        steps: u64,
    },
    /// The drift check found ranks whose parameters are not bit-identical to the others'
    /// (see [`DistributedDataParallel::check_drift`](crate::DistributedDataParallel::check_drift)).
    /// Every rank gets this error, naming the same ranks.
    #[error("{}", drift_text(*.rank, *.after_step, *.last_good_step, .differing, .fingerprints))]
    Drift {
        /// This rank.
        rank: usize,
        /// The steps completed when the check ran.
        after_step: u64,
        /// The step after which the previous check passed (0: before the first step).
        last_good_step: u64,
        /// The ranks whose parameters differ from the largest group of equal ranks (ties
        /// go to the group of the lowest rank).
        differing: Vec<usize>,
        /// Every rank's fingerprint, by rank.
        fingerprints: Vec<u64>,
    },
}

fn not_elastic_text(
    call: &str,
    rank: usize,
    world_size: usize,
    lost: &[usize],
    cause: Option<&DistError>,
) -> String {
    format!(
        "{call} on rank {rank} of {world_size}: rank(s) {lost:?} were lost, but this communicator \
         was made without Config::elastic(true), so its clique's handles were aborted rather than \
         kept for a shrink and no communicator of the ranks left can be made: make every rank's \
         communicator with Config::new().elastic(true) (Launcher::config too) to carry on \
         without a lost rank{}",
        cause
            .map(|c| format!("; the step failed with: {c}"))
            .unwrap_or_default()
    )
}

fn drift_text(
    rank: usize,
    after_step: u64,
    last_good: u64,
    differing: &[usize],
    fingerprints: &[u64],
) -> String {
    let who = if differing.contains(&rank) {
        format!("this rank ({rank}) is one of them")
    } else {
        format!("this rank ({rank}) agrees with the majority")
    };
    let table = fingerprints
        .iter()
        .enumerate()
        .map(|(r, f)| format!("rank {r} {f:016x}"))
        .collect::<Vec<_>>()
        .join(", ");
    let when = if after_step == 0 {
        "parameter drift before the first data-parallel step".to_string()
    } else {
        format!("parameter drift after step {after_step}")
    };
    format!(
        "{when}: rank(s) {differing:?} hold parameters that differ \
         from the other ranks' ({who}){}. A step outside \
         the data-parallel object (opt.step or opt.backward_step on a plain optimizer) or a \
         parameter set on one rank only does this. Fingerprints: {table}",
        if after_step == 0 {
            String::new()
        } else {
            format!("; they still agreed after step {last_good}")
        }
    )
}

/// An error of this crate: its [`kind`](Self::kind), the line of your code that called
/// into the crate ([`caller`](Self::caller), through `#[track_caller]`), and the training
/// step it happened in when a data-parallel object knows it ([`step`](Self::step)).
pub struct DistError {
    kind: DistErrorKind,
    caller: &'static Location<'static>,
    step: Option<u64>,
}

impl DistError {
    /// An error of `kind` at the caller's line.
    #[track_caller]
    pub fn new(kind: DistErrorKind) -> DistError {
        DistError {
            kind,
            caller: Location::caller(),
            step: None,
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> &DistErrorKind {
        &self.kind
    }

    /// What went wrong, by value.
    pub fn into_kind(self) -> DistErrorKind {
        self.kind
    }

    /// The line of the caller's code (the call into this crate) the error comes from.
    pub fn caller(&self) -> &'static Location<'static> {
        self.caller
    }

    /// The training step (counted from 1) it happened in, when known.
    pub fn step(&self) -> Option<u64> {
        self.step
    }

    /// The nccl-safe error, when NCCL or nccl-safe's checks failed: also when this error
    /// is a candle error that carries one of this crate's (see
    /// [`in_candle`](Self::in_candle)), such as a step through `candle_nn::Optimizer`
    /// whose result came back through `?`, with context added on the way or not.
    pub fn as_nccl(&self) -> Option<&nccl_safe::Error> {
        match &self.kind {
            DistErrorKind::Nccl(e) => Some(e),
            DistErrorKind::Candle(c) => DistError::in_candle(c).and_then(DistError::as_nccl),
            _ => None,
        }
    }

    /// The error of this crate that a candle error carries, if any: `?` from a
    /// [`DistError`] into a `candle_core::Error` keeps it whole (in candle's `Io` variant,
    /// an `std::io::Error` of kind `Other` around it, whose text is this error's), and it
    /// is found here under candle's context, path and backtrace wrappers too. `?` back
    /// into a [`DistError`] gives it back as it was (kind, caller's line, step).
    pub fn in_candle(e: &candle_core::Error) -> Option<&DistError> {
        use candle_core::Error as C;
        match e {
            C::Io(io) => io.get_ref()?.downcast_ref::<DistError>(),
            C::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<DistError>(),
            C::Context { inner, .. }
            | C::WithPath { inner, .. }
            | C::WithBacktrace { inner, .. } => DistError::in_candle(inner),
            _ => None,
        }
    }

    /// Sets the caller's line (a public entry point's `#[track_caller]` location) and the
    /// step when not set yet. An NCCL error's own "called at" then names it too: the call
    /// into NCCL itself is made from inside candle's storage hook, where no caller's
    /// location reaches.
    pub(crate) fn at(mut self, caller: &'static Location<'static>, step: Option<u64>) -> Self {
        self.caller = caller;
        if self.step.is_none() {
            self.step = step;
        }
        if let DistErrorKind::Nccl(nccl_safe::Error::Nccl(e)) = &mut self.kind {
            e.caller = Some(caller);
        }
        self
    }
}

impl fmt::Display for DistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (at {}:{}",
            self.kind,
            self.caller.file(),
            self.caller.line()
        )?;
        if let Some(step) = self.step {
            write!(f, ", step {step}")?;
        }
        f.write_str(")")
    }
}

impl fmt::Debug for DistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistError")
            .field("kind", &self.kind)
            .field(
                "caller",
                &format_args!("{}:{}", self.caller.file(), self.caller.line()),
            )
            .field("step", &self.step)
            .finish()
    }
}

impl std::error::Error for DistError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.kind)
    }
}

impl From<DistErrorKind> for DistError {
    #[track_caller]
    fn from(kind: DistErrorKind) -> DistError {
        DistError::new(kind)
    }
}

impl From<nccl_launch::Error> for DistError {
    #[track_caller]
    fn from(e: nccl_launch::Error) -> DistError {
        match e {
            nccl_launch::Error::Core(e) => DistError::from(e),
            e => DistError::new(DistErrorKind::Launch(e)),
        }
    }
}

impl From<nccl_safe::Error> for DistError {
    #[track_caller]
    fn from(e: nccl_safe::Error) -> DistError {
        DistError::new(DistErrorKind::Nccl(e))
    }
}

/// A candle error that carries one of this crate's errors (`?` from a [`DistError`] into
/// candle's, then back: a step through `candle_nn::Optimizer`) gives that error back, its
/// kind, line and step as they were, so that [`is_rank_loss`](crate::is_rank_loss) and
/// `run_elastic` see a lost rank whichever way the step was made. Any other candle error
/// becomes [`DistErrorKind::Candle`].
impl From<candle_core::Error> for DistError {
    #[track_caller]
    fn from(e: candle_core::Error) -> DistError {
        match take_carried(e) {
            Ok(d) => d,
            Err(e) => DistError::new(DistErrorKind::Candle(e)),
        }
    }
}

/// Whether `io` is the carrier of one of this crate's errors.
fn carries(io: &std::io::Error) -> bool {
    io.get_ref().is_some_and(|x| x.is::<DistError>())
}

/// The error of this crate that `e` carries at its top (under a backtrace candle may
/// have added), else `e` itself.
fn take_carried(e: candle_core::Error) -> Result<DistError, candle_core::Error> {
    use candle_core::Error as C;
    match e {
        C::Io(io) if carries(&io) => match io.into_inner().map(|x| x.downcast::<DistError>()) {
            Some(Ok(d)) => Ok(*d),
            // Not reached: `carries` checked both.
            Some(Err(x)) => Err(C::Io(std::io::Error::other(x))),
            None => Err(C::Msg("an I/O error without its cause".into())),
        },
        C::WithBacktrace { inner, backtrace } => {
            take_carried(*inner).map_err(|inner| C::WithBacktrace {
                inner: Box::new(inner),
                backtrace,
            })
        }
        e => Err(e),
    }
}

/// So that a candle loop (`candle_core::Result`) can use `?` on this crate's calls. A
/// candle error stays candle's, with the caller's line (and step) as its context. Any
/// other error of this crate is carried whole, its text unchanged, in candle's `Io`
/// variant (an `std::io::Error` of kind `Other` around it): [`DistError::in_candle`] finds
/// it, and `?` back into a [`DistError`] gives it back, a rank loss still a rank loss.
impl From<DistError> for candle_core::Error {
    fn from(e: DistError) -> candle_core::Error {
        let at = format!(
            "at {}:{}{}",
            e.caller.file(),
            e.caller.line(),
            e.step.map(|s| format!(", step {s}")).unwrap_or_default()
        );
        match e.kind {
            DistErrorKind::Candle(inner) => inner.context(at),
            // Not `Error::wrap`, which appends a backtrace under RUST_BACKTRACE: the
            // message already names the caller's line. An `io::Error` of kind `Other`
            // shows the text of the error it holds, and hands it back by downcast.
            _ => candle_core::Error::Io(std::io::Error::other(e)),
        }
    }
}

thread_local! {
    /// The user's line of the outermost public call of this crate in progress on this
    /// thread: what the core crate's records (flight record, desync report, mismatch table)
    /// name, through `Op::at`, since candle's storage hooks stop `#[track_caller]`.
    static CALLER: std::cell::Cell<Option<&'static Location<'static>>> =
        const { std::cell::Cell::new(None) };
}

/// Ends the scope [`caller_scope`] opened, when it was the outermost.
pub(crate) struct CallerScope {
    outermost: bool,
}

impl Drop for CallerScope {
    fn drop(&mut self) {
        if self.outermost {
            CALLER.with(|c| c.set(None));
        }
    }
}

/// The caller's location, and a scope that makes it the line the core crate records for
/// the collectives run until the scope ends (unless an outer public call of this crate
/// already set its own: the user's line wins over this crate's internal calls).
#[track_caller]
pub(crate) fn caller_scope() -> (&'static Location<'static>, CallerScope) {
    let here = Location::caller();
    let outermost = CALLER.with(|c| {
        if c.get().is_none() {
            c.set(Some(here));
            true
        } else {
            false
        }
    });
    (here, CallerScope { outermost })
}

/// The line of the outermost public call in progress on this thread, if any.
pub(crate) fn scope_caller() -> Option<&'static Location<'static>> {
    CALLER.with(|c| c.get())
}
