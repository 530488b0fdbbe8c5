//! An elastic training job in processes: 4 ranks train a small model with ZeRO-1 and
//! AdamW over the host provider (`Config::elastic`, `run_elastic`, the optimizer's state
//! carried by `resume`, each step's samples from a `DistributedSampler` whose global
//! batches of 10 split over 4 ranks and then 3); when one of them is killed from outside (SIGKILL) the 3 left carry
//! on with the state they hold and the killed rank's, rebuilt from the copy the rank before
//! it kept (`StateCarry::with_replica`, on by default), then a standby process joins
//! through `grow`, receives its part of it, and the job ends on 4 ranks. `scripts/test-processes.sh` runs it under mpirun and srun as 5
//! processes and kills rank 1 by its pid:
//!
//! ```text
//! mpirun -np 5 --enable-recovery target/candle/debug/examples/elastic --dir DIR
//! ```
//!
//! - ranks 0-3 (the launcher's `OMPI_COMM_WORLD_RANK`, `SLURM_PROCID` or `PMI_RANK`) make
//!   the communicator; rank 0 writes its id to `DIR/id`, the others read it there;
//! - rank 1, at step `--kill-at`, writes its pid to `DIR/victim.pid` (for the outside kill)
//!   and from then on takes `--slow-ms` (100 ms) per step, so that the kill lands while
//!   the others wait for it in a collective;
//! - the survivors train `--small-steps` steps on 3 ranks, then grow back to 4: the new
//!   rank 0 writes the grow id to `DIR/grow`; launcher rank 4, the standby, waits for it
//!   there, joins as rank 3 and takes rank 0's step and parameters;
//! - all 4 train to `--steps`.
//!
//! `--timeout-s` (30 s) bounds each wait: the watchdog's timeout, and the wait for a file.
//! `--victims 2`: ranks 1 and 2 are killed (rank 2 writes `DIR/victim2.pid`), with
//! `--standbys 0`: the 2 left train to the end. The standby writes `DIR/standby.pid` as it
//! starts (for a job that kills it before it joins: the others' `grow` fails within the
//! timeout, and they train to the end on 3 ranks).
//!
//! It drives the lower-level calls by hand (`run_elastic`, `grow`, `join`, the grow id in a
//! file) so that the script can kill a standby before it joins; a job of your own uses
//! `ElasticJob` (`examples/elastic_job.rs`, the README's program), which moves the grow id
//! through the job's rendezvous and takes the standby back by a grow policy.
//!
//! Each rank prints lines the script checks (times in ms since the epoch):
//! `LOST rank R at step S after the loss of rank L: first step on 3 ranks at T`,
//! `GROW_ID at T`, `FIRST_STEP_ON_4 rank R at T`, and at the end
//! `FINAL rank R of 4 step S params HASH loss FIRST -> LAST`, and once its communicators
//! are torn down, `EXIT 0 launcher rank N` (a rank that fails prints `ERROR ...` and exits 1).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use candle_core::{DType, Device, Tensor};
use candle_nn::{linear, loss, Linear, Module, ParamsAdamW, VarBuilder, VarMap};
use nccl_safe::{CommDevice, UniqueId};
use nccl_safe_candle::state::AdamW;
use nccl_safe_candle::{
    run_elastic, BatchSplit, Communicator, Config, DistResult, DistributedSampler, StateCarry,
    ZeroRedundancyOptimizer,
};

/// The job's ranks (the standby is the launcher's rank `RANKS`).
const RANKS: usize = 4;
/// The lost rank.
const VICTIM: usize = 1;
/// The samples: neither they nor a global batch divide by 4 or by 3 (the sampler splits
/// them unevenly and weights each rank's loss).
const ROWS: usize = 26;
/// Samples per step over all ranks (10, 10, 6 per epoch).
const GLOBAL_BATCH: usize = 10;
const INPUTS: usize = 8;
const HIDDEN: usize = 16;
const LR: f64 = 0.01;

type Error = Box<dyn std::error::Error + Send + Sync>;

struct Args {
    dir: PathBuf,
    steps: u64,
    kill_at: u64,
    small_steps: u64,
    slow_ms: u64,
    timeout: Duration,
    /// Ranks 1..=victims are killed from outside (1 or 2).
    victims: usize,
    /// Launcher ranks after the job's 4 that wait to join through `grow` (0 or 1).
    standbys: usize,
}

fn args() -> Result<Args, Error> {
    let mut a = Args {
        dir: PathBuf::new(),
        steps: 60,
        kill_at: 10,
        small_steps: 10,
        slow_ms: 100,
        timeout: Duration::from_secs(30),
        victims: 1,
        standbys: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().ok_or_else(|| format!("{k} needs a value"))?;
        let n = || v.parse::<u64>().map_err(|e| format!("{k} {v}: {e}"));
        match k.as_str() {
            "--dir" => a.dir = PathBuf::from(&v),
            "--steps" => a.steps = n()?,
            "--kill-at" => a.kill_at = n()?,
            "--small-steps" => a.small_steps = n()?,
            "--slow-ms" => a.slow_ms = n()?,
            "--timeout-s" => a.timeout = Duration::from_secs(n()?),
            "--victims" => a.victims = n()? as usize,
            "--standbys" => a.standbys = n()? as usize,
            _ => return Err(format!("unknown argument {k}").into()),
        }
    }
    if a.dir.as_os_str().is_empty() {
        return Err("--dir DIR is needed (a folder every rank can read and write)".into());
    }
    if a.kill_at + a.small_steps >= a.steps {
        return Err("--kill-at + --small-steps must stay below --steps".into());
    }
    if !(1..=2).contains(&a.victims) || a.standbys > 1 || (a.victims == 2 && a.standbys > 0) {
        return Err("--victims is 1 or 2, --standbys 0 or 1 (0 with 2 victims)".into());
    }
    Ok(a)
}

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// This process's rank from the launcher's environment.
fn launcher_rank() -> Result<usize, Error> {
    ["OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK", "RANK"]
        .iter()
        .find_map(|k| std::env::var(k).ok())
        .ok_or("no rank in the environment (OMPI_COMM_WORLD_RANK, SLURM_PROCID, PMI_RANK, RANK)")?
        .parse()
        .map_err(|e| format!("the launcher's rank: {e}").into())
}

/// Writes `bytes` to `path` at once (a rename), for a reader that polls for it.
fn publish(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Waits for `path` to appear (written by [`publish`]) and reads the id in it.
fn read_id(path: &Path, timeout: Duration) -> Result<UniqueId, Error> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(b) = std::fs::read(path) {
            return Ok(UniqueId::from_bytes(&b)?);
        }
        if Instant::now() >= deadline {
            return Err(format!("{} did not appear within {timeout:?}", path.display()).into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    fn new(map: &VarMap) -> candle_core::Result<Mlp> {
        let vb = VarBuilder::from_varmap(map, DType::F32, &Device::Cpu);
        Ok(Mlp {
            l1: linear(INPUTS, HIDDEN, vb.pp("l1"))?,
            l2: linear(HIDDEN, 1, vb.pp("l2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.tanh()?)
    }
}

/// xorshift64*: numbers in [-1, 1), the same on every rank.
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed | 1;
    move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// The data set (each step, every rank trains on its part of the step's global batch):
/// inputs and a smooth target.
fn batch() -> candle_core::Result<(Tensor, Tensor)> {
    let mut next = uniform(0x9E37_79B9_7F4A_7C15);
    let xs: Vec<f32> = (0..ROWS * INPUTS).map(|_| next()).collect();
    let ys: Vec<f32> = xs
        .chunks(INPUTS)
        .map(|r| (r[0] * 2.0 - r[1]).sin() * 0.5 + r[2] * r[3])
        .collect();
    Ok((
        Tensor::from_vec(xs, (ROWS, INPUTS), &Device::Cpu)?,
        Tensor::from_vec(ys, (ROWS, 1), &Device::Cpu)?,
    ))
}

/// The parameters, by name, hashed bit for bit (64-bit FNV-1a).
fn params_hash(map: &VarMap) -> candle_core::Result<u64> {
    let data = map.data().lock().expect("the variables");
    let mut vars: Vec<_> = data.iter().collect();
    vars.sort_by(|a, b| a.0.cmp(b.0));
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for (name, v) in vars {
        let values = v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        let bytes = name
            .bytes()
            .chain(values.iter().flat_map(|x| x.to_le_bytes()));
        for b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    Ok(h)
}

/// One rank's training state across the sessions of `run_elastic`.
struct Trainer<'a> {
    args: &'a Args,
    map: VarMap,
    model: Mlp,
    x: Tensor,
    y: Tensor,
    /// The whole batch's loss after each step.
    losses: Vec<f32>,
    /// This process is a rank that is killed (its rank).
    victim: Option<usize>,
    /// The step at which the job lost a rank, once it did.
    lost_at: Option<u64>,
    /// The optimizer's state between two sessions (AdamW's moments, re-sharded by
    /// `resume` over each new world).
    carry: StateCarry,
    /// Each step's samples, on any world: the step the ranks agree on after a recovery
    /// picks the global batch the lost rank never finished.
    sampler: DistributedSampler,
}

impl Trainer<'_> {
    /// Steps on `comm` while `*step < end`; `until_small`: also stop after
    /// `--small-steps` steps on fewer than 4 ranks (then return how many ranks are left).
    fn steps(
        &mut self,
        comm: &Communicator,
        step: &mut u64,
        end: u64,
        until_small: bool,
    ) -> DistResult<()> {
        // Built again on every communicator: rank 0's parameters, shards of the new world,
        // and the state the ranks carried, re-sharded over it.
        let config = ParamsAdamW {
            lr: LR,
            ..ParamsAdamW::default()
        };
        let mut opt =
            ZeroRedundancyOptimizer::<AdamW>::resume(comm, &self.map, config, &self.carry)?;
        let small = comm.world_size() < RANKS;
        if small && self.lost_at.is_none() {
            self.lost_at = Some(*step);
        }
        let mut first = true;
        while *step < end {
            if until_small && small && *step >= self.lost_at.unwrap_or(0) + self.args.small_steps {
                break;
            }
            if let (Some(v), true) = (self.victim, *step == self.args.kill_at) {
                // Rank 1's `victim.pid`, rank 2's `victim2.pid`.
                let name = if v == 1 {
                    "victim.pid".to_string()
                } else {
                    format!("victim{v}.pid")
                };
                let path = self.args.dir.join(name);
                publish(&path, std::process::id().to_string().as_bytes())
                    .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
            }
            if self.victim.is_some() && *step >= self.args.kill_at {
                // Slow from here: the others wait for this rank in the next collective.
                std::thread::sleep(Duration::from_millis(self.args.slow_ms));
            }
            let part = self.sampler.part_for(comm, *step)?;
            let (xs, ys) = (part.select(&self.x)?, part.select(&self.y)?);
            let l = (loss::mse(&self.model.forward(&xs)?, &ys)? * part.weight)?;
            opt.backward_step(&l)?;
            *step += 1;
            self.losses
                .push(loss::mse(&self.model.forward(&self.x)?, &self.y)?.to_scalar::<f32>()?);
            if first {
                first = false;
                if small {
                    println!(
                        "LOST rank {} at step {} after the loss of a rank: first step on {} ranks at {:.1}",
                        comm.rank(),
                        *step - 1,
                        comm.world_size(),
                        now_ms()
                    );
                } else if *step > self.args.kill_at {
                    println!("FIRST_STEP_ON_4 rank {} at {:.1}", comm.rank(), now_ms());
                }
            }
        }
        Ok(())
    }
}

fn run(args: &Args, me: usize) -> Result<(), Error> {
    let config = Config::new().elastic(true).timeout(args.timeout);
    let map = VarMap::new();
    let model = Mlp::new(&map)?;
    let (x, y) = batch()?;
    let mut t = Trainer {
        args,
        map,
        model,
        x,
        y,
        losses: Vec::new(),
        victim: (VICTIM..VICTIM + args.victims).contains(&me).then_some(me),
        lost_at: None,
        carry: StateCarry::new(),
        sampler: DistributedSampler::new(ROWS, GLOBAL_BATCH)?
            .shuffle(0x5EED)
            .split(BatchSplit::Uneven),
    };
    let (comm, mut step) = if me < RANKS {
        let id_file = args.dir.join("id");
        let id = if me == 0 {
            let id = UniqueId::from_raw(nccl_safe::host::shared_unique_id());
            publish(&id_file, id.as_bytes())?;
            id
        } else {
            read_id(&id_file, args.timeout)?
        };
        let comm = Communicator::init_rank(&CommDevice::Host, RANKS, me, &id, &config)?;
        // To 3 ranks: train until a rank is lost and the rest have taken a few steps.
        let run = run_elastic(comm, 0, |comm, step| t.steps(comm, step, args.steps, true))?;
        if run.comm.world_size() == RANKS {
            return Err(format!("no rank was lost by step {}", run.step).into());
        }
        for r in &run.recoveries {
            println!(
                "RECOVERY rank {} lost rank {} at step {}: {} -> {} ranks, recover() took {:?} (lost {:?})",
                r.ranks.0, r.lost, r.step, r.world_sizes.0, r.world_sizes.1, r.took, r.lost_ranks
            );
        }
        let mut step = run.step;
        if args.standbys == 0 {
            (run.comm, step)
        } else {
            // Back to 4: the new rank 0 hands the standby the grow id.
            let grown = if run.comm.rank() == 0 {
                let gid = run.comm.grow_id()?;
                println!("GROW_ID at {:.1}", now_ms());
                publish(&args.dir.join("grow"), gid.as_bytes())?;
                nccl_safe_candle::grow(run.comm, RANKS, Some(&gid), &mut step)
            } else {
                nccl_safe_candle::grow(run.comm, RANKS, None, &mut step)
            };
            // A standby that never joins costs the grow only: carry on at the old size.
            let comm = grown.unwrap_or_else(|(comm, e)| {
                println!(
                    "GROW_FAILED rank {}: carrying on at {} ranks: {e}",
                    comm.rank(),
                    comm.world_size()
                );
                comm
            });
            (comm, step)
        }
    } else {
        // The standby: joins as the last rank once the job has shrunk. Its pid first, for
        // a job that kills it before it joins.
        publish(
            &args.dir.join("standby.pid"),
            std::process::id().to_string().as_bytes(),
        )?;
        let gid = read_id(&args.dir.join("grow"), args.timeout)?;
        nccl_safe_candle::join(&CommDevice::Host, RANKS, RANKS - 1, &gid, &config)?
    };
    let end = args.steps;
    let run = run_elastic(comm, step, |comm, step| t.steps(comm, step, end, false))?;
    step = run.step;
    let (first, last) = (
        t.losses.first().copied().unwrap_or(f32::NAN),
        t.losses.last().copied().unwrap_or(f32::NAN),
    );
    println!(
        "FINAL rank {} of {} step {step} params {:016x} loss {first:.6} -> {last:.6}",
        run.comm.rank(),
        run.comm.world_size(),
        params_hash(&t.map)?
    );
    Ok(())
}

fn main() {
    let result = args().and_then(|a| {
        let me = launcher_rank()?;
        run(&a, me).map_err(|e| format!("launcher rank {me}: {e}"))?;
        Ok(me)
    });
    match result {
        // After every communicator's teardown: the process exits 0 from here.
        Ok(me) => println!("EXIT 0 launcher rank {me}"),
        Err(e) => {
            println!("ERROR {e}");
            eprintln!("elastic: {e}");
            std::process::exit(1);
        }
    }
}
