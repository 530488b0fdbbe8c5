//! Element types and reduction operators.

use nccl_sys::{ncclDataType_t, ncclRedOp_t};

use crate::error::{Error, Result};
use crate::library::Library;
use crate::version::Version;

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL can move and reduce. Sealed: the set is NCCL's `ncclDataType_t`.
///
/// The fp8 types come from the `float8` crate ([`float8::F8E4M3`], [`float8::F8E5M2`], the
/// types cudarc's `f8` feature and candle use) and need NCCL 2.24 or newer
/// ([`DataType::since`]): on an older NCCL an fp8 operation fails with
/// [`crate::Error::Unsupported`] before NCCL sees it.
///
/// ```
/// use nccl_safe::{DataType, NcclType};
/// assert_eq!(<half::bf16 as NcclType>::DATA_TYPE, DataType::Bfloat16);
/// assert_eq!(<float8::F8E4M3 as NcclType>::DATA_TYPE, DataType::Float8e4m3);
/// ```
pub trait NcclType:
    sealed::Sealed
    + Copy
    + Send
    + Sync
    + 'static
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
{
    /// The matching `ncclDataType_t`.
    const DATA_TYPE: DataType;
}

/// Declares [`DataType`], one row per type: the variant, its C name, its size in bytes and
/// the name nccl-tests prints. Each method below is a column.
macro_rules! data_types {
    ($($(#[$doc:meta])* $v:ident = $c:ident, $size:literal, $name:literal;)*) => {
        /// NCCL's data types (`ncclDataType_t`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum DataType {
            $($(#[$doc])* $v,)*
        }

        impl DataType {
            /// Every variant, in declaration order (`ALL[d as usize] == d`).
            #[cfg_attr(not(feature = "diag"), allow(dead_code))]
            pub(crate) const ALL: &[DataType] = &[$(DataType::$v),*];

            /// The raw `ncclDataType_t`.
            #[inline]
            pub fn to_raw(self) -> ncclDataType_t {
                match self {
                    $(DataType::$v => nccl_sys::bindings::$c,)*
                }
            }

            /// Bytes per element.
            pub fn size(self) -> usize {
                match self {
                    $(DataType::$v => $size,)*
                }
            }

            /// The name nccl-tests prints (`float`, `half`, `bfloat16`, `int32`, ...).
            pub fn name(self) -> &'static str {
                match self {
                    $(DataType::$v => $name,)*
                }
            }

            /// `ncclFloat8e4m3`, `ncclFloat32`, ...: the C name, as errors report it.
            pub fn c_name(self) -> &'static str {
                match self {
                    $(DataType::$v => stringify!($c),)*
                }
            }
        }
    };
}

data_types! {
    /// `ncclInt8`
    Int8 = ncclInt8, 1, "int8";
    /// `ncclUint8`
    Uint8 = ncclUint8, 1, "uint8";
    /// `ncclInt32`
    Int32 = ncclInt32, 4, "int32";
    /// `ncclUint32`
    Uint32 = ncclUint32, 4, "uint32";
    /// `ncclInt64`
    Int64 = ncclInt64, 8, "int64";
    /// `ncclUint64`
    Uint64 = ncclUint64, 8, "uint64";
    /// `ncclFloat16`
    Float16 = ncclFloat16, 2, "half";
    /// `ncclFloat32`
    Float32 = ncclFloat32, 4, "float";
    /// `ncclFloat64`
    Float64 = ncclFloat64, 8, "double";
    /// `ncclBfloat16`
    Bfloat16 = ncclBfloat16, 2, "bfloat16";
    /// `ncclFloat8e4m3` (NCCL 2.24+): [`float8::F8E4M3`].
    Float8e4m3 = ncclFloat8e4m3, 1, "f8e4m3";
    /// `ncclFloat8e5m2` (NCCL 2.24+): [`float8::F8E5M2`].
    Float8e5m2 = ncclFloat8e5m2, 1, "f8e5m2";
}

impl DataType {
    /// The NCCL release that introduced the type, for types newer than the oldest release
    /// this crate loads (the fp8 types: 2.24); `None` for the others.
    ///
    /// ```
    /// use nccl_safe::{DataType, Version};
    /// assert_eq!(DataType::Float8e5m2.since(), Some(Version::new(2, 24, 0)));
    /// assert_eq!(DataType::Float32.since(), None);
    /// ```
    pub const fn since(self) -> Option<Version> {
        match self {
            DataType::Float8e4m3 | DataType::Float8e5m2 => Some(Version::new(2, 24, 0)),
            _ => None,
        }
    }

    /// `Ok` when `lib` knows the type; [`Error::Unsupported`] naming it, the release that
    /// introduced it and the loaded release otherwise.
    #[inline]
    pub fn check_supported(self, lib: &Library) -> Result<()> {
        match self.since() {
            Some(needs) if lib.version() < needs => Err(self.unsupported(needs, lib)),
            _ => Ok(()),
        }
    }

    #[cold]
    fn unsupported(self, needs: Version, lib: &Library) -> Error {
        Error::Unsupported {
            symbol: self.c_name(),
            needs,
            found: lib.version(),
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
    float8::F8E4M3 => Float8e4m3, float8::F8E5M2 => Float8e5m2,
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
    /// `ncclAvg`: the mean over the ranks. NCCL computes it for integers as the sum divided
    /// by the number of ranks (truncating), and for floating-point types as the sum of each
    /// input times `1/nranks` rounded to the type, so it does not overflow where the sum
    /// would, and can differ from sum-then-divide in the last bit.
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
