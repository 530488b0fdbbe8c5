//! One rank of the sweep: its communicator, stream and buffers, on a GPU or on the host
//! provider, behind one trait so the sweep is written once.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use nccl_safe::{AsStream, Communicator, NcclMemory, NcclType, RecvBuffer, Stream};

/// Errors of the bench: the crate's, cudarc's, or the bench's own text.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The bench's result type.
pub type Result<T> = std::result::Result<T, BoxError>;

/// An element type the sweep can fill with small integers and check exactly.
pub trait Elem: NcclType + DeviceRepr + ValidAsZeroBits + PartialEq + std::fmt::Debug {
    /// The nearest value of this type (inputs are small integers, exact in every type).
    fn from_f64(v: f64) -> Self;
    /// The value as `f64` (exact for every type here but large 64-bit integers).
    fn to_f64(self) -> f64;
    /// Whether it is an integer type (`avg` truncates).
    const INTEGER: bool;
    /// Relative tolerance for a result that NCCL may round differently (`avg` of floats).
    const EPSILON: f64;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_f64(self) -> f64 { self as f64 }
            const INTEGER: bool = true;
            const EPSILON: f64 = 0.0;
        }
    )*};
}
int_elem!(i8, u8, i32, u32, i64, u64);

impl Elem for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    const INTEGER: bool = false;
    const EPSILON: f64 = 4.0 * f32::EPSILON as f64;
}

impl Elem for f64 {
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
    const INTEGER: bool = false;
    const EPSILON: f64 = 4.0 * f64::EPSILON;
}

impl Elem for half::f16 {
    fn from_f64(v: f64) -> Self {
        half::f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
    const INTEGER: bool = false;
    const EPSILON: f64 = 4.0 * 0.000_976_562_5;
}

impl Elem for half::bf16 {
    fn from_f64(v: f64) -> Self {
        half::bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
    const INTEGER: bool = false;
    const EPSILON: f64 = 4.0 * 0.007_812_5;
}

/// What the sweep needs from one rank.
pub trait Rank {
    /// A buffer of `T` in the memory this rank's NCCL reads.
    type Buf<T: Elem>: RecvBuffer<T>;
    /// Its stream.
    type Stream: AsStream;
    /// Owned buffer (what `upload` returns).
    type Owned<T: Elem>: std::ops::DerefMut<Target = Self::Buf<T>>;

    /// The communicator.
    fn comm(&self) -> &Communicator;
    /// The stream collectives are issued on.
    fn stream(&self) -> &Self::Stream;
    /// A buffer holding `data`.
    fn upload<T: Elem>(&self, data: Vec<T>) -> Result<Self::Owned<T>>;
    /// Overwrites `buf` with `data` (same length).
    fn write<T: Elem>(&self, buf: &mut Self::Owned<T>, data: &[T]) -> Result<()>;
    /// The contents of `buf`.
    fn download<T: Elem>(&self, buf: &Self::Buf<T>) -> Result<Vec<T>>;
    /// Waits for the stream's work (what nccl-tests times up to).
    fn synchronize(&self) -> Result<()>;
}

/// A rank of the host provider: `Vec<T>` buffers, `Stream::Host`, done when a call returns.
pub struct HostRank {
    /// The communicator.
    pub comm: Communicator,
}

/// `Vec<T>` as an owned buffer (it is its own target).
pub struct HostBuf<T>(pub Vec<T>);

impl<T> std::ops::Deref for HostBuf<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T> std::ops::DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

impl Rank for HostRank {
    type Buf<T: Elem> = Vec<T>;
    type Stream = Stream;
    type Owned<T: Elem> = HostBuf<T>;

    fn comm(&self) -> &Communicator {
        &self.comm
    }
    fn stream(&self) -> &Stream {
        &Stream::Host
    }
    fn upload<T: Elem>(&self, data: Vec<T>) -> Result<HostBuf<T>> {
        Ok(HostBuf(data))
    }
    fn write<T: Elem>(&self, buf: &mut HostBuf<T>, data: &[T]) -> Result<()> {
        buf.0.copy_from_slice(data);
        Ok(())
    }
    fn download<T: Elem>(&self, buf: &Vec<T>) -> Result<Vec<T>> {
        Ok(buf.clone())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// A rank on a CUDA device: cudarc buffers and stream, NVIDIA's NCCL.
pub struct CudaRank {
    /// The communicator.
    pub comm: Communicator,
    /// The stream every collective of this rank runs on.
    pub stream: Arc<CudaStream>,
    /// The device's context.
    pub ctx: Arc<CudaContext>,
}

/// A `CudaSlice` as an owned buffer (it is its own target).
pub struct CudaBuf<T>(pub CudaSlice<T>);

impl<T> std::ops::Deref for CudaBuf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.0
    }
}

impl<T> std::ops::DerefMut for CudaBuf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.0
    }
}

impl Rank for CudaRank {
    type Buf<T: Elem> = CudaSlice<T>;
    type Stream = Arc<CudaStream>;
    type Owned<T: Elem> = CudaBuf<T>;

    fn comm(&self) -> &Communicator {
        &self.comm
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn upload<T: Elem>(&self, data: Vec<T>) -> Result<CudaBuf<T>> {
        Ok(CudaBuf(self.stream.clone_htod(&data)?))
    }
    fn write<T: Elem>(&self, buf: &mut CudaBuf<T>, data: &[T]) -> Result<()> {
        Ok(self.stream.memcpy_htod(data, &mut buf.0)?)
    }
    fn download<T: Elem>(&self, buf: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(buf)?)
    }
    fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}

/// Any rank, with its buffers from NCCL's allocator (`ncclMemAlloc`): what `-R` runs on.
pub struct NcclMemRank<'r, R>(pub &'r R);

/// An [`NcclMemory`] as an owned buffer (it is its own target).
pub struct NcclBuf<T: NcclType>(pub NcclMemory<T>);

impl<T: NcclType> std::ops::Deref for NcclBuf<T> {
    type Target = NcclMemory<T>;
    fn deref(&self) -> &NcclMemory<T> {
        &self.0
    }
}

impl<T: NcclType> std::ops::DerefMut for NcclBuf<T> {
    fn deref_mut(&mut self) -> &mut NcclMemory<T> {
        &mut self.0
    }
}

impl<R: Rank> Rank for NcclMemRank<'_, R>
where
    R::Stream: Clone + Into<Stream>,
{
    type Buf<T: Elem> = NcclMemory<T>;
    type Stream = R::Stream;
    type Owned<T: Elem> = NcclBuf<T>;

    fn comm(&self) -> &Communicator {
        self.0.comm()
    }
    fn stream(&self) -> &R::Stream {
        self.0.stream()
    }
    fn upload<T: Elem>(&self, data: Vec<T>) -> Result<NcclBuf<T>> {
        let mut mem = NcclMemory::alloc_zeros(self.comm(), data.len(), self.stream().clone())?;
        mem.copy_from_host(&data, self.stream())?;
        Ok(NcclBuf(mem))
    }
    fn write<T: Elem>(&self, buf: &mut NcclBuf<T>, data: &[T]) -> Result<()> {
        Ok(buf.0.copy_from_host(data, self.stream())?)
    }
    fn download<T: Elem>(&self, buf: &NcclMemory<T>) -> Result<Vec<T>> {
        Ok(buf.to_vec(self.stream())?)
    }
    fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
}
