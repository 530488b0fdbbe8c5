//! [`DistributedDataParallel`]: bucketed gradient averaging for a `VarMap`.

use std::ops::Range;
use std::panic::Location;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use nccl_safe::{Communicator, ReduceOp};

use crate::accumulate::{check_drift, fnv, private::Target, Accumulate, Accumulation, Tracker};
use crate::error::{DistError, DistErrorKind as K, DistResult as Result};
#[cfg(feature = "cuda")]
use crate::tensor::all_reduce_on;
use crate::tensor::shard_batch;
use crate::tensor::{all_reduce, all_reduce_buckets, all_reduce_scalar, broadcast};

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
    Err(K::ParameterMismatch {
        rank: comm.rank(),
        count: params.len(),
        fingerprint: h,
        first,
    }
    .into())
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
            return Err(K::InvalidArgument {
                call: "sync_grads",
                reason: format!(
                    "a parameter of {len} elements at {offset} fits no bucket of {buckets:?}"
                ),
            }
            .into());
        }
        count[b] += 1;
        offset += len;
    }
    Ok(count)
}

/// Data-parallel training of a `VarMap`'s parameters: every rank computes gradients on its
/// part of the batch, [`sync_grads`](Self::sync_grads) replaces them by their average over
/// the ranks, and every rank's optimizer applies the same update, so the parameters stay
/// bit-identical.
///
/// Parameters are ordered by name. At construction every rank checks that all ranks hold
/// the same names, shapes and dtypes ([`DistErrorKind::ParameterMismatch`](crate::DistErrorKind::ParameterMismatch) on every rank
/// otherwise), then takes rank 0's values.
///
/// The gradients of one element type are packed in reverse parameter order, and each
/// bucket of them (up to [`DEFAULT_BUCKET_CAP`] bytes, see
/// [`with_bucket_cap`](Self::with_bucket_cap)) is all-reduced with NCCL's average as its
/// own call. On the host provider they are packed into one fresh buffer, whose buckets
/// are reduced one after the other. Each bucket is an operation the watchdog follows like
/// any: a stuck rank gets its notice and its timeout (naming the rank behind and your
/// line), and a lost rank fails the step as a rank loss that
/// [`run_elastic`](crate::run_elastic) recovers from, as with ZeRO-1. The gradients handed
/// back are views of the packed buffers: no tensor of the caller's is ever written.
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
    tracker: Tracker,
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
    #[track_caller]
    pub fn new(comm: &'c Communicator, map: &VarMap) -> Result<Self> {
        Self::with_bucket_cap(comm, map, DEFAULT_BUCKET_CAP)
    }

    /// With buckets of up to `cap_bytes` (a parameter larger than that gets its own).
    #[track_caller]
    pub fn with_bucket_cap(comm: &'c Communicator, map: &VarMap, cap_bytes: usize) -> Result<Self> {
        Self::from_named(comm, sorted_params(map), cap_bytes)
    }

    /// For named variables held elsewhere than a `VarMap`; they are sorted by name.
    #[track_caller]
    pub fn from_named(
        comm: &'c Communicator,
        params: Vec<(String, Var)>,
        cap_bytes: usize,
    ) -> Result<Self> {
        let (at, _scope) = crate::error::caller_scope();
        Self::from_named_inner(comm, params, cap_bytes).map_err(|e| e.at(at, None))
    }

    fn from_named_inner(
        comm: &'c Communicator,
        mut params: Vec<(String, Var)>,
        cap_bytes: usize,
    ) -> Result<Self> {
        if cap_bytes == 0 {
            return Err(K::InvalidArgument {
                call: "DistributedDataParallel",
                reason: "the bucket cap must be at least one byte".into(),
            }
            .into());
        }
        if params.is_empty() {
            return Err(K::InvalidArgument {
                call: "DistributedDataParallel",
                reason: "no parameters".into(),
            }
            .into());
        }
        params.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = params.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(K::InvalidArgument {
                call: "DistributedDataParallel",
                reason: format!("two parameters are named {:?}", w[0].0),
            }
            .into());
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
            tracker: Tracker::default(),
            params,
            plans,
        })
    }

    /// Gives every rank rank 0's parameter values again (after rank 0 loaded a
    /// checkpoint or set its own initialization, say). Every rank must call it.
    #[track_caller]
    pub fn broadcast_params(&self) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        broadcast_all(self.comm, &self.params).map_err(|e| e.at(at, None))
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

    /// This rank's equal part of a batch along its first dimension ([`shard_batch`]):
    /// the first dimension must divide by the number of ranks (so that the average of
    /// the ranks' mean gradients is the whole batch's). A view: no copy.
    ///
    /// With the drift check on ([`with_drift_check`](Self::with_drift_check)) it also
    /// reads the first element of each parameter, and fails with
    /// [`DistErrorKind::SteppedOutside`](crate::DistErrorKind::SteppedOutside) when they
    /// changed since the previous batch with no step of this object in between: an
    /// optimizer stepped on local gradients, a path the drift check inside the steps
    /// never sees.
    #[track_caller]
    pub fn shard_batch(&self, batch: &Tensor) -> Result<Tensor> {
        if self.tracker.drift_checked() {
            let (at, _scope) = crate::error::caller_scope();
            let step = self.tracker.current();
            let outside = crate::accumulate::sample(&self.params)
                .map(|s| self.tracker.outside_step(s))
                .map_err(|e| e.at(at, Some(step)))?;
            if outside {
                return Err(DistError::from(K::SteppedOutside {
                    call: "shard_batch",
                    rank: self.comm.rank(),
                    steps: self.tracker.completed(),
                })
                .at(at, Some(step)));
            }
        }
        shard_batch(self.comm, batch)
    }

    /// The old name of [`shard_batch`](Self::shard_batch).
    #[deprecated(
        note = "renamed shard_batch (the same on ZeroRedundancyOptimizer and DdpOptimizer)"
    )]
    #[track_caller]
    pub fn shard(&self, batch: &Tensor) -> Result<Tensor> {
        shard_batch(self.comm, batch)
    }

    /// Steps completed (each [`sync_grads`](Self::sync_grads) outside an accumulation,
    /// each [`backward_step`](Self::backward_step), each accumulation's step).
    pub fn steps(&self) -> u64 {
        self.tracker.completed()
    }

    /// Runs [`check_drift`](Self::check_drift) after every `every` steps (0: never, the
    /// default), inside the step that completes them: the step then fails with
    /// [`DistErrorKind::Drift`](crate::DistErrorKind::Drift), naming the step and the
    /// ranks, on every rank.
    pub fn with_drift_check(self, every: u64) -> Self {
        self.tracker.set_drift_every(every);
        self
    }

    /// Checks that every rank holds bit-identical parameters: each rank hashes its
    /// parameters' bits (FNV-1a; on CUDA that reads them to the host), and one all-gather
    /// of four numbers per rank compares the hashes. Every rank must call it at the same
    /// point. On a difference, every rank gets
    /// [`DistErrorKind::Drift`](crate::DistErrorKind::Drift), naming the steps completed,
    /// the step after which the last check passed, and the ranks outside the largest
    /// group of equal ones. Cheap next to a step (one pass over the parameters, no
    /// gradient work), so it can run every N steps ([`with_drift_check`](Self::with_drift_check)).
    #[track_caller]
    pub fn check_drift(&self) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        check_drift(self.comm, &self.params, &self.tracker).map_err(|e| e.at(at, None))
    }

    /// Replaces every parameter's gradient in `grads` by its average over the ranks, as
    /// one step. A parameter without a gradient (unused this step) counts as zeros, like
    /// PyTorch's `find_unused_parameters`, and gets the average too. Refused while a
    /// [`no_sync`](Self::no_sync) accumulation is open
    /// ([`DistErrorKind::AccumulationOpen`](crate::DistErrorKind::AccumulationOpen)).
    #[track_caller]
    pub fn sync_grads(&self, grads: &mut GradStore) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        let step = self.tracker.current();
        self.tracker
            .may_step("sync_grads", self.comm.rank())
            .map_err(DistError::from)
            .and_then(|()| self.sync_step(grads))
            .map_err(|e| e.at(at, Some(step)))
    }

    /// One step: the drift check when due, the reduction, the step counted.
    fn sync_step(&self, grads: &mut GradStore) -> Result<()> {
        self.reduce(grads)?;
        if self.tracker.stepped().is_some() {
            check_drift(self.comm, &self.params, &self.tracker)?;
        }
        Ok(())
    }

    /// The gradients' average over the ranks, in buckets.
    fn reduce(&self, grads: &mut GradStore) -> Result<()> {
        for plan in &self.plans {
            let parts = plan
                .params
                .iter()
                .map(|&i| {
                    let t = self.params[i].1.as_tensor();
                    let g = match grads.get(t) {
                        Some(g) => g.clone(),
                        None => t.zeros_like()?,
                    };
                    if g.dims() != t.dims() || g.dtype() != t.dtype() {
                        return Err(K::Shape {
                            call: "sync_grads",
                            reason: format!(
                                "the gradient of {} is {:?} {:?}, the parameter {:?} {:?}",
                                self.params[i].0,
                                g.dims(),
                                g.dtype(),
                                t.dims(),
                                t.dtype()
                            ),
                        }
                        .into());
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
            return Err(K::WrongDevice {
                call: "sync_grads",
                tensor: format!("{:?} (another candle device)", p.device().location()),
                comm: "the candle device of the parameters at construction".into(),
            }
            .into());
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

    /// Gradient accumulation over `micro_batches` micro-batches with `opt`, one reduction
    /// and one step at the end (PyTorch's `no_sync`); see [`Accumulation`] for why it
    /// cannot be misused. **Each micro-batch's loss is scaled by `1 / micro_batches`** by
    /// the guard's `backward`.
    ///
    /// ```
    /// # use candle_core::{DType, Device, Tensor};
    /// # use candle_nn::{linear, loss, Module, Optimizer, VarBuilder, VarMap, SGD};
    /// # use nccl_safe_candle::{DistributedDataParallel, DistResult, Launcher, Unscaled};
    /// Launcher::host(2).try_run(|rank| -> DistResult<()> {
    ///     let map = VarMap::new();
    ///     let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
    ///     let ddp = DistributedDataParallel::new(rank.comm(), &map)?;
    ///     let mut sgd = SGD::new(ddp.vars(), 0.1)?;
    ///     let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
    ///     let y = Tensor::zeros((8, 1), DType::F32, &Device::Cpu)?;
    ///     let mut acc = ddp.no_sync(4, &mut sgd)?;
    ///     for i in 0..4 {
    ///         let (xi, yi) = (x.narrow(0, 2 * i, 2)?, y.narrow(0, 2 * i, 2)?);
    ///         acc.backward(Unscaled(&loss::mse(&model.forward(&xi)?, &yi)?))?; // scaled by 1/4
    ///     }
    ///     acc.step() // one all-reduce, one SGD step
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    ///
    /// A step of your own inside it does not compile (the guard holds the optimizer):
    ///
    /// ```compile_fail,E0499
    /// # use candle_core::{DType, Device, Tensor};
    /// # use candle_nn::{linear, loss, Module, Optimizer, VarBuilder, VarMap, SGD};
    /// # use nccl_safe_candle::{DistributedDataParallel, DistResult, Launcher};
    /// # Launcher::host(1).try_run(|rank| -> DistResult<()> {
    /// # let map = VarMap::new();
    /// # let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
    /// # let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
    /// let ddp = DistributedDataParallel::new(rank.comm(), &map)?;
    /// let mut sgd = SGD::new(ddp.vars(), 0.1)?;
    /// let mut acc = ddp.no_sync(2, &mut sgd)?;
    /// let l = model.forward(&x)?.sum_all()?;
    /// sgd.backward_step(&l)?; // error: `sgd` is borrowed by the accumulation
    /// acc.step()
    /// # })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    #[doc(alias = "accumulate")]
    pub fn no_sync<'a, O: Optimizer>(
        &'a self,
        micro_batches: usize,
        opt: &'a mut O,
    ) -> Result<Accumulation<DdpStep<'a, 'c, O>>> {
        Accumulation::open(DdpStep { ddp: self, opt }, micro_batches)
    }

    /// `loss.backward()`, [`sync_grads`](Self::sync_grads), then `opt.step`: a drop-in for
    /// `opt.backward_step(&loss)`. Refused inside an accumulation (which holds `opt`).
    /// [`DdpOptimizer`](crate::DdpOptimizer) holds the optimizer itself, so that a plain
    /// `opt.backward_step(&loss)` (which here would step on local gradients) cannot happen.
    #[track_caller]
    pub fn backward_step<O: Optimizer>(&self, opt: &mut O, loss: &Tensor) -> Result<()> {
        let (at, _scope) = crate::error::caller_scope();
        let step = self.tracker.current();
        self.backward_step_inner(opt, loss)
            .map_err(|e| e.at(at, Some(step)))
    }

    fn backward_step_inner<O: Optimizer>(&self, opt: &mut O, loss: &Tensor) -> Result<()> {
        self.tracker.may_step("backward_step", self.comm.rank())?;
        let mut grads = loss.backward()?;
        self.reduce(&mut grads)?;
        opt.step(&grads)?;
        if self.tracker.stepped().is_some() {
            check_drift(self.comm, &self.params, &self.tracker)?;
        }
        Ok(())
    }

    /// A one-element tensor (a loss) reduced over the ranks as `f64`, for logging; `t`
    /// itself is left unchanged.
    #[track_caller]
    pub fn all_reduce_scalar(&self, t: &Tensor, op: ReduceOp) -> Result<f64> {
        all_reduce_scalar(self.comm, t, op)
    }

    pub(crate) fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// One step of summed gradients: reduced, `step(grads)`, counted and drift-checked.
    pub(crate) fn step_with(
        &self,
        grads: &mut GradStore,
        step: impl FnOnce(&GradStore) -> candle_core::Result<()>,
    ) -> Result<()> {
        self.reduce(grads)?;
        step(grads)?;
        if self.tracker.stepped().is_some() {
            check_drift(self.comm, &self.params, &self.tracker)?;
        }
        Ok(())
    }
}

/// A [`DistributedDataParallel`] with your optimizer, held by an [`Accumulation`] from
/// [`DistributedDataParallel::no_sync`].
pub struct DdpStep<'a, 'c, O> {
    ddp: &'a DistributedDataParallel<'c>,
    opt: &'a mut O,
}

impl<O> std::fmt::Debug for DdpStep<'_, '_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpStep").field("ddp", self.ddp).finish()
    }
}

impl<O: Optimizer> Target for DdpStep<'_, '_, O> {
    fn params(&self) -> &[(String, Var)] {
        &self.ddp.params
    }

    fn tracker(&self) -> &Tracker {
        &self.ddp.tracker
    }

    fn rank(&self) -> usize {
        self.ddp.comm.rank()
    }

    fn step_summed(&mut self, grads: &mut GradStore, at: &'static Location<'static>) -> Result<()> {
        let step = self.ddp.tracker.current();
        let opt = &mut *self.opt;
        self.ddp
            .step_with(grads, |g| opt.step(g))
            .map_err(|e| e.at(at, Some(step)))
    }
}

impl<O: Optimizer> Accumulate for DdpStep<'_, '_, O> {}

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
        assert!(matches!(e.kind(), K::InvalidArgument { .. }), "{e}");
        // A parameter straddling two buckets.
        let e = per_bucket([3, 2, 1].into_iter(), &buckets).unwrap_err();
        assert!(matches!(e.kind(), K::InvalidArgument { .. }), "{e}");
    }

    #[test]
    fn everything_in_one_bucket_under_a_large_cap() {
        let f = DType::BF16;
        let plans = BucketPlan::plan(&[(10, f), (20, f), (30, f)], DEFAULT_BUCKET_CAP);
        assert_eq!(plans[0].buckets, vec![0..60]);
    }
}
