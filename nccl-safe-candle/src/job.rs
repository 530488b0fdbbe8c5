//! [`ElasticJob`]: the launcher of an elastic job, as threads or as the processes of
//! torchrun, srun or mpirun, handing each rank what [`run_elastic`](crate::run_elastic)
//! needs, with standbys that the job takes back by a [`GrowPolicy`].
//!
//! One call starts a rank whichever way the job runs: [`ElasticJob::run`] runs its closure
//! on every rank in threads ([`ElasticJob::host`]) or on this process's rank
//! ([`ElasticJob::from_env`]), and gives it an [`ElasticRank`]: a member with an owned,
//! elastic communicator ([`Config::elastic`] is set for it), or a standby that waits to be
//! taken back. [`ElasticRank::train`] runs the training loop: the session closure steps
//! until the step it is told to stop at; after the loss of a rank it runs again on the
//! ranks left ([`run_elastic`](crate::run_elastic)); at the policy's check points, while
//! the job is below its size, it takes a waiting standby back in ([`grow`](crate::grow) /
//! [`join`](crate::join)).
//!
//! The grow's id moves through the job's own rendezvous, not by hand: in threads through
//! memory; in processes over the job's authenticated TCP rendezvous
//! ([`TcpRendezvous`], the same token,
//! `NCCL_SAFE_RENDEZVOUS_TOKEN`): standby `i` (launcher rank `members + i`) is reached on
//! `MASTER_ADDR:MASTER_PORT + 2 + i` (after the id's port and the desync board's), where
//! the communicator's rank 0 offers it a place (the new world size), then the grow's id,
//! and at the end of the job tells it that it is not needed. The launcher's last
//! `standbys` ranks are the standbys; the others are the members.
//!
//! In processes the launcher must let the survivors run on when a rank dies: mpirun
//! `--enable-recovery`, srun without `--kill-on-bad-exit`; torchrun's agent stops every
//! worker, so it is refused ([`EnvError::EndsSurvivors`](nccl_launch::env::EnvError),
//! naming what to start the job with).
//!
//! What it does not do (yet): a grow's rank 0 must be able to listen on `MASTER_ADDR`
//! (after the loss of the job's first rank, the new rank 0 must run on its host; else the
//! job carries on at its smaller size); a standby is offered a place once every
//! [`GrowPolicy::WhenStandbyWaits`] check point, one standby per grow.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use nccl_launch::env::ProcessEnv;
use nccl_launch::rendezvous::{Refusal, RendezvousError, ServerHandle, TcpRendezvous};
use nccl_safe::{CommDevice, Communicator, Config, UniqueId};

use crate::elastic::{device_of, run_elastic_with, ElasticRun, MinRanks};
use crate::error::{DistError, DistErrorKind as K, DistResult as Result};

/// When the ranks of an elastic job take a standby back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrowPolicy {
    /// Never: the job carries on at the size it shrank to, and its standbys are told at
    /// the end that they are not needed.
    Never,
    /// While the job is below its size: every `every` steps (a check point, where the
    /// session closure returns and is run again), take back one standby that waits.
    /// Rank 0 offers a place to a standby ahead of the check point; the grow happens at
    /// the first check point after the standby took it.
    WhenStandbyWaits {
        /// Steps between two check points (1 or more).
        every: u64,
    },
}

impl Default for GrowPolicy {
    /// [`GrowPolicy::WhenStandbyWaits`] every 10 steps.
    fn default() -> Self {
        GrowPolicy::WhenStandbyWaits { every: 10 }
    }
}

/// How long a standby waits to be taken back or released, by default.
pub const DEFAULT_STANDBY_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How long rank 0 waits at the end of a job for each standby to hear that it is not
/// needed (a standby that died costs this).
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// One poll of a standby for its rendezvous (a refused or missing server is tried again
/// after it).
const POLL: Duration = Duration::from_millis(1000);

/// The launcher of an elastic job: its members and standbys, in threads or processes.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{linear, loss, Module, VarBuilder, VarMap, SGD};
/// use nccl_safe_candle::{ElasticJob, ZeroRedundancyOptimizer};
///
/// // 2 ranks in threads (under mpirun: `ElasticJob::from_env()?`, the same closure) and a
/// // standby, which nothing needs here: it is released at the end.
/// let ends = ElasticJob::host(2).standbys(1).run(|rank| {
///     let map = VarMap::new();
///     let model = linear(4, 1, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
///     let x = Tensor::ones((6, 4), DType::F32, &Device::Cpu)?;
///     let y = Tensor::zeros((6, 1), DType::F32, &Device::Cpu)?;
///     let run = rank.train(5, |comm, step, stop| {
///         let mut opt = ZeroRedundancyOptimizer::<SGD>::new(comm, &map, 0.1)?;
///         let (x, y) = (opt.shard_batch(&x)?, opt.shard_batch(&y)?);
///         while *step < stop {
///             opt.backward_step(&loss::mse(&model.forward(&x)?, &y)?)?;
///             *step += 1;
///         }
///         Ok(())
///     })?;
///     Ok(run.map(|r| (r.step, r.comm.world_size())))
/// });
/// let ends: Vec<_> = ends.into_iter().collect::<Result<_, _>>()?;
/// assert_eq!(ends, vec![Some((5, 2)), Some((5, 2)), None]);
/// # Ok::<(), nccl_safe_candle::DistError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ElasticJob {
    kind: Kind,
    standbys: usize,
    config: Config,
    policy: GrowPolicy,
    standby_timeout: Duration,
    min_ranks: MinRanks,
}

#[derive(Debug, Clone)]
enum Kind {
    /// `n` member ranks (and the standbys) as threads on the host provider.
    Host(usize),
    /// This process's rank of a launched job.
    Process { env: ProcessEnv, host: bool },
}

impl ElasticJob {
    /// `members` ranks as threads on the host provider (and [`standbys`](Self::standbys)
    /// more threads).
    pub fn host(members: usize) -> ElasticJob {
        ElasticJob::with(Kind::Host(members))
    }

    /// This process's rank of a job started by torchrun, srun or mpirun (the variables of
    /// [`nccl_launch::env`]); the launcher's last [`standbys`](Self::standbys) ranks
    /// are the standbys. On the GPU of the local rank, or the host provider with
    /// [`host_provider`](Self::host_provider).
    pub fn from_env() -> Result<ElasticJob> {
        let env = ProcessEnv::from_process_env().map_err(nccl_launch::Error::from)?;
        Ok(ElasticJob::with(Kind::Process { env, host: false }))
    }

    /// [`from_env`](Self::from_env) when a launcher started this process, else `members`
    /// ranks in threads on the host provider ([`host`](Self::host)): one program for both.
    pub fn from_env_or_host(members: usize) -> Result<ElasticJob> {
        match ProcessEnv::from_process_env() {
            Ok(env) => Ok(ElasticJob::with(Kind::Process { env, host: false })),
            Err(nccl_launch::env::EnvError::NotLaunched) => Ok(ElasticJob::host(members)),
            Err(e) => Err(nccl_launch::Error::from(e).into()),
        }
    }

    fn with(kind: Kind) -> ElasticJob {
        ElasticJob {
            kind,
            standbys: 0,
            config: Config::new().elastic(true),
            policy: GrowPolicy::default(),
            standby_timeout: DEFAULT_STANDBY_TIMEOUT,
            min_ranks: MinRanks::default(),
        }
    }

    /// In processes: the ranks run on the host provider (CPU memory, the processes of one
    /// machine meeting in shared memory) rather than a GPU each. In threads they always do.
    pub fn host_provider(mut self) -> ElasticJob {
        if let Kind::Process { host, .. } = &mut self.kind {
            *host = true;
        }
        self
    }

    /// How many standbys: in threads, extra threads; in processes, the launcher's last
    /// `n` ranks (default 0).
    pub fn standbys(mut self, n: usize) -> ElasticJob {
        self.standbys = n;
        self
    }

    /// The communicators' configuration; [`Config::elastic`] is set on it.
    pub fn config(mut self, config: Config) -> ElasticJob {
        self.config = config.elastic(true);
        self
    }

    /// When a standby is taken back (default [`GrowPolicy::default`]).
    pub fn grow_policy(mut self, policy: GrowPolicy) -> ElasticJob {
        self.policy = policy;
        self
    }

    /// How long a standby waits to be taken back or released before it fails
    /// (default [`DEFAULT_STANDBY_TIMEOUT`]).
    pub fn standby_timeout(mut self, timeout: Duration) -> ElasticJob {
        self.standby_timeout = timeout;
        self
    }

    /// The quorum rule of each recovery (default [`MinRanks::Half`]: at least half of the
    /// ranks it began with, and at least 2): a recovery that would leave fewer ends the
    /// rank's [`ElasticRank::train`] with
    /// [`DistErrorKind::NoQuorum`](crate::DistErrorKind::NoQuorum), so a rank stuck past
    /// the timeout that wakes after the others recovered without it exits with an error
    /// rather than training alone. See [`MinRanks`].
    pub fn min_ranks(mut self, rule: MinRanks) -> ElasticJob {
        self.min_ranks = rule;
        self
    }

    /// The job's size: its members.
    pub fn members(&self) -> Result<usize> {
        match &self.kind {
            Kind::Host(n) => Ok(*n),
            Kind::Process { env, .. } => env
                .world_size
                .checked_sub(self.standbys)
                .filter(|&m| m > 0)
                .ok_or_else(|| {
                    invalid(format!(
                        "{} standbys leave no member of a job of {} processes",
                        self.standbys, env.world_size
                    ))
                }),
        }
    }

    /// Runs `f` on every rank of the job, members and standbys, and returns what each
    /// returned: in threads every rank's, in launcher-rank order; in processes this
    /// process's. A member's [`ElasticRank`] holds its communicator (made here, collective
    /// over the members); a standby's waits in [`ElasticRank::train`].
    pub fn run<T, F>(&self, f: F) -> Vec<Result<T>>
    where
        T: Send,
        F: Fn(ElasticRank) -> Result<T> + Sync,
    {
        let members = match self.members() {
            Ok(m) => m,
            Err(e) => return vec![Err(e)],
        };
        if let GrowPolicy::WhenStandbyWaits { every: 0 } = self.policy {
            return vec![Err(invalid(
                "GrowPolicy::WhenStandbyWaits needs every >= 1".into(),
            ))];
        }
        match &self.kind {
            Kind::Host(_) => self.run_threads(members, &f),
            Kind::Process { env, host } => {
                vec![self.process_rank(env, *host, members).and_then(&f)]
            }
        }
    }

    fn rank(
        &self,
        role: Role,
        device: CommDevice,
        members: usize,
        channel: Channel,
    ) -> ElasticRank {
        ElasticRank {
            role,
            device,
            members,
            standbys: self.standbys,
            config: self.config.clone(),
            policy: self.policy,
            standby_timeout: self.standby_timeout,
            min_ranks: self.min_ranks,
            channel,
        }
    }

    fn run_threads<T: Send>(
        &self,
        members: usize,
        f: &(impl Fn(ElasticRank) -> Result<T> + Sync),
    ) -> Vec<Result<T>> {
        let id = match CommDevice::Host.unique_id() {
            Ok(id) => id,
            Err(e) => return vec![Err(e.into())],
        };
        let mail = Arc::new(Mailboxes::new(self.standbys));
        // Members still running: the last to end releases the standbys (when rank 0
        // failed before it could).
        let running = std::sync::atomic::AtomicUsize::new(members);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..members + self.standbys)
                .map(|r| {
                    let (id, mail, running) = (&id, Arc::clone(&mail), &running);
                    s.spawn(move || {
                        let _last = (r < members).then(|| LastOut(running, Arc::clone(&mail)));
                        let role = if r < members {
                            let comm = Communicator::init_rank(
                                &CommDevice::Host,
                                members,
                                r,
                                id,
                                &self.config,
                            )?;
                            Role::Member(Box::new(comm))
                        } else {
                            Role::Standby(r - members)
                        };
                        f(self.rank(role, CommDevice::Host, members, Channel::Threads(mail)))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    }

    fn process_rank(&self, env: &ProcessEnv, host: bool, members: usize) -> Result<ElasticRank> {
        let device = if host {
            CommDevice::Host
        } else {
            cuda_device(env.cuda_ordinal())?
        };
        let channel = Channel::Tcp(TcpGrow {
            env: env.clone(),
            offer: None,
        });
        if env.rank >= members {
            env.keeps_survivors().map_err(nccl_launch::Error::from)?;
            return Ok(self.rank(Role::Standby(env.rank - members), device, members, channel));
        }
        let mut member_env = env.clone();
        member_env.world_size = members;
        let mut launcher =
            nccl_launch::ProcessLauncher::new(member_env).config(self.config.clone());
        if host {
            launcher = launcher.host();
        }
        let comm = launcher.init()?.into_comm();
        Ok(self.rank(Role::Member(Box::new(comm)), device, members, channel))
    }
}

/// The CUDA device of a process's local rank (its standby's device).
#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize) -> Result<CommDevice> {
    let ctx = candle_core::cuda_backend::cudarc::driver::CudaContext::new(ordinal)
        .map_err(|e| invalid(format!("CUDA device {ordinal}: {e}")))?;
    Ok(CommDevice::Cuda(ctx))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_ordinal: usize) -> Result<CommDevice> {
    Err(invalid(
        "ranks on GPUs need this crate's `cuda` feature; ElasticJob::host_provider runs them on the CPU".into(),
    ))
}

fn invalid(reason: String) -> DistError {
    K::InvalidArgument {
        call: "ElasticJob",
        reason,
    }
    .into()
}

/// A member, or a standby (its index among the standbys).
#[derive(Debug)]
enum Role {
    Member(Box<Communicator>),
    Standby(usize),
}

/// One rank of an [`ElasticJob`]: a member with its communicator, or a standby.
#[derive(Debug)]
pub struct ElasticRank {
    role: Role,
    device: CommDevice,
    members: usize,
    standbys: usize,
    config: Config,
    policy: GrowPolicy,
    standby_timeout: Duration,
    min_ranks: MinRanks,
    channel: Channel,
}

impl ElasticRank {
    /// Whether this rank waits to be taken back (it has no communicator yet).
    pub fn is_standby(&self) -> bool {
        matches!(self.role, Role::Standby(_))
    }

    /// The member's communicator, for a loop of your own around
    /// [`run_elastic`](crate::run_elastic) (`None` for a standby).
    pub fn into_comm(self) -> Option<Communicator> {
        match self.role {
            Role::Member(c) => Some(*c),
            Role::Standby(_) => None,
        }
    }

    /// Trains to step `end`: runs `session(comm, &mut step, stop)`, which steps while
    /// `*step < stop` and increments `*step` after each step, from step 0 (a standby: from
    /// the step it joins at), again on the ranks left after the loss of a rank
    /// ([`run_elastic`](crate::run_elastic)), and, while the job is below its size, at each
    /// check point of the [`GrowPolicy`] (`stop` is the next one), where a waiting standby
    /// is taken back ([`grow`](crate::grow)). Build the optimizer in the session (with
    /// `resume` and a [`StateCarry`](crate::StateCarry) to keep its state), and the batch
    /// of each step from a [`DistributedSampler`](crate::DistributedSampler): the world's
    /// size changes between sessions.
    ///
    /// A standby waits (up to [`ElasticJob::standby_timeout`]) until rank 0 takes it back,
    /// then trains with the others; `Ok(None)` when the job ended without it. A grow that
    /// fails (the standby died while it joined) leaves the job at its size. A member
    /// returns the last communicator, its step and the recoveries. A recovery that would
    /// leave fewer ranks than [`ElasticJob::min_ranks`] allows ends it with
    /// [`DistErrorKind::NoQuorum`](crate::DistErrorKind::NoQuorum).
    #[track_caller]
    pub fn train(
        self,
        end: u64,
        mut session: impl FnMut(&Communicator, &mut u64, u64) -> Result<()>,
    ) -> Result<Option<ElasticRun<()>>> {
        let ElasticRank {
            role,
            device,
            members,
            standbys,
            config,
            policy,
            standby_timeout,
            min_ranks,
            mut channel,
        } = self;
        let (at, _scope) = crate::error::caller_scope();
        let (mut comm, mut step) = match role {
            Role::Member(c) => (*c, 0),
            Role::Standby(i) => {
                let joined = channel.standby_wait(i, &device, &config, standby_timeout);
                match joined.map_err(|e| e.at(at, None))? {
                    Some(joined) => joined,
                    None => return Ok(None),
                }
            }
        };
        // Which standbys are members now (rank 0's list, shared at each session's start).
        let mut joined = vec![false; standbys];
        let mut recoveries = Vec::new();
        // Whether this rank was rank 0 at its last session's start: it releases the
        // standbys when it fails (else they would wait for their timeout).
        let mut lead = false;
        loop {
            let run = run_elastic_with(comm, step, min_ranks, |c, s| {
                lead = c.rank() == 0;
                if standbys > 0 {
                    share_joined(c, &mut joined)?;
                }
                let short = c.world_size() < members;
                let growing = matches!(policy, GrowPolicy::WhenStandbyWaits { .. });
                if short && growing && standbys > 0 && c.rank() == 0 {
                    // Offer a place now, so that a standby has until the check point.
                    channel.prepare(c.world_size(), &joined);
                }
                let stop = match policy {
                    GrowPolicy::WhenStandbyWaits { every } if short && standbys > 0 => {
                        ((*s / every) + 1).saturating_mul(every).min(end)
                    }
                    _ => end,
                };
                session(c, s, stop)?;
                if *s >= end || !short || stop == end {
                    return Ok(None);
                }
                // A check point: rank 0 says whether a standby is ready, and which.
                let ready = if c.rank() == 0 {
                    channel.ready(c.world_size(), &joined)
                } else {
                    None
                };
                let i = bcast_from_0(c, ready.map_or(-1.0, |i| i as f64))?;
                if i < 0.0 {
                    return Ok(None);
                }
                // Rank 0 takes the grow's id, then says whether it could (NCCL sends it to
                // ranks 0 and n-1 in the call, and they wait for it in their grow: only a
                // grow whose id exists is started).
                let id = if c.rank() == 0 {
                    c.grow_id().ok()
                } else {
                    None
                };
                let ok = bcast_from_0(c, if id.is_some() { 1.0 } else { 0.0 })?;
                Ok((ok > 0.5).then_some((i as usize, id)))
            });
            let run = match run {
                Ok(run) => run,
                Err(e) => {
                    if lead && standbys > 0 {
                        channel.release(&joined);
                    }
                    return Err(e);
                }
            };
            comm = run.comm;
            step = run.step;
            recoveries.extend(run.recoveries);
            let (i, id) = match run.value {
                Some(ready) => ready,
                None if step >= end => break,
                // A check point without a standby ready: the next session.
                None => continue,
            };
            let w = comm.world_size() + 1;
            let grown = match id {
                Some(id) => {
                    // A server that cannot start leaves the standby without the id: the
                    // grow fails at its timeout on every rank, and the job carries on.
                    let server = channel.hand_id(&id, w, i).ok().flatten();
                    let grown = crate::elastic::grow(comm, w, Some(&id), &mut step);
                    channel.handed(server);
                    grown
                }
                None => crate::elastic::grow(comm, w, None, &mut step),
            };
            comm = match grown {
                Ok(big) => {
                    joined[i] = true;
                    big
                }
                Err((old, _)) => old,
            };
        }
        if comm.rank() == 0 && standbys > 0 {
            channel.release(&joined);
        }
        Ok(Some(ElasticRun {
            comm,
            value: (),
            step,
            recoveries,
        }))
    }
}

/// Rank 0's `v` to every rank of `c`.
fn bcast_from_0(c: &Communicator, v: f64) -> Result<f64> {
    let t = Tensor::new(&[v][..], &device_of(c)?)?;
    crate::tensor::broadcast(c, &t, 0)?;
    Ok(t.to_vec1::<f64>()?[0])
}

/// Rank 0's list of the standbys that joined, to every rank.
fn share_joined(c: &Communicator, joined: &mut [bool]) -> Result<()> {
    let mine: Vec<f64> = joined.iter().map(|&j| f64::from(u8::from(j))).collect();
    let t = Tensor::new(mine.as_slice(), &device_of(c)?)?;
    crate::tensor::broadcast(c, &t, 0)?;
    for (j, v) in joined.iter_mut().zip(t.to_vec1::<f64>()?) {
        *j = v > 0.5;
    }
    Ok(())
}

/// How grow ids reach the standbys.
#[derive(Debug)]
enum Channel {
    Threads(Arc<Mailboxes>),
    Tcp(TcpGrow),
}

impl Channel {
    /// Rank 0 at a check point of a world of `world` ranks: a standby ready to join as
    /// rank `world`, if one is (and offers a place to one, in processes).
    fn ready(&mut self, world: usize, joined: &[bool]) -> Option<usize> {
        match self {
            Channel::Threads(m) => {
                let slots = m.lock();
                (0..slots.len()).find(|&i| !joined[i] && matches!(slots[i], Mail::Waiting))
            }
            Channel::Tcp(t) => t.ready(world, joined),
        }
    }

    /// Rank 0 at the start of a session below the job's size: offers a standby a place
    /// (in processes; in threads a standby waits in its mailbox).
    fn prepare(&mut self, world: usize, joined: &[bool]) {
        if let Channel::Tcp(t) = self {
            if t.offer.as_ref().is_none_or(|o| o.1 != world + 1) {
                t.ready(world, joined);
            }
        }
    }

    /// Rank 0: the grow's id `id` to standby `i`, which joins as rank `w - 1` of `w` (a
    /// server that serves it, in processes).
    fn hand_id(&mut self, id: &UniqueId, w: usize, i: usize) -> Result<Option<ServerHandle>> {
        match self {
            Channel::Threads(m) => {
                m.post(i, Mail::Id(w, *id));
                Ok(None)
            }
            Channel::Tcp(t) => Ok(Some(t.serve(i, *id.as_bytes())?)),
        }
    }

    /// Rank 0, after the grow (made or failed: a standby that fetched the id late would
    /// only fail to join it, and wait again): the id's server is done with.
    fn handed(&mut self, server: Option<ServerHandle>) {
        if let Some(s) = server {
            s.stop();
        }
    }

    /// Rank 0 at the end: every standby not taken back is told that it is not needed.
    fn release(&mut self, joined: &[bool]) {
        match self {
            Channel::Threads(m) => {
                for i in (0..joined.len()).filter(|&i| !joined[i]) {
                    m.post(i, Mail::Done);
                }
            }
            Channel::Tcp(t) => t.release(joined),
        }
    }

    /// A standby: waits for a grow id, joins, and returns the communicator and the step;
    /// `None` when released.
    fn standby_wait(
        &mut self,
        i: usize,
        device: &CommDevice,
        config: &Config,
        timeout: Duration,
    ) -> Result<Option<(Communicator, u64)>> {
        let deadline = Instant::now() + timeout;
        loop {
            let offer = match self {
                Channel::Threads(m) => m.wait(i, deadline),
                Channel::Tcp(t) => t.wait(i, deadline)?,
            };
            let (w, id) = match offer {
                Some(Some(o)) => o,
                Some(None) => return Ok(None),
                None => {
                    return Err(nccl_safe::Error::Timeout {
                        what: format!("standby {i} was neither taken back nor released"),
                        timeout,
                    }
                    .into())
                }
            };
            match crate::elastic::join(device, w, w - 1, &id, config) {
                Ok(joined) => return Ok(Some(joined)),
                // The grow failed (a rank lost meanwhile, an id of a communicator that
                // shrank): wait for the next offer.
                Err(_) if Instant::now() < deadline => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

/// A member's thread: the last to end (returned, failed or panicked) releases every
/// standby still waiting.
struct LastOut<'a>(&'a std::sync::atomic::AtomicUsize, Arc<Mailboxes>);

impl Drop for LastOut<'_> {
    fn drop(&mut self) {
        if self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            let n = self.1.lock().len();
            for i in 0..n {
                self.1.post(i, Mail::Done);
            }
        }
    }
}

/// The standbys' mailboxes of a job in threads.
#[derive(Debug)]
struct Mailboxes {
    slots: Mutex<Vec<Mail>>,
    changed: Condvar,
}

#[derive(Debug, Clone)]
enum Mail {
    Idle,
    Waiting,
    Id(usize, UniqueId),
    Done,
}

impl Mailboxes {
    fn new(n: usize) -> Mailboxes {
        Mailboxes {
            slots: Mutex::new(vec![Mail::Idle; n]),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Mail>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn post(&self, i: usize, mail: Mail) {
        self.lock()[i] = mail;
        self.changed.notify_all();
    }

    /// Standby `i` waits for an id (`Some(Some)`), its release (`Some(None)`) or the
    /// deadline (`None`).
    fn wait(&self, i: usize, deadline: Instant) -> Option<Option<(usize, UniqueId)>> {
        let mut g = self.lock();
        if matches!(g[i], Mail::Idle | Mail::Id(..)) {
            // (An id taken before was a grow that failed: wait for a new one.)
            g[i] = Mail::Waiting;
        }
        loop {
            match &g[i] {
                Mail::Id(w, id) => return Some(Some((*w, *id))),
                Mail::Done => return Some(None),
                _ => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = self
                .changed
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The grow's messages to a standby over the TCP rendezvous: 128 bytes, this magic, the
/// kind and the new world size (an id has no such prefix).
const MAGIC: &[u8; 24] = b"nccl-safe-candle/grow/1\0";
const OFFER: u64 = 1;
const DONE: u64 = 2;

fn message(kind: u64, world: usize) -> [u8; 128] {
    let mut m = [0u8; 128];
    m[..24].copy_from_slice(MAGIC);
    m[24..32].copy_from_slice(&kind.to_le_bytes());
    m[32..40].copy_from_slice(&(world as u64).to_le_bytes());
    m
}

/// `(kind, world)` of a message, `None` for an id.
fn parse(m: &[u8; 128]) -> Option<(u64, usize)> {
    if &m[..24] != MAGIC {
        return None;
    }
    let word = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&m[r]);
        u64::from_le_bytes(b)
    };
    Some((word(24..32), word(32..40) as usize))
}

/// The grow over the job's TCP rendezvous (see the [module docs](self)).
#[derive(Debug)]
struct TcpGrow {
    env: ProcessEnv,
    /// Rank 0's open offer: the standby, the world size it was offered, its server.
    offer: Option<(usize, usize, ServerHandle)>,
}

impl TcpGrow {
    /// The rendezvous of standby `i`, with `timeout`.
    fn rendezvous(&self, i: usize, timeout: Duration) -> Result<TcpRendezvous> {
        let port = (self.env.master_port as usize + 2 + i)
            .try_into()
            .map_err(|_| {
                invalid(format!(
                    "MASTER_PORT {} + 2 + {i} is no port",
                    self.env.master_port
                ))
            })?;
        let mut env = self.env.clone();
        env.master_port = port;
        Ok(TcpRendezvous::from_env(&env)
            .map_err(nccl_launch::Error::from)?
            .timeout(timeout)
            .io_timeout(timeout.min(Duration::from_secs(10))))
    }

    fn serve(&self, i: usize, bytes: [u8; 128]) -> Result<ServerHandle> {
        // The id's wait is the grow's: the communicator's timeout (and a margin).
        let timeout = Duration::from_secs(600);
        Ok(self
            .rendezvous(i, timeout)?
            .serve(2, bytes)
            .map_err(nccl_launch::Error::from)?)
    }

    fn ready(&mut self, world: usize, joined: &[bool]) -> Option<usize> {
        let w = world + 1;
        if let Some((i, ow, h)) = self.offer.take() {
            if ow != w {
                // Offered before the world shrank: offer the new size again.
                h.stop();
                self.offer(i, w);
                return None;
            }
            if !h.is_finished() {
                self.offer = Some((i, ow, h));
                return None;
            }
            if h.wait().is_ok() {
                return Some(i);
            }
            // Expired: offer the next standby.
            let next = (1..=joined.len())
                .map(|k| (i + k) % joined.len())
                .find(|&j| !joined[j]);
            if let Some(j) = next {
                self.offer(j, w);
            }
            return None;
        }
        if let Some(i) = (0..joined.len()).find(|&i| !joined[i]) {
            self.offer(i, w);
        }
        None
    }

    /// Offers standby `i` the place of rank `w - 1` of `w` (a server that waits for it).
    fn offer(&mut self, i: usize, w: usize) {
        if let Ok(h) = self.serve(i, message(OFFER, w)) {
            self.offer = Some((i, w, h));
        }
    }

    fn release(&mut self, joined: &[bool]) {
        if let Some((_, _, h)) = self.offer.take() {
            h.stop();
        }
        let servers: Vec<ServerHandle> = (0..joined.len())
            .filter(|&i| !joined[i])
            .filter_map(|i| {
                self.rendezvous(i, RELEASE_WAIT)
                    .ok()?
                    .serve(2, message(DONE, 0))
                    .ok()
            })
            .collect();
        for s in servers {
            let _ = s.wait();
        }
    }

    /// Standby `i`: polls its rendezvous until an id comes after an offer
    /// (`Some(Some((world, id)))`), a release (`Some(None)`), or the deadline (`None`).
    fn wait(&self, i: usize, deadline: Instant) -> Result<Option<Option<(usize, UniqueId)>>> {
        let mut world = None;
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            let r = self.rendezvous(i, POLL.min(left))?;
            match r.fetch(1, 2) {
                Ok(m) => match (parse(&m), world) {
                    (Some((DONE, _)), _) => return Ok(Some(None)),
                    (Some((OFFER, w)), _) if w >= 2 => world = Some(w),
                    (Some(_), _) => {}
                    (None, Some(w)) => {
                        if let Ok(id) = UniqueId::from_bytes(&m) {
                            return Ok(Some(Some((w, id))));
                        }
                    }
                    // An id without an offer: not for us.
                    (None, None) => {}
                },
                // The server lingers after it served us: try again shortly.
                Err(RendezvousError::Refused {
                    reason: Refusal::DuplicateRank | Refusal::InProgress | Refusal::Busy,
                    ..
                }) => std::thread::sleep(Duration::from_millis(50)),
                Err(_) => {}
            }
        }
        Ok(None)
    }
}
