//! Data parallelism for [candle](https://github.com/huggingface/candle) over nccl-safe.
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
//! A training loop becomes data-parallel by changing three lines:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Module, Optimizer, VarBuilder, VarMap, SGD};
//! use nccl_safe::launch::Launcher;
//! use nccl_safe_candle::DistributedDataParallel;
//!
//! let losses = Launcher::host(2).try_run(|rank| -> nccl_safe_candle::Result<f64> {
//!     let map = VarMap::new();
//!     let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
//!     let ddp = DistributedDataParallel::new(rank.comm(), &map)?; // 1: take rank 0's parameters
//!     let mut sgd = SGD::new(map.all_vars(), 0.1)?;
//!     let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
//!     let x = ddp.shard(&x)?; // 2: this rank's part of the batch
//!     let y = Tensor::zeros((x.dim(0)?, 1), DType::F32, &Device::Cpu)?;
//!     for _ in 0..10 {
//!         let l = loss::mse(&model.forward(&x)?, &y)?;
//!         ddp.backward_step(&mut sgd, &l)?; // 3: was `sgd.backward_step(&l)?`
//!     }
//!     let l = loss::mse(&model.forward(&x)?, &y)?;
//!     ddp.all_reduce_scalar(&l, nccl_safe::ReduceOp::Avg)
//! })?;
//! assert_eq!(losses[0], losses[1]);
//! # Ok::<(), nccl_safe::Error>(())
//! ```
//!
//! No type here needs `unsafe impl Send` or `Sync`: a collective borrows the
//! communicator for the duration of candle's storage hook, on the rank's own thread.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

#[cfg(feature = "cuda")]
mod comm_stream;
mod ddp;
pub mod tensor;
mod zero;

pub use ddp::{BucketPlan, DistributedDataParallel, NoSync, DEFAULT_BUCKET_CAP};
pub use nccl_safe::ReduceOp;
pub use tensor::{all_gather, all_reduce, all_reduce_scalar, broadcast, reduce_scatter};
pub use zero::ZeroRedundancyOptimizer;

use candle_core::DType;

/// What can go wrong; every check fails before NCCL sees a buffer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An NCCL call (or nccl-safe's own check of it) failed.
    #[error(transparent)]
    Nccl(#[from] nccl_safe::Error),
    /// A candle operation failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The collectives take f32, f64, f16 and bf16 tensors.
    #[error("{op}: {dtype:?} tensors are not supported (f32, f64, f16 and bf16 are)")]
    UnsupportedDtype {
        /// The operation.
        op: &'static str,
        /// The tensor's element type.
        dtype: DType,
    },
    /// The collectives run on a tensor's storage in place, which needs it contiguous.
    #[error("{op}: the tensor (shape {shape:?}, stride {stride:?}) is not contiguous; call .contiguous() first")]
    NotContiguous {
        /// The operation.
        op: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Its strides.
        stride: Vec<usize>,
    },
    /// The tensor is not where the communicator works.
    #[error("{op}: the tensor is on {tensor}, but the communicator on {comm}")]
    WrongDevice {
        /// The operation.
        op: &'static str,
        /// Where the tensor is.
        tensor: String,
        /// Where the communicator works.
        comm: String,
    },
    /// A shape the operation cannot take.
    #[error("{op}: {reason}")]
    Shape {
        /// The operation.
        op: &'static str,
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
    /// An argument out of its range.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;

/// So that a candle loop (`candle_core::Result`) can use `?` on this crate's calls.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> candle_core::Error {
        match e {
            Error::Candle(e) => e,
            e => candle_core::Error::wrap(e),
        }
    }
}
