//! Scalable init (`ncclCommInitRankScalable`, NCCL 2.23) and NCCL's parameter API
//! (`ncclParam*`, NCCL 2.30) on the host provider: several roots across ranks in threads
//! and in processes, an init with one id meeting `ncclCommInitRankConfig`'s, bad ids as
//! typed errors before NCCL is called, each call `Unsupported` on an older NCCL, and the
//! parameters as typed values, following param/c_api.cc of 2.30.7.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nccl_safe::host::shared_unique_id;
use nccl_safe::{
    scalable_root_rank, scalable_roots, CommDevice, Communicator, Config, Error, Library, ReduceOp,
    Stream, UniqueId, Version,
};
use support::assert_balanced;

const S: Stream = Stream::Host;
const CHILD: &str = "NCCL_SAFE_TEST_SCALABLE";

fn config() -> Config {
    Config::new().timeout(Duration::from_secs(30))
}

/// An all-reduce of `rank + 1` over the communicator: the sum of 1..=n on every rank.
fn check_sum(comm: &Communicator) {
    let n = comm.world_size() as f32;
    let mut x = vec![comm.rank() as f32 + 1.0; 4];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
    assert_eq!(x, vec![n * (n + 1.0) / 2.0; 4], "rank {}", comm.rank());
}

/// Waits for every child to exit, within 60 s: past that, kills them all and fails
/// naming which had not exited.
fn wait_for_ranks(kids: &mut [std::process::Child]) {
    let start = Instant::now();
    let mut done = vec![None; kids.len()];
    while done.iter().any(Option::is_none) {
        for (i, k) in kids.iter_mut().enumerate() {
            if done[i].is_none() {
                done[i] = k.try_wait().unwrap();
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
            for k in kids.iter_mut() {
                let _ = k.kill();
                let _ = k.wait();
            }
            panic!("a rank hung: {done:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Seven ranks in threads over three roots, each id made by the first rank of its block:
/// every rank joins with its rank, and an all-reduce sums over all seven.
#[test]
fn several_roots_in_threads() {
    let n = 7;
    let roots = 3;
    let makers: Vec<usize> = (0..roots)
        .map(|i| scalable_root_rank(n, roots, i).unwrap())
        .collect();
    assert_eq!(makers, [0, 3, 5]);
    let ids: Vec<UniqueId> = (0..roots)
        .map(|_| CommDevice::Host.unique_id().unwrap())
        .collect();
    std::thread::scope(|s| {
        for rank in 0..n {
            let ids = &ids;
            s.spawn(move || {
                let comm =
                    Communicator::init_rank_scalable(&CommDevice::Host, n, rank, ids, &config())
                        .unwrap();
                assert_eq!((comm.rank(), comm.world_size()), (rank, n));
                check_sum(&comm);
                comm.destroy().map_err(|(_, e)| e).unwrap();
            });
        }
    });
    assert_balanced(&ids[0]);
}

/// One id is `ncclCommInitRankConfig`'s init (init.cc:2700 of 2.30.7 passes `nId = 1`):
/// ranks that call `init_rank_scalable(&[id])` and ranks that call `init_rank(id)` meet.
#[test]
fn one_id_meets_init_rank() {
    let id = CommDevice::Host.unique_id().unwrap();
    std::thread::scope(|s| {
        for rank in 0..3 {
            let id = &id;
            s.spawn(move || {
                let comm = if rank % 2 == 0 {
                    Communicator::init_rank_scalable(
                        &CommDevice::Host,
                        3,
                        rank,
                        std::slice::from_ref(id),
                        &config(),
                    )
                } else {
                    Communicator::init_rank(&CommDevice::Host, 3, rank, id, &config())
                }
                .unwrap();
                check_sum(&comm);
            });
        }
    });
    assert_balanced(&id);
}

/// Runs this binary's test `name` alone in a child process (for process-wide counters or
/// variables), with `env`; fails when it fails.
fn in_child(name: &str, env: &[(&str, &str)]) {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([name, "--exact", "--nocapture"]).env(CHILD, name);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.env_remove("NCCL_PARAM_DUMP_ALL").output().unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// No ids, more ids than ranks and an id given twice are `InvalidArgument` before NCCL is
/// called (no handle is made, nothing counted as misuse, in a process of its own), as are
/// ranks out of range.
#[test]
fn bad_ids_are_typed_errors_before_nccl() {
    if std::env::var_os(CHILD).is_none() {
        return in_child("bad_ids_are_typed_errors_before_nccl", &[]);
    }
    let a = CommDevice::Host.unique_id().unwrap();
    let b = CommDevice::Host.unique_id().unwrap();
    let c = CommDevice::Host.unique_id().unwrap();
    let before = nccl_safe::host::stats();
    let cases: [(&[UniqueId], usize, usize, &str); 4] = [
        (&[], 2, 0, "no unique ids"),
        (&[a, b, c], 2, 0, "3 unique ids for 2 ranks"),
        (&[a, b, a], 4, 1, "ids[0] and ids[2] are the same"),
        (&[a, b], 2, 2, "rank"),
    ];
    for (ids, n, rank, says) in cases {
        let e = Communicator::init_rank_scalable(&CommDevice::Host, n, rank, ids, &config())
            .expect_err(says);
        match &e {
            Error::InvalidArgument { call, reason } => {
                assert_eq!(*call, "ncclCommInitRankScalable", "{e}");
                assert!(reason.contains(says), "{reason}");
            }
            Error::RankOutOfRange { .. } if says == "rank" => {}
            other => panic!("{says}: {other:?}"),
        }
    }
    let after = nccl_safe::host::stats();
    assert_eq!(
        (after.created, after.misused),
        (before.created, before.misused)
    );
}

/// The host provider's C entry point follows init.cc:2477-2481 of 2.30.7: `nId` outside
/// `1..=nranks` is ncclInvalidArgument, `*newcomm` untouched (NCCL reads the out-pointer after
/// the refusal, init.cc:2717-2718, so a caller passes it NULL, as the crate does).
#[test]
fn the_c_entry_point_refuses_a_bad_id_count() {
    let lib = Library::host();
    let init = lib.table().ncclCommInitRankScalable.unwrap();
    let mut ids = [CommDevice::Host.unique_id().unwrap().to_raw(); 3];
    for (nranks, n_id) in [(2, 0), (2, 3), (1, -1)] {
        let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a writable out-pointer, `ids` holds 3 ids; a NULL config is allowed.
        let r = unsafe {
            init(
                &mut comm,
                nranks,
                0,
                n_id,
                ids.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(r, nccl_sys::bindings::ncclInvalidArgument, "nId {n_id}");
        assert!(comm.is_null());
    }
}

/// The launchers' number of roots: one per 256 ranks, at least one, at most one per rank.
#[test]
fn roots_for_the_jobs_size() {
    assert_eq!(scalable_roots(1), 1);
    assert_eq!(scalable_roots(256), 1);
    assert_eq!(scalable_roots(257), 2);
    assert_eq!(scalable_roots(100_000), 391);
    assert_eq!(scalable_roots(0), 1);
    // The blocks cover every rank once, in order (bootstrap.cc:51-69).
    for (n, roots) in [(10, 3), (7, 7), (1000, 4), (5, 1)] {
        let firsts: Vec<usize> = (0..roots)
            .map(|i| scalable_root_rank(n, roots, i).unwrap())
            .collect();
        assert_eq!(firsts[0], 0);
        assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{firsts:?}");
        let sizes: Vec<usize> = firsts
            .iter()
            .zip(firsts.iter().skip(1).chain([&n]))
            .map(|(a, b)| b - a)
            .collect();
        assert!(sizes.iter().all(|&s| s == n / roots || s == n / roots + 1));
    }
    assert_eq!(scalable_root_rank(4, 5, 0), None);
    assert_eq!(scalable_root_rank(4, 2, 2), None);
}

/// Before NCCL 2.23 a scalable init is `Unsupported` (nothing is called, even for ids
/// that would be refused); before 2.30 every parameter call is.
#[test]
fn each_call_on_an_older_nccl_is_unsupported() {
    let unsupported = |e: Error, sym: &str, minor: u32, found: Version| match e {
        Error::Unsupported {
            symbol,
            needs,
            found: f,
        } if symbol == sym && needs == Version::new(2, minor, 0) && f == found => {}
        other => panic!("{sym}: expected Unsupported, got {other:?}"),
    };
    for minor in [18, 22] {
        let lib = Library::host_as_version(2, minor).unwrap();
        let id = UniqueId::new_with(&lib).unwrap();
        let e =
            Communicator::init_rank_scalable_in(&lib, &CommDevice::Host, 1, 0, &[id], &config())
                .unwrap_err();
        unsupported(e, "ncclCommInitRankScalable", 23, lib.version());
        let e = Communicator::init_rank_scalable_in(&lib, &CommDevice::Host, 1, 0, &[], &config())
            .unwrap_err();
        unsupported(e, "ncclCommInitRankScalable", 23, lib.version());
    }
    let lib = Library::host_as_version(2, 23).unwrap();
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_scalable_in(&lib, &CommDevice::Host, 1, 0, &[id], &config())
        .unwrap();
    check_sum(&comm);
    for minor in [18, 29] {
        let lib = Library::host_as_version(2, minor).unwrap();
        let v = lib.version();
        unsupported(
            lib.param("NCCL_DEBUG_FILE").unwrap_err(),
            "ncclParamGetParameter",
            30,
            v,
        );
        unsupported(
            lib.param_names().unwrap_err(),
            "ncclParamGetAllParameterKeys",
            30,
            v,
        );
        unsupported(
            lib.bind_param("NCCL_DEBUG_FILE").unwrap_err(),
            "ncclParamBind",
            30,
            v,
        );
    }
    let lib = Library::host_as_version(2, 30).unwrap();
    assert_eq!(lib.param("NCCL_SET_THREAD_NAME").unwrap(), "FALSE");
}

/// The parameters as typed values, read as NCCL 2.30.7 reads them (param.h, c_api.cc):
/// a string's text, a bit set's names and its `uint32_t`, a boolean's `TRUE`/`FALSE` and
/// its byte, an unknown name `UnknownParam`, a wrong type `InvalidArgument`, the published
/// names only unless `NCCL_PARAM_DUMP_ALL` is set. In a child process, for its variables.
#[test]
fn parameters_as_typed_values() {
    if std::env::var_os(CHILD).is_none() {
        return in_child(
            "parameters_as_typed_values",
            &[
                ("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p"),
                ("NCCL_DEBUG_TIMESTAMP_LEVELS", "warn, TRACE"),
                ("NCCL_WARN_ENABLE_DEBUG_INFO", "t"),
                ("NCCL_SET_THREAD_NAME", "maybe"),
            ],
        );
    }
    let lib = Library::host();
    assert_eq!(lib.param("NCCL_DEBUG_FILE").unwrap(), "/tmp/nccl.%h.%p");
    assert_eq!(
        lib.param("NCCL_DEBUG_TIMESTAMP_FORMAT").unwrap(),
        "[%F %T] "
    );
    assert_eq!(
        lib.param("NCCL_DEBUG_TIMESTAMP_LEVELS").unwrap(),
        "WARN,TRACE"
    );
    assert_eq!(lib.param("NCCL_WARN_ENABLE_DEBUG_INFO").unwrap(), "TRUE");
    // Unparsable: the default.
    assert_eq!(lib.param("NCCL_SET_THREAD_NAME").unwrap(), "FALSE");
    for name in ["NCCL_NO_SUCH_PARAM", "NCCL_DEBUG_FIL", ""] {
        match lib.param(name) {
            Err(Error::UnknownParam { name: n }) if n == name => {}
            other => panic!("{name}: {other:?}"),
        }
        assert!(matches!(
            lib.bind_param(name),
            Err(Error::UnknownParam { .. })
        ));
    }
    assert!(matches!(
        lib.param("NCCL_DEBUG\0FILE"),
        Err(Error::InvalidArgument { .. })
    ));

    let levels = lib.bind_param("NCCL_DEBUG_TIMESTAMP_LEVELS").unwrap();
    assert_eq!(levels.name(), "NCCL_DEBUG_TIMESTAMP_LEVELS");
    // A bound parameter may be read from another thread.
    let from_another = std::thread::scope(|s| s.spawn(|| levels.get::<u32>()).join().unwrap());
    assert_eq!(from_another.unwrap(), (1 << 2) | (1 << 5));
    assert_eq!(levels.get::<u32>().unwrap(), (1 << 2) | (1 << 5));
    assert_eq!(
        levels.raw().unwrap(),
        ((1u32 << 2) | (1 << 5)).to_ne_bytes()
    );
    match levels.get::<u64>() {
        Err(Error::InvalidArgument { call, reason }) => {
            assert_eq!(call, "ncclParamGetU64");
            assert!(reason.contains("not of type uint64_t"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(levels.get::<String>().is_err());

    let file = lib.bind_param("NCCL_DEBUG_FILE").unwrap();
    assert_eq!(file.get::<String>().unwrap(), "/tmp/nccl.%h.%p");
    assert_eq!(file.raw().unwrap(), b"/tmp/nccl.%h.%p\0");
    assert!(file.get::<i32>().is_err());

    let warn = lib.bind_param("NCCL_WARN_ENABLE_DEBUG_INFO").unwrap();
    assert_eq!(warn.raw().unwrap(), [1]);
    assert!(warn.get::<u8>().is_err(), "a bool is not a uint8_t");

    let names = lib.param_names().unwrap();
    assert!(names.iter().any(|n| n == "NCCL_DEBUG_FILE"), "{names:?}");
    // Not published (param.cc:16, debug.cc:80): listed only under NCCL_PARAM_DUMP_ALL.
    assert!(
        !names.iter().any(|n| n == "NCCL_PARAM_DUMP_ALL"),
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n == "NCCL_WARN_ENABLE_DEBUG_INFO"));
    std::env::set_var("NCCL_PARAM_DUMP_ALL", "1");
    let all = lib.param_names().unwrap();
    assert!(all.iter().any(|n| n == "NCCL_PARAM_DUMP_ALL"), "{all:?}");
    assert!(all.len() > names.len());
}

/// Four ranks as processes over two roots (shared ids made here, the parent): the
/// children join across processes and sum over all four; none hangs.
#[test]
fn several_roots_in_processes() {
    if let Ok(spec) = std::env::var(CHILD) {
        let (rank, hex) = spec
            .split_once(':')
            .expect("the child's spec is RANK:IDS, as the parent writes it");
        let rank: usize = rank.parse().unwrap();
        let ids: Vec<UniqueId> = hex.split(',').map(|h| h.parse().unwrap()).collect();
        let comm =
            Communicator::init_rank_scalable(&CommDevice::Host, 4, rank, &ids, &config()).unwrap();
        check_sum(&comm);
        comm.destroy().map_err(|(_, e)| e).unwrap();
        println!("rank {rank} done");
        return;
    }
    let ids: Vec<String> = (0..2)
        .map(|_| UniqueId::from_raw(shared_unique_id()).to_string())
        .collect();
    let ids = ids.join(",");
    let exe = std::env::current_exe().unwrap();
    let mut kids: Vec<_> = (0..4)
        .map(|r| {
            Command::new(&exe)
                .args(["several_roots_in_processes", "--exact", "--nocapture"])
                .env(CHILD, format!("{r}:{ids}"))
                .env("NCCL_SAFE_HOST_TIMEOUT_MS", "20000")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    wait_for_ranks(&mut kids);
    for (r, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(&format!("rank {r} done")),
            "rank {r}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The thread launcher with several roots: each rank's communicator comes from a scalable
/// init over that many ids, and a collective spans every rank; a count of roots of 0 or
/// above the ranks is refused before any rank starts.
#[test]
fn the_launcher_runs_with_several_roots() {
    use nccl_launch::Launcher;
    let sums = Launcher::host(5)
        .roots(2)
        .config(config())
        .run(|rank| {
            let mut x = vec![rank.rank() as f32 + 1.0; 3];
            rank.comm()
                .all_reduce_in_place(&mut x, ReduceOp::Sum, rank.stream())?;
            Ok(x[0])
        })
        .unwrap();
    assert_eq!(sums, vec![15.0; 5]);
    for roots in [0, 6] {
        match Launcher::host(5).roots(roots).run(|_| Ok(())) {
            Err(nccl_launch::Error::Core(Error::InvalidArgument { call, .. })) => {
                assert_eq!(call, "Launcher::roots")
            }
            other => panic!("{roots} roots: {other:?}"),
        }
    }
}

/// A process launcher's rank joins with several ids it was given (`join_scalable`): three
/// ranks' launchers (in threads here, on the host provider) over two shared ids; no ids is
/// refused before NCCL.
#[test]
fn a_process_rank_joins_with_several_ids() {
    use nccl_launch::env::{EnvSource, ProcessEnv};
    use nccl_launch::ProcessLauncher;
    let env = |rank| ProcessEnv {
        source: EnvSource::Torchrun,
        rank,
        world_size: 3,
        local_rank: rank,
        local_world_size: Some(3),
        master_addr: "127.0.0.1".into(),
        master_port: 1,
        elastic: None,
        ends_survivors: None,
    };
    let ids: Vec<UniqueId> = (0..2)
        .map(|_| UniqueId::from_raw(shared_unique_id()))
        .collect();
    std::thread::scope(|s| {
        for rank in 0..3 {
            let ids = &ids;
            s.spawn(move || {
                let launcher = ProcessLauncher::new(env(rank)).host().config(config());
                let r = launcher.join_scalable(ids).unwrap();
                assert_eq!((r.rank(), r.world_size()), (rank, 3));
                check_sum(r.comm());
            });
        }
    });
    let launcher = ProcessLauncher::new(env(0)).host();
    assert!(matches!(
        launcher.join_scalable(&[]),
        Err(nccl_launch::Error::Core(Error::InvalidArgument { .. }))
    ));
}

/// Ranks that pass different ids do not meet (NCCL's roots would wait for ranks that
/// check in elsewhere): each init ends at its timeout, no handle is left live.
#[test]
fn ranks_with_different_ids_time_out() {
    let [a, b, c] = [(); 3].map(|_| CommDevice::Host.unique_id().unwrap());
    let short = Config::new().timeout(Duration::from_millis(300));
    std::thread::scope(|s| {
        for (rank, ids) in [(0, [a, b]), (1, [a, c])] {
            let short = &short;
            s.spawn(move || {
                match Communicator::init_rank_scalable(&CommDevice::Host, 2, rank, &ids, short) {
                    Err(Error::Timeout { .. }) => {}
                    other => panic!("rank {rank}: {other:?}"),
                }
            });
        }
    });
    let st = support::settled_stats(&a);
    assert_eq!(st.live, 0, "{st:?}");
}

/// Set in the children of [`process_job`]: the launcher's variables describe their rank.
const JOB: &str = "NCCL_SAFE_TEST_ROOTS_JOB";

/// A child of [`process_job`]: joins the job through `Launcher::from_env` (the host
/// provider), sums over every rank, and prints its pid and the ids its communicator was
/// made from. `false` when this process is not such a child.
fn job_child() -> bool {
    if std::env::var_os(JOB).is_none() {
        return false;
    }
    let launcher = nccl_launch::Launcher::from_env().unwrap();
    let rank = (launcher.host().config(config()).init()).unwrap_or_else(|e| {
        println!("init failed: {e}");
        std::process::exit(2)
    });
    check_sum(rank.comm());
    let ids: Vec<String> = rank.unique_ids().iter().map(|i| i.to_string()).collect();
    let pid = std::process::id();
    println!("rank {} pid {pid} ids {}", rank.rank(), ids.join(","));
    true
}

/// Runs test `name` as a job of `n` processes, torchrun's variables set for each plus
/// `env`; each rank's pid and the ids it reported, in rank order. Fails when one hangs
/// or fails.
fn process_job(name: &str, n: usize, env: &[(&str, String)]) -> Vec<(u32, Vec<UniqueId>)> {
    let exe = std::env::current_exe().unwrap();
    let mut kids: Vec<_> = (0..n)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args([name, "--exact", "--nocapture", "--test-threads=1"])
                .env(JOB, "1")
                .env_remove("OMPI_COMM_WORLD_RANK")
                .env_remove("SLURM_PROCID")
                .env_remove("TORCHELASTIC_USE_AGENT_STORE")
                .env_remove("TORCHELASTIC_RUN_ID")
                .env_remove("TORCHELASTIC_RESTART_COUNT")
                .env_remove(nccl_launch::ROOTS_VAR)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("NCCL_SAFE_HOST_TIMEOUT_MS", "20000")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    wait_for_ranks(&mut kids);
    let pids: Vec<u32> = kids.iter().map(|k| k.id()).collect();
    kids.into_iter()
        .enumerate()
        .map(|(r, k)| {
            let out = k.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let line = (text.lines())
                .find_map(|l| l.split_once(&format!("rank {r} pid {} ids ", pids[r])))
                .map(|(_, ids)| ids.trim())
                .filter(|_| out.status.success())
                .unwrap_or_else(|| {
                    panic!("rank {r}: {text}{}", String::from_utf8_lossy(&out.stderr))
                });
            let ids = line.split(',').map(|h| h.parse().unwrap()).collect();
            (pids[r], ids)
        })
        .collect()
}

/// Every rank of `job` was made from the same `roots` ids, id `i` made in the process of
/// rank `scalable_root_rank(n, roots, i)` (a host id carries its maker's pid in bytes
/// 16..20), so each root rank called `ncclGetUniqueId` for its own block, as NCCL's
/// `rankHasRoot` says.
fn assert_roots(job: &[(u32, Vec<UniqueId>)], roots: usize) {
    let n = job.len();
    let ids = &job[0].1;
    assert_eq!(ids.len(), roots, "{ids:?}");
    for (r, (_, theirs)) in job.iter().enumerate() {
        assert_eq!(theirs, ids, "rank {r}");
    }
    for (i, id) in ids.iter().enumerate() {
        let maker = scalable_root_rank(n, roots, i).unwrap();
        let pid = u32::from_le_bytes(id.as_bytes()[16..20].try_into().unwrap());
        assert_eq!(pid, job[maker].0, "id {i} is rank {maker}'s");
    }
}

/// A loopback port nothing listens on, the next one free too (rank 0's desync board).
fn free_ports() -> u16 {
    loop {
        let p = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}

/// A process job over the authenticated TCP rendezvous (`Launcher::from_env`, as under
/// mpirun or srun): with `NCCL_SAFE_ROOTS` at 2 and 3, four ranks' communicators are made
/// from that many ids, each made by its root rank and moved through rank 0, and an
/// all-reduce spans all four; unset, a job of four has `scalable_roots(4)` = 1 id.
#[test]
fn a_process_job_over_tcp_uses_the_roots_asked() {
    if job_child() {
        return;
    }
    let name = "a_process_job_over_tcp_uses_the_roots_asked";
    for roots in [Some(2), Some(3), None] {
        let mut env = vec![
            ("MASTER_PORT", free_ports().to_string()),
            (
                "NCCL_SAFE_RENDEZVOUS_TOKEN",
                "roots-test-token-0123456789".into(),
            ),
        ];
        if let Some(n) = roots {
            env.push((nccl_launch::ROOTS_VAR, n.to_string()));
        }
        let job = process_job(name, 4, &env);
        assert_roots(&job, roots.unwrap_or(scalable_roots(4)));
    }
}

/// A process job through torchrun's agent store (a c10d `TCPStore`, here the tests'
/// server of its protocol): with 2 and 3 roots, each root rank publishes its id under
/// its own key and every rank reads them all.
#[test]
fn a_process_job_through_the_store_uses_the_roots_asked() {
    if job_child() {
        return;
    }
    let name = "a_process_job_through_the_store_uses_the_roots_asked";
    for roots in [2, 3] {
        let store = support::c10d::FakeStore::start(support::c10d::Mode::Honest);
        let env = [
            ("MASTER_PORT", store.port().to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
            ("TORCHELASTIC_RUN_ID", format!("roots-{roots}")),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
            (nccl_launch::ROOTS_VAR, roots.to_string()),
        ];
        let job = process_job(name, 4, &env);
        assert_roots(&job, roots);
    }
}

/// Every transport in threads (TCP, a file, the c10d store): three ranks over two roots
/// (rank 2 makes root 1's id, rank 1 none, which never calls `make_id`) and over three,
/// every rank getting every id in root order.
#[test]
fn every_transport_moves_every_roots_id() {
    use nccl_launch::rendezvous::{FileRendezvous, Rendezvous, TcpRendezvous};
    use nccl_launch::store::StoreRendezvous;
    const TOKEN: &str = "roots-test-token-0123456789";
    let long = Duration::from_secs(20);
    let store = support::c10d::FakeStore::start(support::c10d::Mode::Honest);
    let dir = support::temp_dir("every-root");
    for transport in ["tcp", "file", "store"] {
        for roots in [2, 3] {
            let port = free_ports();
            let (dir, addr) = (&dir, store.addr());
            let rendezvous = |rank: usize| {
                match transport {
                    "tcp" => {
                        Rendezvous::Tcp(TcpRendezvous::new("127.0.0.1", port, TOKEN).timeout(long))
                    }
                    "file" => Rendezvous::File(
                        FileRendezvous::new(dir.join(format!("ids-{roots}"))).timeout(long),
                    ),
                    _ => Rendezvous::Store(
                        StoreRendezvous::new(addr.clone(), format!("r{roots}/")).timeout(long),
                    ),
                }
                .exchange_roots(rank, 3, roots, move || {
                    let maker = |i| scalable_root_rank(3, roots, i) == Some(rank);
                    assert!((0..roots).any(maker), "rank {rank} makes no id");
                    Ok::<_, nccl_launch::Error>([rank as u8 + 1; 128])
                })
            };
            let got: Vec<Vec<[u8; 128]>> = std::thread::scope(|s| {
                let ranks: Vec<_> = (0..3)
                    .map(|rank| {
                        s.spawn(move || {
                            let x = rendezvous(rank).unwrap();
                            if let Some(server) = x.server {
                                server.wait().unwrap();
                            }
                            x.ids
                        })
                    })
                    .collect();
                ranks.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let want: Vec<[u8; 128]> = (0..roots)
                .map(|i| [scalable_root_rank(3, roots, i).unwrap() as u8 + 1; 128])
                .collect();
            assert_eq!(want.len(), roots);
            for (rank, ids) in got.iter().enumerate() {
                assert!(ids == &want, "{transport}: rank {rank}, {roots} roots");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ranks that disagree on the number of roots get a typed error at once, never a wait:
/// over TCP (a rank 0 of one id, whose messages are those of an older nccl-safe too, and
/// a rank of one id, or an older nccl-safe's, against a rank 0 of two), through the store
/// and through a file; a custom rendezvous refuses more than one root, and the launcher
/// refuses a count outside `1..=world_size`.
#[test]
fn a_disagreement_on_the_roots_is_a_typed_error() {
    use nccl_launch::rendezvous::TcpRendezvous;
    use nccl_launch::rendezvous::{FileRendezvous, Rendezvous, RendezvousError};
    use nccl_launch::store::{StoreClient, StoreRendezvous};
    const TOKEN: &str = "roots-test-token-0123456789";
    let long = Duration::from_secs(60);
    let make = |seed: u8| move || Ok::<_, nccl_launch::Error>([seed; 128]);
    let mismatch = |r: Result<_, nccl_launch::Error>| match r {
        Err(nccl_launch::Error::Rendezvous(e)) => match *e {
            RendezvousError::RootsMismatch {
                published,
                expected,
                ..
            } => (published, expected),
            e => panic!("{e}"),
        },
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("no error"),
    };
    // TCP: rank 0 serves one id; ranks 1 (no id of its own) and 2 (root 1's) expect two.
    let tcp = |port| TcpRendezvous::new("127.0.0.1", port, TOKEN).timeout(long);
    let server = tcp(0).serve(3, [1; 128]).unwrap();
    let port = server.local_addr().port();
    for rank in [1, 2] {
        let r = Rendezvous::Tcp(tcp(port)).exchange_roots(rank, 3, 2, make(9));
        assert_eq!(mismatch(r.map(|x| x.ids)), (Some(1), 2), "rank {rank}");
    }
    server.stop();
    // TCP: rank 0 of two roots; a rank of one id (the old message, byte for byte) and one
    // of three are refused at once; rank 0 ends at its deadline naming who never came.
    let port = free_ports();
    let short = tcp(port).timeout(Duration::from_secs(3));
    let rank0 = std::thread::spawn(move || {
        Rendezvous::Tcp(short)
            .exchange_roots(0, 3, 2, make(1))
            .map(|x| x.ids)
    });
    let r = Rendezvous::Tcp(tcp(port)).exchange(1, 3, make(9));
    assert_eq!(mismatch(r.map(|x| vec![x.id])), (None, 1));
    let r = Rendezvous::Tcp(tcp(port)).exchange_roots(2, 3, 3, make(9));
    assert_eq!(mismatch(r.map(|x| x.ids)), (Some(2), 3));
    match rank0.join().unwrap() {
        Err(nccl_launch::Error::Rendezvous(e)) => match *e {
            RendezvousError::ServerTimeout { missing, .. } => assert!(missing.contains(&2)),
            e => panic!("{e}"),
        },
        other => panic!("{other:?}"),
    }
    // Store: one id under root 0's key read as two; two read as one; a short value.
    let store = support::c10d::FakeStore::start(support::c10d::Mode::Honest);
    let st = |p: &str| StoreRendezvous::new(store.addr(), p).timeout(long);
    st("a/").publish(3, &[1; 128]).unwrap();
    let r = Rendezvous::Store(st("a/")).exchange_roots(1, 3, 2, make(9));
    assert_eq!(mismatch(r.map(|x| x.ids)), (Some(1), 2));
    let mut c = StoreClient::connect(&store.addr(), long).unwrap();
    let two = [
        &3u32.to_le_bytes()[..],
        &2u32.to_le_bytes(),
        &0u32.to_le_bytes(),
        &[1; 128],
    ]
    .concat();
    c.set(&st("b/").root_key(0), &two).unwrap();
    let r = Rendezvous::Store(st("b/")).exchange(1, 3, make(9));
    assert_eq!(mismatch(r.map(|x| vec![x.id])), (Some(2), 1));
    c.set(&st("c/").root_key(0), &two[..139]).unwrap();
    let r = Rendezvous::Store(st("c/")).exchange_roots(1, 3, 2, make(9));
    assert!(matches!(r, Err(nccl_launch::Error::Store(_))), "{r:?}");
    // File: one id read as two; root 0's file of two read as one; a foreign root file.
    let dir = support::temp_dir("roots");
    let file = |name: &str| FileRendezvous::new(dir.join(name)).timeout(long);
    file("one").publish(3, &[1; 128]).unwrap();
    let r = Rendezvous::File(file("one")).exchange_roots(1, 3, 2, make(9));
    assert_eq!(mismatch(r.map(|x| x.ids)), (Some(1), 2));
    let quick = file("two").timeout(Duration::from_millis(100));
    let r = Rendezvous::File(quick).exchange_roots(0, 3, 2, make(1));
    match r.map(|x| x.ids) {
        Err(nccl_launch::Error::Rendezvous(e)) => {
            assert!(matches!(*e, RendezvousError::FileTimeout { .. }), "{e}")
        }
        other => panic!("{other:?}"),
    }
    match file("two").read(3) {
        Err(RendezvousError::FileContents { detail, .. }) => {
            assert!(detail.contains("2 unique ids"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    std::fs::write(dir.join("two.root1"), [7u8; 100]).unwrap();
    let r = Rendezvous::File(file("two")).exchange_roots(1, 3, 2, make(9));
    match r.map(|x| x.ids) {
        Err(nccl_launch::Error::Rendezvous(e)) => {
            assert!(matches!(*e, RendezvousError::FileContents { .. }), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
    // A custom rendezvous moves one id.
    let custom =
        || Rendezvous::custom(|id: Option<[u8; 128]>| Ok::<_, nccl_launch::Error>(id.unwrap()));
    let r = custom().exchange_roots(0, 3, 2, make(1));
    assert!(
        matches!(
            r,
            Err(nccl_launch::Error::Core(Error::InvalidArgument { .. }))
        ),
        "{r:?}"
    );
}

/// The process launcher's number of roots: `scalable_roots(world_size)` by default (two
/// for 300 ranks; one with a custom rendezvous, which moves one id), the count asked
/// for, and `InvalidArgument` for 0 or more roots than ranks.
#[test]
fn the_process_launcher_picks_the_roots_for_the_jobs_size() {
    use nccl_launch::env::{EnvSource, ProcessEnv};
    use nccl_launch::rendezvous::{Rendezvous, TcpRendezvous};
    use nccl_launch::ProcessLauncher;
    let launcher = |world_size| {
        ProcessLauncher::new(ProcessEnv {
            source: EnvSource::Torchrun,
            rank: 0,
            world_size,
            local_rank: 0,
            local_world_size: None,
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            elastic: None,
            ends_survivors: None,
        })
    };
    let tcp = Rendezvous::Tcp(TcpRendezvous::new("127.0.0.1", 1, "x".repeat(16)));
    let custom =
        Rendezvous::custom(|id: Option<[u8; 128]>| Ok::<_, nccl_launch::Error>(id.unwrap()));
    if std::env::var_os(CHILD).is_some() {
        // In a child with NCCL_SAFE_ROOTS set.
        let v = std::env::var(nccl_launch::ROOTS_VAR).unwrap();
        match (v.as_str(), launcher(4).job_roots(&tcp)) {
            ("3", Ok(3)) => {}
            (
                "abc" | "0" | "5",
                Err(nccl_launch::Error::Core(Error::InvalidArgument { call, .. })),
            ) => {
                assert_eq!(call, "ProcessLauncher::roots")
            }
            (v, other) => panic!("{v}: {other:?}"),
        }
        assert!(launcher(4).roots(2).job_roots(&tcp).is_ok_and(|n| n == 2));
        return;
    }
    if std::env::var_os(nccl_launch::ROOTS_VAR).is_none() {
        assert_eq!(launcher(4).job_roots(&tcp).unwrap(), 1);
        assert_eq!(launcher(300).job_roots(&tcp).unwrap(), 2);
        assert_eq!(launcher(300).job_roots(&custom).unwrap(), 1);
    }
    assert_eq!(launcher(4).roots(4).job_roots(&tcp).unwrap(), 4);
    for roots in [0, 5] {
        match launcher(4).roots(roots).job_roots(&tcp) {
            Err(nccl_launch::Error::Core(Error::InvalidArgument { call, .. })) => {
                assert_eq!(call, "ProcessLauncher::roots")
            }
            other => panic!("{roots}: {other:?}"),
        }
    }
    let name = "the_process_launcher_picks_the_roots_for_the_jobs_size";
    for v in ["3", "abc", "0", "5"] {
        in_child(name, &[(nccl_launch::ROOTS_VAR, v)]);
    }
}
