//! The launchers fail with `nccl_launch::Error` and a typed variant a user matches as it
//! is: a bad environment variable is `Error::Env`, a rendezvous that times out
//! `Error::Rendezvous`, a store that cannot be reached `Error::Store`, the core's errors
//! `Error::Core`. A desync board's failure (only a timeout report sees it) is one of those,
//! boxed as the core's `diag::BoardError`. Loopback only.

use nccl_launch::desync::BoardClient;
use nccl_launch::env::{EnvError, EnvSource, ProcessEnv};
use nccl_launch::rendezvous::{Rendezvous, RendezvousError, TcpRendezvous, TOKEN_VAR};
use nccl_launch::store::{StoreError, StoreRendezvous};
use nccl_launch::Error;
use nccl_launch::{Launcher, ProcessLauncher};
use nccl_safe::diag::{DesyncPost, RemoteBoard};
use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

const TOKEN: &str = "launch-errors-test-token-0123";
const CHILD_VAR: &str = "NCCL_SAFE_TEST_LAUNCH_ERRORS_CHILD";

/// A loopback port nothing listens on.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Rank `rank` of a torchrun-style job of 2 that meets at `port`.
fn rank_of_two(rank: usize, port: u16) -> ProcessEnv {
    let port = port.to_string();
    let rank = rank.to_string();
    ProcessEnv::from_lookup(|v| {
        Some(match v {
            "RANK" | "LOCAL_RANK" => rank.clone(),
            "WORLD_SIZE" => "2".into(),
            "MASTER_ADDR" => "127.0.0.1".into(),
            "MASTER_PORT" => port.clone(),
            _ => return None,
        })
    })
    .unwrap()
}

/// What a user's own code does: `?` on every launcher call into `nccl_launch::Result`.
fn parse_env(vars: &'static [(&'static str, &'static str)]) -> nccl_launch::Result<ProcessEnv> {
    let env = ProcessEnv::from_lookup(|v| {
        vars.iter()
            .find(|(k, _)| *k == v)
            .map(|(_, x)| x.to_string())
    })?;
    Ok(env)
}

#[test]
fn a_bad_environment_variable_is_error_env() {
    let err = parse_env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "two"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap_err();
    match &err {
        nccl_launch::Error::Env(EnvError::Invalid { var, value, .. }) => {
            assert_eq!((*var, value.as_str()), ("WORLD_SIZE", "two"))
        }
        other => panic!("not nccl_launch::Error::Env(EnvError::Invalid): {other:?}"),
    }
    let err = parse_env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).unwrap_err();
    assert!(
        matches!(
            err,
            nccl_launch::Error::Env(EnvError::Missing {
                launcher: EnvSource::Torchrun,
                var: "MASTER_ADDR",
                ..
            })
        ),
        "{err:?}"
    );
}

/// Runs `Launcher::from_env()` (the process environment) as the parent test set it up, and
/// prints which variant it failed with.
#[test]
#[ignore = "run as a child process by the test below"]
fn child_launcher_from_env() {
    let Some(scenario) = std::env::var_os(CHILD_VAR) else {
        panic!("run only as a child process ({CHILD_VAR} unset)");
    };
    let result = Launcher::from_env().and_then(|l| l.host().init());
    let verdict = match (scenario.to_str().unwrap(), result) {
        (
            "bad-port",
            Err(nccl_launch::Error::Env(EnvError::Invalid {
                var: "MASTER_PORT", ..
            })),
        ) => "nccl_launch::Error::Env",
        ("no-token", Err(nccl_launch::Error::Rendezvous(e))) => match *e {
            RendezvousError::MissingToken { var } if var == TOKEN_VAR => {
                "nccl_launch::Error::Rendezvous"
            }
            e => panic!("no-token: unexpected rendezvous error {e:?}"),
        },
        ("board-port-taken", Err(nccl_launch::Error::Rendezvous(e))) => match *e {
            RendezvousError::Bind { addr, .. } => {
                println!("\nBIND={addr}");
                "nccl_launch::Error::Rendezvous"
            }
            e => panic!("board-port-taken: unexpected rendezvous error {e:?}"),
        },
        (s, Err(e)) => panic!("{s}: unexpected error {e:?}"),
        (s, Ok(_)) => panic!("{s}: init succeeded"),
    };
    println!("\nVERDICT={verdict}");
}

#[test]
fn launcher_from_env_fails_with_typed_variants() {
    let exe = std::env::current_exe().unwrap();
    for (scenario, port, expect) in [
        ("bad-port", "http", "nccl_launch::Error::Env"),
        ("no-token", "29500", "nccl_launch::Error::Rendezvous"),
    ] {
        let out = Command::new(&exe)
            .args([
                "--exact",
                "child_launcher_from_env",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_VAR, scenario)
            .env("RUST_BACKTRACE", "0")
            .env_remove("OMPI_COMM_WORLD_RANK")
            .env_remove("SLURM_PROCID")
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env_remove("TORCHELASTIC_RUN_ID")
            .env_remove("TORCHELASTIC_RESTART_COUNT")
            .env_remove(TOKEN_VAR)
            .env("RANK", "1")
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("VERDICT={expect}")),
            "{scenario}: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Rank 0 that cannot host the desync board (its port, `MASTER_PORT + 1`, is taken) fails
/// its init with the bind error, before any rank waits on it, rather than going on while
/// every rank posts to whatever holds that port.
#[test]
fn a_board_that_cannot_bind_fails_rank_0s_init() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let board_port = taken.local_addr().unwrap().port();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_launcher_from_env",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "board-port-taken")
        .env("RUST_BACKTRACE", "0")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("SLURM_PROCID")
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .env_remove("TORCHELASTIC_RUN_ID")
        .env_remove("TORCHELASTIC_RESTART_COUNT")
        .env(TOKEN_VAR, TOKEN)
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "0")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", (board_port - 1).to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let mut child = child;
    while child.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success()
            && stdout.contains("VERDICT=nccl_launch::Error::Rendezvous")
            && stdout.contains(&format!("BIND=127.0.0.1:{board_port}")),
        "after {:?}: {}\n{stdout}\n{stderr}",
        t0.elapsed(),
        out.status
    );
    drop(taken);
}

#[test]
fn a_rendezvous_timeout_is_error_rendezvous() {
    let port = free_port();
    let tcp = TcpRendezvous::new("127.0.0.1", port, TOKEN).timeout(Duration::from_millis(300));
    let t0 = Instant::now();
    let err = ProcessLauncher::new(rank_of_two(1, port))
        .host()
        .init_with(Rendezvous::Tcp(tcp))
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    match err.as_rendezvous() {
        Some(RendezvousError::ClientTimeout { rank, timeout, .. }) => {
            assert_eq!((*rank, *timeout), (1, Duration::from_millis(300)))
        }
        _ => panic!("not nccl_launch::Error::Rendezvous(RendezvousError::ClientTimeout): {err:?}"),
    }
    assert!(err.to_string().contains("MASTER_ADDR/MASTER_PORT"), "{err}");
}

#[test]
fn a_store_connection_failure_is_error_store() {
    let port = free_port();
    let store = StoreRendezvous::new(format!("127.0.0.1:{port}"), "p/")
        .io_timeout(Duration::from_millis(500))
        .timeout(Duration::from_millis(500));
    let err = ProcessLauncher::new(rank_of_two(1, port))
        .host()
        .init_with(Rendezvous::Store(store.clone()))
        .unwrap_err();
    match err {
        nccl_launch::Error::Store(e) => match *e {
            StoreError::Connect { addr, .. } => assert_eq!(addr, format!("127.0.0.1:{port}")),
            e => panic!("not StoreError::Connect: {e:?}"),
        },
        other => panic!("not nccl_launch::Error::Store: {other:?}"),
    }
    // Its desync board fails the same way, through the trait a communicator uses.
    let board = store.board(2);
    let by = Instant::now() + Duration::from_millis(500);
    let err = RemoteBoard::post(&board, 1, &DesyncPost::new(1, 1, "x"), by).unwrap_err();
    let err = err.downcast_ref::<Error>().expect("the launchers' error");
    assert!(
        matches!(err.as_store(), Some(StoreError::Connect { .. })),
        "{err:?}"
    );
}

#[test]
fn the_boards_rank_0_serves_fail_with_error_rendezvous() {
    let client = BoardClient::new(format!("127.0.0.1:{}", free_port()), 2, TOKEN)
        .io_timeout(Duration::from_millis(300));
    let by = Instant::now() + Duration::from_millis(500);
    let err = RemoteBoard::fetch(&client, by).unwrap_err();
    let err = err.downcast_ref::<Error>().expect("the launchers' error");
    // Tried until the deadline; the last error says why.
    match err.as_rendezvous() {
        Some(RendezvousError::BoardTimeout { last_error, .. }) => {
            assert!(last_error.contains("Connection refused"), "{err}")
        }
        _ => panic!("not nccl_launch::Error::Rendezvous(RendezvousError::BoardTimeout): {err:?}"),
    }
}

/// A board of the user's own reports its failure as any error.
#[derive(Debug)]
struct DownBoard;

impl RemoteBoard for DownBoard {
    fn post(&self, _: usize, _: &DesyncPost, _: Instant) -> nccl_safe::diag::BoardResult<()> {
        Err("the key-value service is down".into())
    }

    fn fetch(&self, _: Instant) -> nccl_safe::diag::BoardResult<Vec<Option<DesyncPost>>> {
        Ok(vec![None, None])
    }
}

#[test]
fn a_board_of_ones_own_fails_with_its_own_error() {
    let err = DownBoard
        .post(0, &DesyncPost::new(1, 1, "x"), Instant::now())
        .unwrap_err();
    assert_eq!(err.to_string(), "the key-value service is down");
    // A communicator takes it like nccl-safe's own boards.
    let _config = nccl_safe::Config::default().desync_board(DownBoard);
}

/// The environment `vars` as a launcher would set it.
fn env_of(vars: &[(&str, &str)]) -> ProcessEnv {
    ProcessEnv::from_lookup(|v| {
        vars.iter()
            .find(|(k, _)| *k == v)
            .map(|(_, x)| x.to_string())
    })
    .unwrap()
}

/// An elastic rank under a launcher that ends every process once one exits is refused
/// before any rendezvous, naming what to start it with: mpirun (Open MPI 4) without
/// `--enable-recovery`, torchrun's agent, srun with `SLURM_KILL_ON_BAD_EXIT=1`. The same
/// launchers with recovery on, torchrun's variables set by hand, and plain srun pass.
#[test]
fn an_elastic_rank_under_a_launcher_that_ends_survivors_is_refused() {
    let mpi: &[(&str, &str)] = &[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        (
            "OMPI_MCA_orte_hnp_uri",
            "1147011072.0;tcp://192.0.2.2:58587",
        ),
    ];
    let recovering = [mpi, &[("OMPI_MCA_orte_enable_recovery", "1")]].concat();
    let by_hand: &[(&str, &str)] = &[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let agent = [
        by_hand,
        &[
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            ("TORCHELASTIC_RUN_ID", "job"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
        ],
    ]
    .concat();
    let srun: &[(&str, &str)] = &[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_JOB_NODELIST", "node1"),
    ];
    let killing = [srun, &[("SLURM_KILL_ON_BAD_EXIT", "1")]].concat();
    for (vars, refused) in [
        (mpi, Some("mpirun --enable-recovery")),
        (&recovering[..], None),
        (&agent[..], Some("torchrun's agent stops every worker")),
        (by_hand, None),
        (&killing[..], Some("srun --kill-on-bad-exit=0")),
        (srun, None),
    ] {
        let env = env_of(vars);
        let Some(hint) = refused else {
            assert_eq!(env.keeps_survivors(), Ok(()), "{vars:?}");
            continue;
        };
        let got = ProcessLauncher::new(env.clone())
            .host()
            .config(nccl_safe::Config::new().elastic(true))
            .init();
        match got {
            Err(nccl_launch::Error::Env(e @ EnvError::EndsSurvivors { .. })) => {
                let text = e.to_string();
                assert!(text.contains(hint), "{text}");
                assert!(text.contains("Config::elastic(true)"), "{text}");
                assert_eq!(env.keeps_survivors(), Err(e));
            }
            other => panic!(
                "{vars:?}: expected EndsSurvivors, got {:?}",
                other.map(|_| ())
            ),
        }
    }
}
