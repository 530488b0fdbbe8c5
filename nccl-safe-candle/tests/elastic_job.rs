//! `ElasticJob`: one call starts the ranks of an elastic job, in threads and in processes
//! (as mpirun starts them: `OMPI_COMM_WORLD_*`, the TCP rendezvous), and `ElasticRank::train`
//! survives the loss of a member and takes the standby back by the grow policy, the grow's
//! id going through the job's own rendezvous. Checked: the member that leaves at step 6
//! is recovered from at step 6 on 3 ranks, the standby joins at the first check point
//! after it (step 8), and the 4 ranks end at step 20 bit-identical, within 1e-5 of one
//! process training on the whole batch; with `GrowPolicy::Never` (or no loss) the standby
//! is released at the end and returns `None`. And the quorum rule in processes: a rank
//! stuck past the timeout (a stalled thread, or its process SIGSTOPped) that wakes after
//! the others recovered without it exits with `NoQuorum` rather than training alone.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use candle_nn::{loss, Module, Optimizer, ParamsAdamW, VarMap, SGD};
use common::*;
use nccl_safe::Config;
use nccl_safe_candle::state::AdamW;
use nccl_safe_candle::{
    BatchSplit, DistErrorKind, DistResult, DistributedSampler, ElasticJob, ElasticRank, GrowPolicy,
    MinRanks, StateCarry, ZeroRedundancyOptimizer,
};

const MEMBERS: usize = 4;
const STEPS: u64 = 20;
const LOST_AT: u64 = 6;
/// The first check point after the loss (every 4 steps).
const GROWN_AT: u64 = 8;
const ROWS: usize = 24;
const LR: f64 = 0.05;
const CHILD: &str = "NCCL_SAFE_CANDLE_TEST_JOB";

fn data() -> (Tensor, Tensor) {
    let (x, y) = batch().unwrap();
    (x.narrow(0, 0, ROWS).unwrap(), y.narrow(0, 0, ROWS).unwrap())
}

fn adamw_params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 0.01,
        ..ParamsAdamW::default()
    }
}

enum Opt<'c> {
    Sgd(ZeroRedundancyOptimizer<'c, SGD>),
    AdamW(ZeroRedundancyOptimizer<'c, AdamW>),
}

/// One process, the whole batch.
fn reference() -> Vec<f32> {
    let map = VarMap::new();
    let model = Mlp::new(&map).unwrap();
    init_fixed(&map).unwrap();
    let (x, y) = data();
    let mut opt = SGD::new(map.all_vars(), LR).unwrap();
    for _ in 0..STEPS {
        opt.backward_step(&loss::mse(&model.forward(&x).unwrap(), &y).unwrap())
            .unwrap();
    }
    flat_params(&map).unwrap()
}

/// What a rank ended with: its parameters, step, world size, recoveries' steps, and the
/// step it joined at (a standby).
#[derive(Debug, Clone)]
struct End {
    params: Vec<f32>,
    step: u64,
    world: usize,
    recovered_at: Vec<u64>,
    joined_at: Option<u64>,
}

/// One rank's training: ZeRO-1 with SGD over the sampler's parts of the whole batch; the
/// member that is rank 1 at the start leaves at `LOST_AT` by `leave` when `lose`.
fn train(rank: ElasticRank, lose: bool, slow: bool, leave: &dyn Fn()) -> DistResult<Option<End>> {
    train_with(rank, lose, slow, false, leave)
}

/// [`train`], with AdamW carried by `resume` (`adamw`) instead of SGD.
fn train_with(
    rank: ElasticRank,
    lose: bool,
    slow: bool,
    adamw: bool,
    leave: &dyn Fn(),
) -> DistResult<Option<End>> {
    let standby = rank.is_standby();
    let map = VarMap::new();
    let model = Mlp::new(&map)?;
    init_fixed(&map)?;
    let (x, y) = data();
    let sampler = DistributedSampler::new(ROWS, ROWS)?.split(BatchSplit::Uneven);
    let carry = StateCarry::new();
    let mut first: Option<(u64, usize)> = None;
    let mut joined_at = None;
    let run = rank.train(STEPS, |comm, step, stop| {
        let first = *first.get_or_insert((*step, comm.rank()));
        if standby && joined_at.is_none() {
            joined_at = Some(*step);
        }
        let mut opt = if adamw {
            Opt::AdamW(ZeroRedundancyOptimizer::<AdamW>::resume(
                comm,
                &map,
                adamw_params(),
                &carry,
            )?)
        } else {
            Opt::Sgd(ZeroRedundancyOptimizer::<SGD>::new(comm, &map, LR)?)
        };
        while *step < stop {
            if lose && !standby && first.1 == 1 && *step == LOST_AT {
                leave();
                return Err(candle_core::Error::Msg("rank 1 leaves".into()).into());
            }
            if slow && comm.world_size() < MEMBERS {
                // Steps of a real job's length while short: the standby, polling its
                // rendezvous, has time to take the place offered before the job ends.
                std::thread::sleep(Duration::from_millis(100));
            }
            let part = sampler.part_for(comm, *step)?;
            let l =
                (loss::mse(&model.forward(&part.select(&x)?)?, &part.select(&y)?)? * part.weight)?;
            match &mut opt {
                Opt::Sgd(o) => o.backward_step(&l)?,
                Opt::AdamW(o) => o.backward_step(&l)?,
            }
            *step += 1;
        }
        Ok(())
    })?;
    let Some(run) = run else {
        return Ok(None);
    };
    Ok(Some(End {
        params: flat_params(&map)?,
        step: run.step,
        world: run.comm.world_size(),
        recovered_at: run.recoveries.iter().map(|r| r.step).collect(),
        joined_at,
    }))
}

fn job(policy: GrowPolicy) -> ElasticJob {
    ElasticJob::host(MEMBERS)
        .standbys(1)
        .config(Config::new().timeout(Duration::from_secs(20)))
        .grow_policy(policy)
        .standby_timeout(Duration::from_secs(60))
}

/// The survivors and the standby end on 4 ranks at `STEPS`, bit-identical, near the
/// reference.
fn check_grown(ends: &[&End], reference: &[f32]) {
    assert_eq!(ends.len(), 4, "{ends:?}");
    for e in ends {
        assert_eq!((e.step, e.world), (STEPS, MEMBERS), "{e:?}");
        assert_eq!(e.params, ends[0].params, "the ranks' parameters differ");
        match e.joined_at {
            Some(at) => assert_eq!((at, &e.recovered_at[..]), (GROWN_AT, &[][..])),
            None => assert!(
                e.recovered_at.len() == 1 && resumes_at(e.recovered_at[0], LOST_AT),
                "{e:?}"
            ),
        }
    }
    assert_eq!(ends.iter().filter(|e| e.joined_at.is_some()).count(), 1);
    let d = max_rel_diff(&ends[0].params, reference);
    assert!(d < 1e-5, "{d:e} from the reference");
}

#[test]
fn threads_take_the_standby_back_after_a_loss() {
    let results =
        job(GrowPolicy::WhenStandbyWaits { every: 4 }).run(|r| train(r, true, false, &|| ()));
    assert_eq!(results.len(), 5);
    assert!(results[1].is_err(), "rank 1 left");
    let ends: Vec<End> = [0, 2, 3, 4]
        .iter()
        .map(|&r| {
            let e = results[r]
                .as_ref()
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
            e.clone()
                .unwrap_or_else(|| panic!("rank {r} ended without training"))
        })
        .collect();
    check_grown(&ends.iter().collect::<Vec<_>>(), &reference());
}

/// AdamW's state, carried by `resume`, survives the loss (rebuilt from the copy the rank
/// before the lost one kept), the grow (re-sharded to the standby) and the sessions'
/// restarts at the check points: the 4 end within 1e-5 of the same job that lost nothing
/// (8.9e-2 without the copy, `StateCarry::with_replica(false)`).
#[test]
fn threads_carry_adamws_state_through_the_loss_and_the_grow() {
    let results = job(GrowPolicy::WhenStandbyWaits { every: 4 })
        .run(|r| train_with(r, true, false, true, &|| ()));
    assert!(results[1].is_err(), "rank 1 left");
    let ends: Vec<End> = [0, 2, 3, 4]
        .iter()
        .map(|&r| {
            let e = results[r]
                .as_ref()
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
            e.clone()
                .unwrap_or_else(|| panic!("rank {r} ended without training"))
        })
        .collect();
    // AdamW's update on an f32 model is too sensitive to the order of a sum to compare
    // with one process (6.4e-4 apart with nothing lost): the same job, nothing lost, is
    // the reference.
    let whole = job(GrowPolicy::Never).run(|r| train_with(r, false, false, true, &|| ()));
    let whole = whole[0].as_ref().unwrap().as_ref().unwrap();
    assert_eq!((whole.step, whole.world), (STEPS, MEMBERS));
    check_grown(&ends.iter().collect::<Vec<_>>(), &whole.params);
}

#[test]
fn threads_without_a_grow_policy_release_the_standby() {
    let results = job(GrowPolicy::Never).run(|r| train(r, true, false, &|| ()));
    let ends: Vec<_> = results
        .into_iter()
        .map(|r| r.map_err(|e| e.to_string()))
        .collect();
    assert!(ends[1].is_err());
    for r in [0, 2, 3] {
        let e = ends[r].as_ref().unwrap().as_ref().unwrap();
        assert_eq!((e.step, e.world), (STEPS, 3));
    }
    assert!(
        matches!(ends[4], Ok(None)),
        "the standby is released: {:?}",
        ends[4]
    );
}

#[test]
fn threads_without_a_loss_release_the_standby() {
    let results = job(GrowPolicy::default()).run(|r| train(r, false, false, &|| ()));
    for (r, e) in results.iter().enumerate().take(MEMBERS) {
        let e = e.as_ref().unwrap().as_ref().unwrap();
        assert_eq!((e.step, e.world), (STEPS, MEMBERS), "rank {r}");
    }
    assert!(matches!(results[4], Ok(None)));
}

/// A child process: one launcher rank (the parent set mpirun's variables).
fn child() {
    let job = ElasticJob::from_env()
        .unwrap()
        .host_provider()
        .standbys(1)
        .config(Config::new().timeout(Duration::from_secs(20)))
        .grow_policy(GrowPolicy::WhenStandbyWaits { every: 4 })
        .standby_timeout(Duration::from_secs(50));
    // Rank 1 dies as a SIGKILLed process would: no destructor runs.
    let out = job.run(|r| train(r, true, true, &|| std::process::exit(3)));
    match &out[0] {
        Ok(Some(e)) => println!(
            "END step {} world {} recovered {:?} joined {:?} params {}",
            e.step,
            e.world,
            e.recovered_at,
            e.joined_at,
            e.params
                .iter()
                .map(|v| format!("{:08x}", v.to_bits()))
                .collect::<String>()
        ),
        Ok(None) => println!("END released"),
        Err(e) => println!("END error {e}"),
    }
}

/// Four free ports in a row below the ephemeral range (the rendezvous, the desync board,
/// the standby's rendezvous and a spare).
fn free_ports() -> u16 {
    free_ports_from(0)
}

/// [`free_ports`], searched from the `first`-th candidate: the two tests of processes run
/// at once in one test binary (one pid), so each searches its own range, or both could
/// pick the same ports before either binds them.
fn free_ports_from(first: u16) -> u16 {
    let base = 20000 + (std::process::id() % 5000) as u16 * 2;
    (first..first + 2000u16)
        .map(|k| base.wrapping_add(k * 4) % 30000 + 2000)
        .find(|&p| (p..p + 4).all(|q| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok()))
        .expect("four free ports")
}

#[test]
fn processes_take_the_standby_back_through_the_rendezvous() {
    if std::env::var(CHILD).is_ok() {
        child();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let port = free_ports();
    let token = format!(
        "{:032x}",
        std::process::id() as u128 * 0x9E37_79B9_7F4A_7C15
    );
    let ranks = MEMBERS + 1;
    let kids: Vec<_> = (0..ranks)
        .map(|r| {
            // (coreutils' timeout ends a rank that hangs, so the test fails, not hangs.)
            let mut c = Command::new("timeout");
            c.arg("--kill-after=5").arg("90").arg(&exe).args([
                "processes_take_the_standby_back_through_the_rendezvous",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ]);
            for v in [
                "RANK",
                "WORLD_SIZE",
                "SLURM_PROCID",
                "OMPI_MCA_orte_hnp_uri",
                "TORCHELASTIC_RUN_ID",
            ] {
                c.env_remove(v);
            }
            c.env(CHILD, "1")
                .env("OMPI_COMM_WORLD_RANK", r.to_string())
                .env("OMPI_COMM_WORLD_SIZE", ranks.to_string())
                .env("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("NCCL_SAFE_RENDEZVOUS_TOKEN", &token)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    let start = Instant::now();
    let outs: Vec<_> = kids
        .into_iter()
        .map(|k| {
            let out = k.wait_with_output().unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        })
        .collect();
    assert!(start.elapsed() < Duration::from_secs(90), "{outs:#?}");
    assert_eq!(outs[1].0, Some(3), "rank 1 died: {outs:#?}");
    let mut params = Vec::new();
    for r in [0, 2, 3, 4] {
        let line = outs[r]
            .1
            .lines()
            .find_map(|l| l.find("END ").map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("rank {r} printed no end: {outs:#?}"));
        assert_eq!(outs[r].0, Some(0), "rank {r}: {line}");
        // The standby joins at a check point (every 4 steps) after the loss, once it
        // took the place offered (its rendezvous is polled twice a second).
        let want = if r == 4 {
            format!("END step {STEPS} world {MEMBERS} recovered [] joined Some(")
        } else {
            format!("END step {STEPS} world {MEMBERS} recovered [")
        };
        assert!(line.starts_with(&want), "rank {r}: {line}");
        if r == 4 {
            let at: u64 = line["END step 20 world 4 recovered [] joined Some(".len()..]
                .split(')')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{line}"));
            assert!(
                at.is_multiple_of(4) && (GROWN_AT..STEPS).contains(&at),
                "{line}"
            );
        }
        params.push(line.rsplit(' ').next().unwrap().to_string());
    }
    assert!(params.iter().all(|p| *p == params[0]), "{outs:#?}");
    let reference: String = reference()
        .iter()
        .map(|v| format!("{:08x}", v.to_bits()))
        .collect();
    let ours: Vec<f32> = (0..params[0].len() / 8)
        .map(|i| f32::from_bits(u32::from_str_radix(&params[0][8 * i..8 * i + 8], 16).unwrap()))
        .collect();
    let theirs: Vec<f32> = (0..reference.len() / 8)
        .map(|i| f32::from_bits(u32::from_str_radix(&reference[8 * i..8 * i + 8], 16).unwrap()))
        .collect();
    let d = max_rel_diff(&ours, &theirs);
    assert!(d < 1e-5, "{d:e} from one process");
}

/// The README's elastic program is `examples/elastic_job.rs`, character for character
/// (CI runs the example: the README shows what was run).
#[test]
fn the_readme_shows_the_example_program() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let example =
        std::fs::read_to_string(format!("{root}/nccl-safe-candle/examples/elastic_job.rs"))
            .unwrap();
    let marker = "<!-- nccl-safe-candle/examples/elastic_job.rs -->\n```rust,ignore\n";
    let start = readme.find(marker).expect("the README's marker") + marker.len();
    let len = readme[start..]
        .find("```\n")
        .expect("the end of the code block");
    assert!(
        readme[start..start + len] == example,
        "the README's copy of examples/elastic_job.rs differs from the file: copy the file into it"
    );
}

/// Every member fails before it trains: the standby is released when the last member's
/// thread ends, not after its own timeout.
#[test]
fn threads_release_the_standby_when_every_member_failed() {
    let started = Instant::now();
    let results = job(GrowPolicy::default())
        .standby_timeout(Duration::from_secs(30))
        .run(|r| {
            if !r.is_standby() {
                return Err(candle_core::Error::Msg("a member fails".into()).into());
            }
            r.train(STEPS, |_, _, _| Ok(())).map(|run| run.is_none())
        });
    assert!(results[..MEMBERS].iter().all(Result::is_err));
    assert!(
        matches!(results[MEMBERS], Ok(true)),
        "the standby is released, after {:?}: {:?}",
        started.elapsed(),
        results[MEMBERS]
    );
}

const STALL_CHILD: &str = "NCCL_SAFE_CANDLE_TEST_STALL";
/// With it, the folder where rank 1 writes its pid at `LOST_AT` (`pid`) and then waits
/// for `continued`: the parent SIGSTOPs it meanwhile, and SIGCONTs it 4 s later.
const STOP_DIR: &str = "NCCL_SAFE_CANDLE_TEST_STOP_DIR";

/// The training of [`stall_child`]'s ranks (and of the threads of
/// [`threads_a_quorum_above_the_ranks_left_refuses_every_recovery`]): rank 1 is stuck at
/// `LOST_AT`, by a sleep of 4 s, or (`stop_dir`) until the parent continues it.
fn stall_train(
    rank: ElasticRank,
    stop_dir: Option<&std::path::Path>,
) -> DistResult<Option<(u64, usize)>> {
    let map = VarMap::new();
    let model = Mlp::new(&map)?;
    init_fixed(&map)?;
    let (x, y) = data();
    let sampler = DistributedSampler::new(ROWS, ROWS)?.split(BatchSplit::Uneven);
    let mut stalled = false;
    let run = rank.train(STEPS, |comm, step, stop| {
        let mut opt = ZeroRedundancyOptimizer::<SGD>::new(comm, &map, LR)?;
        while *step < stop {
            if comm.world_size() == MEMBERS && comm.rank() == 1 && *step == LOST_AT && !stalled {
                // The others time out, name this rank, and shrink without it meanwhile.
                stalled = true;
                match &stop_dir {
                    // Stopped whole (its watchdog too) by the parent's SIGSTOP.
                    Some(dir) => {
                        let pid = std::process::id().to_string();
                        std::fs::write(dir.join("pid"), pid).unwrap();
                        while !dir.join("continued").exists() {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                    // A long stall of the training thread.
                    None => std::thread::sleep(Duration::from_secs(4)),
                }
            }
            let part = sampler.part_for(comm, *step)?;
            let l =
                (loss::mse(&model.forward(&part.select(&x)?)?, &part.select(&y)?)? * part.weight)?;
            opt.backward_step(&l)?;
            *step += 1;
        }
        Ok(())
    })?;
    Ok(run.map(|r| (r.step, r.comm.world_size())))
}

/// A rank of the tests of a stuck rank that wakes: 4 members, the timeout 1 s; rank 1 is
/// stuck at `LOST_AT` (it sleeps 4 s, or it is SIGSTOPped from outside for 4 s), then
/// carries on with its loop. Prints `END step S world W` or `END error E`, and exits 4 on
/// an error.
fn stall_child() {
    let stop_dir = std::env::var_os(STOP_DIR).map(std::path::PathBuf::from);
    let job = ElasticJob::from_env()
        .unwrap()
        .host_provider()
        .config(Config::new().timeout(Duration::from_secs(1)));
    let out = job.run(|rank| stall_train(rank, stop_dir.as_deref()));
    match &out[0] {
        Ok(Some((step, world))) => println!("END step {step} world {world}"),
        Ok(None) => println!("END released"),
        Err(e) => {
            println!("END error {e}");
            std::process::exit(4);
        }
    }
}

/// Runs the 4 ranks of [`stall_child`] as processes (as mpirun starts them), from the
/// test `name`, its ports the `ports`-th candidates on; with `sigstop`, SIGSTOPs rank 1
/// when it writes its pid and SIGCONTs it 4 s later. Checks that ranks 0, 2 and 3 end at
/// step 20 on 3 ranks and that rank 1 exits non-zero with the quorum error.
fn stuck_rank_wakes(name: &str, ports: u16, sigstop: bool) {
    let exe = std::env::current_exe().unwrap();
    let port = free_ports_from(ports);
    let token = format!(
        "{:032x}",
        std::process::id() as u128 * 0x9E37_79B9_7F4A_7C15 + 1 + ports as u128
    );
    let dir = std::env::temp_dir().join(format!("nccl-safe-stall-{}-{ports}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let kids: Vec<_> = (0..MEMBERS)
        .map(|r| {
            let mut c = Command::new("timeout");
            c.arg("--kill-after=5").arg("90").arg(&exe).args([
                name,
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ]);
            for v in [
                "RANK",
                "WORLD_SIZE",
                "SLURM_PROCID",
                "OMPI_MCA_orte_hnp_uri",
                "TORCHELASTIC_RUN_ID",
            ] {
                c.env_remove(v);
            }
            if sigstop {
                c.env(STOP_DIR, &dir);
            }
            c.env(STALL_CHILD, "1")
                .env("OMPI_COMM_WORLD_RANK", r.to_string())
                .env("OMPI_COMM_WORLD_SIZE", MEMBERS.to_string())
                .env("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("NCCL_SAFE_RENDEZVOUS_TOKEN", &token)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    if sigstop {
        let limit = Instant::now() + Duration::from_secs(60);
        let pid = loop {
            match std::fs::read_to_string(dir.join("pid")) {
                Ok(p) if !p.is_empty() => break p,
                _ if Instant::now() < limit => std::thread::sleep(Duration::from_millis(5)),
                _ => panic!("rank 1 wrote no pid within 60 s"),
            }
        };
        let signal = |sig: &str| {
            let ok = Command::new("kill").args([sig, &pid]).status().unwrap();
            assert!(ok.success(), "kill {sig} {pid}");
        };
        signal("-STOP");
        std::thread::sleep(Duration::from_secs(4));
        std::fs::write(dir.join("continued"), "").unwrap();
        signal("-CONT");
    }
    let outs: Vec<_> = kids
        .into_iter()
        .map(|k| {
            let out = k.wait_with_output().unwrap();
            let end = String::from_utf8_lossy(&out.stdout)
                .lines()
                .find_map(|l| l.find("END ").map(|i| l[i..].to_string()));
            (out.status.code(), end)
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    for r in [0, 2, 3] {
        let want = format!("END step {STEPS} world 3");
        assert_eq!(outs[r], (Some(0), Some(want)), "rank {r}: {outs:#?}");
    }
    let (code, end) = &outs[1];
    let end = end.as_deref().unwrap_or("");
    assert_eq!(*code, Some(4), "the woken rank 1: {outs:#?}");
    assert!(
        end.starts_with("END error recover on rank 1 of 4: no quorum") && end.contains("min_ranks"),
        "{end}"
    );
}

/// In processes (as mpirun starts them): rank 1's training thread stalls past the
/// timeout, ranks 0, 2 and 3 recover without it and end at step 20 on 3 ranks; rank 1
/// wakes to a failed communicator with every other rank gone, and exits non-zero with the
/// quorum error (`DistErrorKind::NoQuorum`, naming `min_ranks`) rather than training
/// alone. Before, it recovered into a world of one and ended at step 20 too: two models.
#[test]
fn processes_a_stuck_rank_that_wakes_exits_with_no_quorum() {
    if std::env::var(STALL_CHILD).is_ok() {
        stall_child();
        return;
    }
    stuck_rank_wakes(
        "processes_a_stuck_rank_that_wakes_exits_with_no_quorum",
        2000,
        false,
    );
}

/// The same with rank 1's whole process SIGSTOPped for 4 s (its watchdog too), then
/// SIGCONTed.
#[test]
fn processes_a_sigstopped_rank_that_continues_exits_with_no_quorum() {
    if std::env::var(STALL_CHILD).is_ok() {
        stall_child();
        return;
    }
    stuck_rank_wakes(
        "processes_a_sigstopped_rank_that_continues_exits_with_no_quorum",
        4000,
        true,
    );
}

/// `ElasticJob::min_ranks` reaches every recovery: with `MinRanks::AtLeast(4)` on 4 ranks,
/// the 3 that stay after rank 1 stalls are refused too (3 or fewer < 4), as is rank 1 when it
/// wakes (1 < 4): every rank ends with `NoQuorum` naming `MinRanks::AtLeast(4)`. Under the
/// default the 3 carry on (`processes_a_stuck_rank_that_wakes_exits_with_no_quorum`).
#[test]
fn threads_a_quorum_above_the_ranks_left_refuses_every_recovery() {
    let outs = ElasticJob::host(MEMBERS)
        .config(Config::new().timeout(Duration::from_secs(1)))
        .min_ranks(MinRanks::AtLeast(4))
        .run(|rank| stall_train(rank, None));
    assert_eq!(outs.len(), MEMBERS);
    for (r, out) in outs.iter().enumerate() {
        let e = out.as_ref().expect_err("no quorum");
        // Rank 1 finds every other rank gone; the others rank 1, and those of them that
        // refused (and tore down) before they read.
        let fits = |l: usize| if r == 1 { l == 1 } else { (1..=3).contains(&l) };
        assert!(
            matches!(e.kind(), DistErrorKind::NoQuorum { left, min_ranks: 4, lost, .. }
                if fits(*left) && lost.contains(&1) != (r == 1)),
            "rank {r}: {e}"
        );
        assert!(
            e.to_string().contains("MinRanks::AtLeast(4)"),
            "rank {r}: {e}"
        );
    }
}
