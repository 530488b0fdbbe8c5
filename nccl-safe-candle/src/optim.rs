//! [`DdpOptimizer`]: a [`DistributedDataParallel`] that holds its optimizer, as a candle
//! optimizer.

use std::panic::Location;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use nccl_safe::{Communicator, ReduceOp};

use crate::accumulate::{private::Target, Accumulate, Accumulation, OptimizerState, Tracker};
use crate::ddp::{DistributedDataParallel, DEFAULT_BUCKET_CAP};
use crate::error::{DistError, DistErrorKind as K, DistResult as Result};
use crate::state::{reshard, CarriedState, Export, ShardableState, StateCarry};

/// Data-parallel training with the optimizer inside: [`DistributedDataParallel`] (rank
/// 0's parameters, checked alike on every rank; gradients averaged in buckets) and the
/// candle optimizer `O` built over its parameters, as one `candle_nn::Optimizer`.
///
/// Because the only optimizer you hold is this one, its `backward_step(&loss)` is the
/// data-parallel step, and a plain local step cannot happen by mistake (with a
/// [`DistributedDataParallel`] and an optimizer of your own, `opt.backward_step(&loss)`
/// instead of `ddp.backward_step(&mut opt, &loss)` steps on local gradients and the ranks
/// drift apart). It has the same shape as
/// [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer):
/// [`shard_batch`](Self::shard_batch), [`no_sync`](Self::no_sync),
/// [`check_drift`](Self::check_drift), [`optimizer_state_bytes`](Self::optimizer_state_bytes).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{linear, loss, Module, Optimizer, VarBuilder, VarMap, SGD};
/// use nccl_safe_candle::{DdpOptimizer, DistResult, Launcher, Unscaled};
///
/// Launcher::host(2).try_run(|rank| -> DistResult<()> {
///     let map = VarMap::new();
///     let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
///     let mut opt = DdpOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?.with_drift_check(5);
///     let x = opt.shard_batch(&Tensor::ones((8, 4), DType::F32, &Device::Cpu)?)?;
///     let y = Tensor::zeros((x.dim(0)?, 1), DType::F32, &Device::Cpu)?;
///     for _ in 0..10 {
///         opt.backward_step(&loss::mse(&model.forward(&x)?, &y)?)?;
///     }
///     // Accumulation: the guard takes each micro-batch's backward (scaled by 1/2).
///     let mut acc = opt.no_sync(2)?;
///     for half in [x.narrow(0, 0, 2)?, x.narrow(0, 2, 2)?] {
///         let y = Tensor::zeros((2, 1), DType::F32, &Device::Cpu)?;
///         acc.backward(Unscaled(&loss::mse(&model.forward(&half)?, &y)?))?;
///     }
///     acc.step()
/// })?;
/// # Ok::<(), nccl_launch::Error>(())
/// ```
pub struct DdpOptimizer<'c, O> {
    ddp: DistributedDataParallel<'c>,
    opt: O,
    /// Set by [`resume`](Self::resume): where the state goes when this is dropped, and
    /// how to export it.
    carry: Option<(&'c StateCarry, Export<O>)>,
}

impl<O> std::fmt::Debug for DdpOptimizer<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpOptimizer")
            .field("ddp", &self.ddp)
            .finish()
    }
}

impl<'c, O: Optimizer> DdpOptimizer<'c, O> {
    /// Over a `VarMap`'s parameters with [`DEFAULT_BUCKET_CAP`], with `O`'s configuration
    /// (`SGD`'s learning rate, `AdamW`'s `ParamsAdamW`, ...).
    #[track_caller]
    pub fn new(comm: &'c Communicator, map: &VarMap, config: O::Config) -> Result<Self> {
        Self::with_bucket_cap(comm, map, DEFAULT_BUCKET_CAP, config)
    }

    /// With buckets of up to `cap_bytes`.
    #[track_caller]
    pub fn with_bucket_cap(
        comm: &'c Communicator,
        map: &VarMap,
        cap_bytes: usize,
        config: O::Config,
    ) -> Result<Self> {
        Self::from_ddp(
            DistributedDataParallel::with_bucket_cap(comm, map, cap_bytes)?,
            config,
        )
    }

    /// Around a [`DistributedDataParallel`] (built with
    /// [`from_named`](DistributedDataParallel::from_named), say): `O` over its parameters.
    #[track_caller]
    pub fn from_ddp(ddp: DistributedDataParallel<'c>, config: O::Config) -> Result<Self> {
        let (at, _scope) = crate::error::caller_scope();
        let opt = O::new(ddp.vars(), config).map_err(|e| DistError::from(e).at(at, None))?;
        Ok(DdpOptimizer {
            ddp,
            opt,
            carry: None,
        })
    }

    /// The [`DistributedDataParallel`] inside (its parameters, bucket plans, comm).
    pub fn ddp(&self) -> &DistributedDataParallel<'c> {
        &self.ddp
    }

    /// The wrapped optimizer. There is no `&mut` access to it: a step of its own would
    /// skip the reduction; change its learning rate through
    /// `candle_nn::Optimizer::set_learning_rate` on this type.
    pub fn optimizer(&self) -> &O {
        &self.opt
    }

    /// This rank's equal part of a batch ([`shard_batch`](crate::shard_batch)).
    #[track_caller]
    pub fn shard_batch(&self, batch: &Tensor) -> Result<Tensor> {
        self.ddp.shard_batch(batch)
    }

    /// Steps completed.
    pub fn steps(&self) -> u64 {
        self.ddp.steps()
    }

    /// Runs the drift check after every `every` steps (0: never, the default); see
    /// [`DistributedDataParallel::with_drift_check`].
    pub fn with_drift_check(self, every: u64) -> Self {
        self.ddp.tracker().set_drift_every(every);
        self
    }

    /// See [`DistributedDataParallel::check_drift`].
    #[track_caller]
    pub fn check_drift(&self) -> Result<()> {
        self.ddp.check_drift()
    }

    /// Gradient accumulation over `micro_batches` micro-batches, one reduction and one
    /// step at the end; see [`Accumulation`]. **Each micro-batch's loss is scaled by
    /// `1 / micro_batches`** by the guard's `backward`.
    #[track_caller]
    #[doc(alias = "accumulate")]
    pub fn no_sync(&mut self, micro_batches: usize) -> Result<Accumulation<&mut Self>> {
        Accumulation::open(self, micro_batches)
    }

    /// The gradients averaged over the ranks, then `O`'s step: one step. Refused after
    /// an accumulation dropped without its step.
    #[track_caller]
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        let step = self.ddp.tracker().current();
        self.step_inner(grads).map_err(|e| e.at(at, Some(step)))
    }

    fn step_inner(&mut self, grads: &GradStore) -> Result<()> {
        let tracker = self.ddp.tracker();
        tracker.may_step("DdpOptimizer::step", self.ddp.comm().rank())?;
        // The reduction hands back views of its own buffers: a store of our own, so the
        // caller's is left as it was.
        let mut mine = GradStore::default();
        for (_, v) in self.ddp.params() {
            if let Some(g) = grads.get(v.as_tensor()) {
                mine.insert(v.as_tensor(), g.clone());
            }
        }
        let opt = &mut self.opt;
        self.ddp.step_with(&mut mine, |g| opt.step(g))
    }

    /// `loss.backward()`, then [`step`](Self::step).
    #[track_caller]
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        let step = self.ddp.tracker().current();
        let grads = loss
            .backward()
            .map_err(|e| DistError::from(e).at(at, Some(step)))?;
        self.step(&grads)
    }

    /// A one-element tensor (a loss) reduced over the ranks as `f64`, for logging.
    #[track_caller]
    pub fn all_reduce_scalar(&self, t: &Tensor, op: ReduceOp) -> Result<f64> {
        self.ddp.all_reduce_scalar(t, op)
    }

    /// The bytes of optimizer state this rank keeps: `O::COPIES` times the parameters'
    /// bytes (AdamW: 2x), the same on every rank.
    pub fn optimizer_state_bytes(&self) -> usize
    where
        O: OptimizerState,
    {
        let params: usize = self
            .ddp
            .params()
            .iter()
            .map(|(_, v)| v.as_tensor().elem_count() * v.as_tensor().dtype().size_in_bytes())
            .sum();
        O::COPIES * params
    }
}

/// The bound [`ShardableState`] sits on each method, so that the compiler's error for
/// candle_nn's `AdamW` names its drop-in, [`state::AdamW`](crate::state::AdamW).
impl<'c, O: Optimizer> DdpOptimizer<'c, O> {
    /// [`new`](Self::new), then the optimizer state left in `carry` by the previous
    /// optimizer of this rank (dropped when its session ended or a step failed), taken from
    /// rank 0 (each rank holds the whole state, so a lost rank loses none of it; a new rank,
    /// with an empty carry, receives it); the state goes back to `carry` when this one is
    /// dropped. Collective: every rank of `comm` calls it, with its carry empty or not. All
    /// parameters must share one element type; the buckets are [`DEFAULT_BUCKET_CAP`]. See
    /// [`ZeroRedundancyOptimizer::resume`](crate::ZeroRedundancyOptimizer::resume).
    #[track_caller]
    pub fn resume(
        comm: &'c Communicator,
        map: &VarMap,
        config: O::Config,
        carry: &'c StateCarry,
    ) -> Result<Self>
    where
        O: ShardableState,
    {
        let (at, _scope) = crate::error::caller_scope();
        (|| {
            let mut d = Self::from_ddp(DistributedDataParallel::new(comm, map)?, config)?;
            let (total, dtype, device) = d.flat_shape()?;
            let copies = d.opt.export_state()?.tensors.len();
            let state = reshard(comm, carry.take(), total, dtype, copies, 0..total, &device)?;
            d.opt.import_state(state)?;
            d.carry = Some((carry, O::export_state));
            Ok(d)
        })()
        .map_err(|e: DistError| e.at(at, None))
    }

    /// The whole optimizer state (every rank holds it), for
    /// [`resume`](Self::resume) or [`ZeroRedundancyOptimizer::resume`](crate::ZeroRedundancyOptimizer::resume)
    /// on another communicator (put it in a [`StateCarry`]).
    #[track_caller]
    pub fn into_state(mut self) -> Result<CarriedState>
    where
        O: ShardableState,
    {
        let (at, _scope) = crate::error::caller_scope();
        self.carry = None;
        carried_with(&self, O::export_state).map_err(|e| e.at(at, None))
    }
}

impl<O> DdpOptimizer<'_, O> {
    /// The flat parameters' length, element type and device.
    fn flat_shape(&self) -> Result<(usize, candle_core::DType, candle_core::Device)> {
        let params = self.ddp.params();
        let first = params[0].1.as_tensor();
        if let Some((name, v)) = params.iter().find(|(_, v)| v.dtype() != first.dtype()) {
            return Err(K::InvalidArgument {
                call: "DdpOptimizer::resume",
                reason: format!(
                    "its state is carried for parameters of one dtype: {name} is {:?}, others {:?}",
                    v.dtype(),
                    first.dtype()
                ),
            }
            .into());
        }
        let total = params.iter().map(|(_, v)| v.elem_count()).sum();
        Ok((total, first.dtype(), first.device().clone()))
    }
}

/// The whole state (`export` of its optimizer), over the whole flat vector.
fn carried_with<O>(d: &DdpOptimizer<'_, O>, export: Export<O>) -> Result<CarriedState> {
    let (total, dtype, _) = d.flat_shape()?;
    CarriedState::new(0, total, dtype, export(&d.opt)?)
}

/// A [`resume`](DdpOptimizer::resume)d optimizer leaves its state in its carry.
impl<O> Drop for DdpOptimizer<'_, O> {
    fn drop(&mut self) {
        if let Some((carry, export)) = self.carry.take() {
            if let Ok(c) = carried_with(self, export) {
                carry.put(c);
            }
        }
    }
}

impl<O: Optimizer> Target for &mut DdpOptimizer<'_, O> {
    fn params(&self) -> &[(String, Var)] {
        self.ddp.params()
    }

    fn tracker(&self) -> &Tracker {
        self.ddp.tracker()
    }

    fn rank(&self) -> usize {
        self.ddp.comm().rank()
    }

    fn step_summed(&mut self, grads: &mut GradStore, at: &'static Location<'static>) -> Result<()> {
        let step = self.ddp.tracker().current();
        let opt = &mut self.opt;
        self.ddp
            .step_with(grads, |g| opt.step(g))
            .map_err(|e| e.at(at, Some(step)))
    }
}

impl<O: Optimizer> Accumulate for &mut DdpOptimizer<'_, O> {}

/// The data-parallel step as a candle optimizer. `Optimizer::new` is refused: it gets
/// unnamed variables, whose order (a `VarMap`'s) differs from rank to rank; build it with
/// [`DdpOptimizer::new`] (a communicator and a `VarMap`).
impl<O: Optimizer> Optimizer for DdpOptimizer<'_, O> {
    type Config = O::Config;

    fn new(_: Vec<Var>, _: O::Config) -> candle_core::Result<Self> {
        Err(candle_core::Error::Msg(
            "DdpOptimizer needs a communicator and named parameters: build it with \
             DdpOptimizer::new(comm, &varmap, config)"
                .into(),
        ))
    }

    #[track_caller]
    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        Ok(DdpOptimizer::step(self, grads)?)
    }

    #[track_caller]
    fn backward_step(&mut self, loss: &Tensor) -> candle_core::Result<()> {
        Ok(DdpOptimizer::backward_step(self, loss)?)
    }

    fn learning_rate(&self) -> f64 {
        self.opt.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.opt.set_learning_rate(lr)
    }
}
