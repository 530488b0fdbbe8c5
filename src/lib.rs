//! nccl-safe: a safe Rust API over NVIDIA NCCL.
#![deny(missing_docs)]
pub mod host;
