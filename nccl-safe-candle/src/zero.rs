//! [`ZeroRedundancyOptimizer`]: ZeRO stage 1, optimizer state sharded over the ranks.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use nccl_safe::{Communicator, ReduceOp};

use crate::ddp::{broadcast_all, check_same_params, sorted_params};
use crate::tensor::{all_gather, reduce_scatter};
use crate::{Error, Result};

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
/// element type. On CUDA all of it runs on candle's stream: each step needs the previous
/// one's result, so a communication stream of its own would add events without overlap.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{linear, loss, Module, VarBuilder, VarMap, SGD};
/// use nccl_safe::launch::Launcher;
/// use nccl_safe_candle::ZeroRedundancyOptimizer;
///
/// let shards = Launcher::host(2).try_run(|rank| -> nccl_safe_candle::Result<usize> {
///     let map = VarMap::new();
///     let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
///     let mut opt = ZeroRedundancyOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?;
///     let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
///     let y = Tensor::zeros((2, 1), DType::F32, &Device::Cpu)?;
///     opt.backward_step(&loss::mse(&model.forward(&x)?, &y)?)?;
///     Ok(opt.shard().as_tensor().elem_count())
/// })?;
/// assert_eq!(shards, vec![3, 3]); // 5 parameters' elements over 2 ranks, padded to 6
/// # Ok::<(), nccl_safe::Error>(())
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
    pub fn new(comm: &'c Communicator, map: &VarMap, config: O::Config) -> Result<Self> {
        Self::from_named(comm, sorted_params(map), config)
    }

    /// For named variables held elsewhere than a `VarMap`; they are sorted by name.
    pub fn from_named(
        comm: &'c Communicator,
        mut params: Vec<(String, Var)>,
        config: O::Config,
    ) -> Result<Self> {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let Some((_, first)) = params.first() else {
            return Err(Error::InvalidArgument {
                op: "ZeroRedundancyOptimizer",
                reason: "no parameters".into(),
            });
        };
        let dtype = first.as_tensor().dtype();
        if let Some((name, v)) = params.iter().find(|(_, v)| v.as_tensor().dtype() != dtype) {
            return Err(Error::InvalidArgument {
                op: "ZeroRedundancyOptimizer",
                reason: format!(
                    "all parameters must share one dtype: {name} is {:?}, others {dtype:?}",
                    v.as_tensor().dtype()
                ),
            });
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
        })
    }

    /// The wrapped optimizer (over this rank's part only).
    pub fn optimizer(&self) -> &O {
        &self.opt
    }

    /// The wrapped optimizer, to change its settings.
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.opt
    }

    /// This rank's part of the flat parameters (what the optimizer updates).
    pub fn shard(&self) -> &Var {
        &self.shard
    }

    /// The parameters, sorted by name.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The gradients averaged over the ranks (only this rank's part reduced), this rank's
    /// part updated, and every parameter set from the gathered parts.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
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
                    return Err(Error::Shape {
                        op: "ZeroRedundancyOptimizer::step",
                        reason: format!(
                            "the gradient of {name} is {:?} {:?}, the parameter {:?} {dtype:?}",
                            g.dims(),
                            g.dtype(),
                            t.dims()
                        ),
                    })
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
        self.opt.step(&mine)?;
        let all = all_gather(self.comm, self.shard.as_tensor())?;
        let mut offset = 0;
        for (_, v) in &self.params {
            let len = v.as_tensor().elem_count();
            v.set(&all.narrow(0, offset, len)?.reshape(v.as_tensor().shape())?)?;
            offset += len;
        }
        Ok(())
    }

    /// `loss.backward()`, then [`step`](Self::step): a drop-in for `opt.backward_step`.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        self.step(&grads)
    }

    /// The bytes of this rank's part of the flat parameters: the optimizer keeps its
    /// per-element state for these only.
    pub fn shard_bytes(&self) -> usize {
        self.shard.as_tensor().elem_count() * self.shard.as_tensor().dtype().size_in_bytes()
    }
}
