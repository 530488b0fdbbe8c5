//! [`DistributedDataParallel`]: bucketed gradient averaging for a `VarMap`.

use std::ops::Range;
use std::sync::Mutex;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use nccl_safe::{Communicator, ReduceOp};

use crate::tensor::{all_reduce, all_reduce_buckets, all_reduce_scalar, broadcast};
use crate::{Error, Result};

/// PyTorch's default bucket size: 25 MiB.
pub const DEFAULT_BUCKET_CAP: usize = 25 * 1024 * 1024;

/// The parameters of a `VarMap`, sorted by name (a `VarMap` is a `HashMap`, whose order
/// differs from rank to rank).
pub(crate) fn sorted_params(map: &VarMap) -> Vec<(String, Var)> {
    let data = map.data().lock().unwrap_or_else(|p| p.into_inner());
    let mut named: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// FNV-1a, 64 bits: stable across builds and processes (unlike std's hasher).
fn fnv(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// Checks that every rank holds the same parameters (names, shapes, dtypes, in order):
/// the fingerprint's four 16-bit parts (exact in f32), and their negatives, all-reduced
/// with max; equal on every rank only when the minimum equals the maximum.
pub(crate) fn check_same_params(comm: &Communicator, params: &[(String, Var)]) -> Result<()> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    fnv(&mut h, &(params.len() as u64).to_le_bytes());
    for (name, v) in params {
        fnv(&mut h, name.as_bytes());
        fnv(&mut h, &[0xff]);
        for d in v.as_tensor().dims() {
            fnv(&mut h, &(*d as u64).to_le_bytes());
        }
        fnv(&mut h, v.as_tensor().dtype().as_str().as_bytes());
        fnv(&mut h, &[0xfe]);
    }
    let parts: Vec<f32> = (0..4).map(|i| ((h >> (16 * i)) & 0xffff) as f32).collect();
    let both: Vec<f32> = parts.iter().chain(parts.iter()).copied().collect();
    let device = match params.first() {
        Some((_, v)) => v.as_tensor().device().clone(),
        None => candle_core::Device::Cpu,
    };
    let t = Tensor::from_vec(both, 8, &device)?;
    let signs = Tensor::from_vec(vec![1f32, 1., 1., 1., -1., -1., -1., -1.], 8, &device)?;
    let t = t.mul(&signs)?;
    all_reduce(comm, &t, ReduceOp::Max)?;
    let r = t.mul(&signs)?.to_vec1::<f32>()?;
    if r[..4] == r[4..] {
        return Ok(());
    }
    let first = params
        .iter()
        .take(4)
        .map(|(n, v)| format!("{n} {:?} {:?}", v.as_tensor().dims(), v.as_tensor().dtype()))
        .collect::<Vec<_>>()
        .join(", ");
    Err(Error::ParameterMismatch {
        rank: comm.rank(),
        count: params.len(),
        fingerprint: h,
        first,
    })
}

/// Every parameter from rank 0, in place.
pub(crate) fn broadcast_all(comm: &Communicator, params: &[(String, Var)]) -> Result<()> {
    params
        .iter()
        .try_for_each(|(_, v)| broadcast(comm, v.as_tensor(), 0))
}

/// How the gradients of one element type are packed: parameters in reverse name order
/// (the order backward produces them), and the element ranges of the flat buffer each
/// all-reduced as one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// The element type of these parameters.
    pub dtype: DType,
    /// Indices into the sorted parameters, in packing order.
    pub params: Vec<usize>,
    /// Each bucket's range of elements in the flat buffer.
    pub buckets: Vec<Range<usize>>,
}

impl BucketPlan {
    /// Plans the buckets for parameters of `(element count, dtype)`, in name order: one
    /// plan per element type, parameters in reverse order, a new bucket when the next
    /// parameter would take the current one over `cap_bytes`. A parameter larger than the
    /// cap gets a bucket of its own.
    pub fn plan(sizes: &[(usize, DType)], cap_bytes: usize) -> Vec<BucketPlan> {
        let mut plans: Vec<BucketPlan> = Vec::new();
        let mut fill: Vec<usize> = Vec::new(); // bytes in each plan's last bucket
        for (i, &(len, dtype)) in sizes.iter().enumerate().rev() {
            let p = match plans.iter().position(|p| p.dtype == dtype) {
                Some(p) => p,
                None => {
                    plans.push(BucketPlan {
                        dtype,
                        params: Vec::new(),
                        buckets: Vec::new(),
                    });
                    fill.push(0);
                    plans.len() - 1
                }
            };
            let bytes = len * dtype.size_in_bytes();
            let plan = &mut plans[p];
            let end = plan.buckets.last().map_or(0, |b| b.end);
            match plan.buckets.last_mut() {
                Some(b) if fill[p] + bytes <= cap_bytes || fill[p] == 0 => {
                    b.end += len;
                    fill[p] += bytes;
                }
                _ => {
                    plan.buckets.push(end..end + len);
                    fill[p] = bytes;
                }
            }
            plan.params.push(i);
        }
        plans
    }
}

/// Gradients added up under [`DistributedDataParallel::no_sync`], not yet reduced.
#[derive(Default)]
struct Pending {
    accumulating: bool,
    sums: Vec<Option<Tensor>>,
}

/// Data-parallel training of a `VarMap`'s parameters: every rank computes gradients on its
/// part of the batch, [`sync_grads`](Self::sync_grads) replaces them by their average over
/// the ranks, and every rank's optimizer applies the same update, so the parameters stay
/// bit-identical.
///
/// Parameters are ordered by name. At construction every rank checks that all ranks hold
/// the same names, shapes and dtypes ([`Error::ParameterMismatch`] on every rank
/// otherwise), then takes rank 0's values.
///
/// The gradients of one element type are packed into one fresh buffer, in reverse
/// parameter order, and each bucket of it (up to [`DEFAULT_BUCKET_CAP`] bytes, see
/// [`with_bucket_cap`](Self::with_bucket_cap)) is all-reduced with NCCL's average as its
/// own call: on the host provider all of them in one NCCL group, on CUDA back to back on
/// candle's stream, after the kernels that packed the buffer and before the ones that
/// unpack it (the stream orders them, with no synchronization; there is no separate
/// communication stream, so packing does not overlap with reducing). The gradients handed back are views of that buffer: no tensor
/// of the caller's is ever written.
pub struct DistributedDataParallel<'c> {
    comm: &'c Communicator,
    params: Vec<(String, Var)>,
    plans: Vec<BucketPlan>,
    pending: Mutex<Pending>,
}

impl std::fmt::Debug for DistributedDataParallel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("rank", &self.comm.rank())
            .field("params", &self.params.len())
            .field("plans", &self.plans)
            .finish()
    }
}

impl<'c> DistributedDataParallel<'c> {
    /// With [`DEFAULT_BUCKET_CAP`]: checks that every rank holds the same parameters and
    /// broadcasts rank 0's.
    pub fn new(comm: &'c Communicator, map: &VarMap) -> Result<Self> {
        Self::with_bucket_cap(comm, map, DEFAULT_BUCKET_CAP)
    }

    /// With buckets of up to `cap_bytes` (a parameter larger than that gets its own).
    pub fn with_bucket_cap(comm: &'c Communicator, map: &VarMap, cap_bytes: usize) -> Result<Self> {
        Self::from_named(comm, sorted_params(map), cap_bytes)
    }

    /// For named variables held elsewhere than a `VarMap`; they are sorted by name.
    pub fn from_named(
        comm: &'c Communicator,
        mut params: Vec<(String, Var)>,
        cap_bytes: usize,
    ) -> Result<Self> {
        if cap_bytes == 0 {
            return Err(Error::InvalidArgument {
                op: "DistributedDataParallel",
                reason: "the bucket cap must be at least one byte".into(),
            });
        }
        if params.is_empty() {
            return Err(Error::InvalidArgument {
                op: "DistributedDataParallel",
                reason: "no parameters".into(),
            });
        }
        params.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = params.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::InvalidArgument {
                op: "DistributedDataParallel",
                reason: format!("two parameters are named {:?}", w[0].0),
            });
        }
        check_same_params(comm, &params)?;
        broadcast_all(comm, &params)?;
        let sizes: Vec<(usize, DType)> = params
            .iter()
            .map(|(_, v)| (v.as_tensor().elem_count(), v.as_tensor().dtype()))
            .collect();
        let plans = BucketPlan::plan(&sizes, cap_bytes);
        Ok(DistributedDataParallel {
            comm,
            pending: Mutex::new(Pending {
                accumulating: false,
                sums: vec![None; params.len()],
            }),
            params,
            plans,
        })
    }

    /// Gives every rank rank 0's parameter values again (after rank 0 loaded a
    /// checkpoint or set its own initialization, say). Every rank must call it.
    pub fn broadcast_params(&self) -> Result<()> {
        broadcast_all(self.comm, &self.params)
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Communicator {
        self.comm
    }

    /// The parameters, sorted by name.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The parameters' variables, sorted by name (for an optimizer).
    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|(_, v)| v.clone()).collect()
    }

    /// How the gradients are packed: one plan per element type.
    pub fn plans(&self) -> &[BucketPlan] {
        &self.plans
    }

    /// This rank's equal part of a batch along its first dimension, which must divide by
    /// the number of ranks (so the average of the ranks' mean gradients is the whole
    /// batch's). A view: no copy.
    pub fn shard(&self, batch: &Tensor) -> Result<Tensor> {
        let (n, world) = (batch.dim(0)?, self.comm.world_size());
        if n % world != 0 {
            return Err(Error::Shape {
                op: "DistributedDataParallel::shard",
                reason: format!("a batch of {n} does not split into {world} equal parts"),
            });
        }
        Ok(batch.narrow(0, self.comm.rank() * (n / world), n / world)?)
    }

    /// Replaces every parameter's gradient in `grads` by its average over the ranks. A
    /// parameter without a gradient (unused this step) counts as zeros, like PyTorch's
    /// `find_unused_parameters`, and gets the average too. Inside
    /// [`no_sync`](Self::no_sync), only adds `grads` to a local sum, which the next call
    /// outside adds to its own before reducing.
    pub fn sync_grads(&self, grads: &mut GradStore) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.accumulating {
            for (i, (_, v)) in self.params.iter().enumerate() {
                if let Some(g) = grads.get(v.as_tensor()) {
                    pending.sums[i] = Some(match pending.sums[i].take() {
                        Some(s) => s.add(g)?,
                        None => g.copy()?,
                    });
                }
            }
            return Ok(());
        }
        for plan in &self.plans {
            let parts = plan
                .params
                .iter()
                .map(|&i| {
                    let t = self.params[i].1.as_tensor();
                    let g = match (grads.get(t), pending.sums[i].take()) {
                        (Some(g), Some(s)) => g.add(&s)?,
                        (Some(g), None) => g.clone(),
                        (None, Some(s)) => s,
                        (None, None) => t.zeros_like()?,
                    };
                    if g.dims() != t.dims() || g.dtype() != t.dtype() {
                        return Err(Error::Shape {
                            op: "sync_grads",
                            reason: format!(
                                "the gradient of {} is {:?} {:?}, the parameter {:?} {:?}",
                                self.params[i].0,
                                g.dims(),
                                g.dtype(),
                                t.dims(),
                                t.dtype()
                            ),
                        });
                    }
                    Ok(g.flatten_all()?)
                })
                .collect::<Result<Vec<_>>>()?;
            // A fresh buffer: `cat` of one tensor (and a flatten) would share its storage.
            let flat = if parts.len() == 1 {
                parts[0].copy()?
            } else {
                Tensor::cat(&parts, 0)?
            };
            all_reduce_buckets(self.comm, &flat, ReduceOp::Avg, &plan.buckets)?;
            let mut offset = 0;
            for &i in &plan.params {
                let t = self.params[i].1.as_tensor();
                let len = t.elem_count();
                grads.insert(t, flat.narrow(0, offset, len)?.reshape(t.shape())?);
                offset += len;
            }
        }
        Ok(())
    }

    /// Gradient accumulation: while the guard lives, [`sync_grads`](Self::sync_grads)
    /// communicates nothing and adds the gradients to a local sum; the first call after it
    /// reduces the sum together with its own gradients (don't step the optimizer in
    /// between). Like PyTorch's `no_sync()`.
    pub fn no_sync(&self) -> NoSync<'_, 'c> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .accumulating = true;
        NoSync { ddp: self }
    }

    /// `loss.backward()`, [`sync_grads`](Self::sync_grads), then `opt.step`: a drop-in for
    /// `opt.backward_step(&loss)`.
    pub fn backward_step<O: Optimizer>(&self, opt: &mut O, loss: &Tensor) -> Result<()> {
        let mut grads = loss.backward()?;
        self.sync_grads(&mut grads)?;
        opt.step(&grads)?;
        Ok(())
    }

    /// A one-element tensor (a loss) reduced over the ranks as `f64`, for logging; `t`
    /// itself is left unchanged.
    pub fn all_reduce_scalar(&self, t: &Tensor, op: ReduceOp) -> Result<f64> {
        all_reduce_scalar(self.comm, t, op)
    }
}

/// While it lives, [`DistributedDataParallel::sync_grads`] only accumulates locally.
#[must_use = "no_sync ends when the guard is dropped"]
pub struct NoSync<'d, 'c> {
    ddp: &'d DistributedDataParallel<'c>,
}

impl std::fmt::Debug for NoSync<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NoSync")
    }
}

impl Drop for NoSync<'_, '_> {
    fn drop(&mut self) {
        self.ddp
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .accumulating = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_in_reverse_order_and_a_large_parameter_alone() {
        // f32 parameters of 4, 100, 4, 4 elements (16, 400, 16, 16 bytes), cap 40 bytes.
        let f = DType::F32;
        let plans = BucketPlan::plan(&[(4, f), (100, f), (4, f), (4, f)], 40);
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].params, vec![3, 2, 1, 0]);
        // [3, 2] fill 32 bytes; 1 alone (400 > cap); 0 in a new bucket.
        assert_eq!(plans[0].buckets, vec![0..8, 8..108, 108..112]);
    }

    #[test]
    fn one_plan_per_dtype_and_a_bucket_per_parameter_with_a_tiny_cap() {
        let plans = BucketPlan::plan(
            &[
                (2, DType::F32),
                (3, DType::F64),
                (5, DType::F32),
                (7, DType::F64),
            ],
            1,
        );
        assert_eq!(plans.len(), 2);
        assert_eq!((plans[0].dtype, plans[1].dtype), (DType::F64, DType::F32));
        assert_eq!(plans[0].params, vec![3, 1]);
        assert_eq!(plans[0].buckets, vec![0..7, 7..10]);
        assert_eq!(plans[1].params, vec![2, 0]);
        assert_eq!(plans[1].buckets, vec![0..5, 5..7]);
    }

    #[test]
    fn everything_in_one_bucket_under_a_large_cap() {
        let f = DType::BF16;
        let plans = BucketPlan::plan(&[(10, f), (20, f), (30, f)], DEFAULT_BUCKET_CAP);
        assert_eq!(plans[0].buckets, vec![0..60]);
    }
}
