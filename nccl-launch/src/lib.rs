//! nccl-launch: starting the ranks of an [nccl-safe](nccl_safe) job. Start with
//! [`Launcher`]: [`Launcher::host`] runs a rank per thread on the host provider (any
//! machine, `cargo test` included), [`Launcher::all_devices`] a rank per visible GPU, and
//! [`Launcher::from_env`] joins a multi-process job started by torchrun, Slurm or mpirun
//! ([`mod@env`] reads their variables; under torchrun the unique id goes through the
//! agent's c10d store, see [`store`], and under Slurm and mpirun through the authenticated
//! [`rendezvous`]). [`desync`] is the board rank 0 hosts, where the ranks of other
//! processes post what they were last doing when a collective times out.
//!
//! ```
//! use nccl_launch::Launcher;
//! use nccl_safe::ReduceOp;
//!
//! let sums = Launcher::host(2).run(|rank| {
//!     let mut grad = vec![rank.rank() as f32 + 1.0; 4];
//!     rank.comm().all_reduce_in_place(&mut grad, ReduceOp::Sum, rank.stream())?;
//!     Ok(grad[0])
//! })?;
//! assert_eq!(sums, vec![3.0; 2]);
//! # Ok::<(), nccl_launch::Error>(())
//! ```
//!
//! Errors are an [`Error`]: the core's ([`Error::Core`]) or the launchers' own (the
//! environment, the rendezvous, torchrun's store, a failed rank of a run).
#![deny(missing_docs)]

mod common;
mod cuda_probe;
pub mod desync;
pub mod env;
mod error;
mod fds;
mod launcher;
mod process;
pub mod rendezvous;
pub mod store;
mod wire;

pub use error::{Error, Result};
pub use launcher::{
    cuda_device_count, LaunchReport, Launcher, Rank, RankStats, DEFAULT_LAUNCH_TIMEOUT, STUCK_AFTER,
};
pub use process::{ProcessLauncher, ROOTS_VAR};

/// Locks `m`, taking the data of a poisoned lock as it is (every lock of the crate guards
/// data that a panic leaves consistent).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
