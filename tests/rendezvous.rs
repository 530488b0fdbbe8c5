//! Launch environment parsing and the id rendezvous, on loopback only.

use nccl_launch::desync::{BoardClient, DesyncBoard};
use nccl_launch::env::{
    first_slurm_host, slurm_default_port, EnvError, EnvSource, ProcessEnv, DEFAULT_PORT,
};
use nccl_launch::rendezvous::{
    FileRendezvous, Refusal, Rendezvous, RendezvousError, TcpRendezvous, ID_LEN, TOKEN_VAR,
};
use nccl_launch::Error;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const TOKEN: &[u8] = b"test-job-token-0123456789";
const CHILD_VAR: &str = "NCCL_SAFE_TEST_RENDEZVOUS_CHILD";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn sample_id(seed: u8) -> [u8; ID_LEN] {
    std::array::from_fn(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
}

fn tcp(port: u16) -> TcpRendezvous {
    TcpRendezvous::new("127.0.0.1", port, TOKEN)
        .timeout(Duration::from_secs(5))
        .io_timeout(Duration::from_secs(1))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn four_ranks_in_threads_get_the_same_id() {
    let port = free_port();
    let world = 4;
    let handles: Vec<_> = (0..world)
        .rev() // the fetching ranks start first and retry until rank 0 listens
        .map(|rank| {
            thread::spawn(move || {
                let ex = Rendezvous::Tcp(tcp(port))
                    .exchange(rank, world, || Ok::<_, Error>(sample_id(9)))
                    .unwrap();
                if let Some(server) = ex.server {
                    server.wait().unwrap();
                }
                ex.id
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), sample_id(9));
    }
}

/// Runs as one rank when the parent test sets CHILD_VAR.
#[test]
#[ignore = "run as a child process by the test below"]
fn child_rank_process() {
    if std::env::var_os(CHILD_VAR).is_none() {
        panic!("run only as a child process ({CHILD_VAR} unset)");
    }
    let env = ProcessEnv::from_process_env().unwrap();
    let rdzv = TcpRendezvous::from_env(&env)
        .unwrap()
        .timeout(Duration::from_secs(8));
    let ex = Rendezvous::Tcp(rdzv)
        .exchange(env.rank, env.world_size, || {
            // A per-run id, so a stale server could not satisfy the parent.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let mut id = [0u8; ID_LEN];
            id[..16].copy_from_slice(&t.to_le_bytes());
            id[16..20].copy_from_slice(&std::process::id().to_le_bytes());
            Ok::<_, Error>(id)
        })
        .unwrap();
    if let Some(server) = ex.server {
        server.wait().unwrap();
    }
    println!("\nNCCL_SAFE_ID={}", hex(&ex.id));
}

#[test]
fn four_ranks_as_processes_get_the_same_id() {
    let exe = std::env::current_exe().unwrap();
    let port = free_port();
    let world = 4;
    let mut children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "child_rank_process",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_VAR, "1")
                .env("RUST_BACKTRACE", "0")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env(TOKEN_VAR, "process-test-token")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(15);
    for c in &mut children {
        while c.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                for c in &mut children {
                    let _ = c.kill();
                }
                panic!("child ranks did not finish within 15 s");
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
    let ids: Vec<String> = children
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let out = c.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success(),
                "rank {rank} failed: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            stdout
                .lines()
                .find_map(|l| {
                    l.split("NCCL_SAFE_ID=")
                        .nth(1)
                        .map(|h| h.trim().to_string())
                })
                .unwrap_or_else(|| panic!("rank {rank} printed no id: {stdout}"))
        })
        .collect();
    assert_eq!(ids[0].len(), 2 * ID_LEN);
    assert!(ids.iter().all(|id| id == &ids[0]), "ids differ: {ids:?}");
}

/// A wrong token gets the wrong-token refusal, never the id. A server without the token
/// could send that refusal as well as rank 0, so the rank tries until its deadline, and
/// the timeout says what rank 0 answered.
#[test]
fn wrong_token_is_refused_without_the_id() {
    let server = tcp(0).serve(2, sample_id(1)).unwrap();
    let port = server.local_addr().port();
    let t0 = Instant::now();
    let err = TcpRendezvous::new("127.0.0.1", port, b"not-the-job-token-at-all".to_vec())
        .timeout(Duration::from_millis(500))
        .fetch(1, 2)
        .unwrap_err();
    assert!(t0.elapsed() >= Duration::from_millis(500), "{err}");
    let RendezvousError::ClientTimeout {
        rank: 1,
        last_error,
        ..
    } = &err
    else {
        panic!("not a ClientTimeout: {err}");
    };
    assert_eq!(
        last_error,
        &format!(
            "rank 0 at 127.0.0.1:{port} refused rank 1: {}",
            Refusal::BadToken
        ),
        "{err}"
    );

    // A raw peer that answers the challenge with a made-up MAC gets a short refusal only.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut hello = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut hello).unwrap();
    let mut auth = vec![2u8];
    auth.extend_from_slice(&1u32.to_be_bytes());
    auth.extend_from_slice(&2u32.to_be_bytes());
    auth.extend_from_slice(&[7u8; 64]);
    s.write_all(&(auth.len() as u32).to_be_bytes()).unwrap();
    s.write_all(&auth).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.len() < 32, "a refused peer got {} bytes", rest.len());
    assert!(!rest
        .windows(8)
        .any(|w| sample_id(1).windows(8).any(|i| i == w)));

    // The honest rank is still served.
    assert_eq!(tcp(port).fetch(1, 2).unwrap(), sample_id(1));
    server.wait().unwrap();
}

#[test]
fn missing_rank_times_out_and_is_named() {
    let server = tcp(0)
        .timeout(Duration::from_millis(500))
        .serve(3, sample_id(2))
        .unwrap();
    let port = server.local_addr().port();
    assert_eq!(tcp(port).fetch(1, 3).unwrap(), sample_id(2));
    let err = server.wait().unwrap_err();
    match &err {
        RendezvousError::ServerTimeout {
            missing,
            world_size: 3,
            ..
        } => assert_eq!(missing, &[2]),
        e => panic!("unexpected error: {e}"),
    }
    assert!(err.to_string().contains("ranks [2] of 3"), "{err}");
}

#[test]
fn client_without_server_times_out_with_the_address() {
    let port = free_port();
    let t0 = Instant::now();
    let err = tcp(port)
        .timeout(Duration::from_millis(400))
        .fetch(2, 4)
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(
        matches!(err, RendezvousError::ClientTimeout { rank: 2, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!(
            "could not reach rank 0 at 127.0.0.1:{port} within"
        )),
        "{err}"
    );
}

#[test]
fn duplicate_rank_is_refused_and_the_server_goes_on() {
    let server = tcp(0).serve(3, sample_id(3)).unwrap();
    let port = server.local_addr().port();
    assert_eq!(tcp(port).fetch(1, 3).unwrap(), sample_id(3));
    let err = tcp(port).fetch(1, 3).unwrap_err();
    assert!(
        matches!(
            err,
            RendezvousError::Refused {
                rank: 1,
                reason: Refusal::DuplicateRank,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("distinct RANK"), "{err}");
    assert_eq!(tcp(port).fetch(2, 3).unwrap(), sample_id(3));
    server.wait().unwrap();
}

#[test]
fn world_size_disagreement_is_refused_and_the_server_goes_on() {
    let server = tcp(0).serve(3, sample_id(4)).unwrap();
    let port = server.local_addr().port();
    let err = tcp(port).fetch(1, 4).unwrap_err();
    assert!(
        matches!(
            err,
            RendezvousError::Refused {
                reason: Refusal::WorldSizeMismatch {
                    server: 3,
                    client: 4
                },
                ..
            }
        ),
        "{err}"
    );
    assert!(tcp(port).fetch(1, 3).is_ok());
    assert!(tcp(port).fetch(2, 3).is_ok());
    server.wait().unwrap();
    // Rank 0 never fetches.
    assert!(matches!(
        tcp(port).fetch(0, 3),
        Err(RendezvousError::InvalidRank { rank: 0, .. })
    ));
}

#[test]
fn garbage_and_huge_length_prefixes_are_dropped() {
    let server = tcp(0).serve(3, sample_id(5)).unwrap();
    let port = server.local_addr().port();
    let send = |bytes: &[u8]| {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = s.write_all(bytes);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink); // the server closes on us
        sink.len()
    };
    // A 4 GiB length prefix, an HTTP request, and a well-sized frame of nonsense.
    assert!(send(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]) < 100);
    assert!(send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") < 100);
    assert!(send(&[0, 0, 0, 3, 9, 9, 9]) < 100);
    // A peer that connects and says nothing does not hold up the others.
    let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    assert_eq!(tcp(port).fetch(1, 3).unwrap(), sample_id(5));
    assert_eq!(tcp(port).fetch(2, 3).unwrap(), sample_id(5));
    server.wait().unwrap();
}

#[test]
fn server_binds_only_the_address_given_and_stops_when_done() {
    let server = tcp(0).serve(2, sample_id(6)).unwrap();
    let addr = server.local_addr();
    assert!(addr.ip().is_loopback());
    assert_eq!(tcp(addr.port()).fetch(1, 2).unwrap(), sample_id(6));
    server.wait().unwrap();
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err(),
        "listener still open"
    );
}

fn temp_path(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("nccl-safe-{name}-{}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

#[test]
fn file_rendezvous_gives_every_rank_the_id() {
    let path = temp_path("file-rdzv");
    let world = 4;
    let handles: Vec<_> = (0..world)
        .rev()
        .map(|rank| {
            let path = path.clone();
            thread::spawn(move || {
                if rank == 0 {
                    thread::sleep(Duration::from_millis(50)); // readers poll first
                }
                let f = FileRendezvous::new(path).timeout(Duration::from_secs(5));
                Rendezvous::File(f)
                    .exchange(rank, world, || Ok::<_, Error>(sample_id(7)))
                    .unwrap()
                    .id
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), sample_id(7));
    }
    // A reader that expects another world size is told so.
    let err = FileRendezvous::new(&path).read(5).unwrap_err();
    assert!(matches!(err, RendezvousError::FileContents { .. }), "{err}");
    std::fs::remove_file(&path).unwrap();
    // No file: a bounded wait, then an error naming the path.
    let err = FileRendezvous::new(&path)
        .timeout(Duration::from_millis(100))
        .read(4)
        .unwrap_err();
    assert!(matches!(err, RendezvousError::FileTimeout { .. }), "{err}");
    assert!(err.to_string().contains(&path.display().to_string()));
}

#[test]
fn closure_rendezvous_gives_every_rank_the_id() {
    // A toy broadcast: a cell rank 0 fills and the others wait on.
    let store: Arc<(Mutex<Option<[u8; ID_LEN]>>, Condvar)> = Arc::default();
    let world = 3;
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let store = Arc::clone(&store);
            thread::spawn(move || {
                let r = Rendezvous::custom(move |id: Option<[u8; ID_LEN]>| {
                    let (cell, cv) = &*store;
                    let mut g = cell.lock().unwrap();
                    if let Some(id) = id {
                        *g = Some(id);
                        cv.notify_all();
                        return Ok::<_, std::io::Error>(id);
                    }
                    let (g, _) = cv
                        .wait_timeout_while(g, Duration::from_secs(5), |v| v.is_none())
                        .unwrap();
                    g.ok_or_else(|| std::io::Error::other("timed out"))
                });
                r.exchange(rank, world, || Ok::<_, Error>(sample_id(8)))
                    .unwrap()
                    .id
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), sample_id(8));
    }
    let err = Rendezvous::custom(|_| Err::<[u8; ID_LEN], _>("store down"))
        .exchange(1, 2, || Ok::<_, Error>(sample_id(0)))
        .unwrap_err();
    assert!(
        err.to_string().contains("store down") && err.to_string().contains("rank 1"),
        "{err}"
    );
    // The closure's error arrives as its text, with its sources: nothing to downcast.
    let err = Rendezvous::custom(|_| {
        Err::<[u8; ID_LEN], _>(std::io::Error::other(CausedBy(
            "the broadcast",
            Reason("peer gone"),
        )))
    })
    .exchange(1, 2, || Ok::<_, Error>(sample_id(0)))
    .unwrap_err();
    match err {
        nccl_launch::Error::Rendezvous(e) => match *e {
            RendezvousError::Custom { rank: 1, reason } => {
                assert_eq!(reason, "the broadcast failed: peer gone")
            }
            e => panic!("not RendezvousError::Custom: {e:?}"),
        },
        other => panic!("not nccl_launch::Error::Rendezvous: {other:?}"),
    }
    let err = Rendezvous::custom(|_| Ok::<_, std::io::Error>(sample_id(1)))
        .exchange(0, 2, || Ok::<_, Error>(sample_id(0)))
        .unwrap_err();
    assert!(matches!(
        err.as_rendezvous(),
        Some(RendezvousError::CustomMismatch)
    ));
}

/// An error ("`what` failed") whose source says why.
#[derive(Debug)]
struct CausedBy(&'static str, Reason);

impl std::fmt::Display for CausedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed", self.0)
    }
}

impl std::error::Error for CausedBy {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.1)
    }
}

#[derive(Debug)]
struct Reason(&'static str);

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Reason {}

#[derive(Debug)]
enum AppError {
    NoId,
    Nccl(Error),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Nccl(e)
    }
}

#[test]
fn exchange_passes_make_id_errors_through_and_checks_the_rank() {
    let r = Rendezvous::File(FileRendezvous::new(temp_path("unused")));
    assert!(matches!(
        r.exchange(0, 2, || Err(AppError::NoId)),
        Err(AppError::NoId)
    ));
    let r = Rendezvous::File(FileRendezvous::new(temp_path("unused")));
    let e = r.exchange(2, 2, || Err(AppError::NoId)).unwrap_err();
    assert!(matches!(
        e,
        AppError::Nccl(ref e) if matches!(e.as_rendezvous(), Some(RendezvousError::InvalidRank {
            rank: 2,
            world_size: 2
        }))
    ));
}

// ---- environment ----

/// Environment variables as name/value pairs.
type Vars<'a> = &'a [(&'a str, &'a str)];

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "5"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("MASTER_ADDR", "10.0.0.1"),
    ("MASTER_PORT", "29400"),
];

fn with(
    base: &[(&'static str, &'static str)],
    over: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    let mut v: Vec<_> = base
        .iter()
        .filter(|(k, _)| !over.iter().any(|(o, _)| o == k))
        .copied()
        .collect();
    v.extend_from_slice(over);
    v
}

fn without(base: &[(&'static str, &'static str)], var: &str) -> Vec<(&'static str, &'static str)> {
    base.iter().filter(|(k, _)| *k != var).copied().collect()
}

#[test]
fn torchrun_environment() {
    let e = ProcessEnv::from_lookup(env(TORCHRUN)).unwrap();
    assert_eq!(
        e,
        ProcessEnv {
            source: EnvSource::Torchrun,
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: Some(4),
            master_addr: "10.0.0.1".into(),
            master_port: 29400,
            elastic: None,
            ends_survivors: None,
        }
    );
    assert_eq!(e.cuda_ordinal(), 1);
}

const OMPI: &[(&str, &str)] = &[
    ("OMPI_COMM_WORLD_RANK", "3"),
    ("OMPI_COMM_WORLD_SIZE", "4"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ("MASTER_ADDR", "head"),
];

#[test]
fn open_mpi_environment() {
    let e = ProcessEnv::from_lookup(env(OMPI)).unwrap();
    assert_eq!(
        (e.source, e.rank, e.world_size, e.cuda_ordinal()),
        (EnvSource::OpenMpi, 3, 4, 1)
    );
    assert_eq!(
        (e.master_addr.as_str(), e.master_port),
        ("head", DEFAULT_PORT)
    );
    let e = ProcessEnv::from_lookup(env(&with(OMPI, &[("MASTER_PORT", "1234")]))).unwrap();
    assert_eq!(e.master_port, 1234);
    let err = ProcessEnv::from_lookup(env(&without(OMPI, "MASTER_ADDR"))).unwrap_err();
    assert!(matches!(
        err,
        EnvError::Missing {
            var: "MASTER_ADDR",
            launcher: EnvSource::OpenMpi,
            ..
        }
    ));
    assert!(err.to_string().contains("mpirun -x MASTER_ADDR"), "{err}");
}

const SLURM: &[(&str, &str)] = &[
    ("SLURM_PROCID", "6"),
    ("SLURM_NTASKS", "8"),
    ("SLURM_LOCALID", "2"),
    ("SLURM_NTASKS_PER_NODE", "4"),
    ("SLURM_JOB_NODELIST", "node[01-04,07],gpu5"),
    ("SLURM_JOB_ID", "123456"),
];

#[test]
fn slurm_environment() {
    let e = ProcessEnv::from_lookup(env(SLURM)).unwrap();
    assert_eq!(
        (e.source, e.rank, e.world_size, e.local_rank),
        (EnvSource::Slurm, 6, 8, 2)
    );
    assert_eq!(e.local_world_size, Some(4));
    assert_eq!(e.master_addr, "node01");
    assert_eq!(e.master_port, slurm_default_port(123456));
    assert_eq!(slurm_default_port(123456), 13456);
    let e = ProcessEnv::from_lookup(env(&with(
        SLURM,
        &[("MASTER_ADDR", "login"), ("MASTER_PORT", "4000")],
    )))
    .unwrap();
    assert_eq!((e.master_addr.as_str(), e.master_port), ("login", 4000));
    // SLURM_NODELIST when SLURM_JOB_NODELIST is absent; SLURM_NPROCS for SLURM_NTASKS.
    let mut v = without(&without(SLURM, "SLURM_JOB_NODELIST"), "SLURM_NTASKS");
    v.extend([("SLURM_NODELIST", "gpu5,node[1-2]"), ("SLURM_NPROCS", "8")]);
    let e = ProcessEnv::from_lookup(env(&v)).unwrap();
    assert_eq!((e.master_addr.as_str(), e.world_size), ("gpu5", 8));
    let e = ProcessEnv::from_lookup(env(&without(SLURM, "SLURM_JOB_ID"))).unwrap();
    assert_eq!(e.master_port, DEFAULT_PORT);
}

#[test]
fn slurm_nodelist_forms() {
    assert_eq!(
        first_slurm_host("node[01-04,07],gpu5").as_deref(),
        Some("node01")
    );
    assert_eq!(
        first_slurm_host("gpu5,node[01-04]").as_deref(),
        Some("gpu5")
    );
    assert_eq!(first_slurm_host("node7").as_deref(), Some("node7"));
    assert_eq!(first_slurm_host("a1,b[2-3]").as_deref(), Some("a1"));
    assert_eq!(first_slurm_host("b[2-3],a1").as_deref(), Some("b2"));
    assert_eq!(
        first_slurm_host("node[007-010]").as_deref(),
        Some("node007")
    );
    assert_eq!(first_slurm_host("node[3,5-6]").as_deref(), Some("node3"));
    assert_eq!(
        first_slurm_host("rack[1-2]-n[3-4]-ib").as_deref(),
        Some("rack1-n3-ib")
    );
    assert_eq!(
        first_slurm_host("a-b.example.org").as_deref(),
        Some("a-b.example.org")
    );
    for bad in ["", "node[01-04", "node]", "node[]", "[", ",node1"] {
        assert_eq!(first_slurm_host(bad), None, "{bad:?}");
    }
}

#[test]
fn launcher_precedence() {
    // torchrun under srun: torchrun's variables win; mpirun in a Slurm allocation: Open MPI wins.
    let mut v = TORCHRUN.to_vec();
    v.extend_from_slice(SLURM);
    v.extend_from_slice(&OMPI[..3]);
    assert_eq!(
        ProcessEnv::from_lookup(env(&v)).unwrap().source,
        EnvSource::Torchrun
    );
    let mut v = OMPI.to_vec();
    v.extend_from_slice(SLURM);
    assert_eq!(
        ProcessEnv::from_lookup(env(&v)).unwrap().source,
        EnvSource::OpenMpi
    );
    assert_eq!(
        ProcessEnv::from_lookup(env(&[])).unwrap_err(),
        EnvError::NotLaunched
    );
}

fn invalid(pairs: &[(&'static str, &'static str)]) -> (&'static str, String) {
    match ProcessEnv::from_lookup(env(pairs)) {
        Err(EnvError::Invalid { var, value, reason }) => {
            let msg = EnvError::Invalid {
                var,
                value: value.clone(),
                reason,
            }
            .to_string();
            assert!(msg.contains(var) && msg.contains(&value), "{msg}");
            (var, value)
        }
        other => panic!("expected an invalid value, got {other:?}"),
    }
}

#[test]
fn bad_values_name_the_variable_and_value() {
    let cases: &[(Vars, (&str, &str))] = &[
        (&[("RANK", "two")], ("RANK", "two")),
        (&[("RANK", "-1")], ("RANK", "-1")),
        (&[("RANK", "8")], ("RANK", "8")),
        (&[("WORLD_SIZE", "0")], ("WORLD_SIZE", "0")),
        (&[("WORLD_SIZE", "8x")], ("WORLD_SIZE", "8x")),
        (&[("LOCAL_RANK", "4")], ("LOCAL_RANK", "4")),
        (&[("LOCAL_WORLD_SIZE", "0")], ("LOCAL_WORLD_SIZE", "0")),
        (&[("MASTER_PORT", "0")], ("MASTER_PORT", "0")),
        (&[("MASTER_PORT", "70000")], ("MASTER_PORT", "70000")),
        (&[("MASTER_PORT", "http")], ("MASTER_PORT", "http")),
        (&[("MASTER_ADDR", "")], ("MASTER_ADDR", "")),
        (&[("MASTER_ADDR", "a b")], ("MASTER_ADDR", "a b")),
    ];
    for (over, (var, value)) in cases {
        let got = invalid(&with(TORCHRUN, over));
        assert_eq!((got.0, got.1.as_str()), (*var, *value), "{over:?}");
    }
    assert_eq!(
        invalid(&with(OMPI, &[("OMPI_COMM_WORLD_RANK", "4")])).0,
        "OMPI_COMM_WORLD_RANK"
    );
    assert_eq!(
        invalid(&with(SLURM, &[("SLURM_JOB_NODELIST", "node[1-")])).0,
        "SLURM_JOB_NODELIST"
    );
    assert_eq!(
        invalid(&with(SLURM, &[("SLURM_JOB_ID", "abc")])).0,
        "SLURM_JOB_ID"
    );
    assert_eq!(
        invalid(&with(SLURM, &[("SLURM_LOCALID", "x")])).0,
        "SLURM_LOCALID"
    );
    // A missing variable names it and the launcher.
    for var in ["RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        let err = ProcessEnv::from_lookup(env(&without(TORCHRUN, var))).unwrap_err();
        assert!(
            matches!(err, EnvError::Missing { var: v, launcher: EnvSource::Torchrun, .. } if v == var),
            "{err}"
        );
        assert!(err.to_string().contains(var), "{err}");
    }
    let err = ProcessEnv::from_lookup(env(&without(SLURM, "SLURM_JOB_NODELIST"))).unwrap_err();
    assert!(
        matches!(
            err,
            EnvError::Missing {
                var: "SLURM_JOB_NODELIST",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn token_comes_from_the_environment() {
    let e = ProcessEnv::from_lookup(env(TORCHRUN)).unwrap();
    let err = TcpRendezvous::from_lookup(&e, TOKEN_VAR, env(&[])).unwrap_err();
    assert!(matches!(&err, RendezvousError::MissingToken { var } if var == TOKEN_VAR));
    assert!(err.to_string().contains(TOKEN_VAR));
    let err = TcpRendezvous::from_lookup(&e, "MY_TOKEN", env(&[("MY_TOKEN", "")])).unwrap_err();
    assert!(matches!(err, RendezvousError::MissingToken { .. }));
    let t =
        TcpRendezvous::from_lookup(&e, "MY_TOKEN", env(&[("MY_TOKEN", "s3cret-s3cret-s3cret")]))
            .unwrap();
    assert_eq!(t.addr(), "10.0.0.1:29400");
    assert!(!format!("{t:?}").contains("s3cret"));
}

#[test]
fn tokens_shorter_than_16_bytes_are_refused_with_the_reason() {
    let e = ProcessEnv::from_lookup(env(TORCHRUN)).unwrap();
    // `kiwi` fell to an offline search of one sniffed handshake in under a second.
    let err = TcpRendezvous::from_lookup(&e, "MY_TOKEN", env(&[("MY_TOKEN", "kiwi")])).unwrap_err();
    assert!(
        matches!(err, RendezvousError::WeakToken { len: 4 }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("4 bytes") && text.contains("at least 16"),
        "{text}"
    );
    assert!(text.contains("offline"), "{text}");
    let fifteen = "0123456789abcde";
    assert!(TcpRendezvous::from_lookup(&e, "T", env(&[("T", fifteen)])).is_err());
    assert!(TcpRendezvous::from_lookup(&e, "T", env(&[("T", "0123456789abcdef")])).is_ok());
    // Built directly, a weak token is refused by both sides before any traffic.
    let weak = TcpRendezvous::new("127.0.0.1", free_port(), "kiwi");
    assert!(matches!(
        weak.serve(2, sample_id(0)),
        Err(RendezvousError::WeakToken { len: 4 })
    ));
    assert!(matches!(
        weak.fetch(1, 2),
        Err(RendezvousError::WeakToken { len: 4 })
    ));
    assert!(matches!(
        nccl_launch::desync::DesyncBoard::serve("127.0.0.1:0", 2, "kiwi"),
        Err(RendezvousError::WeakToken { len: 4 })
    ));
    let board = nccl_launch::desync::BoardClient::new("127.0.0.1:9", 2, "kiwi");
    assert!(matches!(
        board.fetch(),
        Err(RendezvousError::WeakToken { len: 4 })
    ));
}

#[test]
fn torchrun_elastic_variables_are_read_and_checked() {
    let with_agent = with(
        TORCHRUN,
        &[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ],
    );
    let e = ProcessEnv::from_lookup(env(&with_agent)).unwrap();
    let el = e.elastic.unwrap();
    assert!(el.use_agent_store);
    assert_eq!((el.run_id.as_str(), el.restart_count), ("abc", 2));
    let bad = with(&with_agent, &[("TORCHELASTIC_RESTART_COUNT", "two")]);
    let err = ProcessEnv::from_lookup(env(&bad)).unwrap_err();
    assert!(
        err.to_string().contains("TORCHELASTIC_RESTART_COUNT"),
        "{err}"
    );
    let bad = with(&with_agent, &[("TORCHELASTIC_USE_AGENT_STORE", "maybe")]);
    let err = ProcessEnv::from_lookup(env(&bad)).unwrap_err();
    assert!(
        err.to_string().contains("TORCHELASTIC_USE_AGENT_STORE"),
        "{err}"
    );
    let partial = without(&with_agent, "TORCHELASTIC_RUN_ID");
    let err = ProcessEnv::from_lookup(env(&partial)).unwrap_err();
    assert!(err.to_string().contains("TORCHELASTIC_RUN_ID"), "{err}");
    // Without them, as before.
    assert!(ProcessEnv::from_lookup(env(TORCHRUN))
        .unwrap()
        .elastic
        .is_none());
}

// ---- a hostile peer on 127.0.0.1 ------------------------------------------------------

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body)?;
    Ok(body)
}

fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    s.write_all(&(body.len() as u32).to_be_bytes())?;
    s.write_all(body)
}

/// rank 0's busy refusal, as sent in place of the hello.
const BUSY: [u8; 10] = [4, 5, 0, 0, 0, 0, 0, 0, 0, 0];

/// Whether the server closed `s` within `within` (after whatever it had sent).
fn closed_within(s: &TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut sink = Vec::new();
    let mut r = s;
    r.read_to_end(&mut sink).is_ok()
}

/// Busy is retried, not read as a protocol error: a rank 0 that is busy for its first
/// connections and then serves gives the rank its id.
#[test]
fn busy_is_retried_until_rank_0_has_room() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let client = thread::spawn(move || tcp(port).fetch(1, 2));
    for _ in 0..3 {
        let (mut s, _) = listener.accept().unwrap();
        write_frame(&mut s, &BUSY).unwrap();
    }
    drop(listener);
    let server = tcp(port).serve(2, sample_id(11)).unwrap();
    assert_eq!(client.join().unwrap().unwrap(), sample_id(11));
    server.wait().unwrap();
}

/// A rank 0 that is busy until the deadline ends in a timeout that says so, with the time
/// the rank really waited.
#[test]
fn busy_until_the_deadline_is_a_timeout_naming_the_time_taken() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let busy = thread::spawn(move || {
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            match listener.accept() {
                Ok((mut s, _)) => {
                    let _ = write_frame(&mut s, &BUSY);
                }
                Err(_) => thread::sleep(Duration::from_millis(2)),
            }
        }
    });
    let t0 = Instant::now();
    let err = tcp(port)
        .timeout(Duration::from_millis(700))
        .fetch(1, 2)
        .unwrap_err();
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy.join().unwrap();
    assert!(took < Duration::from_secs(2), "{took:?}");
    let RendezvousError::ClientTimeout {
        elapsed,
        last_error,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert!(last_error.contains("busy"), "{err}");
    assert!(*elapsed >= Duration::from_millis(700) && *elapsed < Duration::from_secs(2));
    assert!(err.to_string().contains("gave up after 0.7"), "{err}");
}

/// A stranger holding every connection the server admits (and more) does not keep the ranks out: the
/// oldest connections that never authenticated make room.
#[test]
fn a_stranger_filling_every_connection_does_not_keep_a_rank_out() {
    let server = tcp(0)
        .max_connections(32, 32)
        .io_timeout(Duration::from_secs(5))
        .serve(3, sample_id(12))
        .unwrap();
    let port = server.local_addr().port();
    let mut idle: Vec<TcpStream> = (0..64)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    // Wait until the server has accepted them all: each got its hello, or was already
    // closed to make room for a later one.
    for s in &mut idle {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut len = [0u8; 4];
        if let Err(e) = s.read_exact(&mut len) {
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
        }
    }
    let t0 = Instant::now();
    assert_eq!(tcp(port).fetch(1, 3).unwrap(), sample_id(12));
    assert_eq!(tcp(port).fetch(2, 3).unwrap(), sample_id(12));
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    server.wait().unwrap();
    // The first 32 idle ones were closed to make room, long before their deadline.
    assert!(closed_within(&idle[0], Duration::from_millis(500)));
}

/// A flood of new connections while the ranks start: every rank still gets in.
#[test]
fn a_connection_flood_does_not_keep_the_ranks_out() {
    let server = tcp(0)
        .max_connections(16, 16)
        .serve(4, sample_id(13))
        .unwrap();
    let port = server.local_addr().port();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let flood = thread::spawn(move || {
        let mut held = std::collections::VecDeque::new();
        let until = Instant::now() + Duration::from_secs(10);
        let mut n = 0usize;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < until {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                held.push_back(s);
                n += 1;
            }
            if held.len() > 40 {
                held.pop_front();
            }
            thread::sleep(Duration::from_millis(1));
        }
        n
    });
    thread::sleep(Duration::from_millis(100));
    let ranks: Vec<_> = (1..4)
        .map(|r| thread::spawn(move || tcp(port).fetch(r, 4)))
        .collect();
    for r in ranks {
        assert_eq!(r.join().unwrap().unwrap(), sample_id(13));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = flood.join().unwrap();
    assert!(n > 50, "the flood opened only {n} connections");
    server.wait().unwrap();
}

/// One peer address holds at most its share of the connections: older ones of the same
/// address are closed to make room.
#[test]
fn connections_per_peer_address_are_capped() {
    let server = tcp(0)
        .max_connections(256, 8)
        .io_timeout(Duration::from_secs(5))
        .serve(2, sample_id(14))
        .unwrap();
    let port = server.local_addr().port();
    let conns: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    // The server has accepted each once it sent its hello, or closed it.
    for s in &conns {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut len = [0u8; 4];
        if let Err(e) = (&mut &*s).read_exact(&mut len) {
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
        }
    }
    let closed = conns
        .iter()
        .filter(|s| closed_within(s, Duration::from_millis(100)))
        .count();
    assert_eq!(closed, 12, "20 connections from one address, 8 kept");
    assert_eq!(tcp(port).fetch(1, 2).unwrap(), sample_id(14));
    server.wait().unwrap();
}

/// A peer sending one byte at a time cannot hold its connection past the deadline of the
/// whole handshake (each byte would have reset a per-read timeout).
#[test]
fn a_slow_drip_peer_is_cut_off_at_the_connection_deadline() {
    let server = tcp(0)
        .io_timeout(Duration::from_millis(600))
        .serve(2, sample_id(15))
        .unwrap();
    let port = server.local_addr().port();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let t0 = Instant::now();
    read_frame(&mut s).unwrap(); // the hello
                                 // An authentication frame of 77 bytes, dripped a byte every 100 ms.
    let mut frame = 73u32.to_be_bytes().to_vec();
    frame.extend_from_slice(&[2u8; 73]);
    let mut cut = None;
    for b in frame {
        if s.write_all(&[b]).is_err() {
            cut = Some(t0.elapsed());
            break;
        }
        thread::sleep(Duration::from_millis(100));
        let mut probe = [0u8; 1];
        s.set_nonblocking(true).unwrap();
        let closed = matches!(s.read(&mut probe), Ok(0) | Ok(_));
        s.set_nonblocking(false).unwrap();
        if closed {
            cut = Some(t0.elapsed());
            break;
        }
    }
    let cut = cut.expect("the server kept the dripping peer for the whole frame");
    assert!(cut < Duration::from_millis(1500), "cut off after {cut:?}");
    assert_eq!(tcp(port).fetch(1, 2).unwrap(), sample_id(15));
    server.wait().unwrap();
}

/// A slow fake rank 0 (one byte of its hello every 200 ms) cannot keep a rank past its
/// own deadline, and the error says how long it really waited.
#[test]
fn a_slow_fake_rank_0_cannot_hold_a_rank_past_its_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let fake = thread::spawn(move || {
        let mut conns = Vec::new();
        let until = Instant::now() + Duration::from_secs(10);
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < until {
            if let Ok((s, _)) = listener.accept() {
                conns.push((s, 0usize));
            }
            // A hello-sized frame (length 49), one byte per tick.
            for (s, at) in &mut conns {
                let b = if *at == 3 { 49 } else { u8::from(*at == 4) };
                let _ = s.write_all(&[b]);
                *at += 1;
            }
            thread::sleep(Duration::from_millis(200));
        }
    });
    let t0 = Instant::now();
    let err = TcpRendezvous::new("127.0.0.1", port, TOKEN)
        .timeout(Duration::from_secs(1))
        .io_timeout(Duration::from_secs(10))
        .fetch(1, 2)
        .unwrap_err();
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    fake.join().unwrap();
    assert!(took < Duration::from_millis(1800), "{took:?}");
    assert!(
        matches!(err, RendezvousError::ClientTimeout { elapsed, .. } if elapsed < Duration::from_millis(1800)),
        "{err}"
    );
    assert!(err.to_string().contains("gave up after 1.0"), "{err}");
}

#[test]
fn debug_output_never_shows_the_token() {
    let token = "a-secret-job-token-of-enough-length";
    let shown = format!("{:?}", TcpRendezvous::new("127.0.0.1", 1, token));
    assert!(!shown.contains(token), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
}

// ---- strangers on the node: descriptors, a second address, forged refusals ------------

/// A fake server on `addr` that answers every connection as `answer` says (given the
/// connection's number), until `stop` is set; how many it answered.
fn fake_server(
    listener: TcpListener,
    stop: Arc<std::sync::atomic::AtomicBool>,
    answer: impl Fn(usize, &mut TcpStream) + Send + 'static,
) -> thread::JoinHandle<usize> {
    listener.set_nonblocking(true).unwrap();
    thread::spawn(move || {
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    answer(n, &mut s);
                    n += 1;
                }
                Err(_) => thread::sleep(Duration::from_millis(2)),
            }
        }
        n
    })
}

/// What a squatter that does not hold the token can answer: a hello of the right magic and
/// then the wrong-token refusal, a hello that is not the protocol's, or rank 0's busy.
fn squat(n: usize, s: &mut TcpStream) {
    match n % 3 {
        0 => {
            let mut hello = vec![1u8];
            hello.extend_from_slice(b"nccl-safe-rdzv/1");
            hello.extend_from_slice(&[9u8; 32]);
            let _ = write_frame(s, &hello);
            let _ = read_frame(s); // the rank's AUTH
            let _ = write_frame(s, &[4, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
        }
        1 => {
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        }
        _ => {
            let _ = write_frame(s, &BUSY);
        }
    }
}

/// A rendezvous host that stands for two addresses, of which a stranger holds the first
/// (listening on the job's port before rank 0 starts, as under mpirun): the ranks still get
/// the id once rank 0 listens on the other, and the stranger's answers never end them.
#[test]
fn a_squatter_on_a_second_address_costs_no_rank_its_id() {
    // A port free on both addresses: the one the system gives 127.0.0.2 may be held on
    // 127.0.0.1 by another process (rank 0 could then not serve there).
    let (squatter, port) = (0..50)
        .find_map(|_| {
            let squatter = TcpListener::bind("127.0.0.2:0").unwrap();
            let port = squatter.local_addr().unwrap().port();
            TcpListener::bind(("127.0.0.1", port))
                .ok()
                .map(|_| (squatter, port))
        })
        .expect("a port free on 127.0.0.1 and 127.0.0.2");
    let ips = ["127.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap()];
    let rdzv = move || {
        TcpRendezvous::new("rdzv-node", port, TOKEN)
            .resolve_to(ips)
            .timeout(Duration::from_secs(10))
            .io_timeout(Duration::from_secs(1))
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fake = fake_server(squatter, Arc::clone(&stop), squat);
    let t0 = Instant::now();
    let ranks: Vec<_> = (1..3)
        .map(|r| thread::spawn(move || (rdzv().fetch(r, 3), t0.elapsed())))
        .collect();
    thread::sleep(Duration::from_secs(1));
    let server = rdzv().serve(3, sample_id(17)).unwrap();
    assert_eq!(
        server.local_addr(),
        format!("127.0.0.1:{port}").parse().unwrap()
    );
    for (r, rank) in ranks.into_iter().enumerate() {
        let (got, took) = rank.join().unwrap();
        let got = got.unwrap_or_else(|e| panic!("rank {} after {took:?}: {e}", r + 1));
        assert_eq!(got, sample_id(17));
        assert!(took < Duration::from_secs(3), "rank {}: {took:?}", r + 1);
    }
    server.wait().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(fake.join().unwrap() >= 2, "the squatter was asked");
}

/// With only the squatter answering, a rank tries until its own deadline (not less), and
/// the error names the address that answered and what it said.
#[test]
fn a_squatter_alone_costs_the_deadline_and_is_named() {
    let squatter = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Only wrong-token refusals, so the last answer is one.
    let fake = fake_server(squatter, Arc::clone(&stop), |_, s| squat(0, s));
    let t0 = Instant::now();
    let err = TcpRendezvous::new("rdzv-node", port, TOKEN)
        .resolve_to(["127.0.0.2".parse().unwrap()])
        .timeout(Duration::from_millis(800))
        .fetch(1, 2)
        .unwrap_err();
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    fake.join().unwrap();
    assert!(took >= Duration::from_millis(800), "{took:?}: {err}");
    assert!(took < Duration::from_secs(3), "{took:?}: {err}");
    let RendezvousError::ClientTimeout { last_error, .. } = &err else {
        panic!("not a ClientTimeout: {err}");
    };
    assert!(
        last_error.contains(&format!("127.0.0.2:{port}")) && last_error.contains("wrong job token"),
        "{err}"
    );
}

/// A relay between a rank and rank 0 that replaces rank 0's answer with a refusal of its
/// own: the refusal proves nothing, so the rank tries again and gets the id.
#[test]
fn a_forged_refusal_is_retried_until_rank_0_answers() {
    let server = tcp(0).serve(2, sample_id(16)).unwrap();
    let real = server.local_addr().port();
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = relay.local_addr().unwrap().port();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The first two connections get a forged "rank already claimed" in place of the id;
    // later ones are relayed as they are.
    let forger = fake_server(relay, Arc::clone(&stop), move |n, c| {
        let mut s = TcpStream::connect(("127.0.0.1", real)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let hello = read_frame(&mut s).unwrap();
        write_frame(c, &hello).unwrap();
        let auth = read_frame(c).unwrap();
        write_frame(&mut s, &auth).unwrap();
        if n < 2 {
            // Rank 0 is still serving this rank on the relay's connection: dropped here.
            write_frame(c, &[4, 4, 0, 0, 0, 2, 0, 0, 0, 1]).unwrap();
            return;
        }
        let id = read_frame(&mut s).unwrap();
        write_frame(c, &id).unwrap();
        let ack = read_frame(c).unwrap();
        let _ = write_frame(&mut s, &ack);
    });
    let t0 = Instant::now();
    let got = tcp(port).fetch(1, 2);
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let got = got.unwrap_or_else(|e| panic!("after {took:?}: {e}"));
    assert_eq!(got, sample_id(16));
    assert!(forger.join().unwrap() >= 3);
    assert!(took < Duration::from_secs(3), "{took:?}");
    server.wait().unwrap();
}

/// A relay that forges every refusal costs the rank its whole deadline, not less, and the
/// error says the server at that address did not prove it holds the token.
#[test]
fn a_relay_forging_every_answer_costs_the_deadline() {
    let server = tcp(0).serve(2, sample_id(18)).unwrap();
    let real = server.local_addr().port();
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = relay.local_addr().unwrap().port();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let forger = fake_server(relay, Arc::clone(&stop), move |_, c| {
        let mut s = TcpStream::connect(("127.0.0.1", real)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let hello = read_frame(&mut s).unwrap();
        write_frame(c, &hello).unwrap();
        let auth = read_frame(c).unwrap();
        write_frame(&mut s, &auth).unwrap();
        let _ = write_frame(c, &[4, 4, 0, 0, 0, 2, 0, 0, 0, 1]);
    });
    let t0 = Instant::now();
    let err = tcp(port)
        .timeout(Duration::from_millis(800))
        .fetch(1, 2)
        .unwrap_err();
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    forger.join().unwrap();
    assert!(took >= Duration::from_millis(800), "{took:?}: {err}");
    let RendezvousError::ClientTimeout { last_error, .. } = &err else {
        panic!("not a ClientTimeout: {err}");
    };
    assert!(
        last_error.contains(&format!("127.0.0.1:{port}"))
            && last_error.contains("did not prove it holds the job token"),
        "{err}"
    );
    // The real rank 1 still gets its id.
    assert_eq!(tcp(real).fetch(1, 2).unwrap(), sample_id(18));
    server.wait().unwrap();
}

// ---- a stranger at the open-file limit ------------------------------------------------

const FD_CHILD: &str = "NCCL_SAFE_TEST_FD_LIMIT_CHILD";
/// Rank 0's open-file limit in the child, soft and hard (so it cannot raise it).
const FD_LIMIT: u64 = 256;
/// Files rank 0 opens while the stranger holds its connections (NCCL's init would).
const FILES: usize = 64;

/// Rank 0 under an open-file limit of [`FD_LIMIT`]: serves the id to ranks 1 and 2 on the
/// port the parent gives, and the desync board on the next; when the parent writes a
/// line, opens [`FILES`] files and says how many it could.
#[test]
#[ignore = "run as a child process by the test below"]
fn child_rank_0_under_a_low_open_file_limit() {
    let Some(port) = std::env::var(FD_CHILD)
        .ok()
        .and_then(|p| p.parse::<u16>().ok())
    else {
        panic!("run only as a child process ({FD_CHILD} unset)");
    };
    let limit = libc::rlimit {
        rlim_cur: FD_LIMIT as libc::rlim_t,
        rlim_max: FD_LIMIT as libc::rlim_t,
    };
    // SAFETY: setrlimit reads the struct it is given.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
    let server = TcpRendezvous::new("127.0.0.1", port, TOKEN)
        .timeout(Duration::from_secs(60))
        .serve(3, sample_id(19))
        .unwrap();
    let board = DesyncBoard::serve(("127.0.0.1", port + 1), 3, TOKEN).unwrap();
    println!("\n@@READY");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let files: Vec<_> = (0..FILES)
        .map(|_| std::fs::File::open("/dev/null"))
        .collect();
    let opened = files.iter().filter(|f| f.is_ok()).count();
    let error = files
        .iter()
        .find_map(|f| f.as_ref().err().map(|e| e.to_string()));
    println!("\n@@OPENED {opened} {error:?}");
    drop(files);
    println!("\n@@SERVED {:?}", server.wait().map_err(|e| e.to_string()));
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    board.stop();
}

/// A TCP connection to `127.0.0.1:port` from the loopback address `from`.
fn connect_from(from: std::net::Ipv4Addr, port: u16) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let addr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a fresh socket, owned by the TcpStream from here on.
    let s = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        TcpStream::from_raw_fd(fd)
    };
    use std::os::fd::AsRawFd;
    let (src, dst) = (addr(from, 0), addr(std::net::Ipv4Addr::LOCALHOST, port));
    // SAFETY: bind and connect read the address they are given, of the length given.
    unsafe {
        if libc::bind(
            s.as_raw_fd(),
            (&src as *const libc::sockaddr_in).cast(),
            len,
        ) != 0
            || libc::connect(
                s.as_raw_fd(),
                (&dst as *const libc::sockaddr_in).cast(),
                len,
            ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(s)
}

/// A stranger holding `per_source` connections to each of `ports` from each of `sources`
/// loopback addresses, reopening every one the server closes (every 50 ms), until `stop`.
/// Returns how many connections it opened in all.
fn hold_connections(
    ports: Vec<u16>,
    sources: u8,
    per_source: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
    opened: Arc<std::sync::atomic::AtomicUsize>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let targets: Vec<(std::net::Ipv4Addr, u16)> = (0..sources)
            .flat_map(|i| {
                let ports = ports.clone();
                ports.into_iter().flat_map(move |p| {
                    (0..per_source).map(move |_| (std::net::Ipv4Addr::new(127, 0, 0, 10 + i), p))
                })
            })
            .collect();
        let mut held: Vec<Option<TcpStream>> = targets.iter().map(|_| None).collect();
        let mut buf = [0u8; 256];
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for (slot, &(from, port)) in held.iter_mut().zip(&targets) {
                let closed = match slot {
                    None => true,
                    Some(s) => loop {
                        match s.read(&mut buf) {
                            Ok(0) => break true,
                            Ok(_) => continue,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                            Err(_) => break true,
                        }
                    },
                };
                if closed {
                    *slot = connect_from(from, port).ok();
                    if let Some(s) = slot {
                        s.set_nonblocking(true).unwrap();
                        opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            thread::sleep(Duration::from_millis(50));
        }
    })
}

/// A stranger holding more connections to rank 0's rendezvous and desync board than rank
/// 0 has descriptors, from 8 loopback addresses: every rank still gets the id in its normal
/// time, a post to the board goes through, and rank 0 can still open files.
#[test]
fn a_stranger_at_the_open_file_limit_keeps_no_rank_out() {
    // Two free neighbouring ports: the rendezvous and the board.
    let port = loop {
        let p = free_port();
        if p < u16::MAX && TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            break p;
        }
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_rank_0_under_a_low_open_file_limit",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FD_CHILD, port.to_string())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(l);
        }
    });
    let wait_for = |mark: &str| -> String {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(l) if l.starts_with(mark) => return l,
                Ok(_) => {}
                Err(e) => panic!("the child never printed {mark}: {e}"),
            }
        }
    };
    wait_for("@@READY");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // 8 x 24 connections to each server: 384 in all, over the child's 256 descriptors.
    let stranger = hold_connections(
        vec![port, port + 1],
        8,
        24,
        Arc::clone(&stop),
        Arc::clone(&opened),
    );
    let held = support_until(Duration::from_secs(10), || {
        opened.load(std::sync::atomic::Ordering::Relaxed) >= 384
    });
    assert!(held, "the stranger could not open its connections");
    thread::sleep(Duration::from_millis(500));
    let child_stdin = child.stdin.as_mut().unwrap();
    child_stdin.write_all(b"open\n").unwrap();
    let files = wait_for("@@OPENED");
    let t0 = Instant::now();
    let ranks: Vec<_> = (1..3)
        .map(|r| {
            thread::spawn(move || {
                let got = TcpRendezvous::new("127.0.0.1", port, TOKEN)
                    .timeout(Duration::from_secs(8))
                    .io_timeout(Duration::from_secs(2))
                    .fetch(r, 3);
                (got, t0.elapsed())
            })
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    let board = BoardClient::new(format!("127.0.0.1:{}", port + 1), 3, TOKEN);
    let t1 = Instant::now();
    let posted = board.post(2, &nccl_safe::diag::DesyncPost::new(1, 1, "x"));
    let post_took = t1.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    stranger.join().unwrap();
    drop(child.stdin.take());
    let served = wait_for("@@SERVED");
    let _ = child.wait();
    eprintln!(
        "ranks: {:?}; board post: {post_took:?}; {files}; {served}",
        results.iter().map(|r| r.1).collect::<Vec<_>>()
    );
    for (r, (got, took)) in results.into_iter().enumerate() {
        let got = got.unwrap_or_else(|e| panic!("rank {} after {took:?}: {e}", r + 1));
        assert_eq!(got, sample_id(19));
        assert!(took < Duration::from_secs(2), "rank {}: {took:?}", r + 1);
    }
    posted.unwrap_or_else(|e| panic!("the board post after {post_took:?}: {e}"));
    assert!(post_took < Duration::from_secs(2), "{post_took:?}");
    assert_eq!(files, format!("@@OPENED {FILES} None"));
    assert_eq!(served, "@@SERVED Ok(())");
}

fn support_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        thread::sleep(Duration::from_millis(10));
    }
    false
}

/// When a server must close a connection that has not authenticated, it closes one of the
/// source holding the most: a rank slow to answer its challenge (here held back by a relay)
/// keeps its connection while a stranger floods from another address, though it is the
/// oldest.
#[test]
fn a_strangers_flood_closes_its_own_connections_first() {
    let server = tcp(0)
        .max_connections(8, 64)
        .io_timeout(Duration::from_secs(5))
        .serve(2, sample_id(20))
        .unwrap();
    let real = server.local_addr().port();
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = relay.local_addr().unwrap().port();
    let (got_auth, go) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
    let (got_auth_tx, got_auth_rx) = got_auth;
    let (go_tx, go_rx) = go;
    let relayer = thread::spawn(move || -> std::io::Result<()> {
        let (mut c, _) = relay.accept()?;
        let mut s = TcpStream::connect(("127.0.0.1", real))?;
        for x in [&mut c, &mut s] {
            x.set_read_timeout(Some(Duration::from_secs(5)))?;
        }
        let hello = read_frame(&mut s)?;
        write_frame(&mut c, &hello)?;
        let auth = read_frame(&mut c)?;
        let _ = got_auth_tx.send(());
        let _ = go_rx.recv_timeout(Duration::from_secs(10));
        write_frame(&mut s, &auth)?;
        let id = read_frame(&mut s)?;
        write_frame(&mut c, &id)?;
        let ack = read_frame(&mut c)?;
        write_frame(&mut s, &ack)
    });
    let rank = thread::spawn(move || tcp(port).timeout(Duration::from_secs(3)).fetch(1, 2));
    got_auth_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    // 16 connections from another address, each accepted (its hello read) or closed.
    let flood: Vec<TcpStream> = (0..16)
        .map(|_| {
            let mut s = connect_from(std::net::Ipv4Addr::new(127, 0, 0, 10), real).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let _ = read_frame(&mut s);
            s
        })
        .collect();
    go_tx.send(()).unwrap();
    let relayed = relayer.join().unwrap();
    let got = rank.join().unwrap();
    assert!(
        relayed.is_ok(),
        "the rank's connection was closed: {relayed:?}"
    );
    assert_eq!(got.unwrap(), sample_id(20));
    drop(flood);
    server.wait().unwrap();
}
