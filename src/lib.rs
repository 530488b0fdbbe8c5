//! nccl-safe: a safe Rust API over NVIDIA NCCL.
//!
//! * NCCL is loaded at run time ([`Library`]): no link step, no CUDA toolkit to build.
//! * Every NCCL call goes through one checked path and fails with an [`Error`] that carries
//!   NCCL's error string, its last-error text, the call and the caller.
#![deny(missing_docs)]

pub mod error;
mod id;
pub mod launch;
pub mod library;
pub mod version;

pub use error::{Error, NcclError, Result, ResultCode};
pub use id::{UniqueId, UNIQUE_ID_BYTES};
pub use library::{CallContext, Discovery, Library, Provider};
pub use version::Version;
