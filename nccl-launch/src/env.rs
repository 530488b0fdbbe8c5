//! Reading which rank this process is from the variables a launcher sets.
//!
//! Three launchers are understood, checked in this order of precedence (the first one
//! whose marker variable is present wins, so `srun torchrun ...` is read as torchrun and
//! `mpirun` inside a Slurm allocation as Open MPI):
//!
//! | launcher | marker | rank, world size, local rank | address | port |
//! |---|---|---|---|---|
//! | torchrun | `RANK` or `WORLD_SIZE` | `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (`LOCAL_WORLD_SIZE` optional) | `MASTER_ADDR` | `MASTER_PORT` |
//! | Open MPI | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` (`OMPI_COMM_WORLD_LOCAL_SIZE` optional) | `MASTER_ADDR` | `MASTER_PORT`, else [`DEFAULT_PORT`] |
//! | Slurm | `SLURM_PROCID` | `SLURM_PROCID`, `SLURM_NTASKS` (or `SLURM_NPROCS`), `SLURM_LOCALID` (`SLURM_NTASKS_PER_NODE` optional) | `MASTER_ADDR`, else the first host of `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`) | `MASTER_PORT`, else [`slurm_default_port`] of `SLURM_JOB_ID`, else [`DEFAULT_PORT`] |
//!
//! Under torchrun, `TORCHELASTIC_USE_AGENT_STORE`, `TORCHELASTIC_RUN_ID` and
//! `TORCHELASTIC_RESTART_COUNT` are read too ([`Elastic`]): with the agent's store, the id
//! goes through it (see [`super::store`]) under a key unique to the run and its attempt.
//!
//! Detection takes the environment as a closure so it can be tested without touching the
//! process environment; [`ProcessEnv::from_process_env`] reads the real one.

pub use crate::error::{EnvError, EnvSource};

/// Port used when the launcher gives none and none can be derived (torchrun's default).
pub const DEFAULT_PORT: u16 = 29500;

/// Where this process sits in a multi-process job, as told by its launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    /// The launcher the values were read from.
    pub source: EnvSource,
    /// This process's rank in `0..world_size`.
    pub rank: usize,
    /// Number of processes (ranks) in the job.
    pub world_size: usize,
    /// This process's index among the processes on its node.
    pub local_rank: usize,
    /// Number of processes on this node, when the launcher says.
    pub local_world_size: Option<usize>,
    /// Host name or address of rank 0, where the rendezvous is served.
    pub master_addr: String,
    /// TCP port of the rendezvous on `master_addr` (never 0).
    pub master_port: u16,
    /// torchrun's elastic-agent variables, when set.
    pub elastic: Option<Elastic>,
    /// When the launcher ends every process of the job once one exits (so an elastic job
    /// cannot survive a loss): what to start it with instead. See
    /// [`keeps_survivors`](Self::keeps_survivors).
    pub ends_survivors: Option<&'static str>,
}

/// What torchrun's elastic agent tells its workers about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Elastic {
    /// `TORCHELASTIC_USE_AGENT_STORE`: the agent serves a c10d store on
    /// `MASTER_ADDR:MASTER_PORT`, which the workers use (and nothing of theirs binds it).
    pub use_agent_store: bool,
    /// `TORCHELASTIC_RUN_ID`: the job's run id (`--rdzv-id`).
    pub run_id: String,
    /// `TORCHELASTIC_RESTART_COUNT`: how many times the agent restarted the workers.
    pub restart_count: u64,
}

/// The port used under Slurm when `MASTER_PORT` is unset: `10000 + SLURM_JOB_ID % 10000`,
/// so that jobs sharing a node use different ports (the convention PyTorch Lightning uses).
pub fn slurm_default_port(job_id: u64) -> u16 {
    // job_id % 10000 < 10000, so the sum is at most 19999 and fits in u16.
    10000 + (job_id % 10000) as u16
}

/// The first host of a Slurm compressed host list, e.g. `node[01-04,07],gpu5` -> `node01`,
/// `rack[1-2]-n[3-4]` -> `rack1-n3`. Returns `None` for an empty or malformed list.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let mut host = String::new();
    let mut chars = list.chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                // Inside a bracket: take the first entry of the first range, skip the rest.
                let mut first = String::new();
                let mut taking = true;
                let mut closed = false;
                for c in chars.by_ref() {
                    match c {
                        ']' => {
                            closed = true;
                            break;
                        }
                        ',' | '-' => taking = false,
                        c if taking => first.push(c),
                        _ => {}
                    }
                }
                if !closed || first.is_empty() {
                    return None;
                }
                host.push_str(&first);
            }
            ']' => return None,
            c if c.is_whitespace() => return None,
            c => host.push(c),
        }
    }
    if host.is_empty() {
        None
    } else {
        Some(host)
    }
}

impl ProcessEnv {
    /// Reads the process environment (see the [module docs](self) for the variables).
    pub fn from_process_env() -> Result<Self, EnvError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the launcher variables through `lookup` (a variable's value, or `None` when
    /// unset), so that tests and embedders need not touch the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let set = |var| lookup(var).is_some();
        let mut env = if set("RANK") || set("WORLD_SIZE") {
            Self::torchrun(&lookup)
        } else if set("OMPI_COMM_WORLD_RANK") {
            Self::open_mpi(&lookup)
        } else if set("SLURM_PROCID") {
            Self::slurm(&lookup)
        } else {
            Err(EnvError::NotLaunched)
        }?;
        env.ends_survivors = env.launcher_ends_survivors(&lookup);
        Ok(env)
    }

    /// The CUDA device ordinal this rank should use: its local rank.
    pub fn cuda_ordinal(&self) -> usize {
        self.local_rank
    }

    /// [`EnvError::EndsSurvivors`] when the launcher ends every process of the job once
    /// one of them exits (its field `ends_survivors`), which an elastic job
    /// (`Config::elastic(true)`) cannot survive; `ProcessLauncher::init` checks it for an
    /// elastic configuration.
    pub fn keeps_survivors(&self) -> Result<(), EnvError> {
        match self.ends_survivors {
            None => Ok(()),
            Some(hint) => Err(EnvError::EndsSurvivors {
                launcher: self.source,
                hint,
            }),
        }
    }

    /// What the launcher needs to let the other processes run on when one exits, when it
    /// can tell that they will not:
    /// - mpirun (Open MPI 4, which sets `OMPI_MCA_orte_*`) ends the job when a process
    ///   exits unless started with `--enable-recovery` (`OMPI_MCA_orte_enable_recovery=1`);
    ///   Open MPI 5 tells its processes nothing of it, so there it is not checked;
    /// - torchrun's agent (`TORCHELASTIC_*` set) stops every worker when one fails, and
    ///   restarts them all with `--max-restarts`: no recovery inside the job there;
    /// - srun keeps the others unless `--kill-on-bad-exit` (or Slurm's `KillOnBadExit`) is
    ///   on, which the tasks cannot see: told only by `SLURM_KILL_ON_BAD_EXIT=1`.
    fn launcher_ends_survivors(
        &self,
        get: &dyn Fn(&str) -> Option<String>,
    ) -> Option<&'static str> {
        let on = |v: &str| get(v).is_some_and(|v| matches!(v.trim(), "1" | "true" | "yes" | "on"));
        match self.source {
            EnvSource::OpenMpi
                if get("OMPI_MCA_orte_hnp_uri").is_some()
                    && !on("OMPI_MCA_orte_enable_recovery") =>
            {
                Some("start it with `mpirun --enable-recovery`")
            }
            EnvSource::Torchrun if self.elastic.is_some() => Some(
                "torchrun's agent stops every worker when one fails (and restarts them all with --max-restarts): for recovery inside the job start the ranks with `mpirun --enable-recovery` or srun, or recover from a checkpoint with --max-restarts",
            ),
            EnvSource::Slurm if on("SLURM_KILL_ON_BAD_EXIT") => Some(
                "unset SLURM_KILL_ON_BAD_EXIT and start the job with `srun --kill-on-bad-exit=0`",
            ),
            _ => None,
        }
    }

    fn torchrun(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        const HINT: &str = "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; set them all when launching by hand";
        let env = Lookup::new(get, EnvSource::Torchrun, HINT);
        let world_size = env.size("WORLD_SIZE")?;
        let mut p = env.place(
            world_size,
            "WORLD_SIZE",
            "RANK",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
        )?;
        p.master_addr = env.addr("MASTER_ADDR")?;
        p.master_port = env.port("MASTER_PORT")?;
        p.elastic = Self::elastic(&env)?;
        Ok(p)
    }

    fn elastic(env: &Lookup<'_>) -> Result<Option<Elastic>, EnvError> {
        const VARS: [&str; 3] = [
            "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT",
        ];
        if VARS.iter().all(|v| env.get(v).is_none()) {
            return Ok(None);
        }
        const HINT: &str = "torchrun's agent sets TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT together";
        let env = Lookup { hint: HINT, ..*env };
        let flag = env.required(VARS[0])?;
        let use_agent_store = match flag.trim().to_ascii_lowercase().as_str() {
            "true" | "1" => true,
            "false" | "0" => false,
            _ => {
                return Err(EnvError::Invalid {
                    var: VARS[0],
                    value: flag,
                    reason: "expected True or False".into(),
                })
            }
        };
        let run_id = env.required(VARS[1])?;
        let restart_count = env.number(VARS[2])? as u64;
        Ok(Some(Elastic {
            use_agent_store,
            run_id,
            restart_count,
        }))
    }

    fn open_mpi(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        const HINT: &str = "mpirun sets OMPI_COMM_WORLD_*; pass the address of rank 0's host with `mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port>`";
        let env = Lookup::new(get, EnvSource::OpenMpi, HINT);
        let world_size = env.size("OMPI_COMM_WORLD_SIZE")?;
        let mut p = env.place(
            world_size,
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )?;
        p.master_addr = env.addr("MASTER_ADDR")?;
        p.master_port = match env.get("MASTER_PORT") {
            Some(_) => env.port("MASTER_PORT")?,
            None => DEFAULT_PORT,
        };
        Ok(p)
    }

    fn slurm(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        const HINT: &str = "srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_JOB_NODELIST; run the program with srun inside an allocation";
        let env = Lookup::new(get, EnvSource::Slurm, HINT);
        let world_size = env.size(env.either("SLURM_NTASKS", "SLURM_NPROCS"))?;
        let mut p = env.place(
            world_size,
            "SLURM_NTASKS",
            "SLURM_PROCID",
            "SLURM_LOCALID",
            "SLURM_NTASKS_PER_NODE",
        )?;
        p.master_addr = if env.get("MASTER_ADDR").is_some() {
            env.addr("MASTER_ADDR")?
        } else {
            let var = env.either("SLURM_JOB_NODELIST", "SLURM_NODELIST");
            let value = env.required(var)?;
            first_slurm_host(&value).ok_or_else(|| EnvError::Invalid {
                var,
                value,
                reason: "not a Slurm host list such as `node[01-04,07],gpu5`".into(),
            })?
        };
        p.master_port = if env.get("MASTER_PORT").is_some() {
            env.port("MASTER_PORT")?
        } else if let Some(job) = env.get("SLURM_JOB_ID") {
            let id = job.trim().parse::<u64>().map_err(|_| EnvError::Invalid {
                var: "SLURM_JOB_ID",
                value: job.clone(),
                reason: "not a non-negative integer (it picks the default port; set MASTER_PORT to override)".into(),
            })?;
            slurm_default_port(id)
        } else {
            DEFAULT_PORT
        };
        Ok(p)
    }
}

/// The variables as one launcher sets them: `source`, with the `hint` its errors carry.
#[derive(Clone, Copy)]
struct Lookup<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
    source: EnvSource,
    hint: &'static str,
}

impl<'a> Lookup<'a> {
    fn new(get: &'a dyn Fn(&str) -> Option<String>, source: EnvSource, hint: &'static str) -> Self {
        Lookup { get, source, hint }
    }

    fn get(&self, var: &str) -> Option<String> {
        (self.get)(var)
    }

    /// `a`, unless only `b` is set: the older name of the same variable.
    fn either(&self, a: &'static str, b: &'static str) -> &'static str {
        if self.get(a).is_none() && self.get(b).is_some() {
            b
        } else {
            a
        }
    }

    fn required(&self, var: &'static str) -> Result<String, EnvError> {
        self.get(var).ok_or(EnvError::Missing {
            launcher: self.source,
            var,
            hint: self.hint,
        })
    }

    fn number(&self, var: &'static str) -> Result<usize, EnvError> {
        let value = self.required(var)?;
        value
            .trim()
            .parse::<usize>()
            .map_err(|_| EnvError::Invalid {
                var,
                value: value.clone(),
                reason: "not a non-negative integer".into(),
            })
    }

    fn size(&self, var: &'static str) -> Result<usize, EnvError> {
        let n = self.number(var)?;
        if n == 0 {
            return Err(EnvError::Invalid {
                var,
                value: n.to_string(),
                reason: "a job has at least one rank".into(),
            });
        }
        Ok(n)
    }

    /// The place of this process: its rank from `rank_var`, below `world_size` (read from
    /// `size_var`), its local rank from `local_var`, and the local size from
    /// `local_size_var` when set (above the local rank). The caller fills in where the job
    /// meets (and whether torchrun's agent runs it).
    fn place(
        &self,
        world_size: usize,
        size_var: &'static str,
        rank_var: &'static str,
        local_var: &'static str,
        local_size_var: &'static str,
    ) -> Result<ProcessEnv, EnvError> {
        let below = |var, n: usize, what, size_var, size| {
            (n < size).then_some(n).ok_or_else(|| EnvError::Invalid {
                var,
                value: n.to_string(),
                reason: format!("{what} must be less than {size_var}={size}"),
            })
        };
        let rank = below(
            rank_var,
            self.number(rank_var)?,
            "rank",
            size_var,
            world_size,
        )?;
        let local_rank = self.number(local_var)?;
        let local_world_size = match self.get(local_size_var) {
            None => None,
            Some(_) => Some(self.size(local_size_var)?),
        };
        if let Some(n) = local_world_size {
            below(local_var, local_rank, "local rank", local_size_var, n)?;
        }
        Ok(ProcessEnv {
            source: self.source,
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: String::new(),
            master_port: 0,
            elastic: None,
            ends_survivors: None,
        })
    }

    fn addr(&self, var: &'static str) -> Result<String, EnvError> {
        let value = self.required(var)?;
        let trimmed = value.trim();
        if trimmed.is_empty() || trimmed.chars().any(char::is_whitespace) {
            return Err(EnvError::Invalid {
                var,
                value,
                reason: "expected a host name or IP address of rank 0".into(),
            });
        }
        Ok(trimmed.to_string())
    }

    fn port(&self, var: &'static str) -> Result<u16, EnvError> {
        let value = self.required(var)?;
        match value.trim().parse::<u16>() {
            Ok(0) | Err(_) => Err(EnvError::Invalid {
                var,
                value,
                reason: "expected a TCP port in 1..=65535".into(),
            }),
            Ok(p) => Ok(p),
        }
    }
}
