//! Data parallelism for [candle](https://github.com/huggingface/candle) over nccl-safe.
//!
//! Where to start: [`DistributedDataParallel`] (or [`DdpOptimizer`]) for a fixed set of ranks,
//! [`ElasticJob`] for a job that carries on without a lost rank (`examples/elastic_job.rs`,
//! the README's program, is a complete one).
//!
//! - [`tensor`]: all-reduce (sum, avg, min, max, product), broadcast, all-gather and
//!   reduce-scatter on candle [`Tensor`](candle_core::Tensor)s of f32, f64, f16 and bf16,
//!   in place on candle's own storage: CPU tensors on nccl-safe's host provider, CUDA
//!   tensors (the `cuda` feature) on candle's own stream with no copy to the host.
//! - [`DistributedDataParallel`]: a `VarMap`'s parameters taken from rank 0 and checked
//!   alike on every rank at construction; gradients packed into buckets (25 MiB by default)
//!   in reverse parameter order, averaged over the ranks and unpacked; unused parameters'
//!   gradients zero-filled; [`no_sync`](DistributedDataParallel::no_sync) for gradient
//!   accumulation. On CUDA the buckets are reduced on a communication stream of its own,
//!   ordered against candle's stream by events, while candle packs the next bucket (see
//!   [its ordering](DistributedDataParallel#ordering-on-cuda)).
//! - [`ZeroRedundancyOptimizer`]: ZeRO stage 1. Each rank keeps the optimizer state of
//!   1/N of the flattened parameters only, and wraps any candle optimizer for it: a step
//!   reduce-scatters the gradients, updates this rank's shard, and all-gathers the
//!   parameters.
//!
//! - [`DdpOptimizer`]: a `DistributedDataParallel` holding its candle optimizer, itself a
//!   `candle_nn::Optimizer`, so that `opt.backward_step(&loss)` is the data-parallel step
//!   and a local step cannot happen by mistake.
//! - [`Accumulation`] (`no_sync(micro_batches)` on all three): gradient accumulation whose
//!   guard takes each micro-batch's backward, **scaling its loss by `1 / micro_batches`**,
//!   and whose step refuses a wrong count; a step of your own inside it does not compile.
//! - [`run_elastic`] (module [`elastic`]): training that carries on without a rank it
//!   lost: the ranks left shrink the communicator, agree on the rank and the step, and
//!   run the session again on the smaller world (communicators made with
//!   `Config::elastic`). Built with `resume` and a [`StateCarry`], the optimizer's state
//!   comes along, re-sharded over the new world (module [`state`]: [`ShardableState`],
//!   this crate's [`AdamW`](state::AdamW), candle_nn's AdamW's drop-in); ZeRO-1 keeps a
//!   copy of each rank's state on the rank before it, so a lost rank's range is rebuilt.
//!   A recovery keeps a quorum ([`MinRanks`], default half of the ranks and at least 2):
//!   a stuck rank that wakes alone gets [`DistErrorKind::NoQuorum`] instead of training on.
//! - [`ElasticJob`] (module [`job`]): the launcher of an elastic job, one call in threads
//!   or under mpirun, srun or torchrun, handing each rank an owned elastic communicator
//!   or a standby; [`ElasticRank::train`] is `run_elastic` with a [`GrowPolicy`] that
//!   takes a waiting standby back, its grow id over the job's own rendezvous
//!   (`examples/elastic_job.rs`, the README's program).
//! - [`DistributedSampler`]: each step's global batch split over any number of ranks
//!   (padded, dropped or uneven, as PyTorch's `DistributedSampler`), the same samples
//!   after a recovery changed the world: what an elastic loop shards its data with
//!   (`shard_batch` refuses a batch that does not split evenly).
//! - Drift detection (`check_drift`, `with_drift_check(every)`): a fingerprint of every
//!   rank's parameters compared across ranks, naming the step and the ranks that differ.
//!
//! Errors ([`DistError`]) carry the line of your code that called into the crate
//! (`#[track_caller]` on every public entry point) and the step, when a data-parallel
//! object knows it. The crate re-exports what a trainer needs from nccl-safe
//! ([`Launcher`], [`Rank`], [`Communicator`], [`ReduceOp`], [`Config`], and
//! [`nccl_safe`] itself), and none of its names clash with candle's under glob imports
//! (`use candle_core::*; use candle_nn::*; use nccl_safe_candle::*;`): its error is
//! `DistError`, its result `DistResult`, and `?` turns them into `candle_core::Error` or
//! `anyhow::Error`.
//!
//! A training loop becomes data-parallel by changing three lines:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Module, Optimizer, VarBuilder, VarMap, SGD};
//! use nccl_safe_candle::{DdpOptimizer, DistResult, Launcher, ReduceOp};
//!
//! let losses = Launcher::host(2).try_run(|rank| -> DistResult<f64> {
//!     let map = VarMap::new();
//!     let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
//!     // 1: was `SGD::new(map.all_vars(), 0.1)?`; takes rank 0's parameters
//!     let mut sgd = DdpOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?;
//!     let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
//!     let x = sgd.shard_batch(&x)?; // 2: this rank's part of the batch
//!     let y = Tensor::zeros((x.dim(0)?, 1), DType::F32, &Device::Cpu)?;
//!     for _ in 0..10 {
//!         let l = loss::mse(&model.forward(&x)?, &y)?;
//!         sgd.backward_step(&l)?; // unchanged: averages the gradients, then steps
//!     }
//!     sgd.check_drift()?; // 3 (optional): every rank holds the same parameters
//!     let l = loss::mse(&model.forward(&x)?, &y)?;
//!     sgd.all_reduce_scalar(&l, ReduceOp::Avg)
//! })?;
//! assert_eq!(losses[0], losses[1]);
//! # Ok::<(), nccl_launch::Error>(())
//! ```
//!
//! One rank per process (torchrun, mpirun, Slurm): [`init_from_env`] gives the rank and its
//! candle device, on the host provider with CPU tensors unless the crate is built with
//! its `cuda` feature.
//!
//! No type here needs `unsafe impl Send` or `Sync`: a collective borrows the
//! communicator for the duration of candle's storage hook, on the rank's own thread.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod accumulate;
#[cfg(feature = "cuda")]
mod comm_stream;
mod ddp;
pub mod elastic;
pub mod error;
pub mod job;
mod optim;
pub mod sampler;
pub mod state;
pub mod tensor;
mod zero;

pub use accumulate::{Accumulate, Accumulation, MicroBatchLoss, OptimizerState, Unscaled};
pub use ddp::{BucketPlan, DdpStep, DistributedDataParallel, DEFAULT_BUCKET_CAP};
pub use elastic::{
    grow, is_rank_loss, join, recover, recover_with, run_elastic, run_elastic_with, ElasticRun,
    MinRanks, Recovery,
};
pub use error::{DistError, DistErrorKind, DistResult};
pub use job::{ElasticJob, ElasticRank, GrowPolicy};
pub use nccl_launch::{Launcher, Rank};
pub use nccl_safe;
pub use nccl_safe::{Communicator, Config, ReduceOp};
pub use optim::DdpOptimizer;
pub use sampler::{BatchPart, BatchSplit, DistributedSampler};
pub use state::{CarriedState, FlatState, ShardableState, StateCarry};
pub use tensor::{
    all_gather, all_reduce, all_reduce_scalar, broadcast, reduce_scatter, shard_batch,
};
pub use zero::ZeroRedundancyOptimizer;

use candle_core::Device;

/// One rank per process, from the launcher's environment (torchrun, Open MPI, Slurm; see
/// nccl-safe's `Launcher::from_env`), with its candle device. Without this crate's `cuda`
/// feature the rank runs on the host provider with `Device::Cpu` (nccl-safe's
/// `Launcher::from_env()?.host().init()`), so the same program runs on a machine
/// without a GPU; with it, on the GPU of its local rank with `Device::new_cuda`.
#[track_caller]
pub fn init_from_env() -> DistResult<(Rank, Device)> {
    let (at, _scope) = crate::error::caller_scope();
    let launcher = Launcher::from_env().map_err(|e| DistError::from(e).at(at, None))?;
    #[cfg(not(feature = "cuda"))]
    let launcher = launcher.host();
    let rank = launcher
        .init()
        .map_err(|e| DistError::from(e).at(at, None))?;
    let device = candle_device(&rank)?;
    Ok((rank, device))
}

/// The candle device of a rank's communicator: `Device::Cpu` on the host provider, the
/// communicator's GPU otherwise.
#[track_caller]
pub fn candle_device(rank: &Rank) -> DistResult<Device> {
    let (at, _scope) = crate::error::caller_scope();
    match rank.comm().cuda_ordinal() {
        None => Ok(Device::Cpu),
        Some(d) => Device::new_cuda(d).map_err(|e| DistError::from(e).at(at, None)),
    }
}
