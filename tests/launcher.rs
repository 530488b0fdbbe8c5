//! The thread launcher on the host provider, and the process launcher with child
//! processes under torchrun-style variables against NVIDIA's real NCCL (no GPU).

mod support;

use std::collections::HashSet;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nccl_launch::Launcher;
use nccl_safe::host::{root_id_of, stats_for, HostStats};
use nccl_safe::{Error, ReduceOp};

/// Runs `f` under a launcher of `n` host ranks, returning the launch result and the host
/// provider's counters for the communicator the ranks shared.
fn launch<R: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(&nccl_launch::Rank) -> nccl_safe::Result<R> + Sync,
) -> (nccl_launch::Result<Vec<R>>, HostStats) {
    let ids = Mutex::new(HashSet::new());
    let result = Launcher::host(n).timeout(timeout).run(|rank| {
        let id = root_id_of(rank.comm().as_raw()).expect("a host handle");
        ids.lock().unwrap().insert(id.internal.map(|c| c as u8));
        f(rank)
    });
    let ids = ids.into_inner().unwrap();
    assert_eq!(ids.len(), 1, "every rank shares one communicator");
    let id = nccl_sys::ncclUniqueId {
        internal: ids
            .into_iter()
            .next()
            .unwrap()
            .map(|b| b as std::ffi::c_char),
    };
    (result, stats_for(&id))
}

fn assert_exactly_once(stats: HostStats, n: u64) {
    assert_eq!(stats.created, n, "{stats:?}");
    assert_eq!(stats.destroyed + stats.aborted, n, "{stats:?}");
    assert_eq!(stats.live, 0, "{stats:?}");
    assert_eq!(stats.misused, 0, "{stats:?}");
}

#[test]
fn all_reduce_on_1_2_4_8_ranks() {
    for n in [1usize, 2, 4, 8] {
        let (result, stats) = launch(n, Duration::from_secs(30), |rank| {
            let mut x = vec![rank.rank() as i64 + 1; 33];
            rank.comm()
                .all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
            Ok(x)
        });
        let values = result.unwrap();
        let want = (n * (n + 1) / 2) as i64;
        assert_eq!(values.len(), n);
        assert!(
            values.iter().all(|v| v.iter().all(|&x| x == want)),
            "{n} ranks"
        );
        assert_exactly_once(stats, n as u64);
        assert_eq!(stats.destroyed, n as u64, "healthy runs destroy, not abort");
    }
}

#[test]
fn a_rank_that_errors_is_named_and_the_others_do_not_hang() {
    let start = Instant::now();
    let (result, stats) = launch(4, Duration::from_secs(20), |rank| {
        if rank.rank() == 2 {
            return Err(Error::InvalidArgument {
                call: "test",
                reason: "rank 2 gives up".into(),
            });
        }
        let mut x = vec![1.0f32; 8];
        rank.comm()
            .all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
        Ok(())
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    let err = result.unwrap_err();
    let nccl_launch::Error::RankFailed { rank, ranks, .. } = &err else {
        panic!("{err:?}")
    };
    // The first failing rank in rank order may be a victim; the cause is rank 2's.
    assert!(ranks[2].contains("rank 2 gives up"), "{err}");
    assert!(*rank <= 2);
    for r in [0, 1, 3] {
        assert!(!ranks[r].contains("still running"), "{err}");
    }
    assert_exactly_once(stats, 4);
    assert!(stats.aborted >= 1);
}

#[test]
fn a_rank_that_panics_is_named_and_the_others_do_not_hang() {
    let start = Instant::now();
    let (result, stats) = launch(3, Duration::from_secs(20), |rank| {
        if rank.rank() == 1 {
            panic!("rank 1 exploded");
        }
        let mut x = vec![1u32; 8];
        rank.comm()
            .all_reduce_in_place(&mut x, ReduceOp::Max, rank.stream())?;
        Ok(())
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    let err = result.unwrap_err().to_string();
    assert!(err.contains("rank 1: panicked: rank 1 exploded"), "{err}");
    assert_exactly_once(stats, 3);
}

#[test]
fn a_rank_that_returns_early_without_its_collective_ends_everyone_within_the_timeout() {
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let (result, stats) = launch(3, timeout, |rank| {
        if rank.rank() == 0 {
            return Ok(()); // skips the collective the others wait in
        }
        let mut x = vec![1i32; 4];
        rank.comm()
            .all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
        Ok(())
    });
    let took = start.elapsed();
    // At once: the others fail as soon as rank 0 returns, not after the timeout.
    assert!(took < timeout, "took {took:?}");
    let err = result.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("rank 0: returned"), "{text}");
    assert!(
        text.contains("rank 0 left: its launcher closure returned after 0 collective(s)"),
        "{text}"
    );
    assert_exactly_once(stats, 3);
}

// ---- multi-process: torchrun-style variables, real NCCL, no GPU ------------------------

const CHILD: &str = "NCCL_SAFE_TEST_LAUNCH_CHILD";

/// Runs only inside the child processes spawned below (and by torchrun in
/// `scripts/test-torchrun.sh`).
#[test]
#[ignore = "run as a child process by the tests below"]
fn child_rank_entry() {
    if std::env::var_os(CHILD).is_none() {
        panic!("run only as a child process ({CHILD} unset)");
    }
    let launcher = Launcher::from_env().expect("torchrun variables");
    let rendezvous =
        nccl_launch::rendezvous::Rendezvous::from_env(launcher.env()).expect("rendezvous");
    let (id, server) = launcher.exchange_id(rendezvous).expect("id exchange");
    println!("\n@@ID={id}");
    match launcher.join(&id) {
        Ok(_) => println!("\n@@INIT=ok"),
        Err(e) => println!("\n@@INIT=error: {e}"),
    }
    if let Some(s) = server {
        s.wait().expect("every rank fetched the id");
    }
}

#[test]
fn four_processes_share_one_id_and_fail_init_alike_without_a_gpu() {
    let lib = support::real_nccl("2.32.3");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let start = Instant::now();
    let children: Vec<_> = (0..4)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "child_rank_entry",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, "1")
                .env("NCCL_LIBRARY", &lib)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "4")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("NCCL_SAFE_RENDEZVOUS_TOKEN", "launcher-test-token")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect::<Vec<_>>();
    let children: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    assert!(start.elapsed() < Duration::from_secs(60));
    let mut ids = HashSet::new();
    let mut inits = Vec::new();
    for (rank, out) in children.iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let id = stdout
            .lines()
            .find_map(|l| l.strip_prefix("@@ID="))
            .expect("an id line");
        assert_eq!(id.len(), 256);
        ids.insert(id.to_string());
        let init = stdout
            .lines()
            .find_map(|l| l.strip_prefix("@@INIT="))
            .expect("an init line");
        inits.push(init.replace(
            &format!("rank {rank} (local rank {rank})"),
            "rank R (local rank R)",
        ));
    }
    eprintln!("each rank: {}", inits[0]);
    assert_eq!(ids.len(), 1, "every rank got the same id: {ids:?}");
    assert!(inits.iter().all(|i| i == &inits[0]), "{inits:?}");
    assert!(
        inits[0].starts_with("error:") && inits[0].contains("no CUDA device"),
        "{inits:?}"
    );
}

/// Under torchrun with the agent's store: the id goes through the store (which holds
/// MASTER_PORT, so a rank binding it would fail), no token is set, every rank gets the same
/// id, and without a GPU every rank fails alike, naming CUDA_VISIBLE_DEVICES and the count.
#[test]
fn four_processes_under_torchrun_share_one_id_through_the_agent_store() {
    let lib = support::real_nccl("2.32.3");
    let store = support::c10d::FakeStore::start(support::c10d::Mode::Honest);
    let exe = std::env::current_exe().unwrap();
    let start = Instant::now();
    let children: Vec<_> = (0..4)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "child_rank_entry",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, "1")
                .env("NCCL_LIBRARY", &lib)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "4")
                .env("LOCAL_WORLD_SIZE", "4")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", store.port().to_string())
                .env("TORCHELASTIC_USE_AGENT_STORE", "True")
                .env("TORCHELASTIC_RUN_ID", "launcher-test")
                .env("TORCHELASTIC_RESTART_COUNT", "0")
                .env_remove("NCCL_SAFE_RENDEZVOUS_TOKEN")
                .env_remove("CUDA_VISIBLE_DEVICES")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect::<Vec<_>>();
    let children: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    assert!(start.elapsed() < Duration::from_secs(60));
    let mut ids = HashSet::new();
    let mut inits = Vec::new();
    for (rank, out) in children.iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let id = stdout
            .lines()
            .find_map(|l| l.strip_prefix("@@ID="))
            .expect("an id line")
            .to_string();
        ids.insert(id);
        let init = stdout
            .lines()
            .find_map(|l| l.strip_prefix("@@INIT="))
            .expect("an init line");
        inits.push(init.replace(
            &format!("rank {rank} (local rank {rank})"),
            "rank R (local rank R)",
        ));
    }
    eprintln!("each rank: {}", inits[0]);
    assert_eq!(ids.len(), 1, "every rank got the same id: {ids:?}");
    // It went through the store, under the run's and attempt's key (with PyTorch's `/`).
    let value = store
        .value("/nccl-safe/launcher-test/attempt_0/0/unique_id")
        .expect("rank 0 set the id in the store");
    let hex: String = value[4..].iter().map(|b| format!("{b:02x}")).collect();
    assert!(ids.contains(&hex));
    assert!(inits.iter().all(|i| i == &inits[0]), "{inits:?}");
    assert!(
        inits[0].starts_with("error:")
            && inits[0].contains("no CUDA device")
            && inits[0].contains("CUDA_VISIBLE_DEVICES")
            && inits[0].contains("sees no CUDA GPU"),
        "{inits:?}"
    );
}

/// The device check names the variable, the count, and what to do.
#[test]
fn too_few_gpus_for_the_local_ranks_is_a_clear_error_on_every_rank() {
    use nccl_launch::env::ProcessEnv;
    use nccl_launch::ProcessLauncher;
    let at = |local: usize| {
        let vars = [
            ("RANK", local.to_string()),
            ("LOCAL_RANK", local.to_string()),
            ("WORLD_SIZE", "2".to_string()),
            ("LOCAL_WORLD_SIZE", "2".to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", "29500".to_string()),
        ];
        ProcessLauncher::new(
            ProcessEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
                .unwrap(),
        )
    };
    // Two ranks on a node with one GPU: both fail, before any rendezvous.
    for local in [0, 1] {
        let err = at(local).check_devices(1).unwrap_err().to_string();
        assert!(err.contains("LOCAL_WORLD_SIZE=2"), "{err}");
        assert!(err.contains("sees 1 CUDA GPU"), "{err}");
        assert!(err.contains("CUDA_VISIBLE_DEVICES"), "{err}");
        assert!(err.contains("--nproc_per_node=1"), "{err}");
    }
    assert!(at(1).check_devices(2).is_ok());
    let err = at(0).check_devices(0).unwrap_err().to_string();
    assert!(err.contains("sees no CUDA GPU"), "{err}");
}

#[test]
fn the_straggler_view_names_the_slow_rank() {
    let report = Launcher::host(3)
        .run_report(|rank| {
            for _ in 0..5 {
                if rank.rank() == 2 {
                    std::thread::sleep(Duration::from_millis(20)); // a slow data loader
                }
                let mut x = vec![1.0f32; 16];
                rank.comm()
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(report.ranks.len(), 3);
    assert!(report.ranks.iter().all(|r| r.collectives == 5), "{report}");
    // Ranks 0 and 1 waited ~100 ms for rank 2; rank 2 hardly waited.
    assert!(
        report.ranks[0].waiting >= Duration::from_millis(60),
        "{report}"
    );
    assert_eq!(report.straggler(), Some(2), "{report}");
    let text = report.to_string();
    assert!(
        text.lines().nth(3).unwrap().contains("<-- straggler"),
        "{text}"
    );
    eprintln!("{text}");
}
