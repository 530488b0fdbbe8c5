//! The host-side types of NCCL's device API header (`nccl_device/core.h`, NCCL 2.29+), which
//! bindgen's input (`nccl.h`) does not include: written by hand from tag `v2.30.7-1`
//! (core.h:162-195; the same layout as v2.29.7-1's core.h:150-167), with layout checks.
#![allow(non_camel_case_types, non_snake_case)]

use core::ffi::{c_int, c_uint};

use crate::bindings::{ncclComm_t, ncclResult_t, NCCL_API_MAGIC};

/// `ncclGinType_t`: the kind of GPU-initiated networking a communicator has.
pub type ncclGinType_t = c_uint;
/// No GPU-initiated networking.
pub const NCCL_GIN_TYPE_NONE: ncclGinType_t = 0;
/// Through NCCL's proxy thread.
pub const NCCL_GIN_TYPE_PROXY: ncclGinType_t = 2;
/// GPUDirect Async Kernel-Initiated.
pub const NCCL_GIN_TYPE_GDAKI: ncclGinType_t = 3;
/// GPI.
pub const NCCL_GIN_TYPE_GPI: ncclGinType_t = 4;

/// `ncclCommProperties_t` (`struct ncclCommProperties`): what `ncclCommQueryProperties`
/// writes. The first three fields are NCCL's to check: fill them with
/// [`initializer`](Self::initializer) (`NCCL_COMM_PROPERTIES_INITIALIZER`). NCCL 2.29.2
/// and 2.29.3 write only the fields up to `ginType` (a prefix of this layout,
/// dev_runtime.cc:1169-1181 of v2.29.7-1), for a `version` in that range.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ncclCommProperties_t {
    /// `sizeof(ncclCommProperties_t)`.
    pub size: usize,
    /// `NCCL_API_MAGIC`: checked by NCCL (dev_runtime.cc:1465 of v2.30.7-1).
    pub magic: c_uint,
    /// The NCCL version the caller's layout is: NCCL picks its compatibility by it.
    pub version: c_uint,
    /// The rank.
    pub rank: c_int,
    /// The number of ranks.
    pub nRanks: c_int,
    /// The CUDA device.
    pub cudaDev: c_int,
    /// The NVML device.
    pub nvmlDev: c_int,
    /// Whether the device API (symmetric memory) is supported.
    pub deviceApiSupport: bool,
    /// Whether NVLS multicast is supported.
    pub multimemSupport: bool,
    /// The GIN type ([`NCCL_GIN_TYPE_NONE`], ...).
    pub ginType: ncclGinType_t,
    /// The number of LSA teams (versions after 2.29.3).
    pub nLsaTeams: c_int,
    /// Whether host-initiated RMA is supported (versions after 2.29.3).
    pub hostRmaSupport: bool,
    /// The railed GIN type (versions after 2.29.3).
    pub railedGinType: ncclGinType_t,
}

const _: () = assert!(core::mem::size_of::<ncclCommProperties_t>() == 56);
const _: () = assert!(core::mem::align_of::<ncclCommProperties_t>() == 8);
const _: () = assert!(core::mem::offset_of!(ncclCommProperties_t, ginType) == 36);
const _: () = assert!(core::mem::offset_of!(ncclCommProperties_t, railedGinType) == 48);

impl ncclCommProperties_t {
    /// `NCCL_COMM_PROPERTIES_INITIALIZER` for a caller of NCCL `version` (a version code),
    /// the other fields zero.
    pub const fn initializer(version: c_uint) -> Self {
        ncclCommProperties_t {
            size: core::mem::size_of::<ncclCommProperties_t>(),
            magic: NCCL_API_MAGIC,
            version,
            rank: 0,
            nRanks: 0,
            cudaDev: 0,
            nvmlDev: 0,
            deviceApiSupport: false,
            multimemSupport: false,
            ginType: NCCL_GIN_TYPE_NONE,
            nLsaTeams: 0,
            hostRmaSupport: false,
            railedGinType: NCCL_GIN_TYPE_NONE,
        }
    }
}

extern "C" {
    /// `ncclCommQueryProperties` (NCCL 2.29+), core.h:194 of v2.30.7-1. Declared for the
    /// function table's signature check only (never linked).
    pub fn ncclCommQueryProperties(
        comm: ncclComm_t,
        props: *mut ncclCommProperties_t,
    ) -> ncclResult_t;
}
