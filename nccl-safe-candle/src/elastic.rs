//! Training that carries on without a rank it lost: [`run_elastic`] and [`recover`].
//!
//! When a step fails because a rank left (it returned, panicked, or dropped its
//! communicator: nccl-safe's diagnostics see it and name it,
//! [`Communicator::lost_rank`]), the ranks left
//!
//! 1. agree on who is gone: each names every rank known gone, agreed with the ranks of its
//!    process that recover ([`Communicator::agree_lost_ranks`]), shrinks its communicator
//!    without them ([`Communicator::shrink_after_failure`]), then they check on the new
//!    communicator that they all excluded the same ranks (a disagreement is an error, not a
//!    guess);
//! 2. agree on the step: the new rank 0's step counter is every rank's (a step is applied
//!    by all of them or by none: the data-parallel objects are rebuilt from rank 0's
//!    parameters, [`DistributedDataParallel::new`](crate::DistributedDataParallel::new) and
//!    [`ZeroRedundancyOptimizer::new`](crate::ZeroRedundancyOptimizer::new) take them);
//! 3. continue from that step on the smaller world: the session closure builds its
//!    optimizer again on the new communicator, which re-shards the batch
//!    (`shard_batch`) and ZeRO-1's parameter shards over the new number of ranks.
//!
//! The optimizer's state comes along when the closure builds its optimizer with `resume`
//! and a [`StateCarry`](crate::StateCarry) made before `run_elastic`
//! ([`ZeroRedundancyOptimizer::resume`](crate::ZeroRedundancyOptimizer::resume),
//! [`DdpOptimizer::resume`](crate::DdpOptimizer::resume)), for an optimizer whose state can
//! be exported ([`ShardableState`](crate::ShardableState): this crate's
//! [`AdamW`](crate::state::AdamW), candle's `SGD`): the optimizer dropped by the failed
//! session leaves its state in the carry, and the next one re-shards it over the new world.
//! DDP's state is whole on every rank, so nothing of it is lost. ZeRO-1's is sharded: each
//! survivor keeps the state of its old range, and the copy each rank keeps of the next
//! rank's ([`StateCarry::with_replica`](crate::StateCarry::with_replica), on by default)
//! gives back the lost rank's range, bit for bit (the step count is rank 0's); only two
//! neighbouring ranks lost at once, or no copy, restart a range's state from zero. A rank
//! that joins through [`grow`] / [`join`] comes with an empty carry and receives its part.
//!
//! The communicator must be made with [`Config::elastic`](nccl_safe::Config::elastic)
//! (without it the watchdog aborts the survivors' handles, and [`run_elastic`] and
//! [`recover`] refuse with [`DistErrorKind::NotElastic`](crate::DistErrorKind::NotElastic),
//! naming the setting, for DDP and ZeRO-1 alike). NCCL 2.27+ (the shrink's abort mode) and, for a rank that left while its
//! peers waited, 2.29+ (the watchdog's revoke); the host provider has both.
//!
//! What it does not do (yet): bring back the state of two neighbouring ranks lost at once
//! (the copy of the first's range died with the second); an optimizer built with `new`
//! starts its state afresh on the smaller world (SGD without momentum carries on exactly;
//! candle_nn's AdamW, whose state is private, does not compile with `resume`: its drop-in is
//! [`state::AdamW`](crate::state::AdamW)); a
//! replacement rank joins only between two `run_elastic` runs ([`grow`] and [`join`];
//! [`ElasticRank::train`](crate::ElasticRank::train) decides when, by its
//! [`GrowPolicy`](crate::GrowPolicy), and moves the grow id through the job's rendezvous); a shrink that waits for a rank lost after the
//! survivors agreed on the list is not tried again on NCCL 2.29 (it refuses a second shrink
//! while the first one's job is in progress, init.cc:2762 and 400-416), and ranks of other
//! processes agree only through what each sees (the host provider's records, the desync
//! board), so a rank lost at the moment they read them may end the job with
//! [`DistErrorKind::RecoveryFailed`](crate::DistErrorKind::RecoveryFailed) after
//! [`Config::timeout`](nccl_safe::Config::timeout); a rank that is alive but stuck counts as lost only when the watchdog's
//! timeout finds it the one rank behind (with two or more behind, `run_elastic` returns
//! the step's error); when it wakes, it finds every other rank gone, and the quorum rule
//! ([`MinRanks`], default half of the ranks and at least 2) refuses its recovery into a world
//! of one with [`DistErrorKind::NoQuorum`](crate::DistErrorKind::NoQuorum) rather than let it
//! train a divergent model alone (two halves of an even world stuck apart may both carry on
//! under the default: ask for more with [`run_elastic_with`]). A
//! rank of another process that dies (SIGKILL, the OOM killer) is named by the host
//! provider and recovered from: `examples/elastic.rs`, run under mpirun and srun by
//! `scripts/test-processes.sh`, loses one to an outside SIGKILL and takes a standby back.
//!
//! ```
//! use std::time::Duration;
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Module, ParamsAdamW, VarBuilder, VarMap};
//! use nccl_safe_candle::state::AdamW;
//! use nccl_safe_candle::{run_elastic, Communicator, Config, DistResult, StateCarry, ZeroRedundancyOptimizer};
//! use nccl_safe::{CommDevice, UniqueId};
//!
//! let id = CommDevice::Host.unique_id()?;
//! let worlds = std::thread::scope(|s| {
//!     let ranks: Vec<_> = (0..2).map(|r| s.spawn(move || -> DistResult<usize> {
//!         let config = Config::new().elastic(true).timeout(Duration::from_secs(30));
//!         let comm = Communicator::init_rank(&CommDevice::Host, 2, r, &id, &config)?;
//!         let map = VarMap::new();
//!         let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
//!         let x = Tensor::ones((6, 4), DType::F32, &Device::Cpu)?;
//!         let y = Tensor::zeros((6, 1), DType::F32, &Device::Cpu)?;
//!         let carry = StateCarry::new(); // the optimizer's state between two sessions
//!         let run = run_elastic(comm, 0, |comm, step| {
//!             // Built again after a loss: rank 0's parameters, shards over the new world,
//!             // the state the survivors carried re-sharded over it.
//!             let mut opt = ZeroRedundancyOptimizer::<AdamW>::resume(comm, &map, ParamsAdamW::default(), &carry)?;
//!             let (x, y) = (opt.shard_batch(&x)?, opt.shard_batch(&y)?);
//!             while *step < 5 {
//!                 opt.backward_step(&loss::mse(&model.forward(&x)?, &y)?)?;
//!                 *step += 1;
//!             }
//!             Ok(())
//!         })?;
//!         Ok(run.comm.world_size())
//!     })).collect();
//!     ranks.into_iter().map(|h| h.join().unwrap()).collect::<DistResult<Vec<_>>>()
//! })?;
//! assert_eq!(worlds, vec![2, 2]); // nobody left
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use nccl_safe::{CommDevice, Communicator, Config, ReduceOp, UniqueId};

use crate::error::{DistError, DistErrorKind as K, DistResult as Result};

/// One recovery of [`run_elastic`] / [`recover`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// The lowest-numbered rank that was lost (its number in the communicator it left).
    pub lost: usize,
    /// Every rank that was lost, sorted (numbers in the communicator they left): all the
    /// ranks known gone when the recovery began, and any lost while it ran.
    pub lost_ranks: Vec<usize>,
    /// The step the ranks left carry on from (the step that failed).
    pub step: u64,
    /// The number of ranks before and after.
    pub world_sizes: (usize, usize),
    /// This rank's number before and after.
    pub ranks: (usize, usize),
    /// The shrinks it took: 1 when every rank left named the same ranks at once; more when
    /// a rank was lost during a shrink, or the ranks left first named different ranks.
    pub shrinks: usize,
    /// From the call to `recover` to the new communicator's agreement.
    pub took: Duration,
}

/// The quorum rule of a recovery (as torchft's `min_replicas`): the fewest ranks a
/// recovery may leave. A recovery that would leave fewer is refused with
/// [`DistErrorKind::NoQuorum`](crate::DistErrorKind::NoQuorum) before any shrink, so the
/// rank ends with that error instead of training on.
///
/// Why: a rank stuck past [`Config::timeout`](nccl_safe::Config::timeout) (a SIGSTOPped
/// process, a long stall) is named and excluded by the others, who shrink and train on.
/// When it wakes, its communicator has failed and every other rank is gone from its view:
/// without a quorum it would recover into a world of one and train a second, divergent
/// model (split brain).
///
/// The default, [`MinRanks::Half`], keeps at least half of the ranks the recovery began
/// with, and at least 2: 4 ranks survive two losses at once (4 -> 2) and one after the
/// other (4 -> 3 -> 2), 3 ranks one loss; a rank that woke alone is refused, and so is a
/// survivor of a job of 2 (it cannot tell its peer's death from its own isolation: pass
/// `MinRanks::AtLeast(1)` to let it carry on). Exactly half of an even world may still
/// split in two halves that both carry on (two ranks of 4 stuck together and woken); ask
/// for `AtLeast(n / 2 + 1)` to rule that out, at the price of surviving fewer losses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MinRanks {
    /// At least half of the ranks the recovery began with (rounded up), and at least 2.
    #[default]
    Half,
    /// At least this many ranks (1: a lone survivor carries on; 0 counts as 1).
    AtLeast(usize),
}

impl MinRanks {
    /// The fewest ranks a recovery that begins with `world` ranks may leave.
    pub fn of(self, world: usize) -> usize {
        match self {
            MinRanks::Half => world.div_ceil(2).max(2),
            MinRanks::AtLeast(n) => n.max(1),
        }
    }
}

impl std::fmt::Display for MinRanks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MinRanks::Half => write!(
                f,
                "MinRanks::Half (half of the ranks the recovery began with, at least 2; the default)"
            ),
            MinRanks::AtLeast(n) => write!(f, "MinRanks::AtLeast({n})"),
        }
    }
}

/// What [`run_elastic`] ends with.
#[derive(Debug)]
pub struct ElasticRun<T> {
    /// The communicator the last session ran on (smaller than the first after a loss).
    pub comm: Communicator,
    /// What the last session returned.
    pub value: T,
    /// The step counter at the end.
    pub step: u64,
    /// Each recovery, in order.
    pub recoveries: Vec<Recovery>,
}

/// Whether `e`, the error of a step on `comm`, is the loss of a rank that the ranks left
/// can recover from: the communicator failed, and nccl-safe knows a rank that left
/// ([`Communicator::lost_ranks`]). Also through a `candle_core::Error` (a step through
/// `candle_nn::Optimizer`, `?` back into a [`DistError`]). [`recover`] refuses it on a
/// communicator made without [`Config::elastic`](nccl_safe::Config::elastic)
/// ([`DistErrorKind::NotElastic`](crate::DistErrorKind::NotElastic)).
pub fn is_rank_loss(comm: &Communicator, e: &DistError) -> bool {
    e.as_nccl().is_some() && comm.is_failed() && !comm.lost_ranks().is_empty()
}

/// Runs `session(comm, &mut step)` from step `start`, and after the loss of a rank
/// ([`is_rank_loss`]) [`recover`]s and runs it again on the smaller communicator, from the
/// step the ranks left agree on. `session` builds its data-parallel objects on the
/// communicator it is given (so that they take the new world's shards), runs steps while
/// `*step` is below the end, and increments `*step` after each step that returned `Ok`.
/// Any other error is returned as it is. A rank loss on a communicator made without
/// [`Config::elastic`](nccl_safe::Config::elastic) is
/// [`DistErrorKind::NotElastic`](crate::DistErrorKind::NotElastic), the step's error
/// inside, on every rank left.
///
/// A recovery must leave at least [`MinRanks::default`] ranks (half of the ranks it began
/// with, and at least 2; [`run_elastic_with`] sets another rule): one that would leave
/// fewer ends the run with [`DistErrorKind::NoQuorum`](crate::DistErrorKind::NoQuorum).
/// That is what a rank stuck past the timeout gets when it wakes after the others
/// recovered without it, rather than training alone in a world of one.
#[track_caller]
pub fn run_elastic<T>(
    comm: Communicator,
    start: u64,
    session: impl FnMut(&Communicator, &mut u64) -> Result<T>,
) -> Result<ElasticRun<T>> {
    run_elastic_with(comm, start, MinRanks::default(), session)
}

/// [`run_elastic`] with the quorum rule `min_ranks`: each recovery must leave at least
/// `min_ranks.of(n)` ranks of the `n` it began with, or the run ends with
/// [`DistErrorKind::NoQuorum`](crate::DistErrorKind::NoQuorum) (see [`MinRanks`]).
#[track_caller]
pub fn run_elastic_with<T>(
    comm: Communicator,
    start: u64,
    min_ranks: MinRanks,
    mut session: impl FnMut(&Communicator, &mut u64) -> Result<T>,
) -> Result<ElasticRun<T>> {
    let (at, _scope) = crate::error::caller_scope();
    let mut comm = comm;
    let mut step = start;
    let mut recoveries = Vec::new();
    loop {
        match session(&comm, &mut step) {
            Ok(value) => {
                return Ok(ElasticRun {
                    comm,
                    value,
                    step,
                    recoveries,
                })
            }
            Err(e) if is_rank_loss(&comm, &e) && !comm.is_elastic() => {
                return Err(not_elastic("run_elastic", &comm, Some(e)).at(at, Some(step)));
            }
            Err(e) if is_rank_loss(&comm, &e) => {
                let (next, r) =
                    recover_inner(comm, &mut step, min_ranks).map_err(|e| e.at(at, Some(step)))?;
                comm = next;
                recoveries.push(r);
            }
            Err(e) => return Err(e),
        }
    }
}

/// After the loss of ranks ([`is_rank_loss`]): shrinks `comm` without every rank known
/// gone ([`Communicator::lost_ranks`]), checks on the new communicator that every rank left
/// excluded the same ranks, sets `step` to the new rank 0's, and drops `comm` (revoked, so
/// it is aborted, once). Collective over the ranks left.
///
/// A rank lost while this runs is survived too: a shrink that fails (a rank it keeps never
/// came) is tried again on `comm` excluding every rank then known gone, as long as the list
/// grew, and once more with the same list (another rank may have named more ranks and
/// failed the same shrink: each rank tries each list at most twice, so the ranks left meet
/// on the union); a rank lost after the shrink (the agreement on the new communicator
/// fails for it) is shrunk away from the new communicator in turn. Each shrink is bounded
/// by the communicator's [`Config::timeout`](nccl_safe::Config::timeout).
///
/// Errors: a communicator made without [`Config::elastic`](nccl_safe::Config::elastic)
/// ([`DistErrorKind::NotElastic`](crate::DistErrorKind::NotElastic), naming the setting);
/// nothing known to be lost ([`DistErrorKind::InvalidArgument`](crate::DistErrorKind::InvalidArgument));
/// [`DistErrorKind::RecoveryFailed`](crate::DistErrorKind::RecoveryFailed), naming the ranks
/// lost and the last shrink's error, when no shrink made a communicator (an elastic
/// communicator's handle is still aborted without `ncclCommRevoke`, NCCL before 2.29);
/// ranks that excluded different ranks; [`DistErrorKind::NoQuorum`](crate::DistErrorKind::NoQuorum)
/// when the ranks left would be fewer than [`MinRanks::default`] allows (before any
/// shrink; [`recover_with`] sets another rule).
#[track_caller]
pub fn recover(comm: Communicator, step: &mut u64) -> Result<(Communicator, Recovery)> {
    let (at, _scope) = crate::error::caller_scope();
    recover_inner(comm, step, MinRanks::default()).map_err(|e| e.at(at, Some(*step)))
}

/// [`recover`] with the quorum rule `min_ranks` (see [`MinRanks`]).
#[track_caller]
pub fn recover_with(
    comm: Communicator,
    step: &mut u64,
    min_ranks: MinRanks,
) -> Result<(Communicator, Recovery)> {
    let (at, _scope) = crate::error::caller_scope();
    recover_inner(comm, step, min_ranks).map_err(|e| e.at(at, Some(*step)))
}

/// [`DistErrorKind::NotElastic`](crate::DistErrorKind::NotElastic) for `comm`.
fn not_elastic(call: &'static str, comm: &Communicator, cause: Option<DistError>) -> DistError {
    K::NotElastic {
        call,
        rank: comm.rank(),
        world_size: comm.world_size(),
        lost: comm.lost_ranks(),
        cause: cause.map(Box::new),
    }
    .into()
}

fn recover_inner(
    comm: Communicator,
    step: &mut u64,
    rule: MinRanks,
) -> Result<(Communicator, Recovery)> {
    if !comm.is_elastic() {
        return Err(not_elastic("recover", &comm, None));
    }
    let t0 = Instant::now();
    let (world, rank) = (comm.world_size(), comm.rank());
    let quorum = (rule, rule.of(world));
    // `kept[i]`: the rank of `comm` that rank i of the current communicator is.
    let mut kept: Vec<usize> = (0..world).collect();
    let mut lost_ranks = Vec::new();
    let mut shrinks = 0;
    let mut cur = comm;
    // Each round removes at least one rank: bounded by the world's size.
    loop {
        let lost = cur.agree_lost_ranks();
        if lost.is_empty() {
            return Err(K::InvalidArgument {
                call: "recover",
                reason: "no rank of this communicator is known to have left".into(),
            }
            .into());
        }
        let (small, lost) = shrink_without_lost(&cur, lost, &mut shrinks, quorum)?;
        lost_ranks.extend(lost.iter().map(|&r| kept[r]));
        lost_ranks.sort_unstable();
        kept.retain(|r| !lost_ranks.contains(r));
        match agree(&small, &lost_ranks, world, step) {
            Ok(()) => {
                let r = Recovery {
                    lost: lost_ranks[0],
                    lost_ranks,
                    step: *step,
                    world_sizes: (world, small.world_size()),
                    ranks: (rank, small.rank()),
                    shrinks,
                    took: t0.elapsed(),
                };
                drop(cur);
                return Ok((small, r));
            }
            // A rank lost after it joined the shrink: the new communicator failed in turn.
            Err(e) if is_rank_loss(&small, &e) => {
                drop(cur);
                cur = small;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Shrinks `comm` without `lost` (every rank it knows gone), again while further ranks are
/// found gone (see [`recover`]). Returns the new communicator and the list it excluded.
/// Refuses a list that would leave fewer ranks than `quorum`'s (its rule, and the count for
/// the world the recovery began with) before shrinking.
fn shrink_without_lost(
    comm: &Communicator,
    mut lost: Vec<usize>,
    shrinks: &mut usize,
    (rule, min_ranks): (MinRanks, usize),
) -> Result<(Communicator, Vec<usize>)> {
    let mut tries_of_this_list = 0;
    loop {
        let left = comm.world_size().saturating_sub(lost.len());
        if left < min_ranks {
            return Err(K::NoQuorum {
                rank: comm.rank(),
                world_size: comm.world_size(),
                lost,
                left,
                min_ranks,
                rule,
            }
            .into());
        }
        *shrinks += 1;
        tries_of_this_list += 1;
        let cause = match comm.shrink_after_failure(&lost) {
            Ok(small) => return Ok((small, lost)),
            Err(e) => e,
        };
        let mut now = comm.lost_ranks();
        now.extend(&lost);
        now.sort_unstable();
        now.dedup();
        let grew = now.len() > lost.len();
        // Nothing to exclude any more but this rank itself: a communicator of one would do,
        // but the shrink's own refusals (bad lists) are no loss to retry.
        let retryable = !matches!(
            cause,
            nccl_safe::Error::InvalidArgument { .. }
                | nccl_safe::Error::RankOutOfRange { .. }
                | nccl_safe::Error::Unsupported { .. }
        );
        if retryable && (grew || tries_of_this_list < 2) && now.len() < comm.world_size() {
            if grew {
                tries_of_this_list = 0;
            }
            lost = now;
            continue;
        }
        return Err(K::RecoveryFailed {
            rank: comm.rank(),
            world_size: comm.world_size(),
            lost: now,
            attempts: *shrinks,
            cause: Box::new(cause),
        }
        .into());
    }
}

/// On the new communicator `small`: every rank excluded the same ranks (`lost`, numbered in
/// the communicator of `world` ranks the recovery began with), and `step` becomes the new
/// rank 0's.
fn agree(small: &Communicator, lost: &[usize], world: usize, step: &mut u64) -> Result<()> {
    let device = device_of(small)?;
    let mut mine = vec![0f64; world + 1];
    mine[0] = *step as f64;
    for &r in lost {
        mine[r + 1] = 1.0;
    }
    // Rank 0's step to everyone; the lists' least and greatest entries, which are equal
    // only when every rank's list is the same.
    let theirs = Tensor::new(mine.as_slice(), &device)?;
    crate::tensor::broadcast(small, &theirs, 0)?;
    let (lo, hi) = (
        Tensor::new(&mine[1..], &device)?,
        Tensor::new(&mine[1..], &device)?,
    );
    crate::tensor::all_reduce(small, &lo, ReduceOp::Min)?;
    crate::tensor::all_reduce(small, &hi, ReduceOp::Max)?;
    let (lo, hi) = (lo.to_vec1::<f64>()?, hi.to_vec1::<f64>()?);
    if lo != hi {
        let named = |v: &[f64]| -> Vec<usize> { (0..world).filter(|&r| v[r] > 0.5).collect() };
        return Err(K::InvalidArgument {
            call: "recover",
            reason: format!(
                "the ranks left disagree on the ranks that were lost: rank {} of {} excluded {lost:?}; every rank excluded {:?}, some {:?}",
                small.rank(),
                small.world_size(),
                named(&lo),
                named(&hi),
            ),
        }
        .into());
    }
    *step = theirs.to_vec1::<f64>()?[0] as u64;
    Ok(())
}

/// The candle device of a communicator's rank.
pub(crate) fn device_of(comm: &Communicator) -> Result<Device> {
    Ok(match comm.cuda_ordinal() {
        None => Device::Cpu,
        Some(d) => Device::new_cuda(d)?,
    })
}

/// Rank 0's step counter to every rank of `comm`.
fn agree_on_step(comm: &Communicator, step: &mut u64) -> Result<()> {
    let t = Tensor::new(&[*step as f64], &device_of(comm)?)?;
    crate::tensor::broadcast(comm, &t, 0)?;
    *step = t.to_vec1::<f64>()?[0] as u64;
    Ok(())
}

/// An existing rank's part of taking new ranks back in, between two [`run_elastic`] runs:
/// grows `comm` to `world_size` ranks ([`Communicator::grow`]; the root, the rank that
/// called [`Communicator::grow_id`] and handed the id to the new ranks, passes `Some(id)`,
/// the others `None`), then gives the new ranks rank 0's step (`step`). The new ranks call
/// [`join`]. `comm` is torn down once the grown communicator works (destroyed; aborted by
/// its drop when NCCL refuses the destroy). Run the next session on the grown
/// communicator: its optimizer, built there, takes rank 0's parameters to the new ranks
/// and re-shards over the larger world (with `resume`, the optimizer state too: each new
/// rank receives its ZeRO-1 part, or DDP's whole state).
///
/// On an error `comm` is handed back with it, untouched and usable (as
/// [`Communicator::destroy`] hands back its communicator): a new rank that dies before or
/// while it joins, or right after, costs this call at most `comm`'s timeout
/// (`Config::timeout`), and training carries on at the old size, or grows again with a
/// new id. `step` is then as it was.
#[track_caller]
#[allow(clippy::result_large_err)]
pub fn grow(
    comm: Communicator,
    world_size: usize,
    id: Option<&UniqueId>,
    step: &mut u64,
) -> std::result::Result<Communicator, (Communicator, DistError)> {
    let (at, _scope) = crate::error::caller_scope();
    let before = *step;
    let grown = (|| -> Result<Communicator> {
        let big = comm.grow(world_size, id)?;
        agree_on_step(&big, step)?;
        Ok(big)
    })();
    match grown {
        Ok(big) => {
            // The grown communicator works: the old one goes (a refused destroy hands it
            // back, and its drop aborts it).
            drop(comm.destroy());
            Ok(big)
        }
        Err(e) => {
            *step = before;
            Err((comm, e.at(at, Some(before))))
        }
    }
}

/// A new rank's part of [`grow`]: joins as rank `rank` of `world_size` with the root's id
/// ([`Communicator::join_grown`]) and returns the communicator and the step to start from
/// (rank 0's). Then run [`run_elastic`] from that step, with the same session as the
/// others.
#[track_caller]
pub fn join(
    device: &CommDevice,
    world_size: usize,
    rank: usize,
    id: &UniqueId,
    config: &Config,
) -> Result<(Communicator, u64)> {
    let (at, _scope) = crate::error::caller_scope();
    (|| {
        let comm = Communicator::join_grown(device, world_size, rank, id, config)?;
        let mut step = 0;
        agree_on_step(&comm, &mut step)?;
        Ok((comm, step))
    })()
    .map_err(|e: DistError| e.at(at, None))
}
