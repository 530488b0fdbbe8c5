//! nccl-safe: a safe Rust API over NVIDIA NCCL.
//!
//! * NCCL is loaded at run time ([`Library`]): no link step, no CUDA toolkit to build.
//! * Every NCCL result goes through one check (`Library::check`) and fails with an
//!   [`Error`] that carries NCCL's error string, its last-error text, the call and the
//!   caller; every call on a communicator's handle is made with the handle claimed
//!   against the watchdog, so none is ever made on a handle under teardown.
//! * NCCL's allocator ([`NcclMemory`]), buffer registration ([`Communicator::register`]) and
//!   windows ([`Communicator::register_window`]) are borrows that end exactly once; fp8
//!   element types ([`float8::F8E4M3`], [`float8::F8E5M2`]) need NCCL 2.24.
#![deny(missing_docs)]

mod buffer;
mod comm;
mod comm_ref;
mod config;
#[cfg(feature = "launch")]
mod cuda_probe;
pub mod diag;
mod discovery;
pub mod error;
mod group;
#[cfg(feature = "host")]
pub mod host;
mod id;
#[cfg(feature = "launch")]
pub mod launch;
pub mod library;
mod memory;
mod ops;
mod register;
mod stream;
mod types;
pub mod version;

pub use buffer::{BufferGuard, Memory, RecvBuffer, SendBuffer};
pub use comm::{Communicator, Device, PendingCommunicator, DEFAULT_INIT_TIMEOUT};
pub use comm_ref::CommRef;
pub use config::Config;
pub use error::{Error, NcclError, Result, ResultCode};
pub use group::Group;
pub use id::{UniqueId, UNIQUE_ID_BYTES};
pub use library::{CallContext, Discovery, Library, Provider};
pub use memory::{NcclMemory, NcclView, NcclViewMut};
pub use ops::{Op, PreMulSum, Reduction};
pub use register::{Registration, Window, WindowFlags};
pub use stream::{AsStream, HostStream, Stream, StreamRef};
pub use types::{DataType, NcclType, ReduceOp};
pub use version::Version;
