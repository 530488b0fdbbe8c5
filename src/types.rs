//! Element types and reduction operators.

use nccl_sys::{ncclDataType_t, ncclRedOp_t};

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL can move and reduce. Sealed: the set is NCCL's `ncclDataType_t`.
///
/// ```
/// use nccl_safe::{DataType, NcclType};
/// assert_eq!(<half::bf16 as NcclType>::DATA_TYPE, DataType::Bfloat16);
/// ```
pub trait NcclType: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The matching `ncclDataType_t`.
    const DATA_TYPE: DataType;
}

/// NCCL's data types (`ncclDataType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// `ncclInt8`
    Int8,
    /// `ncclUint8`
    Uint8,
    /// `ncclInt32`
    Int32,
    /// `ncclUint32`
    Uint32,
    /// `ncclInt64`
    Int64,
    /// `ncclUint64`
    Uint64,
    /// `ncclFloat16`
    Float16,
    /// `ncclFloat32`
    Float32,
    /// `ncclFloat64`
    Float64,
    /// `ncclBfloat16`
    Bfloat16,
}

impl DataType {
    /// Every variant, in declaration order (`ALL[d as usize] == d`).
    pub(crate) const ALL: [DataType; 10] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
    ];

    /// The raw `ncclDataType_t`.
    #[inline]
    pub fn to_raw(self) -> ncclDataType_t {
        use nccl_sys::bindings as b;
        match self {
            DataType::Int8 => b::ncclInt8,
            DataType::Uint8 => b::ncclUint8,
            DataType::Int32 => b::ncclInt32,
            DataType::Uint32 => b::ncclUint32,
            DataType::Int64 => b::ncclInt64,
            DataType::Uint64 => b::ncclUint64,
            DataType::Float16 => b::ncclFloat16,
            DataType::Float32 => b::ncclFloat32,
            DataType::Float64 => b::ncclFloat64,
            DataType::Bfloat16 => b::ncclBfloat16,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// The name nccl-tests prints (`float`, `half`, `bfloat16`, `int32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "int8",
            DataType::Uint8 => "uint8",
            DataType::Int32 => "int32",
            DataType::Uint32 => "uint32",
            DataType::Int64 => "int64",
            DataType::Uint64 => "uint64",
            DataType::Float16 => "half",
            DataType::Float32 => "float",
            DataType::Float64 => "double",
            DataType::Bfloat16 => "bfloat16",
        }
    }
}

macro_rules! nccl_types {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl NcclType for $t {
            const DATA_TYPE: DataType = DataType::$v;
        }
    )*};
}

nccl_types! {
    i8 => Int8, u8 => Uint8, i32 => Int32, u32 => Uint32, i64 => Int64, u64 => Uint64,
    half::f16 => Float16, f32 => Float32, f64 => Float64, half::bf16 => Bfloat16,
}

/// NCCL's built-in reduction operators (`ncclRedOp_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// `ncclSum`
    Sum,
    /// `ncclProd`
    Prod,
    /// `ncclMax`
    Max,
    /// `ncclMin`
    Min,
    /// `ncclAvg`: the sum divided by the number of ranks.
    Avg,
}

impl ReduceOp {
    /// The raw `ncclRedOp_t`.
    #[inline]
    pub fn to_raw(self) -> ncclRedOp_t {
        use nccl_sys::bindings as b;
        match self {
            ReduceOp::Sum => b::ncclSum,
            ReduceOp::Prod => b::ncclProd,
            ReduceOp::Max => b::ncclMax,
            ReduceOp::Min => b::ncclMin,
            ReduceOp::Avg => b::ncclAvg,
        }
    }

    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }
}
