//! [`ProcessLauncher`]: one rank per process under torchrun, Slurm or mpirun: the id
//! exchange (torchrun's store, or the authenticated TCP rendezvous; one id per 256 ranks,
//! each made by its root rank, see [`ProcessLauncher::roots`]), the desync board, and the
//! device check.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::desync::{BoardClient, DesyncBoard};
use crate::env::ProcessEnv;
pub use crate::error::ROOTS_VAR;
use crate::error::{invalid, Result};
use crate::rendezvous::{Rendezvous, ServerHandle, TcpRendezvous};
use crate::store::StoreRendezvous;
use nccl_safe::CommDevice;
use nccl_safe::Config;
use nccl_safe::{scalable_roots, UniqueId};

use super::launcher::{cuda_device_count, Launcher, Rank};

/// One rank of a multi-process job; see [`Launcher::from_env`].
#[derive(Debug, Clone)]
pub struct ProcessLauncher {
    env: ProcessEnv,
    config: Config,
    host: bool,
    /// The number of unique ids (roots) of the init; `None`: [`ROOTS_VAR`], else
    /// [`scalable_roots`].
    roots: Option<usize>,
}

impl ProcessLauncher {
    /// For an environment read elsewhere.
    pub fn new(env: ProcessEnv) -> ProcessLauncher {
        ProcessLauncher {
            env,
            config: Config::new(),
            host: false,
            roots: None,
        }
    }

    /// Runs the ranks on the host provider ([`CommDevice::Host`], CPU memory) instead of a GPU
    /// each: the processes of one machine meet in shared memory
    /// ([`nccl_safe::host::shared_unique_id`]), so multi-process code runs on any machine.
    #[cfg(feature = "host")]
    pub fn host(mut self) -> ProcessLauncher {
        self.host = true;
        self
    }

    /// The communicator's configuration.
    pub fn config(mut self, config: Config) -> ProcessLauncher {
        self.config = config;
        self
    }

    /// How many unique ids (roots) the job's init uses, in `1..=world_size`; every rank
    /// must pass the same. Without it, the variable [`ROOTS_VAR`] (`NCCL_SAFE_ROOTS`) when
    /// set, else [`scalable_roots`]`(world_size)`: one root per
    /// [`RANKS_PER_ROOT`](nccl_safe::RANKS_PER_ROOT) ranks, so a job of up to 256 ranks has
    /// one (`ncclCommInitRankConfig`'s init, the same rendezvous messages as before) and a
    /// larger one several (`ncclCommInitRankScalable`), each id made by the first rank of
    /// the block its root serves ([`scalable_root_rank`](nccl_safe::scalable_root_rank)) and
    /// moved by the job's rendezvous ([`Rendezvous::exchange_roots`]). Out of range:
    /// `InvalidArgument` from [`init`](Self::init) before any rendezvous.
    pub fn roots(mut self, roots: usize) -> ProcessLauncher {
        self.roots = Some(roots);
        self
    }

    /// The number of roots [`init`](Self::init) uses for `rendezvous` (see
    /// [`roots`](Self::roots)): a custom rendezvous moves one id, so one unless asked.
    pub fn job_roots(&self, rendezvous: &Rendezvous) -> Result<usize> {
        let world = self.env.world_size;
        let roots = match (self.roots, std::env::var(ROOTS_VAR)) {
            (Some(n), _) => n,
            (None, Ok(v)) => v.trim().parse::<usize>().map_err(|_| {
                let m = format!("{ROOTS_VAR}={v:?} is not a number of roots (1 to {world})");
                invalid("ProcessLauncher::roots", m)
            })?,
            (None, Err(_)) if matches!(rendezvous, Rendezvous::Custom(_)) => 1,
            (None, Err(_)) => scalable_roots(world),
        };
        if roots == 0 || roots > world {
            let m = format!("{roots} roots for {world} ranks: pass 1 to {world}");
            return Err(invalid("ProcessLauncher::roots", m));
        }
        Ok(roots)
    }

    /// The environment read.
    pub fn env(&self) -> &ProcessEnv {
        &self.env
    }

    /// Checks that this node has a GPU for the local rank, exchanges the ids (one per root,
    /// [`roots`](Self::roots): one up to 256 ranks) and joins the communicator on the GPU
    /// of the local rank.
    ///
    /// Under torchrun with the agent's store (`TORCHELASTIC_USE_AGENT_STORE=True`), the id
    /// and the job's desync board go through that store ([`crate::store`]): nothing
    /// is bound and no token is needed. Otherwise the id goes over the authenticated TCP
    /// rendezvous, and rank 0 hosts the desync board on `MASTER_ADDR:MASTER_PORT+1`
    /// ([`crate::desync`], same token) while its [`Rank`] lives (after
    /// [`Rank::into_comm`], for the rest of the process); a board rank 0 cannot bind fails
    /// its init ([`RendezvousError::Bind`](crate::rendezvous::RendezvousError::Bind)).
    /// Every rank's communicator gets the board, so a timeout report shows what the ranks
    /// in other processes were last doing.
    pub fn init(mut self) -> Result<Rank> {
        if !self.host {
            self.check_devices(cuda_device_count())?;
        }
        if nccl_safe::seam::elastic(&self.config) == Some(true) {
            self.env.keeps_survivors()?;
        }
        let world = self.env.world_size;
        if let Some(store) = StoreRendezvous::from_env(&self.env) {
            self.config = nccl_safe::seam::remote_board(
                std::mem::take(&mut self.config),
                Arc::new(store.board(world)),
            );
            return self.init_with(Rendezvous::Store(store));
        }
        let tcp = TcpRendezvous::from_env(&self.env)?;
        let mut board = None;
        if let Some((addr, token)) = tcp.board() {
            if self.env.rank == 0 {
                // Before the rendezvous: a board that cannot bind fails rank 0 before any
                // rank waits on it, rather than leaving the port to whatever holds it.
                board = Some(DesyncBoard::serve(addr.as_str(), world, token.clone())?);
            }
            let client = BoardClient::new(addr, world, token);
            self.config = self.config.desync_board(client);
        }
        let mut rank = self.init_with(Rendezvous::Tcp(tcp))?;
        rank.board = board;
        Ok(rank)
    }

    /// Like [`init`](Self::init) with another rendezvous (file, or your own closure).
    ///
    /// The job's number of roots is [`roots`](Self::roots)'s (by default one per 256
    /// ranks): with more than one, the ids go through `rendezvous` as
    /// [`Rendezvous::exchange_roots`] says and the communicator is made by
    /// `ncclCommInitRankScalable` ([`Rank::unique_ids`] holds them).
    pub fn init_with(self, rendezvous: Rendezvous) -> Result<Rank> {
        let store = match &rendezvous {
            Rendezvous::Store(s) => Some(s.clone()),
            _ => None,
        };
        let roots = self.job_roots(&rendezvous)?;
        let (ids, server) = self.exchange_ids(rendezvous, roots)?;
        let result = self.join_scalable(&ids);
        if let Some(store) = store {
            let (world, rank) = (self.env.world_size, self.env.rank);
            match &result {
                Ok(_) => store.joined(),
                // Peers that retry must not read this id again. If the deletion fails
                // too, a retried peer joins the dead id and fails at its init timeout:
                // the join's own error is the one to report.
                Err(_) => match nccl_safe::seam::root_made_by(world, roots, rank) {
                    Some(0) => {
                        let _ = store.retract();
                    }
                    Some(i) => {
                        let _ = store.retract_root(i);
                    }
                    None => {}
                },
            }
        }
        if let Some(server) = server {
            if result.is_ok() {
                // Every rank joined the communicator, so every rank had the id, whatever
                // became of its acknowledgements.
                server.stop();
            } else {
                // Serve the others until they have the id (so they fail on their own terms,
                // not by waiting for it), or the deadline names who never came.
                let _ = server.wait();
            }
        }
        result
    }

    /// Step one of [`init_with`](Self::init_with) for one root: rank 0 creates the id
    /// (`ncclGetUniqueId`, which needs no GPU) and every rank receives it. Rank 0 also gets
    /// the server handle, whose `wait` reports ranks that never fetched the id.
    pub fn exchange_id(&self, rendezvous: Rendezvous) -> Result<(UniqueId, Option<ServerHandle>)> {
        #[cfg(feature = "host")]
        if self.host {
            let exchanged = rendezvous.exchange(self.env.rank, self.env.world_size, || {
                Ok::<_, crate::Error>(
                    UniqueId::from_raw(nccl_safe::host::shared_unique_id()).to_bytes(),
                )
            })?;
            return Ok((UniqueId::from_bytes(&exchanged.id)?, exchanged.server));
        }
        let lib = nccl_safe::Library::load()?;
        let exchanged = rendezvous.exchange(self.env.rank, self.env.world_size, || {
            Ok::<_, crate::Error>(UniqueId::new_with(&lib)?.to_bytes())
        })?;
        Ok((UniqueId::from_bytes(&exchanged.id)?, exchanged.server))
    }

    /// Step one with `roots` unique ids ([`Rendezvous::exchange_roots`]): each root's id
    /// made by the rank [`scalable_root_rank`](nccl_safe::scalable_root_rank) names
    /// (`ncclGetUniqueId`, or on the host provider a shared id), and every rank receives
    /// them all; one root is [`exchange_id`](Self::exchange_id).
    pub fn exchange_ids(
        &self,
        rendezvous: Rendezvous,
        roots: usize,
    ) -> Result<(Vec<UniqueId>, Option<ServerHandle>)> {
        let (rank, world) = (self.env.rank, self.env.world_size);
        let exchanged = if self.host {
            #[cfg(feature = "host")]
            let make = || {
                Ok::<_, crate::Error>(
                    UniqueId::from_raw(nccl_safe::host::shared_unique_id()).to_bytes(),
                )
            };
            #[cfg(not(feature = "host"))]
            let make = || -> Result<[u8; nccl_safe::UNIQUE_ID_BYTES]> {
                unreachable!("`host` is set only with the host feature")
            };
            rendezvous.exchange_roots(rank, world, roots, make)?
        } else {
            let lib = nccl_safe::Library::load()?;
            let make = || Ok::<_, crate::Error>(UniqueId::new_with(&lib)?.to_bytes());
            rendezvous.exchange_roots(rank, world, roots, make)?
        };
        let ids = (exchanged.ids.iter())
            .map(|b| UniqueId::from_bytes(b))
            .collect::<nccl_safe::Result<Vec<_>>>()?;
        Ok((ids, exchanged.server))
    }

    /// Step two: joins the communicator with `id` on the GPU of the local rank. Without a
    /// GPU for it, a clear error (on every rank alike), never a hang.
    pub fn join(&self, id: &UniqueId) -> Result<Rank> {
        self.join_scalable(std::slice::from_ref(id))
    }

    /// [`join`](Self::join) with several unique ids
    /// ([`Communicator::init_rank_scalable`](nccl_safe::Communicator::init_rank_scalable),
    /// NCCL 2.23+), for a job that distributes them itself: every rank passes the same
    /// ids, id `i` best made by rank [`scalable_root_rank`](nccl_safe::scalable_root_rank)`(world_size,
    /// ids.len(), i)` and gathered by every rank (an `MPI_Allgather`, say). The launcher's
    /// own rendezvous ([`init`](Self::init)) moves one id from rank 0, so its jobs have
    /// one root.
    pub fn join_scalable(&self, ids: &[UniqueId]) -> Result<Rank> {
        let device = if self.host {
            CommDevice::Host
        } else {
            self.check_devices(cuda_device_count())?;
            CommDevice::Cuda(CudaContext::new(self.env.cuda_ordinal())?)
        };
        let env = &self.env;
        Rank::init(&device, env.world_size, env.rank, ids, &self.config)
    }

    /// Whether this node has a GPU for the local rank, given `visible` CUDA devices: an
    /// error naming `CUDA_VISIBLE_DEVICES` and the count otherwise. When the launcher says
    /// how many processes run on this node (`LOCAL_WORLD_SIZE` and the like), every one of
    /// them fails alike when there are too few GPUs for all of them, before any rendezvous.
    pub fn check_devices(&self, visible: usize) -> Result<()> {
        let local = self.env.cuda_ordinal();
        let needed = self.env.local_world_size.unwrap_or(0).max(local + 1);
        if visible >= needed {
            return Ok(());
        }
        let cvd = match std::env::var("CUDA_VISIBLE_DEVICES") {
            Ok(v) => format!("CUDA_VISIBLE_DEVICES={v:?}"),
            Err(_) => "CUDA_VISIBLE_DEVICES is unset".into(),
        };
        let gpus = if visible == 1 { "GPU" } else { "GPUs" };
        let local_size_var = match self.env.source {
            crate::env::EnvSource::Torchrun => "LOCAL_WORLD_SIZE",
            crate::env::EnvSource::OpenMpi => "OMPI_COMM_WORLD_LOCAL_SIZE",
            crate::env::EnvSource::Slurm => "SLURM_NTASKS_PER_NODE",
        };
        let why = match self.env.local_world_size {
            _ if visible == 0 => format!(
                "this process sees no CUDA GPU ({cvd}; or no CUDA driver), and each rank needs one"
            ),
            Some(n) if n > visible => format!(
                "this node runs {n} ranks ({local_size_var}={n}), one GPU each, but this process sees \
                 {visible} CUDA {gpus} ({cvd}); start at most {visible} processes per node \
                 (e.g. torchrun --nproc_per_node={visible})"
            ),
            _ => format!(
                "it needs the GPU of its local rank but this process sees {visible} CUDA {gpus} ({cvd})"
            ),
        };
        let rank = self.env.rank;
        Err(invalid(
            "ProcessLauncher::join",
            format!(
                "rank {rank} (local rank {local}) has no CUDA device: {why}. To run on the CPU, \
             use the host provider: Launcher::from_env()?.host().init()"
            ),
        ))
    }
}

impl Launcher {
    /// One rank per process: reads torchrun / Open MPI / Slurm variables and picks the GPU
    /// of the local rank; [`ProcessLauncher::init`] then joins the job.
    pub fn from_env() -> Result<ProcessLauncher> {
        Ok(ProcessLauncher::new(ProcessEnv::from_process_env()?))
    }
}
