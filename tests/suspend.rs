//! Suspend and resume (`ncclCommSuspend`/`ncclCommResume`, NCCL 2.30) as a type state, and
//! the memory figures of `ncclCommMemStats`, on the host provider: ranks in threads suspend,
//! see their resident memory fall, resume, see it rise, and run collectives again; a
//! suspended communicator is torn down exactly once; a peer that never suspends ends in
//! the watchdog's timeout, not a hang; each call on an NCCL before 2.30 is `Unsupported`;
//! the host provider's C ABI follows NCCL 2.30.7's contract. The properties of
//! `ncclCommQueryProperties` (NCCL 2.29+) likewise.

mod support;

use std::time::{Duration, Instant};

use nccl_safe::{
    CommDevice, Communicator, Config, Error, GinType, Library, ReduceOp, Stream,
    SuspendedCommunicator, UniqueId, Version,
};
use support::assert_balanced;

const S: Stream = Stream::Host;

fn config() -> Config {
    Config::new().timeout(Duration::from_secs(30))
}

/// Runs `f` on `n` ranks in threads, each with its own communicator of one id.
fn ranks(n: usize, config: Config, f: impl Fn(Communicator) + Sync) -> UniqueId {
    let id = CommDevice::Host.unique_id().unwrap();
    std::thread::scope(|s| {
        for rank in 0..n {
            let (id, config, f) = (&id, config.clone(), &f);
            s.spawn(move || {
                let comm =
                    Communicator::init_rank(&CommDevice::Host, n, rank, id, &config).unwrap();
                f(comm)
            });
        }
    });
    id
}

/// Three ranks: suspend, the figures say the suspendable part is released (resident falls
/// to the persistent part), resume, it is back (resident rises to the total), and an
/// all-reduce runs; twice over, then a destroy.
#[test]
fn suspend_and_resume_across_ranks_in_threads() {
    let id = ranks(3, config(), |mut comm| {
        for round in 0..2 {
            let before = comm.mem_stats().unwrap();
            assert!(!before.suspended, "round {round}: {before:?}");
            assert!(before.suspendable > 0 && before.persistent > 0);
            assert_eq!(before.total, before.persistent + before.suspendable);
            assert_eq!(before.resident(), before.total);

            let suspended = comm.suspend().map_err(|(_, e)| e).unwrap();
            let during = suspended.mem_stats().unwrap();
            assert!(during.suspended, "{during:?}");
            // NCCL's counters are what was allocated: a suspend leaves them.
            assert_eq!(
                (during.total, during.suspendable),
                (before.total, before.suspendable)
            );
            assert_eq!(during.resident(), before.persistent);
            assert!(during.resident() < before.resident());
            assert_eq!(suspended.world_size(), 3);

            comm = suspended.resume().map_err(|(_, e)| e).unwrap();
            let after = comm.mem_stats().unwrap();
            assert!(!after.suspended);
            assert_eq!(after.resident(), before.resident());

            let mut x = vec![comm.rank() as f32 + 1.0; 8];
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
            assert_eq!(x, vec![6.0; 8], "round {round}");
        }
        assert!(!comm.is_failed());
        comm.destroy().map_err(|(_, e)| e).unwrap();
    });
    assert_balanced(&id);
}

/// A suspended communicator's teardown is exactly once: dropped (a destroy), aborted, or
/// destroyed explicitly, every handle is torn down once.
#[test]
fn a_suspended_communicator_is_torn_down_once() {
    for how in 0..3 {
        // Both suspends end before either rank tears down: the host provider fails a
        // clique whose rank aborts while a peer's call still runs.
        let both = std::sync::Barrier::new(2);
        let id = ranks(2, config(), |comm| {
            let suspended: SuspendedCommunicator = comm.suspend().map_err(|(_, e)| e).unwrap();
            both.wait();
            match how {
                0 => drop(suspended),
                1 => suspended.abort().unwrap(),
                _ => suspended.destroy().map_err(|(_, e)| e).unwrap(),
            }
        });
        assert_balanced(&id);
    }
}

/// A rank whose peer never suspends does not hang: the watchdog's timeout ends the
/// suspend, the communicator comes back failed, and dropping it aborts it once.
#[test]
#[cfg(feature = "diag")]
fn a_peer_that_never_suspends_ends_in_a_timeout() {
    let started = Instant::now();
    let short = Config::new().timeout(Duration::from_millis(500));
    let id = ranks(2, short, |comm| {
        if comm.rank() == 0 {
            let (comm, e) = comm.suspend().expect_err("the peer never suspends");
            assert!(
                matches!(e, Error::Timeout { .. } | Error::RankLeft { .. }),
                "{e:?}"
            );
            assert!(comm.is_failed());
        } else {
            // Stays until rank 0's suspend timed out, then leaves.
            std::thread::sleep(Duration::from_secs(2));
        }
    });
    assert!(started.elapsed() < Duration::from_secs(60));
    assert_balanced(&id);
}

/// Before NCCL 2.30 suspend, resume's way in and the memory figures are `Unsupported`,
/// naming the entry point and 2.30, with nothing called: the communicator comes back
/// healthy and is destroyed.
#[test]
fn each_call_on_an_nccl_before_2_30_is_unsupported() {
    for minor in [18, 29] {
        let lib = Library::host_as_version(2, minor).unwrap();
        let v = lib.version();
        let id = UniqueId::new_with(&lib).unwrap();
        let comm =
            Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &config()).unwrap();
        let unsupported = |e: Error, sym: &str| match e {
            Error::Unsupported {
                symbol,
                needs,
                found,
            } if symbol == sym && needs == Version::new(2, 30, 0) && found == v => {}
            other => panic!("{sym} on 2.{minor}: expected Unsupported, got {other:?}"),
        };
        unsupported(comm.mem_stats().unwrap_err(), "ncclCommMemStats");
        let (comm, e) = comm.suspend().expect_err("2.30 is needed");
        unsupported(e, "ncclCommSuspend");
        assert!(!comm.is_failed());
        comm.destroy().map_err(|(_, e)| e).unwrap();
        assert_balanced(&id);
    }
    // 2.30 has them.
    let lib = Library::host_as_version(2, 30).unwrap();
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &config()).unwrap();
    let comm = comm
        .suspend()
        .map_err(|(_, e)| e)
        .unwrap()
        .resume()
        .map_err(|(_, e)| e)
        .unwrap();
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);
}

/// The host provider's C ABI follows NCCL 2.30.7's contract (mem_manager.cc:925-1047): on
/// a non-blocking communicator a suspend returns ncclInProgress and its state reads
/// ncclInProgress until the task ended; flags without NCCL_SUSPEND_MEM do nothing; the
/// figures (a NULL value or an unknown stat: ncclInvalidArgument) say it is suspended; a
/// collective on it is refused; a second suspend fails in its task (the communicator's
/// error, ncclInvalidUsage); a resume of one that is not suspended, likewise.
#[test]
fn the_host_abi_follows_nccl_2_30s_contract() {
    use nccl_sys::bindings::*;
    let lib = Library::host();
    let t = lib.table();
    let (suspend, resume, stats) = (
        t.ncclCommSuspend.unwrap(),
        t.ncclCommResume.unwrap(),
        t.ncclCommMemStats.unwrap(),
    );
    let state = |c: ncclComm_t| {
        let mut s = ncclSuccess;
        // SAFETY: a live handle and a writable result.
        assert_eq!(unsafe { (t.ncclCommGetAsyncError)(c, &mut s) }, ncclSuccess);
        s
    };
    let settle = |c: ncclComm_t| {
        let until = Instant::now() + Duration::from_secs(10);
        while state(c) == ncclInProgress && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        state(c)
    };
    let stat = |c: ncclComm_t, s: ncclCommMemStat_t| {
        let mut v = u64::MAX;
        // SAFETY: a live handle and a writable value.
        let r = unsafe { stats(c, s, &mut v) };
        (r, v)
    };
    let init = || {
        let id = CommDevice::Host.unique_id().unwrap();
        // SAFETY: ncclConfig_t is plain data; all-zero is a valid bit pattern.
        let mut cfg: ncclConfig_t = unsafe { std::mem::zeroed() };
        cfg.size = std::mem::size_of::<ncclConfig_t>();
        cfg.magic = NCCL_API_MAGIC;
        cfg.version = NCCL_VERSION_CODE;
        cfg.blocking = 0;
        cfg.cgaClusterSize = nccl_sys::NCCL_CONFIG_UNDEF_INT;
        let mut c: ncclComm_t = std::ptr::null_mut();
        // SAFETY: writable out-pointer, a valid id and config.
        let r = unsafe { (t.ncclCommInitRankConfig)(&mut c, 1, id.to_raw(), 0, &mut cfg) };
        assert!(r == ncclSuccess || r == ncclInProgress, "{r}");
        assert_eq!(settle(c), ncclSuccess);
        c
    };

    let c = init();
    // SAFETY (every call below): a live handle; NULL where NCCL checks for it.
    assert_eq!(unsafe { suspend(c, 0) }, ncclSuccess, "no flag: nothing");
    assert_eq!(stat(c, ncclStatGpuMemSuspended), (ncclSuccess, 0));
    assert_eq!(
        unsafe { stats(c, ncclStatGpuMemTotal, std::ptr::null_mut()) },
        ncclInvalidArgument
    );
    assert_eq!(stat(c, 4).0, ncclInvalidArgument);
    assert_eq!(
        unsafe { suspend(c, NCCL_SUSPEND_MEM as i32) },
        ncclInProgress
    );
    assert_eq!(settle(c), ncclSuccess);
    assert_eq!(stat(c, ncclStatGpuMemSuspended), (ncclSuccess, 1));
    let total = stat(c, ncclStatGpuMemTotal).1;
    assert_eq!(
        total,
        stat(c, ncclStatGpuMemPersist).1 + stat(c, ncclStatGpuMemSuspend).1
    );
    let mut x = [1.0f32; 4];
    let p = x.as_mut_ptr().cast();
    let r = unsafe { (t.ncclAllReduce)(p, p, 4, ncclFloat32, ncclSum, c, std::ptr::null_mut()) };
    assert_eq!(
        r, ncclInvalidUsage,
        "a collective on a suspended communicator"
    );
    // A second suspend: refused in its task, which leaves the communicator's error.
    assert_eq!(
        unsafe { suspend(c, NCCL_SUSPEND_MEM as i32) },
        ncclInProgress
    );
    assert_eq!(settle(c), ncclInvalidUsage);
    assert_eq!(unsafe { (t.ncclCommAbort)(c) }, ncclSuccess);

    let c = init();
    assert_eq!(unsafe { resume(c) }, ncclInProgress);
    assert_eq!(settle(c), ncclInvalidUsage, "a resume of one not suspended");
    assert_eq!(unsafe { (t.ncclCommAbort)(c) }, ncclSuccess);

    let c = init();
    assert_eq!(
        unsafe { suspend(c, NCCL_SUSPEND_MEM as i32) },
        ncclInProgress
    );
    assert_eq!(settle(c), ncclSuccess);
    assert_eq!(unsafe { resume(c) }, ncclInProgress);
    assert_eq!(settle(c), ncclSuccess);
    assert_eq!(stat(c, ncclStatGpuMemSuspended), (ncclSuccess, 0));
    assert_eq!(unsafe { (t.ncclCommDestroy)(c) }, ncclSuccess);
}

/// Each rank's properties on the host provider: its rank and size, the device API (its
/// windows), no multicast, no GPU-initiated networking, one LSA team, host RMA (the
/// one-sided calls).
#[test]
fn properties_across_ranks_in_threads() {
    let id = ranks(3, config(), |comm| {
        let p = comm.properties().unwrap();
        assert_eq!((p.rank, p.world_size), (comm.rank(), 3));
        assert!(p.device_api && !p.multimem, "{p:?}");
        assert_eq!(
            (p.gin, p.railed_gin, p.lsa_teams, p.host_rma),
            (
                Some(GinType::None),
                Some(GinType::None),
                Some(1),
                Some(true)
            )
        );
        comm.destroy().map_err(|(_, e)| e).unwrap();
    });
    assert_balanced(&id);
}

/// Before NCCL 2.29 the properties are `Unsupported`; NCCL 2.29.2 writes only the fields up
/// to the GIN type, which come back `None`.
#[test]
fn properties_follow_the_version() {
    let lib = Library::host_as_version(2, 28).unwrap();
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &config()).unwrap();
    match comm.properties() {
        Err(Error::Unsupported { symbol, needs, .. })
            if symbol == "ncclCommQueryProperties" && needs == Version::new(2, 29, 0) => {}
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert!(!comm.is_failed());
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);

    let lib = Library::host_as_version(2, 29).unwrap();
    assert_eq!(lib.version(), Version::new(2, 29, 2));
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &config()).unwrap();
    let p = comm.properties().unwrap();
    assert_eq!((p.rank, p.world_size), (0, 1));
    assert_eq!((p.gin, p.lsa_teams, p.host_rma), (None, None, None));
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);
}

/// The host provider's `ncclCommQueryProperties` follows NCCL 2.30.7 (dev_runtime.cc:
/// 1459-1498): NULL props is ncclInvalidArgument, a bad magic or a version newer than the
/// library ncclInvalidUsage, and a 2.29.3 caller's fields after `ginType` are not written.
#[test]
fn the_host_abi_of_properties_follows_nccl_2_30() {
    use nccl_sys::bindings::*;
    use nccl_sys::device::ncclCommProperties_t;
    let lib = Library::host();
    let query = lib.table().ncclCommQueryProperties.unwrap();
    let id = CommDevice::Host.unique_id().unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &config()).unwrap();
    let raw = comm.as_raw();
    // SAFETY (every call below): a live handle, and a properties struct or NULL.
    assert_eq!(
        unsafe { query(raw, std::ptr::null_mut()) },
        ncclInvalidArgument
    );
    let mut p = ncclCommProperties_t::initializer(NCCL_VERSION_CODE);
    p.magic = 0;
    assert_eq!(unsafe { query(raw, &mut p) }, ncclInvalidUsage, "magic");
    let mut p = ncclCommProperties_t::initializer(NCCL_VERSION_CODE + 1);
    assert_eq!(unsafe { query(raw, &mut p) }, ncclInvalidUsage, "too new");
    let mut p = ncclCommProperties_t::initializer(22903);
    p.nLsaTeams = -7;
    assert_eq!(unsafe { query(raw, &mut p) }, ncclSuccess);
    assert_eq!(
        (p.nRanks, p.nLsaTeams),
        (1, -7),
        "2.29.3's layout stops at ginType"
    );
    let mut p = ncclCommProperties_t::initializer(NCCL_VERSION_CODE);
    assert_eq!(unsafe { query(raw, &mut p) }, ncclSuccess);
    assert_eq!(p.nLsaTeams, 1);
    comm.destroy().map_err(|(_, e)| e).unwrap();
    // NULL props, the bad magic and the version too new count as misuse.
    let st = support::settled_stats(&id);
    let counts = (st.created, st.destroyed, st.live, st.misused);
    assert_eq!(counts, (1, 1, 0, 3), "{st:?}");
}
