//! Gradient accumulation that cannot be misused ([`Accumulation`]), the step counter every
//! data-parallel object keeps, and the drift check.

use std::panic::Location;
use std::sync::Mutex;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use nccl_safe::Communicator;

use crate::error::{DistError, DistErrorKind as K, DistResult};
use crate::tensor::all_gather;

/// The step counter, the open accumulation and the drift check's schedule of one
/// data-parallel object.
#[derive(Debug, Default)]
pub struct Tracker {
    state: Mutex<TrackerState>,
}

#[derive(Debug, Default)]
struct TrackerState {
    /// Steps completed.
    steps: u64,
    /// The open accumulation: (micro-batches, taken).
    open: Option<(usize, usize)>,
    /// An accumulation dropped without its step, not reported yet.
    abandoned: Option<(usize, usize)>,
    /// Check for drift every this many steps (0: never).
    drift_every: u64,
    /// The step after which the last drift check passed.
    last_good: u64,
    /// With the drift check on: a sample of the parameters at the last `shard_batch`,
    /// and the steps completed then (`outside_step`).
    sharded: Option<(u64, u64)>,
}

impl Tracker {
    fn lock(&self) -> std::sync::MutexGuard<'_, TrackerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The step in progress (completed + 1), for errors.
    pub(crate) fn current(&self) -> u64 {
        self.lock().steps + 1
    }

    /// Steps completed.
    pub(crate) fn completed(&self) -> u64 {
        self.lock().steps
    }

    pub(crate) fn set_drift_every(&self, every: u64) {
        self.lock().drift_every = every;
    }

    /// May a step (outside an accumulation) start now? Reports an abandoned
    /// accumulation once.
    pub(crate) fn may_step(&self, call: &'static str, rank: usize) -> Result<(), K> {
        let mut s = self.lock();
        if let Some((micro_batches, done)) = s.open {
            return Err(K::AccumulationOpen {
                call,
                rank,
                micro_batches,
                done,
            });
        }
        if let Some((micro_batches, done)) = s.abandoned.take() {
            return Err(K::AccumulationAbandoned {
                call,
                rank,
                micro_batches,
                done,
            });
        }
        Ok(())
    }

    /// Opens an accumulation of `micro_batches`.
    pub(crate) fn open(
        &self,
        call: &'static str,
        rank: usize,
        micro_batches: usize,
    ) -> Result<(), K> {
        if micro_batches == 0 {
            return Err(K::InvalidArgument {
                call,
                reason: "an accumulation needs at least one micro-batch".into(),
            });
        }
        self.may_step(call, rank)?;
        self.lock().open = Some((micro_batches, 0));
        Ok(())
    }

    fn took(&self, done: usize) {
        if let Some(open) = &mut self.lock().open {
            open.1 = done;
        }
    }

    fn close(&self) {
        self.lock().open = None;
    }

    fn abandon(&self, micro_batches: usize, done: usize) {
        let mut s = self.lock();
        s.open = None;
        s.abandoned = Some((micro_batches, done));
    }

    /// Whether the drift check is on.
    pub(crate) fn drift_checked(&self) -> bool {
        self.lock().drift_every > 0
    }

    /// At a batch's sharding, with the drift check on: `true` when the parameters'
    /// `sample` changed since the previous batch's with no step in between (an optimizer
    /// stepped outside the data-parallel object). Keeps `sample` for the next batch.
    pub(crate) fn outside_step(&self, sample: u64) -> bool {
        let mut s = self.lock();
        let steps = s.steps;
        let outside = s
            .sharded
            .is_some_and(|(before, at)| at == steps && before != sample);
        s.sharded = Some((sample, steps));
        outside
    }

    /// A step completed; returns the steps completed when a drift check is due now.
    pub(crate) fn stepped(&self) -> Option<u64> {
        let mut s = self.lock();
        s.steps += 1;
        (s.drift_every > 0 && s.steps.is_multiple_of(s.drift_every)).then_some(s.steps)
    }

    /// The last step after which a check passed; records `steps` as the new one when `ok`.
    fn checked(&self, steps: u64, ok: bool) -> u64 {
        let mut s = self.lock();
        let last = s.last_good;
        if ok {
            s.last_good = steps;
        }
        last
    }
}

pub(crate) mod private {
    use super::*;

    /// Seals [`MicroBatchLoss`](super::MicroBatchLoss).
    pub trait SealedLoss {}

    /// What an [`Accumulation`] steps: the parameters, the tracker, and the step of
    /// summed, unreduced gradients.
    pub trait Target {
        fn params(&self) -> &[(String, Var)];
        fn tracker(&self) -> &Tracker;
        fn rank(&self) -> usize;
        /// Reduces `grads` (the micro-batches' sum of scaled gradients) and steps, as one
        /// step of the tracker.
        fn step_summed(
            &mut self,
            grads: &mut GradStore,
            at: &'static Location<'static>,
        ) -> DistResult<()>;
    }
}

/// A micro-batch's loss as the model computed it (its mean over the micro-batch), **not**
/// divided by the number of micro-batches: the only thing
/// [`Accumulation::backward`] takes, which divides it by `micro_batches` itself.
///
/// The wrapper is the guard's API, so that code written when the loss had to be scaled by
/// hand (`acc.backward(&(loss / n as f64)?)`, which would now scale it twice) does not
/// compile: the compiler's error names `Unscaled`. Drop the division when adding it.
#[derive(Debug, Clone, Copy)]
pub struct Unscaled<'t>(pub &'t Tensor);

/// What [`Accumulation::backward`] takes: [`Unscaled`] only. Sealed.
#[diagnostic::on_unimplemented(
    message = "`Accumulation::backward` takes `Unscaled(&loss)`, not `{Self}`",
    label = "wrap the micro-batch's loss, not divided by the micro-batch count: `Unscaled(&loss)`",
    note = "the guard divides each micro-batch's loss by the micro-batch count itself: code that divided it too (as it had to before) would scale it twice"
)]
pub trait MicroBatchLoss: private::SealedLoss {
    /// The unscaled loss.
    fn loss(&self) -> &Tensor;
}

impl MicroBatchLoss for Unscaled<'_> {
    fn loss(&self) -> &Tensor {
        self.0
    }
}

impl private::SealedLoss for Unscaled<'_> {}

/// What [`Accumulation`] works on: [`DdpStep`](crate::DdpStep) (a
/// [`DistributedDataParallel`](crate::DistributedDataParallel) with your optimizer),
/// [`DdpOptimizer`](crate::DdpOptimizer) and
/// [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer). Sealed.
pub trait Accumulate: private::Target {}

/// Gradient accumulation over a fixed number of micro-batches, with one gradient
/// reduction and one optimizer step at the end (PyTorch's `no_sync`), made so that it
/// cannot be misused:
///
/// - **The guard takes the backward.** [`backward(Unscaled(&loss))`](Self::backward) runs
///   `(loss / micro_batches).backward()` and adds the gradients to the guard's local sum:
///   **each micro-batch's loss is scaled by `1 / micro_batches`**, so that the step applies
///   the mean gradient over the whole accumulated batch, as one step on it would (pass
///   the unscaled mean loss of the micro-batch, wrapped in [`Unscaled`]: a bare `&Tensor`,
///   as code that scaled the loss by hand passed, does not compile). A plain `loss.backward()` produces
///   gradients the guard never sees, and [`step`](Self::step) then refuses
///   ([`DistErrorKind::MicroBatchCount`](crate::DistErrorKind::MicroBatchCount)): no
///   gradient is dropped silently.
/// - **Only the guard steps.** The guard holds the optimizer (or the data-parallel
///   optimizer) by `&mut` until [`step`](Self::step), so a step of your own inside it
///   (`opt.backward_step`, `ddp.backward_step(&mut opt, ..)`) does not compile; a
///   [`DistributedDataParallel::sync_grads`](crate::DistributedDataParallel::sync_grads)
///   inside it is [`DistErrorKind::AccumulationOpen`](crate::DistErrorKind::AccumulationOpen).
/// - **Every accumulation ends with its step.** A guard dropped without
///   [`step`](Self::step) makes the next step fail once with
///   [`DistErrorKind::AccumulationAbandoned`](crate::DistErrorKind::AccumulationAbandoned).
///
/// Communication happens in `step` only: one reduction of the summed gradients.
#[must_use = "an accumulation must end with .step()"]
pub struct Accumulation<T: Accumulate> {
    target: T,
    micro_batches: usize,
    done: usize,
    sums: Vec<Option<Tensor>>,
    ended: bool,
}

impl<T: Accumulate> std::fmt::Debug for Accumulation<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accumulation")
            .field("micro_batches", &self.micro_batches)
            .field("taken", &self.done)
            .finish()
    }
}

impl<T: Accumulate> Accumulation<T> {
    /// Opens an accumulation on `target` (its tracker refuses when one is open already).
    #[track_caller]
    pub(crate) fn open(target: T, micro_batches: usize) -> DistResult<Self> {
        let (at, _scope) = crate::error::caller_scope();
        let (tracker, rank) = (target.tracker(), target.rank());
        tracker
            .open("no_sync", rank, micro_batches)
            .map_err(|k| DistError::from(k).at(at, Some(tracker.current())))?;
        let n = target.params().len();
        Ok(Accumulation {
            target,
            micro_batches,
            done: 0,
            sums: vec![None; n],
            ended: false,
        })
    }

    /// The micro-batches this accumulation was opened for.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// How many micro-batches [`backward`](Self::backward) took so far.
    pub fn taken(&self) -> usize {
        self.done
    }

    /// One micro-batch: `(loss / micro_batches).backward()`, its gradients added to the
    /// local sum (no communication). `loss` is the micro-batch's mean loss, unscaled, in
    /// [`Unscaled`]. More calls than micro-batches is
    /// [`DistErrorKind::MicroBatchCount`](crate::DistErrorKind::MicroBatchCount).
    ///
    /// A bare tensor, as code that divided the loss by the micro-batch count itself
    /// passed, does not compile (it would be scaled twice):
    ///
    /// ```compile_fail,E0308
    /// # use candle_core::{DType, Device, Tensor};
    /// # use candle_nn::{VarMap, SGD, Optimizer};
    /// # use nccl_safe_candle::{DistributedDataParallel, DistResult, Launcher};
    /// # Launcher::host(1).try_run(|rank| -> DistResult<()> {
    /// # let map = VarMap::new();
    /// # let w = map.get(4, "w", candle_nn::Init::Const(1.0), DType::F32, &Device::Cpu)?;
    /// # let ddp = DistributedDataParallel::new(rank.comm(), &map)?;
    /// # let mut sgd = SGD::new(ddp.vars(), 0.1)?;
    /// let mut acc = ddp.no_sync(2, &mut sgd)?;
    /// for _ in 0..2 {
    ///     let loss = w.sum_all()?;
    ///     acc.backward(&(loss / 2.0)?)?; // error: `Unscaled(&loss)` expected
    /// }
    /// acc.step()
    /// # })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    ///
    /// ```
    /// # use candle_core::{DType, Device, Tensor};
    /// # use candle_nn::{VarMap, SGD, Optimizer};
    /// # use nccl_safe_candle::{DistributedDataParallel, DistResult, Launcher, Unscaled};
    /// # Launcher::host(1).try_run(|rank| -> DistResult<()> {
    /// # let map = VarMap::new();
    /// # let w = map.get(4, "w", candle_nn::Init::Const(1.0), DType::F32, &Device::Cpu)?;
    /// # let ddp = DistributedDataParallel::new(rank.comm(), &map)?;
    /// # let mut sgd = SGD::new(ddp.vars(), 0.1)?;
    /// let mut acc = ddp.no_sync(2, &mut sgd)?;
    /// for _ in 0..2 {
    ///     let loss = w.sum_all()?;
    ///     acc.backward(Unscaled(&loss))?; // scaled by 1/2 here
    /// }
    /// acc.step()
    /// # })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn backward(&mut self, loss: impl MicroBatchLoss) -> DistResult<()> {
        let (at, _scope) = crate::error::caller_scope();
        let step = self.target.tracker().current();
        self.backward_inner(loss.loss())
            .map_err(|e| e.at(at, Some(step)))
    }

    fn backward_inner(&mut self, loss: &Tensor) -> DistResult<()> {
        if self.done == self.micro_batches {
            return Err(K::MicroBatchCount {
                call: "Accumulation::backward",
                rank: self.target.rank(),
                micro_batches: self.micro_batches,
                done: self.done + 1,
            }
            .into());
        }
        let scaled = loss.affine(1.0 / self.micro_batches as f64, 0.0)?;
        let grads = scaled.backward()?;
        for (i, (_, v)) in self.target.params().iter().enumerate() {
            if let Some(g) = grads.get(v.as_tensor()) {
                self.sums[i] = Some(match self.sums[i].take() {
                    Some(s) => s.add(g)?,
                    None => g.copy()?,
                });
            }
        }
        self.done += 1;
        self.target.tracker().took(self.done);
        Ok(())
    }

    /// Ends the accumulation: the summed gradients reduced over the ranks, and one
    /// optimizer step. Refused, with nothing stepped, unless
    /// [`backward`](Self::backward) took exactly the micro-batches the accumulation was
    /// opened for.
    #[track_caller]
    pub fn step(mut self) -> DistResult<()> {
        let (at, _scope) = crate::error::caller_scope();
        self.ended = true;
        let tracker = self.target.tracker();
        tracker.close();
        let step = tracker.current();
        if self.done != self.micro_batches {
            return Err(DistError::from(K::MicroBatchCount {
                call: "Accumulation::step",
                rank: self.target.rank(),
                micro_batches: self.micro_batches,
                done: self.done,
            })
            .at(at, Some(step)));
        }
        let mut grads = GradStore::default();
        for (i, (_, v)) in self.target.params().iter().enumerate() {
            if let Some(s) = self.sums[i].take() {
                grads.insert(v.as_tensor(), s);
            }
        }
        self.target.step_summed(&mut grads, at)
    }
}

impl<T: Accumulate> Drop for Accumulation<T> {
    fn drop(&mut self) {
        if !self.ended {
            self.target.tracker().abandon(self.micro_batches, self.done);
        }
    }
}

/// Optimizers whose state is a known number of copies of the parameters, so that the
/// optimizer-state memory can be reported: [`ZeroRedundancyOptimizer::optimizer_state_bytes`](crate::ZeroRedundancyOptimizer::optimizer_state_bytes)
/// and [`DdpOptimizer::optimizer_state_bytes`](crate::DdpOptimizer::optimizer_state_bytes).
pub trait OptimizerState {
    /// How many tensors of the parameters' size the optimizer keeps: AdamW 2 (its two
    /// moments), plain SGD 0, SGD with momentum 1.
    const COPIES: usize;
}

impl OptimizerState for candle_nn::SGD {
    const COPIES: usize = 0;
}

impl OptimizerState for candle_nn::AdamW {
    const COPIES: usize = 2;
}

/// A cheap sample of the parameters for [`Tracker::outside_step`]: the first element of
/// each, read in one copy (an optimizer step moves every parameter with a gradient).
pub(crate) fn sample(params: &[(String, Var)]) -> DistResult<u64> {
    let firsts = params
        .iter()
        .filter(|(_, v)| v.as_tensor().elem_count() > 0)
        .map(|(_, v)| {
            let t = v.as_tensor().flatten_all()?.narrow(0, 0, 1)?;
            t.to_dtype(DType::F64)
        })
        .collect::<candle_core::Result<Vec<Tensor>>>()?;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    if firsts.is_empty() {
        return Ok(h);
    }
    for x in Tensor::cat(&firsts, 0)?.to_vec1::<f64>()? {
        fnv(&mut h, &x.to_bits().to_le_bytes());
    }
    Ok(h)
}

/// FNV-1a, 64 bits: stable across builds and processes (unlike std's hasher).
pub(crate) fn fnv(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// A fingerprint of the parameters' bits (f16 and bf16 widened to f32, which is exact).
fn fingerprint(params: &[(String, Var)]) -> DistResult<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for (_, v) in params {
        let t = v.as_tensor().flatten_all()?;
        match t.dtype() {
            DType::F64 => t
                .to_vec1::<f64>()?
                .iter()
                .for_each(|x| fnv(&mut h, &x.to_bits().to_le_bytes())),
            DType::F32 | DType::F16 | DType::BF16 => t
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?
                .iter()
                .for_each(|x| fnv(&mut h, &x.to_bits().to_le_bytes())),
            _ => t
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?
                .iter()
                .for_each(|x| fnv(&mut h, &x.to_bits().to_le_bytes())),
        }
        fnv(&mut h, &[0xff]);
    }
    Ok(h)
}

/// The drift check: every rank's fingerprint of its parameters, all-gathered (four
/// 16-bit parts per rank, exact in f32), compared. `Ok` when all are equal; otherwise
/// [`K::Drift`] on every rank, naming the ranks outside the largest group of equal ones.
pub(crate) fn check_drift(
    comm: &Communicator,
    params: &[(String, Var)],
    tracker: &Tracker,
) -> DistResult<()> {
    let steps = tracker.completed();
    let h = fingerprint(params)?;
    let device = match params.first() {
        Some((_, v)) => v.as_tensor().device().clone(),
        None => candle_core::Device::Cpu,
    };
    let parts: Vec<f32> = (0..4).map(|i| ((h >> (16 * i)) & 0xffff) as f32).collect();
    let all = all_gather(comm, &Tensor::from_vec(parts, 4, &device)?)?.to_vec1::<f32>()?;
    let fingerprints: Vec<u64> = all
        .chunks(4)
        .map(|p| (0..4).fold(0u64, |h, i| h | ((p[i] as u64) << (16 * i))))
        .collect();
    // The largest group of equal fingerprints (ties: the group of the lowest rank).
    let mut best = fingerprints[0];
    let mut best_count = 0;
    for f in &fingerprints {
        let count = fingerprints.iter().filter(|g| *g == f).count();
        if count > best_count {
            (best, best_count) = (*f, count);
        }
    }
    let differing: Vec<usize> = (0..fingerprints.len())
        .filter(|&r| fingerprints[r] != best)
        .collect();
    let last_good_step = tracker.checked(steps, differing.is_empty());
    if differing.is_empty() {
        return Ok(());
    }
    let mut e = DistError::from(K::Drift {
        rank: comm.rank(),
        after_step: steps,
        last_good_step,
        differing,
        fingerprints,
    });
    e = e.at(Location::caller(), Some(steps));
    Err(e)
}
