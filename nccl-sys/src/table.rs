//! The NCCL entry points as a table of function pointers.
//!
//! One macro lists every entry point once, with its C signature and, for the optional
//! ones, the NCCL version that introduced it. From that list come the [`FunctionTable`]
//! struct, its single filling path [`FunctionTable::load`], the symbol lists, and a
//! compile-time check that every signature equals bindgen's prototype from `nccl.h`.

use core::ffi::{c_char, c_int, c_void, CStr};
use core::fmt;

use crate::bindings::*;
use crate::device::*;

/// An entry point that the table knows, with the NCCL version that introduced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Symbol {
    /// The C name, e.g. `"ncclAlltoAll"`.
    pub name: &'static str,
    /// `(major, minor)` of the first NCCL release that exports it. Required symbols say `(2, 18)`.
    pub since: (u32, u32),
}

/// Required symbols absent from a library: it cannot back a [`FunctionTable`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingSymbol {
    /// Every required symbol that the lookup did not find, in table order.
    pub names: Vec<&'static str>,
}

impl fmt::Display for MissingSymbol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "missing required NCCL symbol(s): {}",
            self.names.join(", ")
        )
    }
}

impl std::error::Error for MissingSymbol {}

macro_rules! function_table {
    (
        required {
            $( fn $rname:ident ( $( $rarg:ident : $rty:ty ),* $(,)? ) -> $rret:ty ; )*
        }
        optional {
            $( [$omaj:literal . $omin:literal] fn $oname:ident ( $( $oarg:ident : $oty:ty ),* $(,)? ) -> $oret:ty ; )*
        }
    ) => {
        /// NCCL's entry points as function pointers.
        ///
        /// Required fields are the API of NCCL 2.18, the oldest release this crate supports;
        /// `Option` fields were added later and are `None` when the provider lacks them.
        /// Field names are NCCL's C names.
        #[allow(non_snake_case)]
        #[derive(Clone, Copy)]
        pub struct FunctionTable {
            $(
                #[doc = concat!("`", stringify!($rname), "` (required).")]
                pub $rname: unsafe extern "C" fn($($rty),*) -> $rret,
            )*
            $(
                #[doc = concat!("`", stringify!($oname), "` (NCCL ", stringify!($omaj), ".", stringify!($omin), " and later).")]
                pub $oname: Option<unsafe extern "C" fn($($oty),*) -> $oret>,
            )*
        }

        /// One entry point of the table, named by its C name: a one-word `Copy` value
        /// that stands for the call where a name would (the flight recorder stores it as
        /// an integer). [`name`](Self::name) and [`since`](Self::since) come from the
        /// table's row.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u16)]
        pub enum EntryPoint {
            $(
                #[doc = concat!("`", stringify!($rname), "` (required).")]
                $rname,
            )*
            $(
                #[doc = concat!("`", stringify!($oname), "` (NCCL ", stringify!($omaj), ".", stringify!($omin), " and later).")]
                $oname,
            )*
        }

        impl EntryPoint {
            /// Every entry point, in table order (the required ones first); entry `i` is
            /// the one whose [`index`](Self::index) is `i`.
            pub const ALL: &'static [EntryPoint] = &[
                $( EntryPoint::$rname, )*
                $( EntryPoint::$oname, )*
            ];

            /// The C name, e.g. `"ncclAllReduce"`.
            #[inline]
            pub const fn name(self) -> &'static str {
                match self {
                    $( EntryPoint::$rname => stringify!($rname), )*
                    $( EntryPoint::$oname => stringify!($oname), )*
                }
            }

            /// `(major, minor)` of the first NCCL release that exports it: for a required
            /// entry point, [`MIN_SUPPORTED_VERSION`](crate::MIN_SUPPORTED_VERSION).
            pub const fn since(self) -> (u32, u32) {
                match self {
                    $( EntryPoint::$rname => crate::MIN_SUPPORTED_VERSION, )*
                    $( EntryPoint::$oname => ($omaj, $omin), )*
                }
            }

            /// Whether the table holds it as an `Option` (an entry point newer than
            /// NCCL 2.18).
            pub const fn is_optional(self) -> bool {
                match self {
                    $( EntryPoint::$rname => false, )*
                    $( EntryPoint::$oname => true, )*
                }
            }
        }

        /// Every required entry point, in table order.
        pub const REQUIRED_SYMBOLS: &[&str] = &[$( stringify!($rname) ),*];

        /// Every optional entry point, with the release that introduced it.
        pub const OPTIONAL_SYMBOLS: &[Symbol] = &[
            $( Symbol { name: stringify!($oname), since: ($omaj, $omin) } ),*
        ];

        // Each signature above must be exactly bindgen's prototype from nccl.h. These
        // constants only type-check (they are never used, so nothing is linked).
        $( const _: unsafe extern "C" fn($($rty),*) -> $rret = $rname; )*
        $( const _: unsafe extern "C" fn($($oty),*) -> $oret = $oname; )*

        impl FunctionTable {
            /// Fills the table by asking `lookup` for each entry point by its C name.
            ///
            /// This is the only way a table is built: a `dlopen`ed library passes a closure
            /// over `dlsym`, an in-process provider passes one over its own functions.
            /// A null pointer means "absent": an error for a required symbol (every missing
            /// one is listed), `None` for an optional one.
            ///
            /// # Safety
            /// Every non-null pointer that `lookup` returns for a name must be a function with
            /// exactly NCCL's C signature for that name, and must stay callable for as long as
            /// the table (or any copy of it) is used.
            #[allow(non_snake_case)]
            pub unsafe fn load(
                mut lookup: impl FnMut(&CStr) -> *const c_void,
            ) -> Result<Self, MissingSymbol> {
                let mut missing = Vec::new();
                $(
                    let $rname = lookup(
                        // SAFETY: the literal ends in a NUL and has no other.
                        unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($rname), "\0").as_bytes()) }
                    );
                    if $rname.is_null() {
                        missing.push(stringify!($rname));
                    }
                )*
                if !missing.is_empty() {
                    return Err(MissingSymbol { names: missing });
                }
                Ok(Self {
                    $(
                        // SAFETY: non-null (checked above) and, by the caller's contract, a
                        // function with this exact signature.
                        $rname: unsafe {
                            core::mem::transmute::<*const c_void, unsafe extern "C" fn($($rty),*) -> $rret>($rname)
                        },
                    )*
                    $(
                        $oname: {
                            let p = lookup(
                                // SAFETY: the literal ends in a NUL and has no other.
                                unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($oname), "\0").as_bytes()) }
                            );
                            if p.is_null() {
                                None
                            } else {
                                // SAFETY: non-null and, by the caller's contract, a function
                                // with this exact signature.
                                Some(unsafe {
                                    core::mem::transmute::<*const c_void, unsafe extern "C" fn($($oty),*) -> $oret>(p)
                                })
                            }
                        },
                    )*
                })
            }

            /// The entry point named `name` (a C name such as `c"ncclAllReduce"`), as the
            /// pointer [`FunctionTable::load`] takes back: null for an unknown name or an
            /// absent optional entry point. So a provider that builds its table as a
            /// struct literal serves lookups by name from the same list.
            pub fn get(&self, name: &CStr) -> *const c_void {
                match name.to_bytes() {
                    $( n if n == stringify!($rname).as_bytes() => self.$rname as *const c_void, )*
                    $( n if n == stringify!($oname).as_bytes() => {
                        self.$oname.map_or(core::ptr::null(), |f| f as *const c_void)
                    } )*
                    _ => core::ptr::null(),
                }
            }

            /// Whether the table has `entry`: always for a required one, for an optional
            /// one when its provider exports it. For a constant `entry` this is one load.
            #[inline]
            pub const fn has(&self, entry: EntryPoint) -> bool {
                match entry {
                    $( EntryPoint::$rname => true, )*
                    $( EntryPoint::$oname => self.$oname.is_some(), )*
                }
            }

            /// The names of the optional entry points this table has.
            pub fn present_optional(&self) -> Vec<&'static str> {
                let mut v = Vec::new();
                $( if self.$oname.is_some() { v.push(stringify!($oname)); } )*
                v
            }
        }
    };
}

impl EntryPoint {
    /// Its position in [`EntryPoint::ALL`]: a small integer for compact storage, read back
    /// with [`from_index`](Self::from_index).
    #[inline]
    pub const fn index(self) -> u16 {
        self as u16
    }

    /// The entry point at `index` in [`EntryPoint::ALL`].
    #[inline]
    pub fn from_index(index: u16) -> Option<EntryPoint> {
        EntryPoint::ALL.get(usize::from(index)).copied()
    }

    /// The entry point of C name `name`.
    pub fn from_name(name: &str) -> Option<EntryPoint> {
        EntryPoint::ALL.iter().copied().find(|e| e.name() == name)
    }

    /// The collective it makes, if it is one of [`Collective`]'s entry points.
    #[inline]
    pub const fn collective(self) -> Option<Collective> {
        Collective::of(self)
    }
}

impl fmt::Display for EntryPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl PartialEq<str> for EntryPoint {
    fn eq(&self, other: &str) -> bool {
        self.name() == other
    }
}

impl PartialEq<&str> for EntryPoint {
    fn eq(&self, other: &&str) -> bool {
        self.name() == *other
    }
}

impl PartialEq<EntryPoint> for &str {
    fn eq(&self, other: &EntryPoint) -> bool {
        *self == other.name()
    }
}

/// The release that introduced an optional entry point; `None` for a required or unknown name.
pub fn optional_since(name: &str) -> Option<(u32, u32)> {
    OPTIONAL_SYMBOLS
        .iter()
        .find(|s| s.name == name)
        .map(|s| s.since)
}

impl fmt::Debug for FunctionTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FunctionTable")
            .field("required", &REQUIRED_SYMBOLS.len())
            .field("optional_present", &self.present_optional())
            .finish()
    }
}

function_table! {
    required {
        fn ncclGetVersion(version: *mut c_int) -> ncclResult_t;
        fn ncclGetUniqueId(unique_id: *mut ncclUniqueId) -> ncclResult_t;
        fn ncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId, rank: c_int, config: *mut ncclConfig_t) -> ncclResult_t;
        fn ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId, rank: c_int) -> ncclResult_t;
        fn ncclCommInitAll(comm: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t;
        fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t;
        fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t;
        fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t;
        fn ncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t) -> ncclResult_t;
        fn ncclGetErrorString(result: ncclResult_t) -> *const c_char;
        fn ncclGetLastError(comm: ncclComm_t) -> *const c_char;
        fn ncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t) -> ncclResult_t;
        fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t;
        fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t;
        fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t;
        fn ncclRedOpCreatePreMulSum(op: *mut ncclRedOp_t, scalar: *mut c_void, datatype: ncclDataType_t, residence: ncclScalarResidence_t, comm: ncclComm_t) -> ncclResult_t;
        fn ncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t;
        fn ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclBcast(buff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclSend(sendbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclRecv(recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclGroupStart() -> ncclResult_t;
        fn ncclGroupEnd() -> ncclResult_t;
    }
    optional {
        [2 . 19] fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t;
        [2 . 19] fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t;
        [2 . 19] fn ncclCommRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> ncclResult_t;
        [2 . 19] fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t;
        [2 . 22] fn ncclGroupSimulateEnd(sim_info: *mut ncclSimInfo_t) -> ncclResult_t;
        [2 . 23] fn ncclCommInitRankScalable(newcomm: *mut ncclComm_t, nranks: c_int, myrank: c_int, n_id: c_int, comm_ids: *mut ncclUniqueId, config: *mut ncclConfig_t) -> ncclResult_t;
        [2 . 27] fn ncclCommShrink(comm: ncclComm_t, exclude_ranks_list: *mut c_int, exclude_ranks_count: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t, shrink_flags: c_int) -> ncclResult_t;
        [2 . 27] fn ncclCommWindowRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, win: *mut ncclWindow_t, win_flags: c_int) -> ncclResult_t;
        [2 . 27] fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t;
        [2 . 28] fn ncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        [2 . 28] fn ncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        [2 . 28] fn ncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        [2 . 29] fn ncclCommRevoke(comm: ncclComm_t, revoke_flags: c_int) -> ncclResult_t;
        [2 . 30] fn ncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t;
        [2 . 30] fn ncclCommResume(comm: ncclComm_t) -> ncclResult_t;
        [2 . 30] fn ncclCommMemStats(comm: ncclComm_t, stat: ncclCommMemStat_t, value: *mut u64) -> ncclResult_t;
        [2 . 29] fn ncclWinGetUserPtr(comm: ncclComm_t, win: ncclWindow_t, out_user_ptr: *mut *mut c_void) -> ncclResult_t;
        [2 . 29] fn ncclCommGetUniqueId(comm: ncclComm_t, unique_id: *mut ncclUniqueId) -> ncclResult_t;
        [2 . 29] fn ncclCommGrow(comm: ncclComm_t, n_ranks: c_int, unique_id: *const ncclUniqueId, rank: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t) -> ncclResult_t;
        [2 . 29] fn ncclPutSignal(localbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int, peer_win: ncclWindow_t, peer_win_offset: usize, sig_idx: c_int, ctx: c_int, flags: u32, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        [2 . 29] fn ncclSignal(peer: c_int, sig_idx: c_int, ctx: c_int, flags: u32, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        [2 . 29] fn ncclWaitSignal(n_desc: c_int, signal_descs: *mut ncclWaitSignalDesc_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        [2 . 31] fn ncclAllReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t;
        [2 . 31] fn ncclBroadcastConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t;
        [2 . 31] fn ncclReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t;
        [2 . 31] fn ncclAllGatherConfig(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t;
        [2 . 31] fn ncclReduceScatterConfig(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t;
        [2 . 31] fn ncclAlltoAllConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t;
        [2 . 31] fn ncclGatherConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t;
        [2 . 31] fn ncclScatterConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t;
        [2 . 32] fn ncclSetEncryption(config: *const ncclEncryptionConfig_t) -> ncclResult_t;
        // Added after the 2.32 rows so that earlier entry points keep their index.
        [2 . 29] fn ncclCommQueryProperties(comm: ncclComm_t, props: *mut ncclCommProperties_t) -> ncclResult_t;
        // NCCL 2.30's parameter API (param/c_api.cc of v2.30.7-1), after the rows above
        // for the same reason.
        [2 . 30] fn ncclParamBind(out: *mut ncclParamHandle_t, key: *const c_char) -> ncclResult_t;
        [2 . 30] fn ncclParamGetI8(h: ncclParamHandle_t, out: *mut i8) -> ncclResult_t;
        [2 . 30] fn ncclParamGetI16(h: ncclParamHandle_t, out: *mut i16) -> ncclResult_t;
        [2 . 30] fn ncclParamGetI32(h: ncclParamHandle_t, out: *mut i32) -> ncclResult_t;
        [2 . 30] fn ncclParamGetI64(h: ncclParamHandle_t, out: *mut i64) -> ncclResult_t;
        [2 . 30] fn ncclParamGetU8(h: ncclParamHandle_t, out: *mut u8) -> ncclResult_t;
        [2 . 30] fn ncclParamGetU16(h: ncclParamHandle_t, out: *mut u16) -> ncclResult_t;
        [2 . 30] fn ncclParamGetU32(h: ncclParamHandle_t, out: *mut u32) -> ncclResult_t;
        [2 . 30] fn ncclParamGetU64(h: ncclParamHandle_t, out: *mut u64) -> ncclResult_t;
        [2 . 30] fn ncclParamGetStr(h: ncclParamHandle_t, out: *mut *const c_char) -> ncclResult_t;
        [2 . 30] fn ncclParamGet(h: ncclParamHandle_t, out: *mut c_void, max_len: c_int, len: *mut c_int) -> ncclResult_t;
        [2 . 30] fn ncclParamGetParameter(key: *const c_char, value: *mut *const c_char, value_len: *mut c_int) -> ncclResult_t;
        [2 . 30] fn ncclParamGetAllParameterKeys(table: *mut *mut *const c_char, table_len: *mut c_int) -> ncclResult_t;
        [2 . 30] fn ncclParamDumpAll() -> ();
    }
}

/// How many elements one rank's buffer of a collective holds, from the `count` argument
/// NCCL is given (the count per rank, or per block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// The buffer is not used (NCCL ignores it, a null pointer is fine).
    Unused,
    /// `count` elements.
    Count,
    /// `count x nranks` elements.
    World,
    /// `count` elements on the root; NCCL uses it on no other rank, where [`OffRoot`]
    /// says what a caller passes.
    RootCount(OffRoot),
    /// `count x nranks` elements on the root; as [`RootCount`](Self::RootCount) off it.
    RootWorld(OffRoot),
}

/// What a rank other than the root passes for a buffer that NCCL uses on the root only
/// (an [`Extent::RootCount`] or [`Extent::RootWorld`]): the length the safe layer asks of
/// it. NCCL reads and writes none of its elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffRoot {
    /// As long as on the root (the rule is the same on every rank).
    AsRoot,
    /// Empty (passed as a null pointer) or as long as on the root: NCCL refuses a null one
    /// under `NCCL_CHECK_POINTERS=1`, and over symmetric windows it finds the root's
    /// buffer at this one's offset, so a non-empty one is sized as the root's.
    EmptyOrAsRoot,
    /// Any length: only where it lives matters (NCCL is given its address, null if empty).
    Any,
}

/// The length a rank's buffer must have, from its [`Extent`] (see [`Extent::length`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Length {
    /// Exactly this many elements.
    Exactly(usize),
    /// None, or exactly this many.
    EmptyOr(usize),
    /// Any number.
    Any,
}

impl Length {
    /// Whether a buffer of `len` elements satisfies it.
    #[inline]
    pub const fn accepts(self, len: usize) -> bool {
        match self {
            Length::Exactly(n) => len == n,
            Length::EmptyOr(n) => len == 0 || len == n,
            Length::Any => true,
        }
    }
}

impl Extent {
    /// The elements NCCL reads or writes of it on a rank (`is_root`: whether the rank is
    /// the root); `None` when `count x nranks` overflows.
    #[inline]
    pub fn elements(self, count: usize, nranks: usize, is_root: bool) -> Option<usize> {
        Some(match self {
            Extent::Unused => 0,
            Extent::Count => count,
            Extent::World => count.checked_mul(nranks)?,
            Extent::RootCount(_) if is_root => count,
            Extent::RootWorld(_) if is_root => count.checked_mul(nranks)?,
            Extent::RootCount(_) | Extent::RootWorld(_) => 0,
        })
    }

    /// The elements it holds on the root, where it is largest: `count`, or `count x
    /// nranks` for a world-sized one (0 when unused); `None` when that overflows.
    #[inline]
    pub fn on_root(self, count: usize, nranks: usize) -> Option<usize> {
        self.elements(count, nranks, true)
    }

    /// Whether it holds `nranks` blocks of `count` (on the root, for a rooted one).
    #[inline]
    pub const fn is_world(self) -> bool {
        matches!(self, Extent::World | Extent::RootWorld(_))
    }

    /// What a caller's buffer must hold on a rank: what NCCL uses, and off the root what
    /// its [`OffRoot`] allows; `None` when `count x nranks` overflows (on any rank).
    #[inline]
    pub fn length(self, count: usize, nranks: usize, is_root: bool) -> Option<Length> {
        let n = self.on_root(count, nranks)?;
        Some(match self {
            Extent::RootCount(off) | Extent::RootWorld(off) if !is_root => match off {
                OffRoot::AsRoot => Length::Exactly(n),
                OffRoot::EmptyOrAsRoot => Length::EmptyOr(n),
                OffRoot::Any => Length::Any,
            },
            _ => Length::Exactly(n),
        })
    }
}

/// The rank argument a collective takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankArg {
    /// None: every rank plays the same part.
    None,
    /// A root, the same on every rank.
    Root,
    /// A peer: a point-to-point call, which only it and its peer take part in.
    Peer,
}

/// Whose send buffer fills a block of a receive buffer (see [`Collective::source`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sender {
    /// Every rank's, reduced element by element.
    Reduced,
    /// The root's.
    Root,
    /// Rank `j`'s, for block `j` of the receive buffer.
    RankOfBlock,
    /// The peer's: a point-to-point call, matched pairwise rather than by blocks.
    Peer,
}

/// Which block of the sender's send buffer fills a block of a receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// Its first (for a send buffer of one block, the whole buffer).
    First,
    /// Block `r`, on receiving rank `r`.
    Receiver,
}

/// The source of one block (`count` elements) of a receive buffer: that block of one
/// rank's send buffer, or of every rank's reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSource {
    /// The rank whose send buffer it is copied from; `None` for a reduction over all.
    pub rank: Option<usize>,
    /// The block of the send buffer(s).
    pub block: usize,
}

macro_rules! collectives {
    ($(
        $(#[doc = $doc:literal])*
        $variant:ident = $entry:ident {
            rank: $rank:ident,
            send: $send:ident $(($send_off:ident))?,
            recv: $recv:ident $(($recv_off:ident))?,
            from: $from:ident($block:ident) $(,)?
        }
    )*) => {
        /// The collective and point-to-point calls of NCCL, one row each: everything the
        /// crates know about one (its entry point, its rank argument, its buffers' extents,
        /// where each block of a receive buffer comes from) comes from its row, so a new
        /// one is its entry point's row in the function table, its row here, its safe
        /// methods and the host provider's entry point: the host provider's executors read
        /// its data movement from [`Collective::source`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum Collective {
            $( $(#[doc = $doc])* $variant, )*
        }

        impl Collective {
            /// Every collective, in row order; entry `i` is the one whose
            /// [`index`](Self::index) is `i`.
            pub const ALL: &'static [Collective] = &[$( Collective::$variant, )*];

            /// Its entry point in the [`FunctionTable`].
            #[inline]
            pub const fn entry_point(self) -> EntryPoint {
                match self {
                    $( Collective::$variant => EntryPoint::$entry, )*
                }
            }

            /// The collective that `entry` makes, if any.
            #[inline]
            pub const fn of(entry: EntryPoint) -> Option<Collective> {
                match entry {
                    $( EntryPoint::$entry => Some(Collective::$variant), )*
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }

            /// Where each block of a rank's receive buffer comes from.
            #[inline]
            pub const fn movement(self) -> (Sender, Block) {
                match self {
                    $( Collective::$variant => (Sender::$from, Block::$block), )*
                }
            }

            /// Its rank argument: none, a root or a peer.
            #[inline]
            pub const fn rank_arg(self) -> RankArg {
                match self {
                    $( Collective::$variant => RankArg::$rank, )*
                }
            }

            /// The extents of its (send, receive) buffers on one rank.
            #[inline]
            pub const fn extents(self) -> (Extent, Extent) {
                match self {
                    $( Collective::$variant => (
                        Extent::$send $((OffRoot::$send_off))?,
                        Extent::$recv $((OffRoot::$recv_off))?,
                    ), )*
                }
            }
        }
    };
}

impl Collective {
    /// The C name of its entry point, e.g. `"ncclAllReduce"`.
    #[inline]
    pub const fn name(self) -> &'static str {
        self.entry_point().name()
    }

    /// `(major, minor)` of the first NCCL release that has it (its entry point's).
    #[inline]
    pub const fn since(self) -> (u32, u32) {
        self.entry_point().since()
    }

    /// Whether it takes a reduction.
    #[inline]
    pub const fn reduces(self) -> bool {
        matches!(self.movement(), (Sender::Reduced, _))
    }

    /// The source of block `block` of rank `receiver`'s receive buffer: the whole data
    /// movement of a collective, which the host provider's executors follow. `None` for
    /// a point-to-point call.
    #[inline]
    pub const fn source(self, receiver: usize, block: usize, root: usize) -> Option<BlockSource> {
        let (sender, which) = self.movement();
        let rank = match sender {
            Sender::Reduced => None,
            Sender::Root => Some(root),
            Sender::RankOfBlock => Some(block),
            Sender::Peer => return None,
        };
        let block = match which {
            Block::First => 0,
            Block::Receiver => receiver,
        };
        Some(BlockSource { rank, block })
    }

    /// Whether every rank of the communicator takes part (not a point-to-point call).
    #[inline]
    pub const fn every_rank(self) -> bool {
        !matches!(self.rank_arg(), RankArg::Peer)
    }

    /// Its position in [`Collective::ALL`]: a small integer for compact storage, read back
    /// with [`from_index`](Self::from_index).
    #[inline]
    pub const fn index(self) -> u8 {
        self as u8
    }

    /// The collective at `index` in [`Collective::ALL`].
    #[inline]
    pub fn from_index(index: u8) -> Option<Collective> {
        Collective::ALL.get(usize::from(index)).copied()
    }

    /// The elements of its (send, receive) buffers on a rank, for `count` (NCCL's count
    /// argument) on `nranks` ranks; `None` when one overflows.
    #[inline]
    pub fn elements(self, count: usize, nranks: usize, is_root: bool) -> Option<(usize, usize)> {
        self.per_buffer(|e| e.elements(count, nranks, is_root))
    }

    /// `f` of its (send, receive) extents; `None` when either is.
    #[inline]
    fn per_buffer<T>(self, f: impl Fn(Extent) -> Option<T>) -> Option<(T, T)> {
        let (send, recv) = self.extents();
        Some((f(send)?, f(recv)?))
    }
}

/// The arguments of one collective or point-to-point call, as [`Collective::call`] passes
/// them to its entry point.
#[derive(Debug, Clone, Copy)]
pub struct CallArgs {
    /// `sendbuff` (unused by `ncclRecv`).
    pub send: *const c_void,
    /// `recvbuff` (unused by `ncclSend`).
    pub recv: *mut c_void,
    /// `count`: NCCL's count argument (per rank, or per block).
    pub count: usize,
    /// `datatype`.
    pub datatype: ncclDataType_t,
    /// `op`, for a collective that [`reduces`](Collective::reduces) (else not passed).
    pub op: ncclRedOp_t,
    /// `root` or `peer`, by its [`RankArg`] (else not passed).
    pub rank: c_int,
    /// `comm`.
    pub comm: ncclComm_t,
    /// `stream`.
    pub stream: cudaStream_t,
}

impl Collective {
    /// Calls its entry point in `table` with the arguments it takes from `args`;
    /// `ncclInvalidUsage` when it is an optional entry point the table lacks (check
    /// [`FunctionTable::has`] first to name it in an error).
    ///
    /// # Safety
    /// NCCL's contract for the entry point: the buffers are valid for what it reads and
    /// writes with `count` elements of `datatype` on this rank ([`Collective::elements`]),
    /// until the work is done; `comm` is live; `op`, `rank` and `stream` are valid for it.
    #[inline(always)]
    pub unsafe fn call(self, table: &FunctionTable, args: CallArgs) -> ncclResult_t {
        let t = table;
        let CallArgs {
            send: s,
            recv: r,
            count: n,
            datatype: d,
            op,
            rank,
            comm,
            stream,
        } = args;
        // SAFETY: the caller's contract; each signature is bindgen's (checked above).
        unsafe {
            match self {
                Collective::AllReduce => (t.ncclAllReduce)(s, r, n, d, op, comm, stream),
                Collective::Broadcast => (t.ncclBroadcast)(s, r, n, d, rank, comm, stream),
                Collective::Reduce => (t.ncclReduce)(s, r, n, d, op, rank, comm, stream),
                Collective::AllGather => (t.ncclAllGather)(s, r, n, d, comm, stream),
                Collective::ReduceScatter => (t.ncclReduceScatter)(s, r, n, d, op, comm, stream),
                Collective::AllToAll => match t.ncclAlltoAll {
                    Some(f) => f(s, r, n, d, comm, stream),
                    None => ncclInvalidUsage,
                },
                Collective::Gather => match t.ncclGather {
                    Some(f) => f(s, r, n, d, rank, comm, stream),
                    None => ncclInvalidUsage,
                },
                Collective::Scatter => match t.ncclScatter {
                    Some(f) => f(s, r, n, d, rank, comm, stream),
                    None => ncclInvalidUsage,
                },
                Collective::Send => (t.ncclSend)(s, n, d, rank, comm, stream),
                Collective::Recv => (t.ncclRecv)(r, n, d, rank, comm, stream),
            }
        }
    }

    /// The lengths a caller's (send, receive) buffers must have on a rank for `count`
    /// (NCCL's count argument) on `nranks` ranks: [`Extent::length`] of each; `None` when
    /// one overflows.
    #[inline]
    pub fn lengths(self, count: usize, nranks: usize, is_root: bool) -> Option<(Length, Length)> {
        self.per_buffer(|e| e.length(count, nranks, is_root))
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

collectives! {
    /// `ncclAllReduce`: every rank's send reduced into every rank's receive buffer.
    AllReduce = ncclAllReduce { rank: None, send: Count, recv: Count, from: Reduced(First) }
    /// `ncclBroadcast`: the root's send buffer copied into every rank's receive buffer.
    Broadcast = ncclBroadcast { rank: Root, send: RootCount(AsRoot), recv: Count, from: Root(First) }
    /// `ncclReduce`: every rank's send reduced into the root's receive buffer.
    Reduce = ncclReduce { rank: Root, send: Count, recv: RootCount(AsRoot), from: Reduced(First) }
    /// `ncclAllGather`: every rank's send, in rank order, in every rank's receive buffer.
    AllGather = ncclAllGather { rank: None, send: Count, recv: World, from: RankOfBlock(First) }
    /// `ncclReduceScatter`: block `i` of the reduction in rank `i`'s receive buffer.
    ReduceScatter = ncclReduceScatter { rank: None, send: World, recv: Count, from: Reduced(Receiver) }
    /// `ncclAlltoAll`: block `j` of rank `i`'s send in block `i` of rank `j`'s receive buffer.
    AllToAll = ncclAlltoAll { rank: None, send: World, recv: World, from: RankOfBlock(Receiver) }
    /// `ncclGather`: every rank's send, in rank order, in the root's receive buffer.
    Gather = ncclGather { rank: Root, send: Count, recv: RootWorld(EmptyOrAsRoot), from: RankOfBlock(First) }
    /// `ncclScatter`: block `i` of the root's send in rank `i`'s receive buffer.
    Scatter = ncclScatter { rank: Root, send: RootWorld(Any), recv: Count, from: Root(Receiver) }
    /// `ncclSend`: the send buffer to a peer.
    Send = ncclSend { rank: Peer, send: Count, recv: Unused, from: Peer(First) }
    /// `ncclRecv`: the receive buffer from a peer.
    Recv = ncclRecv { rank: Peer, send: Unused, recv: Count, from: Peer(First) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_round_trip_and_match_the_symbol_lists() {
        for (i, &e) in EntryPoint::ALL.iter().enumerate() {
            assert_eq!(usize::from(e.index()), i);
            assert_eq!(EntryPoint::from_index(e.index()), Some(e));
            assert_eq!(EntryPoint::from_name(e.name()), Some(e));
            assert_eq!(e.is_optional(), optional_since(e.name()).is_some());
            assert_eq!(optional_since(e.name()).unwrap_or((2, 18)), e.since());
        }
        let names: Vec<&str> = EntryPoint::ALL.iter().map(|e| e.name()).collect();
        let symbols: Vec<&str> = REQUIRED_SYMBOLS
            .iter()
            .copied()
            .chain(OPTIONAL_SYMBOLS.iter().map(|s| s.name))
            .collect();
        assert_eq!(names, symbols);
    }

    #[test]
    fn every_collective_has_one_entry_point_and_consistent_rows() {
        for (i, &c) in Collective::ALL.iter().enumerate() {
            assert_eq!(usize::from(c.index()), i);
            assert_eq!(Collective::from_index(c.index()), Some(c));
            let e = c.entry_point();
            assert_eq!(Collective::of(e), Some(c), "{c:?}");
            assert_eq!(e.collective(), Some(c));
            assert_eq!(c.since(), e.since());
            let (send, recv) = c.extents();
            // Only a rooted collective leaves a buffer unused off the root.
            let rooted = |x: Extent| matches!(x, Extent::RootCount(_) | Extent::RootWorld(_));
            assert!(
                !(rooted(send) || rooted(recv)) || c.rank_arg() == RankArg::Root,
                "{c:?}"
            );
            // Point-to-point calls have one buffer; collectives both.
            assert_eq!(
                c.every_rank(),
                send != Extent::Unused && recv != Extent::Unused,
                "{c:?}"
            );
        }
        // Every block of every receive buffer comes from a block that its sender has.
        for &c in Collective::ALL {
            let (send, recv) = c.extents();
            for (n, root) in [(1, 0), (3, 0), (3, 2), (4, 1)] {
                for r in 0..n {
                    for j in 0..recv.elements(1, n, r == root).unwrap() {
                        let Some(src) = c.source(r, j, root) else {
                            assert!(!c.every_rank(), "{c:?}");
                            continue;
                        };
                        let senders: Vec<usize> = src.rank.map_or((0..n).collect(), |q| vec![q]);
                        assert_eq!(src.rank.is_none(), c.reduces(), "{c:?}");
                        for q in senders {
                            let has = send.elements(1, n, q == root).unwrap();
                            assert!(src.block < has, "{c:?} n={n} r={r} j={j}: {src:?}");
                        }
                    }
                }
            }
        }
        // What a caller passes: on the root what NCCL uses; off it too, for every buffer
        // NCCL uses there (only a root-only buffer has an off-root rule of its own).
        for &c in Collective::ALL {
            for (n, count) in [(1, 0), (3, 2), (4, 5)] {
                for is_root in [true, false] {
                    let (s, r) = c.lengths(count, n, is_root).unwrap();
                    let (es, er) = c.elements(count, n, is_root).unwrap();
                    for (len, used) in [(s, es), (r, er)] {
                        if is_root || used > 0 {
                            assert_eq!(len, Length::Exactly(used), "{c:?} n={n} root={is_root}");
                        }
                    }
                }
            }
        }
        assert_eq!(
            Collective::Gather.lengths(2, 3, false),
            Some((Length::Exactly(2), Length::EmptyOr(6)))
        );
        assert_eq!(Collective::Scatter.lengths(usize::MAX, 2, false), None);
        let mut of: Vec<Collective> = EntryPoint::ALL
            .iter()
            .filter_map(|e| e.collective())
            .collect();
        of.sort();
        assert_eq!(of, Collective::ALL, "each row's entry point, once");
        assert_eq!(Collective::Scatter.since(), (2, 28));
        assert_eq!(
            Collective::Scatter.elements(3, 4, false),
            Some((0, 3)),
            "a non-root rank's send buffer is unused"
        );
        assert_eq!(Collective::Scatter.elements(usize::MAX, 2, true), None);
    }
}
