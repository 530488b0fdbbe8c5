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
/// `1..=nranks` is ncclInvalidArgument, `*newcomm` untouched (NCCL reads the slot after
/// the refusal, init.cc:2717-2718, so a caller passes it NULL, as the crate does).
#[test]
fn the_c_entry_point_refuses_a_bad_id_count() {
    let lib = Library::host();
    let init = lib.table().ncclCommInitRankScalable.unwrap();
    let mut ids = [CommDevice::Host.unique_id().unwrap().to_raw(); 3];
    for (nranks, n_id) in [(2, 0), (2, 3), (1, -1)] {
        let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a writable slot, `ids` holds 3 ids; a NULL config is allowed.
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
    let start = Instant::now();
    let mut done = vec![None; 4];
    while done.iter().any(Option::is_none) {
        for (i, k) in kids.iter_mut().enumerate() {
            if done[i].is_none() {
                done[i] = k.try_wait().unwrap();
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
            for k in &mut kids {
                let _ = k.kill();
                let _ = k.wait();
            }
            panic!("a rank hung: {done:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
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
#[cfg(feature = "launch")]
fn the_launcher_runs_with_several_roots() {
    use nccl_safe::launch::Launcher;
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
            Err(Error::InvalidArgument { call, .. }) => assert_eq!(call, "Launcher::roots"),
            other => panic!("{roots} roots: {other:?}"),
        }
    }
}

/// A process launcher's rank joins with several ids it was given (`join_scalable`): three
/// ranks' launchers (in threads here, on the host provider) over two shared ids; no ids is
/// refused before NCCL.
#[test]
#[cfg(feature = "launch")]
fn a_process_rank_joins_with_several_ids() {
    use nccl_safe::launch::env::{EnvSource, ProcessEnv};
    use nccl_safe::launch::ProcessLauncher;
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
        Err(Error::InvalidArgument { .. })
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
