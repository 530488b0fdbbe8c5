//! Starting ranks: [`Launcher`] runs one rank per device in threads; [`Launcher::from_env`]
//! joins a multi-process job started by torchrun, Slurm or mpirun ([`mod@env`] reads their
//! variables; under torchrun the unique id goes through the agent's c10d store, see
//! [`store`], and under Slurm and mpirun through the authenticated [`rendezvous`]).

mod common;
pub mod desync;
pub mod env;
mod fds;
mod launcher;
mod process;
pub mod rendezvous;
pub mod store;
mod wire;

pub use launcher::{
    cuda_device_count, LaunchReport, Launcher, Rank, RankStats, DEFAULT_LAUNCH_TIMEOUT, STUCK_AFTER,
};
pub use process::{ProcessLauncher, ROOTS_VAR};
