//! [`ZeroRedundancyOptimizer`]: ZeRO stage 1, optimizer state sharded over the ranks.

use std::panic::Location;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use nccl_safe::{Communicator, ReduceOp};

use crate::accumulate::{
    check_drift, private::Target, Accumulate, Accumulation, OptimizerState, Tracker,
};
use crate::ddp::{broadcast_all, check_same_params, sorted_params};
use crate::error::{DistErrorKind as K, DistResult as Result};
use crate::state::{
    reshard_pieces, CarriedState, Export, FlatState, Replica, ShardableState, StateCarry,
};
use crate::tensor::shard_batch;
use crate::tensor::{all_gather, reduce_scatter};

/// ZeRO stage 1 (DeepSpeed's flat form) around any candle optimizer `O`.
///
/// The parameters (sorted by name, checked alike on every rank and taken from rank 0, as
/// in [`DistributedDataParallel`](crate::DistributedDataParallel)) are seen as one flat
/// vector, padded to a multiple of the number of ranks N. Rank `r` owns its `r`-th part and
/// builds `O` over that part alone, as one variable: the optimizer's state (momentum,
/// Adam's moments) is about 1/N of what [`DistributedDataParallel`] with `O` keeps.
/// Elementwise optimizers (SGD, AdamW, ...) compute the same update on a part as on the
/// whole.
///
/// A [`step`](Self::step) packs the gradients into a fresh flat buffer (missing ones as
/// zeros), reduce-scatters it with NCCL's average, steps `O` on this rank's part, and
/// all-gathers the parts back into every parameter. All parameters must share one
/// element type. It has the same shape as [`DdpOptimizer`](crate::DdpOptimizer):
/// [`shard_batch`](Self::shard_batch), [`no_sync`](Self::no_sync) (an [`Accumulation`]),
/// [`check_drift`](Self::check_drift), and `candle_nn::Optimizer` (so that
/// `opt.backward_step(&loss)` is the data-parallel step). On CUDA all of it runs on candle's stream: each step needs the previous
/// one's result, so a communication stream of its own would add events without overlap.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{linear, loss, Module, VarBuilder, VarMap, SGD};
/// use nccl_safe_candle::{DistResult, Launcher, ZeroRedundancyOptimizer};
///
/// let shards = Launcher::host(2).try_run(|rank| -> DistResult<usize> {
///     let map = VarMap::new();
///     let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
///     let mut opt = ZeroRedundancyOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?;
///     let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
///     let y = Tensor::zeros((2, 1), DType::F32, &Device::Cpu)?;
///     opt.backward_step(&loss::mse(&model.forward(&x)?, &y)?)?;
///     Ok(opt.param_shard().as_tensor().elem_count())
/// })?;
/// assert_eq!(shards, vec![3, 3]); // 5 parameters' elements over 2 ranks, padded to 6
/// # Ok::<(), nccl_launch::Error>(())
/// ```
///
/// [`DistributedDataParallel`]: crate::DistributedDataParallel
pub struct ZeroRedundancyOptimizer<'c, O> {
    comm: &'c Communicator,
    params: Vec<(String, Var)>,
    /// The flat length, before padding.
    total: usize,
    /// This rank's part of the flat parameters: what `opt` updates.
    shard: Var,
    opt: O,
    tracker: Tracker,
    /// Set by [`resume`](Self::resume): exports `opt`'s state before each step into
    /// `before`.
    exporter: Option<Export<O>>,
    /// The state from before the last step `opt` took.
    before: Option<FlatState>,
    /// Whether that step failed after `opt` stepped (its exchange or all-gather failed).
    failed: bool,
    /// Set by [`resume`](Self::resume): where the state goes when this is dropped.
    carry: Option<&'c StateCarry>,
    /// Set by [`resume`](Self::resume) with [`StateCarry::with_replica`] on two ranks or
    /// more: the copy of the next rank's optimizer state (its whole part, padding
    /// included), the last one received.
    replica: Option<FlatState>,
    /// The copy received before that one.
    replica_before: Option<FlatState>,
}

impl<O> std::fmt::Debug for ZeroRedundancyOptimizer<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroRedundancyOptimizer")
            .field("rank", &self.comm.rank())
            .field("params", &self.params.len())
            .field("elements", &self.total)
            .field("shard", &self.shard.as_tensor().elem_count())
            .finish()
    }
}

fn flat(parts: &[Tensor]) -> Result<Tensor> {
    // A fresh buffer: `cat` of one tensor would share its storage.
    Ok(if parts.len() == 1 {
        parts[0].copy()?
    } else {
        Tensor::cat(parts, 0)?
    })
}

impl<'c, O: Optimizer> ZeroRedundancyOptimizer<'c, O> {
    /// Over a `VarMap`'s parameters, with `O`'s configuration (`SGD`'s learning rate,
    /// `AdamW`'s `ParamsAdamW`, ...).
    #[track_caller]
    pub fn new(comm: &'c Communicator, map: &VarMap, config: O::Config) -> Result<Self> {
        Self::from_named(comm, sorted_params(map), config)
    }

    /// For named variables held elsewhere than a `VarMap`; they are sorted by name.
    #[track_caller]
    pub fn from_named(
        comm: &'c Communicator,
        params: Vec<(String, Var)>,
        config: O::Config,
    ) -> Result<Self> {
        let (at, _scope) = crate::error::caller_scope();
        Self::from_named_inner(comm, params, config).map_err(|e| e.at(at, None))
    }

    fn from_named_inner(
        comm: &'c Communicator,
        mut params: Vec<(String, Var)>,
        config: O::Config,
    ) -> Result<Self> {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let Some((_, first)) = params.first() else {
            return Err(K::InvalidArgument {
                call: "ZeroRedundancyOptimizer",
                reason: "no parameters".into(),
            }
            .into());
        };
        let dtype = first.as_tensor().dtype();
        if let Some((name, v)) = params.iter().find(|(_, v)| v.as_tensor().dtype() != dtype) {
            return Err(K::InvalidArgument {
                call: "ZeroRedundancyOptimizer",
                reason: format!(
                    "all parameters must share one dtype: {name} is {:?}, others {dtype:?}",
                    v.as_tensor().dtype()
                ),
            }
            .into());
        }
        check_same_params(comm, &params)?;
        broadcast_all(comm, &params)?;
        let world = comm.world_size();
        let total: usize = params.iter().map(|(_, v)| v.as_tensor().elem_count()).sum();
        let part = total.div_ceil(world);
        let parts = params
            .iter()
            .map(|(_, v)| v.as_tensor().flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let all = flat(&parts)?;
        // This rank's part, the padding beyond `total` as zeros.
        let start = (comm.rank() * part).min(total);
        let end = ((comm.rank() + 1) * part).min(total);
        let mut mine = vec![all.narrow(0, start, end - start)?];
        if end - start < part {
            mine.push(Tensor::zeros(part - (end - start), dtype, all.device())?);
        }
        let shard = Var::from_tensor(&flat(&mine)?)?;
        let opt = O::new(vec![shard.clone()], config)?;
        Ok(ZeroRedundancyOptimizer {
            comm,
            params,
            total,
            shard,
            opt,
            tracker: Tracker::default(),
            exporter: None,
            before: None,
            carry: None,
            replica: None,
            replica_before: None,
            failed: false,
        })
    }

    /// The wrapped optimizer (over this rank's part only). There is no `&mut` access to
    /// it: a step of its own would skip the reduction and the gather; change its learning
    /// rate through `candle_nn::Optimizer::set_learning_rate` on this type.
    pub fn optimizer(&self) -> &O {
        &self.opt
    }

    /// This rank's part of the flat parameters (what the optimizer updates).
    pub fn param_shard(&self) -> &Var {
        &self.shard
    }

    /// The old name of [`param_shard`](Self::param_shard): the parameters' shard, not
    /// the batch's ([`shard_batch`](Self::shard_batch)).
    #[deprecated(
        note = "renamed param_shard; the batch's part is shard_batch, as on DistributedDataParallel"
    )]
    pub fn shard(&self) -> &Var {
        &self.shard
    }

    /// This rank's equal part of a batch ([`shard_batch`](crate::shard_batch), the same
    /// helper as [`DistributedDataParallel::shard_batch`](crate::DistributedDataParallel::shard_batch)).
    #[track_caller]
    pub fn shard_batch(&self, batch: &Tensor) -> Result<Tensor> {
        shard_batch(self.comm, batch)
    }

    /// The parameters, sorted by name.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Communicator {
        self.comm
    }

    /// Steps completed.
    pub fn steps(&self) -> u64 {
        self.tracker.completed()
    }

    /// Runs [`check_drift`](Self::check_drift) after every `every` steps (0: never, the
    /// default), as [`DistributedDataParallel::with_drift_check`](crate::DistributedDataParallel::with_drift_check).
    pub fn with_drift_check(self, every: u64) -> Self {
        self.tracker.set_drift_every(every);
        self
    }

    /// Checks that every rank holds bit-identical parameters, as
    /// [`DistributedDataParallel::check_drift`](crate::DistributedDataParallel::check_drift).
    #[track_caller]
    pub fn check_drift(&self) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        check_drift(self.comm, &self.params, &self.tracker).map_err(|e| e.at(at, None))
    }

    /// Gradient accumulation over `micro_batches` micro-batches, one reduce-scatter and one
    /// step at the end; see [`Accumulation`]. **Each micro-batch's loss is scaled by
    /// `1 / micro_batches`** by the guard's `backward`.
    #[track_caller]
    #[doc(alias = "accumulate")]
    pub fn no_sync(&mut self, micro_batches: usize) -> Result<Accumulation<&mut Self>> {
        Accumulation::open(self, micro_batches)
    }

    /// The gradients averaged over the ranks (only this rank's part reduced), this rank's
    /// part updated, and every parameter set from the gathered parts: one step. Refused
    /// after an accumulation dropped without its step.
    #[track_caller]
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        let step = self.tracker.current();
        self.tracker
            .may_step("ZeroRedundancyOptimizer::step", self.comm.rank())
            .map_err(Into::into)
            .and_then(|()| self.step_inner(grads))
            .map_err(|e| e.at(at, Some(step)))
    }

    fn step_inner(&mut self, grads: &GradStore) -> Result<()> {
        self.apply(grads)?;
        if self.tracker.stepped().is_some() {
            check_drift(self.comm, &self.params, &self.tracker)?;
        }
        Ok(())
    }

    fn apply(&mut self, grads: &GradStore) -> Result<()> {
        let world = self.comm.world_size();
        let part = self.shard.as_tensor().elem_count();
        let dtype = self.shard.as_tensor().dtype();
        let device = self.shard.as_tensor().device().clone();
        let mut parts = Vec::with_capacity(self.params.len() + 1);
        for (name, v) in &self.params {
            let t = v.as_tensor();
            let g = match grads.get(t) {
                Some(g) if g.dims() == t.dims() && g.dtype() == dtype => g.flatten_all()?,
                Some(g) => {
                    return Err(K::Shape {
                        call: "ZeroRedundancyOptimizer::step",
                        reason: format!(
                            "the gradient of {name} is {:?} {:?}, the parameter {:?} {dtype:?}",
                            g.dims(),
                            g.dtype(),
                            t.dims()
                        ),
                    }
                    .into())
                }
                None => Tensor::zeros(t.elem_count(), dtype, &device)?,
            };
            parts.push(g);
        }
        if part * world > self.total {
            parts.push(Tensor::zeros(part * world - self.total, dtype, &device)?);
        }
        let g = reduce_scatter(self.comm, &flat(&parts)?, ReduceOp::Avg)?;
        let mut mine = GradStore::default();
        mine.insert(self.shard.as_tensor(), g);
        if let Some(export) = self.exporter {
            self.before = Some(export(&self.opt)?);
        }
        self.opt.step(&mine)?;
        self.failed = true;
        if let (Some(export), Some(_)) = (self.exporter, &self.replica) {
            let received = self.exchange(export)?;
            self.replica_before = self.replica.replace(received);
        }
        let all = all_gather(self.comm, self.shard.as_tensor())?;
        // `before` and `replica_before` stay: a peer's all-gather of this step may have
        // failed (its wait for NCCL's launch of it ended by the clique's abort) while this
        // one's completed, and the survivors then resume from that peer's count.
        self.failed = false;
        let mut offset = 0;
        for (_, v) in &self.params {
            let len = v.as_tensor().elem_count();
            v.set(&all.narrow(0, offset, len)?.reshape(v.as_tensor().shape())?)?;
            offset += len;
        }
        Ok(())
    }

    /// This rank's new optimizer state to the rank before it (which keeps the copy), the
    /// next rank's from it: one sum reduce-scatter over `world_size` slots of the state's
    /// length, this rank's state in slot `rank - 1` and zeros elsewhere, so that slot `r`,
    /// which rank `r` receives, is rank `r + 1`'s state exactly (adding zeros is exact). A
    /// collective rather than a send and a receive: a rank lost meanwhile fails it as it
    /// fails the step's other collectives (nccl-safe's departure checks and the watchdog
    /// follow collectives; a point-to-point wait on a departed peer lasted until the host
    /// provider's own timeout). Run after the optimizer's step and before the all-gather,
    /// so that a step either completes with the copies refreshed or leaves both versions to
    /// carry (see `resume`). Its buffer is as long as the flat parameters times the
    /// state's copies (AdamW: 2), for the call only.
    fn exchange(&self, export: Export<O>) -> Result<FlatState> {
        let (world, rank) = (self.comm.world_size(), self.comm.rank());
        let s = export(&self.opt)?;
        let lens: Vec<usize> = s.tensors.iter().map(|t| t.elem_count()).collect();
        let len: usize = lens.iter().sum();
        if len == 0 {
            return Ok(s);
        }
        let t0 = &s.tensors[0];
        let to = (rank + world - 1) % world;
        let mut parts = Vec::with_capacity(s.tensors.len() + 2);
        if to > 0 {
            parts.push(Tensor::zeros(to * len, t0.dtype(), t0.device())?);
        }
        for t in &s.tensors {
            parts.push(t.flatten_all()?);
        }
        if to + 1 < world {
            parts.push(Tensor::zeros(
                (world - 1 - to) * len,
                t0.dtype(),
                t0.device(),
            )?);
        }
        let got = reduce_scatter(self.comm, &flat(&parts)?, ReduceOp::Sum)?;
        let mut tensors = Vec::with_capacity(lens.len());
        let mut at = 0;
        for n in lens {
            tensors.push(got.narrow(0, at, n)?);
            at += n;
        }
        Ok(FlatState {
            step: s.step,
            tensors,
        })
    }

    /// `loss.backward()`, then [`step`](Self::step): a drop-in for `opt.backward_step`.
    #[track_caller]
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        let step = self.tracker.current();
        let grads = loss
            .backward()
            .map_err(|e| crate::DistError::from(e).at(at, Some(step)))?;
        self.step(&grads)
    }

    /// The bytes of this rank's part of the flat parameters (the optimizer's per-element
    /// state covers these only). Not the optimizer state: see
    /// [`optimizer_state_bytes`](Self::optimizer_state_bytes).
    pub fn param_shard_bytes(&self) -> usize {
        self.shard.as_tensor().elem_count() * self.shard.as_tensor().dtype().size_in_bytes()
    }

    /// The old name of [`param_shard_bytes`](Self::param_shard_bytes), which counts the
    /// parameters' shard, not the optimizer's state.
    #[deprecated(
        note = "counts parameters: renamed param_shard_bytes; optimizer_state_bytes counts the state"
    )]
    pub fn shard_bytes(&self) -> usize {
        self.param_shard_bytes()
    }

    /// The bytes of optimizer state this rank keeps: `O::COPIES` times its parameter
    /// shard (AdamW's two moments: 2x [`param_shard_bytes`](Self::param_shard_bytes), about
    /// 2/N of the parameters' bytes).
    pub fn optimizer_state_bytes(&self) -> usize
    where
        O: OptimizerState,
    {
        O::COPIES * self.param_shard_bytes()
    }

    /// The bytes of the copy this rank keeps of the next rank's optimizer state
    /// ([`StateCarry::with_replica`]; 0 without it): as many as its own state (AdamW: 2x
    /// [`param_shard_bytes`](Self::param_shard_bytes)). During a step, until its
    /// all-gather succeeds, the copy received in it is held too (twice this).
    pub fn state_replica_bytes(&self) -> usize {
        self.replica.as_ref().map_or(0, |r| {
            r.tensors
                .iter()
                .map(|t| t.elem_count() * t.dtype().size_in_bytes())
                .sum()
        })
    }
}

/// `resume` and `into_state` need an optimizer whose state can be exported
/// ([`ShardableState`]): not candle_nn's `AdamW` (its moments are private), whose drop-in
/// is [`state::AdamW`](crate::state::AdamW); the bound sits on each method, so that the
/// compiler's error names it.
impl<'c, O: Optimizer> ZeroRedundancyOptimizer<'c, O> {
    /// [`new`](Self::new), then the optimizer state left in `carry` by the previous
    /// optimizer of this rank (dropped when its session ended or a step failed), re-sharded
    /// over `comm`; the state goes back to `carry` when this one is dropped. Collective:
    /// every rank of `comm` calls it, with its carry empty or not.
    ///
    /// Each rank contributes the state of the range of the flat parameters it held, and one
    /// all-reduce per state tensor (AdamW: 2) of the flat length gives each rank the state
    /// of its new range: O(parameters) memory, once per recovery.
    ///
    /// **No state is lost with one rank lost at a time**: with the replica (on by default,
    /// [`StateCarry::with_replica`]) each rank keeps a copy of the next rank's (`rank + 1`
    /// modulo the world) state, received after every step's optimizer update and before
    /// its all-gather, so the rank before a lost one carries the lost rank's range and the
    /// survivors rebuild it bit for bit: training goes on as if nothing had been lost
    /// (`tests/elastic_state.rs` ends within 1e-5 of a run that lost nothing, the same
    /// batches). What no rank carries (two neighbouring ranks lost at once, or
    /// `with_replica(false)`) is zero: there, AdamW's moments start again from zero, with
    /// the step count (bias correction) of the others. A new rank (after
    /// [`grow`](crate::grow)) comes with an empty carry and receives its part (and its copy
    /// of the next rank's). The step count is rank 0's. A state from before a step that
    /// failed after this rank's optimizer had stepped (the exchange or the all-gather
    /// failed) is the one carried, as the parameters are those from before that step: so
    /// each step of a resumed optimizer keeps the state from before it (for this crate's
    /// AdamW, the previous moments, no copy) until its all-gather succeeds, and the copy
    /// likewise.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{linear, loss, Module, ParamsAdamW, VarBuilder, VarMap};
    /// use nccl_safe_candle::{state::AdamW, DistResult, Launcher, StateCarry, ZeroRedundancyOptimizer};
    ///
    /// Launcher::host(2).try_run(|rank| -> DistResult<()> {
    ///     let map = VarMap::new();
    ///     let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
    ///     let (x, y) = (Tensor::ones((2, 4), DType::F32, &Device::Cpu)?, Tensor::zeros((2, 1), DType::F32, &Device::Cpu)?);
    ///     let carry = StateCarry::new();
    ///     for _session in 0..2 {
    ///         let mut opt = ZeroRedundancyOptimizer::<AdamW>::resume(rank.comm(), &map, ParamsAdamW::default(), &carry)?;
    ///         opt.backward_step(&loss::mse(&model.forward(&x)?, &y)?)?;
    ///         assert_eq!(opt.state_replica_bytes(), opt.optimizer_state_bytes());
    ///     } // dropped: its state to `carry`, for the next
    ///     let carried = carry.take().unwrap();
    ///     assert_eq!(carried.state().step, 2);
    ///     assert!(carried.replica_range().is_some()); // the next rank's, copied
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    ///
    /// candle_nn's own `AdamW` keeps its moments private, so it cannot carry them; the
    /// error names the drop-in, [`state::AdamW`](crate::state::AdamW):
    ///
    /// ```compile_fail,E0277
    /// # use candle_nn::{ParamsAdamW, VarMap};
    /// # use nccl_safe_candle::{Communicator, DistResult, StateCarry, ZeroRedundancyOptimizer};
    /// # fn f(comm: &Communicator, map: &VarMap, carry: &StateCarry) -> DistResult<()> {
    /// let opt = ZeroRedundancyOptimizer::<candle_nn::AdamW>::resume(comm, map, ParamsAdamW::default(), carry)?;
    /// # Ok(()) }
    /// ```
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
            let mut z = Self::from_named_inner(comm, sorted_params(map), config)?;
            let part = z.shard.as_tensor().elem_count();
            let copies = z.opt.export_state()?.tensors.len();
            let (world, rank) = (comm.world_size(), comm.rank());
            // One rank has no other to keep its copy.
            let replica = carry.replica() && world > 1;
            let next = (rank + 1) % world;
            let t = z.shard.as_tensor();
            let mut states = reshard_pieces(
                comm,
                carry.take(),
                z.total,
                t.dtype(),
                copies,
                &[
                    rank * part..(rank + 1) * part,
                    next * part..(next + 1) * part,
                ],
                carry.replica(),
                t.device(),
            )?;
            let theirs = states.pop();
            z.opt.import_state(states.remove(0))?;
            z.exporter = Some(O::export_state);
            z.carry = Some(carry);
            z.replica = if replica { theirs } else { None };
            Ok(z)
        })()
        .map_err(|e: crate::DistError| e.at(at, None))
    }

    /// This rank's optimizer state and the range of the flat parameters it covers (its part,
    /// without the padding), and with the replica the copy of the next rank's, for
    /// [`resume`](Self::resume) on another communicator (put it in a [`StateCarry`]).
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

/// This rank's state (`export` of its optimizer) cut to its range of the flat parameters,
/// and its copy of the next rank's cut to that rank's range.
fn carried_with<O>(z: &ZeroRedundancyOptimizer<'_, O>, export: Export<O>) -> Result<CarriedState> {
    let part = z.shard.as_tensor().elem_count();
    let world = z.comm.world_size();
    let range = |rank: usize| {
        let start = (rank * part).min(z.total);
        start..((rank + 1) * part).min(z.total)
    };
    let cut = |s: FlatState, len: usize| -> Result<FlatState> {
        Ok(FlatState {
            step: s.step,
            tensors: s
                .tensors
                .iter()
                .map(|t| t.narrow(0, 0, len))
                .collect::<candle_core::Result<_>>()?,
        })
    };
    let mine = range(z.comm.rank());
    let mut c = CarriedState::new(
        mine.start,
        z.total,
        z.shard.as_tensor().dtype(),
        cut(export(&z.opt)?, mine.len())?,
    )?;
    c.before = z.before.clone().map(|b| cut(b, mine.len())).transpose()?;
    c.failed = z.failed;
    if let Some(last) = &z.replica {
        // Both versions, as for this rank's own state: the re-shard takes the one at the
        // agreed step.
        let theirs = range((z.comm.rank() + 1) % world);
        c.replica = Some(Replica {
            start: theirs.start,
            now: cut(last.clone(), theirs.len())?,
            before: z
                .replica_before
                .clone()
                .map(|b| cut(b, theirs.len()))
                .transpose()?,
        });
    }
    Ok(c)
}

/// A [`resume`](ZeroRedundancyOptimizer::resume)d optimizer leaves its state in its carry.
impl<O> Drop for ZeroRedundancyOptimizer<'_, O> {
    fn drop(&mut self) {
        if let (Some(carry), Some(export)) = (self.carry.take(), self.exporter) {
            if let Ok(c) = carried_with(self, export) {
                carry.put(c);
            }
        }
    }
}

impl<O: Optimizer> Target for &mut ZeroRedundancyOptimizer<'_, O> {
    fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn step_summed(&mut self, grads: &mut GradStore, at: &'static Location<'static>) -> Result<()> {
        let step = self.tracker.current();
        self.step_inner(grads).map_err(|e| e.at(at, Some(step)))
    }
}

impl<O: Optimizer> Accumulate for &mut ZeroRedundancyOptimizer<'_, O> {}

/// The data-parallel step as a candle optimizer: `opt.backward_step(&loss)` and code
/// generic over `Optimizer` work unchanged. `Optimizer::new` is refused: it gets unnamed
/// variables, whose order (a `VarMap`'s) differs from rank to rank; build it with
/// [`ZeroRedundancyOptimizer::new`] (a communicator and a `VarMap`).
impl<O: Optimizer> Optimizer for ZeroRedundancyOptimizer<'_, O> {
    type Config = O::Config;

    fn new(_: Vec<Var>, _: O::Config) -> candle_core::Result<Self> {
        Err(candle_core::Error::Msg(
            "ZeroRedundancyOptimizer needs a communicator and named parameters: build it with \
             ZeroRedundancyOptimizer::new(comm, &varmap, config)"
                .into(),
        ))
    }

    #[track_caller]
    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        Ok(ZeroRedundancyOptimizer::step(self, grads)?)
    }

    #[track_caller]
    fn backward_step(&mut self, loss: &Tensor) -> candle_core::Result<()> {
        Ok(ZeroRedundancyOptimizer::backward_step(self, loss)?)
    }

    fn learning_rate(&self) -> f64 {
        self.opt.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.opt.set_learning_rate(lr)
    }
}
