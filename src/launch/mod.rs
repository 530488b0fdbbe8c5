//! Starting ranks: [`Launcher`] runs one rank per device in threads; [`Launcher::from_env`]
//! joins a multi-process job started by torchrun, Slurm or mpirun ([`mod@env`] reads their
//! variables, [`rendezvous`] exchanges the unique id).

pub mod desync;
pub mod env;
pub mod rendezvous;
mod threads;
mod wire;

pub use threads::{
    cuda_device_count, Backend, LaunchReport, Launcher, ProcessLauncher, Rank, RankStats,
    DEFAULT_LAUNCH_TIMEOUT,
};
