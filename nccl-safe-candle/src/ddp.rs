//! [`DistributedDataParallel`]: bucketed gradient averaging for a `VarMap`.

use std::ops::Range;
use std::sync::Mutex;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use nccl_safe::{Communicator, ReduceOp};

#[cfg(feature = "cuda")]
use crate::tensor::all_reduce_on;
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

/// `parts` concatenated into a fresh buffer: `cat` of one tensor (and a flatten) would
/// share its storage.
fn fresh(parts: &[Tensor]) -> Result<Tensor> {
    Ok(if parts.len() == 1 {
        parts[0].copy()?
    } else {
        Tensor::cat(parts, 0)?
    })
}

/// How many of the parameters of `lens` elements (in packing order) each bucket holds: a
/// bucket holds whole parameters, and one of no elements stays in the bucket it starts at
/// the end of.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn per_bucket(lens: impl Iterator<Item = usize>, buckets: &[Range<usize>]) -> Result<Vec<usize>> {
    let mut count = vec![0usize; buckets.len()];
    let (mut b, mut offset) = (0, 0);
    for len in lens {
        while buckets.get(b).is_some_and(|r| offset + len > r.end) {
            b += 1;
        }
        if b == buckets.len() || offset < buckets[b].start {
            return Err(Error::InvalidArgument {
                op: "sync_grads",
                reason: format!(
                    "a parameter of {len} elements at {offset} fits no bucket of {buckets:?}"
                ),
            });
        }
        count[b] += 1;
        offset += len;
    }
    Ok(count)
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
/// The gradients of one element type are packed in reverse parameter order, and each
/// bucket of them (up to [`DEFAULT_BUCKET_CAP`] bytes, see
/// [`with_bucket_cap`](Self::with_bucket_cap)) is all-reduced with NCCL's average as its
/// own call. On the host provider they are packed into one fresh buffer and all buckets
/// run as one NCCL group. The gradients handed back are views of the packed buffers: no
/// tensor of the caller's is ever written.
///
/// # Ordering on CUDA
///
/// Each `DistributedDataParallel` over CUDA parameters creates, at construction, a
/// communication stream of its own in the CUDA context of the parameters' candle device,
/// and [`sync_grads`](Self::sync_grads) pipelines the buckets between that stream and
/// candle's. For bucket k, in this order:
///
/// 1. candle's stream runs the kernels that pack bucket k into a fresh buffer of its own;
/// 2. the communication stream waits on an event recorded on candle's stream after those
///    kernels;
/// 3. the all-reduce of bucket k is enqueued on the communication stream.
///
/// The host goes on to pack bucket k+1 without waiting, so candle's stream packs bucket
/// k+1 while the communication stream reduces bucket k. After the last bucket (and on an
/// error path, once a bucket was enqueued), candle's stream waits on an event recorded on
/// the communication stream after the last all-reduce: all work enqueued on candle's
/// stream after `sync_grads` returns (the optimizer reading the gradients, the frees of
/// the buffers) runs after every bucket is reduced. Nothing synchronizes with the host:
/// `sync_grads` returns once the work is enqueued. Two events serve every step: each
/// wait takes the work recorded at the time of the wait.
///
/// The communication stream puts the context in cudarc's multi-stream mode. While cudarc's
/// event tracking is on (candle's default), cudarc also orders each buffer's uses across
/// streams by the buffer's own read and write events, which covers the same edges; the
/// events above do not rely on it, because that tracking holds only where every kernel
/// keeps its buffer's guard across its launch, which candle arranges by hand, and it can
/// be turned off (candle's `CudaDevice::disable_event_tracking`, which also saves its
/// per-kernel cost).
///
/// The crate's tests run this path without a GPU, on a fake CUDA driver that checks
/// CUDA's ordering rule beside the work: with cudarc's tracking on and off, and on the
/// error path, no access to a bucket's buffer on one stream is left unordered against an
/// access on the other.
pub struct DistributedDataParallel<'c> {
    comm: &'c Communicator,
    params: Vec<(String, Var)>,
    plans: Vec<BucketPlan>,
    pending: Mutex<Pending>,
    /// On CUDA, the stream the buckets are reduced on.
    #[cfg(feature = "cuda")]
    comm_stream: Option<crate::comm_stream::CommStream>,
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
        #[cfg(feature = "cuda")]
        let comm_stream = match params[0].1.as_tensor().device() {
            candle_core::Device::Cuda(d) => Some(crate::comm_stream::CommStream::new(d)?),
            _ => None,
        };
        Ok(DistributedDataParallel {
            #[cfg(feature = "cuda")]
            comm_stream,
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
            #[cfg(feature = "cuda")]
            if let Some(cs) = &self.comm_stream {
                self.reduce_on_comm_stream(cs, plan, &parts, grads)?;
                continue;
            }
            let flat = fresh(&parts)?;
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

    /// One plan's buckets on CUDA, pipelined: each bucket packed into a buffer of its own
    /// on candle's stream and reduced on the communication stream, so that packing the
    /// next bucket overlaps with reducing this one (see the type's documentation for the
    /// ordering). `parts` are the flattened gradients in `plan.params` order.
    #[cfg(feature = "cuda")]
    fn reduce_on_comm_stream(
        &self,
        cs: &crate::comm_stream::CommStream,
        plan: &BucketPlan,
        parts: &[Tensor],
        grads: &mut GradStore,
    ) -> Result<()> {
        if let Some(p) = parts.iter().find(|p| !cs.serves(p.device())) {
            return Err(Error::WrongDevice {
                op: "sync_grads",
                tensor: format!("{:?} (another candle device)", p.device().location()),
                comm: "the candle device of the parameters at construction".into(),
            });
        }
        let count = per_bucket(parts.iter().map(|p| p.elem_count()), &plan.buckets)?;
        // Declared before the joiner, so dropped after it: on every path candle's stream
        // waits for the communication stream before it frees a buffer.
        let mut buffers: Vec<Option<Tensor>> = Vec::with_capacity(count.len());
        let join = cs.joiner();
        let mut first = 0;
        for &n in &count {
            let group = &parts[first..first + n];
            first += n;
            if group.iter().all(|p| p.elem_count() == 0) {
                buffers.push(None); // nothing to reduce (every rank has the same plan)
                continue;
            }
            buffers.push(Some(fresh(group)?));
            let Some(Some(buffer)) = buffers.last() else {
                continue;
            };
            cs.wait_for_candle()?;
            all_reduce_on(self.comm, buffer, ReduceOp::Avg, cs.stream())?;
        }
        join.finish()?;
        let mut k = 0;
        for (buffer, &n) in buffers.iter().zip(&count) {
            let mut offset = 0;
            for &i in &plan.params[k..k + n] {
                let t = self.params[i].1.as_tensor();
                let len = t.elem_count();
                let g = match buffer {
                    Some(buffer) => buffer.narrow(0, offset, len)?.reshape(t.shape())?,
                    None => t.zeros_like()?,
                };
                grads.insert(t, g);
                offset += len;
            }
            k += n;
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
    fn each_bucket_gets_the_parameters_its_range_covers() {
        let f = DType::F32;
        // Packing order 3, 2, 1, 0 with lengths 4, 4, 100, 4; a cap of 40 bytes.
        let sizes = [(4, f), (100, f), (4, f), (4, f)];
        let plans = BucketPlan::plan(&sizes, 40);
        let lens = plans[0].params.iter().map(|&i| sizes[i].0);
        assert_eq!(per_bucket(lens, &plans[0].buckets).unwrap(), vec![2, 1, 1]);
        // Parameters of no elements stay with the bucket they start at the end of.
        let sizes = [(0, f), (3, f), (0, f), (5, f), (0, f)];
        let plans = BucketPlan::plan(&sizes, 12);
        assert_eq!(plans[0].buckets, vec![0..5, 5..8]);
        let lens = plans[0].params.iter().map(|&i| sizes[i].0);
        assert_eq!(per_bucket(lens, &plans[0].buckets).unwrap(), vec![3, 2]);
        // Only empty parameters: one empty bucket holds them all.
        let plans = BucketPlan::plan(&[(0, f), (0, f)], 12);
        assert_eq!(
            per_bucket([0, 0].into_iter(), &plans[0].buckets).unwrap(),
            vec![2]
        );
    }

    #[test]
    fn lengths_that_fit_no_bucket_are_an_error() {
        let buckets = [0..4, 4..6];
        // More elements than the buckets cover.
        let e = per_bucket([4, 2, 1].into_iter(), &buckets).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // A parameter straddling two buckets.
        let e = per_bucket([3, 2, 1].into_iter(), &buckets).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }

    #[test]
    fn everything_in_one_bucket_under_a_large_cap() {
        let f = DType::BF16;
        let plans = BucketPlan::plan(&[(10, f), (20, f), (30, f)], DEFAULT_BUCKET_CAP);
        assert_eq!(plans[0].buckets, vec![0..60]);
    }
}
