//! Collectives on candle [`Tensor`]s: all-reduce, broadcast, all-gather, reduce-scatter.
//!
//! They run on the tensor's own storage through candle's `InplaceOp1` / `InplaceOp2` hooks:
//! on CPU tensors the host provider reads and writes the `Vec` inside `CpuStorage`; with
//! the `cuda` feature NVIDIA's NCCL reads and writes the `CudaSlice` inside `CudaStorage`,
//! on candle's own stream, with no copy to the host. Work on candle's stream is ordered
//! after the kernels that produced the tensor and before the ones that read it, so no
//! synchronization is needed. candle's stream is the per-thread stream, which NCCL, when it
//! launches from a thread of its own (two or more ranks), would take for that thread's:
//! nccl-safe then runs the collective on a stream of its own, joined to and from the
//! caller's per-thread stream by events.
//!
//! In-place operations ([`all_reduce`], [`broadcast`]) change the tensor's storage: every
//! tensor that shares it (a `reshape`, a `narrow`, a `Tensor::cat` of one tensor) sees
//! the change. Copy first (`t.copy()?`) to keep the original. [`all_gather`] and
//! [`reduce_scatter`] return a new tensor.
//!
//! Checked before NCCL sees anything, each a typed [`DistError`]: the element type (f32, f64,
//! f16, bf16), contiguity, the device (CPU tensors with a host-provider communicator, CUDA
//! tensors on the communicator's GPU), and the shapes.

use std::ops::Range;
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, DeviceLocation, InplaceOp1, InplaceOp2, Layout, Tensor};
use nccl_safe::{Communicator, NcclType, ReduceOp, Stream};

use std::panic::Location;

use crate::error::{DistError, DistErrorKind as K, DistResult as Result};

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc;

/// What runs on a tensor's storage.
#[derive(Clone, Copy, Debug)]
enum Kind<'r> {
    AllReduce(ReduceOp),
    Broadcast(usize),
    /// One all-reduce per range of the tensor's elements (the buckets of a flat buffer), back
    /// to back (on CUDA, on the stream).
    Buckets(ReduceOp, &'r [Range<usize>]),
    /// Into the mutable (first) tensor, from the second.
    AllGather,
    /// Into the mutable (first) tensor, from the second.
    ReduceScatter(ReduceOp),
}

/// candle's hook into its storage. nccl-safe's error is kept here, typed: candle's error
/// can carry only its text.
struct Collective<'a> {
    comm: &'a Communicator,
    kind: Kind<'a>,
    failed: Mutex<Option<nccl_safe::Error>>,
    /// The line the core crate records for the collective (`Op::at`): the user's, from the
    /// outermost public call of this crate in progress.
    caller: &'static Location<'static>,
    /// On CUDA, the stream to run on instead of candle's (the caller orders it).
    #[cfg(feature = "cuda")]
    on: Option<&'a std::sync::Arc<cudarc::driver::CudaStream>>,
}

impl<'a> Collective<'a> {
    #[track_caller]
    fn new(comm: &'a Communicator, kind: Kind<'a>) -> Collective<'a> {
        Collective {
            comm,
            kind,
            failed: Mutex::new(None),
            caller: crate::error::scope_caller().unwrap_or_else(Location::caller),
            #[cfg(feature = "cuda")]
            on: None,
        }
    }

    /// Keeps `e` and hands candle its text.
    fn fail(&self, e: nccl_safe::Error) -> candle_core::Error {
        let text = e.to_string();
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        candle_core::Error::Msg(text)
    }

    /// The typed error when nccl-safe failed, else candle's.
    #[track_caller]
    fn error(&self, e: candle_core::Error) -> DistError {
        match self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => e.into(),
            None => e.into(),
        }
    }

    fn name(&self) -> &'static str {
        match self.kind {
            Kind::AllReduce(_) | Kind::Buckets(..) => "nccl-safe all-reduce",
            Kind::Broadcast(_) => "nccl-safe broadcast",
            Kind::AllGather => "nccl-safe all-gather",
            Kind::ReduceScatter(_) => "nccl-safe reduce-scatter",
        }
    }

    /// The in-place kinds on host memory.
    fn host<T: NcclType>(&self, v: &mut [T]) -> nccl_safe::Result<()> {
        let (comm, s, caller) = (self.comm, &Stream::Host, self.caller);
        match self.kind {
            Kind::AllReduce(op) => comm.all_reduce_in_place_op(v, op, s)?.at(caller).run(),
            Kind::Broadcast(root) => comm.broadcast_in_place_op(v, root, s)?.at(caller).run(),
            // One call per bucket, back to back, as on CUDA: each is an operation of its
            // own that the watchdog follows (its notice, its timeout naming the rank
            // behind, `Config::elastic`'s revoke) and that names the caller's line. (As
            // one NCCL group, a stuck or lost rank failed the step in a way no recovery
            // took for a rank loss, with neither notice nor report.)
            Kind::Buckets(op, ranges) => ranges.iter().try_for_each(|r| {
                let bucket = v.get_mut(r.clone()).ok_or_else(|| out_of_range(r))?;
                comm.all_reduce_in_place_op(bucket, op, s)?.at(caller).run()
            }),
            Kind::AllGather | Kind::ReduceScatter(_) => unreachable!("two-tensor kinds"),
        }
    }

    /// The two-tensor kinds on host memory.
    fn host2<T: NcclType>(&self, out: &mut [T], inp: &[T]) -> nccl_safe::Result<()> {
        let (comm, s, at) = (self.comm, &Stream::Host, self.caller);
        match self.kind {
            Kind::AllGather => comm.all_gather_op(inp, out, s)?.at(at).run(),
            Kind::ReduceScatter(op) => comm.reduce_scatter_op(inp, out, op, s)?.at(at).run(),
            _ => unreachable!("in-place kinds"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda<T: NcclType + cudarc::driver::DeviceRepr>(
        &self,
        slice: &mut cudarc::driver::CudaSlice<T>,
        at: Range<usize>,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> nccl_safe::Result<()> {
        let (comm, caller) = (self.comm, self.caller);
        match self.kind {
            Kind::AllReduce(op) => comm
                .all_reduce_in_place_op(&mut view(slice, at)?, op, stream)?
                .at(caller)
                .run(),
            Kind::Broadcast(root) => comm
                .broadcast_in_place_op(&mut view(slice, at)?, root, stream)?
                .at(caller)
                .run(),
            Kind::Buckets(op, ranges) => ranges.iter().try_for_each(|r| {
                let r = at.start + r.start..at.start + r.end;
                comm.all_reduce_in_place_op(&mut view(slice, r)?, op, stream)?
                    .at(caller)
                    .run()
            }),
            Kind::AllGather | Kind::ReduceScatter(_) => unreachable!("two-tensor kinds"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda2<T: NcclType + cudarc::driver::DeviceRepr>(
        &self,
        out: &mut cudarc::driver::CudaSlice<T>,
        out_at: Range<usize>,
        inp: &cudarc::driver::CudaSlice<T>,
        inp_at: Range<usize>,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> nccl_safe::Result<()> {
        let mut o = out
            .try_slice_mut(out_at.clone())
            .ok_or_else(|| out_of_range(&out_at))?;
        let i = inp
            .try_slice(inp_at.clone())
            .ok_or_else(|| out_of_range(&inp_at))?;
        match self.kind {
            Kind::AllGather => self
                .comm
                .all_gather_op(&i, &mut o, stream)?
                .at(self.caller)
                .run(),
            Kind::ReduceScatter(op) => self
                .comm
                .reduce_scatter_op(&i, &mut o, op, stream)?
                .at(self.caller)
                .run(),
            _ => unreachable!("in-place kinds"),
        }
    }
}

/// Elements `r` of `slice`, as a view.
#[cfg(feature = "cuda")]
fn view<T>(
    slice: &mut cudarc::driver::CudaSlice<T>,
    r: Range<usize>,
) -> nccl_safe::Result<cudarc::driver::CudaViewMut<'_, T>> {
    let bounds = r.clone();
    slice.try_slice_mut(r).ok_or_else(|| out_of_range(&bounds))
}

fn out_of_range(r: &Range<usize>) -> nccl_safe::Error {
    nccl_safe::Error::InvalidArgument {
        call: "nccl-safe-candle",
        reason: format!("elements {r:?} are out of the tensor's buffer"),
    }
}

/// The element range of a contiguous layout (checked before the op; this is a guard).
fn offsets(layout: &Layout) -> candle_core::Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("a collective needs a contiguous tensor".into()))
}

/// Runs `$body` with `$v` bound to the storage's elements of a supported type.
macro_rules! cpu_dispatch {
    ($self:ident, $storage:expr, $v:ident => $body:expr) => {
        match $storage {
            CpuStorage::F32($v) => $body,
            CpuStorage::F64($v) => $body,
            CpuStorage::F16($v) => $body,
            CpuStorage::BF16($v) => $body,
            other => candle_core::bail!("{}: {:?} is not supported", $self.name(), other.dtype()),
        }
    };
}

impl InplaceOp1 for Collective<'_> {
    fn name(&self) -> &'static str {
        Collective::name(self)
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) = offsets(layout)?;
        cpu_dispatch!(self, storage, v => self.host(&mut v[start..end]).map_err(|e| self.fail(e)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        use candle_core::cuda_backend::CudaStorageSlice as S;
        let (start, end) = offsets(layout)?;
        // candle's stream (see the module's documentation), or the one the caller ordered.
        let stream = match self.on {
            Some(s) => s.clone(),
            None => storage.device.cuda_stream(),
        };
        let dtype = storage.dtype();
        let r = start..end;
        match &mut storage.slice {
            S::F32(s) => self.cuda(s, r, &stream),
            S::F64(s) => self.cuda(s, r, &stream),
            S::F16(s) => self.cuda(s, r, &stream),
            S::BF16(s) => self.cuda(s, r, &stream),
            _ => candle_core::bail!("{}: {dtype:?} is not supported", self.name()),
        }
        .map_err(|e| self.fail(e))
    }
}

impl InplaceOp2 for Collective<'_> {
    fn name(&self) -> &'static str {
        Collective::name(self)
    }

    fn cpu_fwd(
        &self,
        out: &mut CpuStorage,
        out_layout: &Layout,
        inp: &CpuStorage,
        inp_layout: &Layout,
    ) -> candle_core::Result<()> {
        let (os, oe) = offsets(out_layout)?;
        let (is, ie) = offsets(inp_layout)?;
        let r = match (out, inp) {
            (CpuStorage::F32(o), CpuStorage::F32(i)) => self.host2(&mut o[os..oe], &i[is..ie]),
            (CpuStorage::F64(o), CpuStorage::F64(i)) => self.host2(&mut o[os..oe], &i[is..ie]),
            (CpuStorage::F16(o), CpuStorage::F16(i)) => self.host2(&mut o[os..oe], &i[is..ie]),
            (CpuStorage::BF16(o), CpuStorage::BF16(i)) => self.host2(&mut o[os..oe], &i[is..ie]),
            (o, i) => candle_core::bail!(
                "{}: {:?} into {:?} is not supported",
                self.name(),
                i.dtype(),
                o.dtype()
            ),
        };
        r.map_err(|e| self.fail(e))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        out: &mut candle_core::CudaStorage,
        out_layout: &Layout,
        inp: &candle_core::CudaStorage,
        inp_layout: &Layout,
    ) -> candle_core::Result<()> {
        use candle_core::cuda_backend::CudaStorageSlice as S;
        let (os, oe) = offsets(out_layout)?;
        let (is, ie) = offsets(inp_layout)?;
        let stream = out.device.cuda_stream();
        let (o, i) = (os..oe, is..ie);
        match (&mut out.slice, &inp.slice) {
            (S::F32(a), S::F32(b)) => self.cuda2(a, o, b, i, &stream),
            (S::F64(a), S::F64(b)) => self.cuda2(a, o, b, i, &stream),
            (S::F16(a), S::F16(b)) => self.cuda2(a, o, b, i, &stream),
            (S::BF16(a), S::BF16(b)) => self.cuda2(a, o, b, i, &stream),
            _ => candle_core::bail!("{}: this element type is not supported", self.name()),
        }
        .map_err(|e| self.fail(e))
    }
}

/// The element types the collectives take.
pub const SUPPORTED_DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Checks what NCCL would otherwise meet as a bad buffer: the element type, contiguity and
/// the device.
pub(crate) fn check(comm: &Communicator, call: &'static str, t: &Tensor) -> Result<()> {
    if !SUPPORTED_DTYPES.contains(&t.dtype()) {
        return Err(K::UnsupportedDtype {
            call,
            dtype: t.dtype(),
        }
        .into());
    }
    if !t.is_contiguous() {
        return Err(K::NotContiguous {
            call,
            shape: t.dims().to_vec(),
            stride: t.stride().to_vec(),
        }
        .into());
    }
    let ok = match (t.device().location(), comm.cuda_ordinal()) {
        (DeviceLocation::Cpu, None) => true,
        (DeviceLocation::Cuda { gpu_id }, Some(d)) => gpu_id == d,
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(K::WrongDevice {
            call,
            tensor: format!("{:?}", t.device().location()),
            comm: match comm.cuda_ordinal() {
                None => "the host provider (which takes CPU tensors)".into(),
                Some(d) => format!("CUDA device {d}"),
            },
        }
        .into())
    }
}

fn run1(comm: &Communicator, t: &Tensor, kind: Kind<'_>) -> Result<()> {
    let op = Collective::new(comm, kind);
    t.inplace_op1(&op).map_err(|e| op.error(e))
}

fn run2(comm: &Communicator, out: &Tensor, inp: &Tensor, kind: Kind<'_>) -> Result<()> {
    let op = Collective::new(comm, kind);
    out.inplace_op2(inp, &op).map_err(|e| op.error(e))
}

/// Reduces `t` over all ranks, in place: every rank ends with the sum (or average, min,
/// max, product) of every rank's `t`. Every tensor sharing `t`'s storage sees the result.
#[track_caller]
pub fn all_reduce(comm: &Communicator, t: &Tensor, op: ReduceOp) -> Result<()> {
    let (at, _scope) = crate::error::caller_scope();
    all_reduce_inner(comm, t, op).map_err(|e| e.at(at, None))
}

fn all_reduce_inner(comm: &Communicator, t: &Tensor, op: ReduceOp) -> Result<()> {
    check(comm, "all_reduce", t)?;
    run1(comm, t, Kind::AllReduce(op))
}

/// Copies rank `root`'s `t` into every rank's `t`, in place (all ranks pass tensors of the
/// same number of elements).
#[track_caller]
pub fn broadcast(comm: &Communicator, t: &Tensor, root: usize) -> Result<()> {
    let (at, _scope) = crate::error::caller_scope();
    broadcast_inner(comm, t, root).map_err(|e| e.at(at, None))
}

fn broadcast_inner(comm: &Communicator, t: &Tensor, root: usize) -> Result<()> {
    check(comm, "broadcast", t)?;
    run1(comm, t, Kind::Broadcast(root))
}

/// Every rank's `t`, concatenated along the first dimension in rank order (a scalar
/// becomes a vector of `world_size` values).
#[track_caller]
pub fn all_gather(comm: &Communicator, t: &Tensor) -> Result<Tensor> {
    let (at, _scope) = crate::error::caller_scope();
    all_gather_inner(comm, t).map_err(|e| e.at(at, None))
}

fn all_gather_inner(comm: &Communicator, t: &Tensor) -> Result<Tensor> {
    check(comm, "all_gather", t)?;
    let mut dims = t.dims().to_vec();
    match dims.first_mut() {
        Some(d) => *d *= comm.world_size(),
        None => dims.push(comm.world_size()),
    }
    let out = Tensor::zeros(dims, t.dtype(), t.device())?;
    run2(comm, &out, t, Kind::AllGather)?;
    Ok(out)
}

/// Reduces `t` over all ranks and leaves rank `r` the `r`-th of `world_size` equal parts
/// along the first dimension, which must divide evenly.
#[track_caller]
pub fn reduce_scatter(comm: &Communicator, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let (at, _scope) = crate::error::caller_scope();
    reduce_scatter_inner(comm, t, op).map_err(|e| e.at(at, None))
}

fn reduce_scatter_inner(comm: &Communicator, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
    check(comm, "reduce_scatter", t)?;
    let world = comm.world_size();
    let mut dims = t.dims().to_vec();
    match dims.first_mut() {
        Some(d) if *d % world == 0 => *d /= world,
        _ => {
            return Err(K::Shape {
                call: "reduce_scatter",
                reason: format!(
                    "the first dimension of shape {:?} must divide into {world} equal parts",
                    t.dims()
                ),
            }
            .into())
        }
    }
    let out = Tensor::zeros(dims, t.dtype(), t.device())?;
    run2(comm, &out, t, Kind::ReduceScatter(op))?;
    Ok(out)
}

/// A one-element tensor (a loss, say) reduced over all ranks, as `f64`, for logging.
/// `t` itself is left unchanged.
#[track_caller]
pub fn all_reduce_scalar(comm: &Communicator, t: &Tensor, op: ReduceOp) -> Result<f64> {
    let (at, _scope) = crate::error::caller_scope();
    all_reduce_scalar_inner(comm, t, op).map_err(|e| e.at(at, None))
}

fn all_reduce_scalar_inner(comm: &Communicator, t: &Tensor, op: ReduceOp) -> Result<f64> {
    if t.elem_count() != 1 {
        return Err(K::Shape {
            call: "all_reduce_scalar",
            reason: format!("a scalar has one element; shape {:?} has more", t.dims()),
        }
        .into());
    }
    // A fresh f64 copy: never the caller's storage.
    let v = t.flatten_all()?.to_dtype(DType::F64)?.copy()?;
    all_reduce_inner(comm, &v, op)?;
    Ok(v.to_vec1::<f64>()?[0])
}

/// One all-reduce per range of `flat`'s elements, in place (the buckets of a flat
/// gradient buffer).
pub(crate) fn all_reduce_buckets(
    comm: &Communicator,
    flat: &Tensor,
    op: ReduceOp,
    ranges: &[Range<usize>],
) -> Result<()> {
    check(comm, "all_reduce (buckets)", flat)?;
    run1(comm, flat, Kind::Buckets(op, ranges))
}

/// All-reduces `t` in place on `stream`, a CUDA stream of `t`'s context other than candle's:
/// the caller orders it against candle's stream (see [`crate::DistributedDataParallel`]).
#[cfg(feature = "cuda")]
pub(crate) fn all_reduce_on(
    comm: &Communicator,
    t: &Tensor,
    op: ReduceOp,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> Result<()> {
    check(comm, "all_reduce (bucket)", t)?;
    let mut c = Collective::new(comm, Kind::AllReduce(op));
    c.on = Some(stream);
    t.inplace_op1(&c).map_err(|e| c.error(e))
}

/// This rank's equal part of a batch along its first dimension, which must divide by the
/// number of ranks (so that the average of the ranks' mean gradients is the whole batch's):
/// rank `r` gets rows `r * n / world ..(r + 1) * n / world`. A view: no copy. The one
/// sharding helper of [`DistributedDataParallel`](crate::DistributedDataParallel),
/// [`DdpOptimizer`](crate::DdpOptimizer) and
/// [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer) (their `shard_batch`).
#[track_caller]
pub fn shard_batch(comm: &Communicator, batch: &Tensor) -> Result<Tensor> {
    let (at, _scope) = crate::error::caller_scope();
    shard_batch_inner(comm, batch).map_err(|e| e.at(at, None))
}

fn shard_batch_inner(comm: &Communicator, batch: &Tensor) -> Result<Tensor> {
    let (n, world) = (batch.dim(0)?, comm.world_size());
    if n % world != 0 {
        return Err(K::Shape {
            call: "shard_batch",
            reason: format!("a batch of {n} does not split into {world} equal parts"),
        }
        .into());
    }
    Ok(batch.narrow(0, comm.rank() * (n / world), n / world)?)
}
