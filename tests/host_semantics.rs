//! Semantics of the host provider beyond arithmetic: groups, split/shrink, non-blocking
//! init, abort, misuse counting, config validation and version emulation. Every call goes
//! through `nccl_sys::FunctionTable`.
#![allow(non_upper_case_globals)]

use core::ffi::{c_int, c_void, CStr};
use std::time::{Duration, Instant};

use nccl_safe::host::{self, HostStats};
use nccl_sys::bindings::*;
use nccl_sys::FunctionTable;

fn table() -> FunctionTable {
    // SAFETY: the host provider's lookup returns functions with NCCL's signatures.
    unsafe { FunctionTable::load(host::lookup) }.expect("host provider table")
}

fn null_stream() -> cudaStream_t {
    core::ptr::null_mut()
}

fn new_id(t: &FunctionTable) -> ncclUniqueId {
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: valid out pointer.
    assert_eq!(unsafe { (t.ncclGetUniqueId)(&mut id) }, ncclSuccess);
    id
}

/// Inits `n` ranks on one id, one thread each, then runs `f(rank, comm)` on each thread.
fn with_ranks<R: Send>(
    t: &FunctionTable,
    n: usize,
    f: impl Fn(usize, ncclComm_t) -> R + Sync,
) -> (ncclUniqueId, Vec<R>) {
    let id = new_id(t);
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    let mut comm: ncclComm_t = core::ptr::null_mut();
                    // SAFETY: valid out pointer; same id for every rank.
                    assert_eq!(
                        unsafe { (t.ncclCommInitRank)(&mut comm, n as c_int, id, r as c_int) },
                        ncclSuccess
                    );
                    f(r, comm)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    });
    (id, out)
}

fn destroy(t: &FunctionTable, c: ncclComm_t) {
    // SAFETY: c is a live handle destroyed once.
    assert_eq!(unsafe { (t.ncclCommDestroy)(c) }, ncclSuccess);
}

fn last_error(t: &FunctionTable) -> String {
    // SAFETY: the provider returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr((t.ncclGetLastError)(core::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

fn stats(
    live: u64,
    created: u64,
    destroyed: u64,
    aborted: u64,
    misused: u64,
) -> (u64, u64, u64, u64, u64) {
    (live, created, destroyed, aborted, misused)
}

fn tuple(s: HostStats) -> (u64, u64, u64, u64, u64) {
    (s.live, s.created, s.destroyed, s.aborted, s.misused)
}

#[test]
fn group_defers_ops_until_group_end() {
    let t = table();
    let (id, _) = with_ranks(&t, 2, |r, comm| {
        let send = [r as f32 + 1.0; 4];
        let mut recv = [0f32; 4];
        // SAFETY: live buffers and comm.
        unsafe {
            assert_eq!((t.ncclGroupStart)(), ncclSuccess);
            let rc = (t.ncclAllReduce)(
                send.as_ptr() as _,
                recv.as_mut_ptr() as _,
                4,
                ncclFloat32,
                ncclSum,
                comm,
                null_stream(),
            );
            assert_eq!(rc, ncclSuccess);
            assert_eq!(recv, [0.0; 4], "recv written before ncclGroupEnd");
            assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
        }
        assert_eq!(recv, [3.0; 4]);
        destroy(&t, comm);
    });
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 2, 2, 0, 0));
}

#[test]
fn send_recv_ring_and_exchange_inside_a_group() {
    let t = table();
    let n = 4;
    with_ranks(&t, n, |r, comm| {
        let send: Vec<i64> = (0..5).map(|i| (r * 100 + i) as i64).collect();
        let mut from_prev = vec![-1i64; 5];
        let mut from_next = vec![-1i64; 5];
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        // SAFETY: live buffers and comm. Both directions at once: would deadlock if blocking.
        unsafe {
            assert_eq!((t.ncclGroupStart)(), ncclSuccess);
            assert_eq!(
                (t.ncclSend)(
                    send.as_ptr() as _,
                    5,
                    ncclInt64,
                    next as c_int,
                    comm,
                    null_stream()
                ),
                ncclSuccess
            );
            assert_eq!(
                (t.ncclSend)(
                    send.as_ptr() as _,
                    5,
                    ncclInt64,
                    prev as c_int,
                    comm,
                    null_stream()
                ),
                ncclSuccess
            );
            assert_eq!(
                (t.ncclRecv)(
                    from_prev.as_mut_ptr() as _,
                    5,
                    ncclInt64,
                    prev as c_int,
                    comm,
                    null_stream()
                ),
                ncclSuccess
            );
            assert_eq!(
                (t.ncclRecv)(
                    from_next.as_mut_ptr() as _,
                    5,
                    ncclInt64,
                    next as c_int,
                    comm,
                    null_stream()
                ),
                ncclSuccess
            );
            assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
        }
        let want = |p: usize| (0..5).map(|i| (p * 100 + i) as i64).collect::<Vec<_>>();
        assert_eq!(from_prev, want(prev));
        assert_eq!(from_next, want(next));
        destroy(&t, comm);
    });
}

#[test]
fn one_thread_drives_an_init_all_clique_in_one_group() {
    let t = table();
    let n = 4usize;
    let devs: [c_int; 4] = [3, 1, 2, 0];
    let mut comms = vec![core::ptr::null_mut(); n];
    // SAFETY: comms has n entries, devlist too.
    assert_eq!(
        unsafe { (t.ncclCommInitAll)(comms.as_mut_ptr(), n as c_int, devs.as_ptr()) },
        ncclSuccess
    );
    let id = host::root_id_of(comms[0]).expect("root id");
    let sends: Vec<Vec<i32>> = (0..n).map(|r| vec![r as i32 + 1; 3]).collect();
    let mut recvs = vec![vec![0i32; 3]; n];
    // SAFETY: live buffers and comms.
    unsafe {
        assert_eq!((t.ncclGroupStart)(), ncclSuccess);
        for r in 0..n {
            let rc = (t.ncclAllReduce)(
                sends[r].as_ptr() as _,
                recvs[r].as_mut_ptr() as _,
                3,
                ncclInt32,
                ncclSum,
                comms[r],
                null_stream(),
            );
            assert_eq!(rc, ncclSuccess);
        }
        assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
        for (r, &c) in comms.iter().enumerate() {
            let (mut dev, mut rank, mut count) = (-9, -9, -9);
            assert_eq!((t.ncclCommCuDevice)(c, &mut dev), ncclSuccess);
            assert_eq!((t.ncclCommUserRank)(c, &mut rank), ncclSuccess);
            assert_eq!((t.ncclCommCount)(c, &mut count), ncclSuccess);
            assert_eq!((dev, rank, count), (devs[r], r as c_int, n as c_int));
        }
    }
    assert!(recvs.iter().all(|v| v == &vec![10; 3]), "{recvs:?}");
    for c in comms {
        destroy(&t, c);
    }
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 4, 4, 0, 0));
}

/// Splits a world of `n` with per-rank (color, key); returns (child rank, child size) or None.
fn split_pattern(
    n: usize,
    color: impl Fn(usize) -> c_int + Sync,
    key: impl Fn(usize) -> c_int + Sync,
) -> Vec<Option<(c_int, c_int, i32)>> {
    let t = table();
    let (id, out) = with_ranks(&t, n, |r, comm| {
        let mut child: ncclComm_t = 0x1 as ncclComm_t;
        // SAFETY: live comm, valid out pointer, NULL config.
        let rc =
            unsafe { (t.ncclCommSplit)(comm, color(r), key(r), &mut child, core::ptr::null_mut()) };
        assert_eq!(rc, ncclSuccess);
        let res = if child.is_null() {
            None
        } else {
            let (mut cr, mut cn) = (0, 0);
            let mut sum = 0i32;
            // SAFETY: live child comm and buffers.
            unsafe {
                assert_eq!((t.ncclCommUserRank)(child, &mut cr), ncclSuccess);
                assert_eq!((t.ncclCommCount)(child, &mut cn), ncclSuccess);
                let one = r as i32;
                let rc = (t.ncclAllReduce)(
                    &one as *const i32 as _,
                    &mut sum as *mut i32 as _,
                    1,
                    ncclInt32,
                    ncclSum,
                    child,
                    null_stream(),
                );
                assert_eq!(rc, ncclSuccess);
            }
            destroy(&t, child);
            Some((cr, cn, sum))
        };
        destroy(&t, comm);
        res
    });
    let st = host::stats_for(&id);
    let children = out.iter().filter(|x| x.is_some()).count() as u64;
    assert_eq!(
        tuple(st),
        stats(0, n as u64 + children, n as u64 + children, 0, 0)
    );
    out
}

#[test]
fn split_colors_keys_and_nocolor() {
    // Two colors by parity, keys in order: child rank = r / 2; sums of parent ranks.
    let out = split_pattern(6, |r| (r % 2) as c_int, |r| r as c_int);
    let want: Vec<_> = (0..6)
        .map(|r| Some(((r / 2) as c_int, 3, if r % 2 == 0 { 6 } else { 9 })))
        .collect();
    assert_eq!(out, want);
    // Reversed keys: child rank = n-1-r.
    let out = split_pattern(4, |_| 7, |r| -(r as c_int));
    assert_eq!(
        out,
        (0..4)
            .map(|r| Some((3 - r as c_int, 4, 6)))
            .collect::<Vec<_>>()
    );
    // Equal keys: ties broken by parent rank.
    let out = split_pattern(3, |_| 0, |_| 5);
    assert_eq!(
        out,
        (0..3).map(|r| Some((r as c_int, 3, 3))).collect::<Vec<_>>()
    );
    // NOCOLOR for odd ranks: they get NULL.
    let out = split_pattern(
        4,
        |r| if r % 2 == 1 { NCCL_SPLIT_NOCOLOR } else { 1 },
        |r| r as c_int,
    );
    assert_eq!(out, vec![Some((0, 2, 2)), None, Some((1, 2, 2)), None]);
}

#[test]
fn shrink_excludes_ranks_and_hides_nothing_else() {
    let t = table();
    let n = 4;
    let (id, out) = with_ranks(&t, n, |r, comm| {
        let shrink = t.ncclCommShrink.expect("shrink");
        let res = if r == 1 {
            None // the excluded rank does not call shrink
        } else {
            let mut excl = [1 as c_int];
            let mut child: ncclComm_t = core::ptr::null_mut();
            // SAFETY: live comm, valid list and out pointer.
            let rc = unsafe {
                shrink(
                    comm,
                    excl.as_mut_ptr(),
                    1,
                    &mut child,
                    core::ptr::null_mut(),
                    NCCL_SHRINK_DEFAULT as c_int,
                )
            };
            assert_eq!(rc, ncclSuccess);
            let (mut cr, mut cn) = (0, 0);
            // SAFETY: live child.
            unsafe {
                (t.ncclCommUserRank)(child, &mut cr);
                (t.ncclCommCount)(child, &mut cn);
            }
            destroy(&t, child);
            Some((cr, cn))
        };
        destroy(&t, comm);
        res
    });
    assert_eq!(out, vec![Some((0, 3)), None, Some((1, 3)), Some((2, 3))]);
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 7, 7, 0, 0));
}

/// A split and a shrink inside a group, as NCCL has them (group.cc:37-66, init.cc:2571-2572
/// of 2.28.9): each call writes NULL, returns ncclSuccess and leaves the parent's state
/// alone; the jobs run at the outermost ncclGroupEnd, which (the parents being blocking)
/// returns with the children written.
#[test]
fn splits_and_shrinks_inside_a_group_run_at_its_end() {
    let t = table();
    let shrink = t.ncclCommShrink.expect("shrink");
    let (id, out) = with_ranks(&t, 3, |r, comm| {
        let (null, no_config) = (core::ptr::null_mut(), core::ptr::null_mut());
        let sentinel = 0x1 as ncclComm_t;
        let (mut split, mut small) = (sentinel, sentinel);
        let mut excl = [2 as c_int];
        let mut state = ncclInProgress;
        // SAFETY: a live comm, an exclude list and out-pointers that outlive the group's end.
        unsafe {
            assert_eq!((t.ncclGroupStart)(), ncclSuccess);
            let rc = (t.ncclCommSplit)(comm, 0, r as c_int, &mut split, no_config);
            assert_eq!(
                (rc, split),
                (ncclSuccess, null),
                "the split's child is NULL for now"
            );
            if r != 2 {
                let flags = NCCL_SHRINK_DEFAULT as c_int;
                let rc = shrink(comm, excl.as_mut_ptr(), 1, &mut small, no_config, flags);
                assert_eq!((rc, small), (ncclSuccess, null), "so is the shrink's");
            }
            assert_eq!((t.ncclCommGetAsyncError)(comm, &mut state), ncclSuccess);
            assert_eq!(state, ncclSuccess, "nothing runs before the group's end");
            assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
        }
        let shape = |c: ncclComm_t| {
            let (mut rank, mut n) = (-1, -1);
            // SAFETY: a live child and writable ints.
            unsafe {
                assert_eq!((t.ncclCommUserRank)(c, &mut rank), ncclSuccess);
                assert_eq!((t.ncclCommCount)(c, &mut n), ncclSuccess);
            }
            destroy(&t, c);
            (rank, n)
        };
        let got = (shape(split), (r != 2).then(|| shape(small)));
        destroy(&t, comm);
        got
    });
    let want = vec![
        ((0, 3), Some((0, 2))),
        ((1, 3), Some((1, 2))),
        ((2, 3), None),
    ];
    assert_eq!(out, want);
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 8, 8, 0, 0));
}

fn config(blocking: c_int) -> ncclConfig_t {
    // SAFETY: ncclConfig_t is plain data; all-zero is a valid bit pattern.
    let mut c: ncclConfig_t = unsafe { core::mem::zeroed() };
    c.size = core::mem::size_of::<ncclConfig_t>();
    c.magic = NCCL_API_MAGIC;
    c.version = NCCL_VERSION_CODE;
    c.blocking = blocking;
    c.cgaClusterSize = nccl_sys::NCCL_CONFIG_UNDEF_INT;
    c
}

/// The calls NCCL starts with `ncclCommEnsureReady` (init.cc:373-389 of 2.28.9: Count,
/// CuDevice, UserRank, Finalize, Split, ncclRedOpCreatePreMulSum, and
/// ncclCommWindowRegister, dev_runtime.cc:904) read the state
/// ncclCommGetAsyncError reads: on a communicator still initializing they are refused
/// with ncclInvalidArgument, and after a peer's abort with that abort's ncclRemoteError.
/// A finalize of NULL is ncclSuccess (init.cc:2271), a second one ncclInvalidArgument.
#[test]
fn calls_that_ensure_ready_read_the_asynchronous_state() {
    let t = table();
    let refusals = |c: ncclComm_t| {
        let (mut n, mut op) = (0, ncclSum);
        let mut scalar = 1.0f32;
        let mut child: ncclComm_t = core::ptr::null_mut();
        let register = t.ncclCommWindowRegister.expect("window API");
        let (mut buf, mut win) = ([0u8; 64], core::ptr::null_mut());
        // SAFETY: a live handle and writable outputs; the scalar and the buffer outlive the
        // calls (a window registered by mistake is released by the teardown).
        unsafe {
            [
                (t.ncclCommCount)(c, &mut n),
                (t.ncclCommCuDevice)(c, &mut n),
                (t.ncclCommUserRank)(c, &mut n),
                (t.ncclCommSplit)(c, 0, 0, &mut child, core::ptr::null_mut()),
                (t.ncclRedOpCreatePreMulSum)(
                    &mut op,
                    (&mut scalar as *mut f32).cast(),
                    ncclFloat32,
                    ncclScalarHostImmediate,
                    c,
                ),
                (t.ncclCommFinalize)(c),
                register(c, buf.as_mut_ptr().cast(), 64, &mut win, 0),
            ]
        }
    };
    // Still initializing (its peer never comes).
    let id = new_id(&t);
    let mut cfg = config(0);
    let mut pending: ncclComm_t = core::ptr::null_mut();
    // SAFETY: valid pointers.
    let rc = unsafe { (t.ncclCommInitRankConfig)(&mut pending, 2, id, 0, &mut cfg) };
    assert_eq!(rc, ncclInProgress);
    assert_eq!(refusals(pending), [ncclInvalidArgument; 7]);
    // SAFETY: the handle, torn down once.
    assert_eq!(unsafe { (t.ncclCommAbort)(pending) }, ncclSuccess);
    // After a peer's abort.
    let ready = std::sync::Barrier::new(2);
    let (id, out) = with_ranks(&t, 2, |r, comm| {
        ready.wait(); // both initialized
        if r == 1 {
            // SAFETY: the handle, torn down once.
            assert_eq!(unsafe { (t.ncclCommAbort)(comm) }, ncclSuccess);
            ready.wait();
            return None;
        }
        ready.wait(); // the peer aborted
        let mut st = ncclSuccess;
        // SAFETY: a live handle, a writable result.
        assert_eq!(
            unsafe { (t.ncclCommGetAsyncError)(comm, &mut st) },
            ncclSuccess
        );
        let got = (st, refusals(comm));
        // SAFETY: the handle, torn down once.
        assert_eq!(unsafe { (t.ncclCommAbort)(comm) }, ncclSuccess);
        Some(got)
    });
    assert_eq!(out[0], Some((ncclRemoteError, [ncclRemoteError; 7])));
    assert_eq!(tuple(host::stats_for(&id)).1, 2);
    // SAFETY: NULL is a no-op for NCCL.
    assert_eq!(
        unsafe { (t.ncclCommFinalize)(core::ptr::null_mut()) },
        ncclSuccess
    );
}

/// A non-blocking init inside a group returns ncclSuccess (the state it reads is set only
/// by the group's end, init.cc:2163-2166 of 2.28.9), and the group's end does not wait for
/// it (a non-blocking group returns at once, group.cc:706-738): so one thread may init rank
/// 0 in a group and rank 1 after it, and both then complete.
#[test]
fn a_non_blocking_init_in_a_group_does_not_hold_the_groups_end() {
    let t = table();
    let id = new_id(&t);
    let init = |rank: c_int, comm: &mut ncclComm_t| {
        let mut cfg = config(0);
        // SAFETY: valid pointers.
        unsafe { (t.ncclCommInitRankConfig)(comm, 2, id, rank, &mut cfg) }
    };
    let (mut c0, mut c1): (ncclComm_t, ncclComm_t) = (core::ptr::null_mut(), core::ptr::null_mut());
    // SAFETY: balanced group calls on this thread.
    unsafe { assert_eq!((t.ncclGroupStart)(), ncclSuccess) };
    assert_eq!(init(0, &mut c0), ncclSuccess, "in a group");
    assert!(!c0.is_null(), "the handle is written during the call");
    // SAFETY: as above. NCCL returns ncclInProgress here, the host provider ncclSuccess.
    let end = unsafe { (t.ncclGroupEnd)() };
    assert!(end == ncclSuccess || end == ncclInProgress, "{end}");
    assert_eq!(init(1, &mut c1), ncclInProgress, "outside a group");
    let deadline = Instant::now() + Duration::from_secs(10);
    for c in [c0, c1] {
        let mut st = ncclInProgress;
        while st == ncclInProgress && Instant::now() < deadline {
            // SAFETY: a live handle, a writable result.
            assert_eq!(
                unsafe { (t.ncclCommGetAsyncError)(c, &mut st) },
                ncclSuccess
            );
        }
        assert_eq!(st, ncclSuccess);
    }
    destroy(&t, c0);
    destroy(&t, c1);
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 2, 2, 0, 0));
}

#[test]
fn non_blocking_init_polls_in_progress_then_success() {
    let t = table();
    let id = new_id(&t);
    let mut cfg = config(0);
    let mut c0: ncclComm_t = core::ptr::null_mut();
    // SAFETY: valid pointers.
    let rc = unsafe { (t.ncclCommInitRankConfig)(&mut c0, 2, id, 0, &mut cfg) };
    assert_eq!(rc, ncclInProgress);
    assert!(!c0.is_null());
    let mut st = ncclSuccess;
    // SAFETY: c0 is a live (initializing) handle.
    assert_eq!(
        unsafe { (t.ncclCommGetAsyncError)(c0, &mut st) },
        ncclSuccess
    );
    assert_eq!(st, ncclInProgress);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut c1: ncclComm_t = core::ptr::null_mut();
            let mut cfg = config(0);
            // SAFETY: valid pointers.
            assert_eq!(
                unsafe { (t.ncclCommInitRankConfig)(&mut c1, 2, id, 1, &mut cfg) },
                ncclInProgress
            );
            loop {
                let mut st = ncclInProgress;
                // SAFETY: live handle.
                assert_eq!(
                    unsafe { (t.ncclCommGetAsyncError)(c1, &mut st) },
                    ncclSuccess
                );
                if st != ncclInProgress {
                    assert_eq!(st, ncclSuccess);
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            destroy(&t, c1);
        });
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // SAFETY: live handle.
        assert_eq!(
            unsafe { (t.ncclCommGetAsyncError)(c0, &mut st) },
            ncclSuccess
        );
        if st != ncclInProgress || Instant::now() > deadline {
            break;
        }
    }
    assert_eq!(st, ncclSuccess);
    destroy(&t, c0);
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 2, 2, 0, 0));
}

#[test]
fn ranks_disagreeing_on_nranks_get_invalid_argument() {
    let t = table();
    let id = new_id(&t);
    let rcs: Vec<(ncclResult_t, bool)> = std::thread::scope(|s| {
        let hs: Vec<_> = [(0, 2), (1, 3)]
            .into_iter()
            .map(|(r, n)| {
                let t = &t;
                s.spawn(move || {
                    let mut c: ncclComm_t = 0x1 as ncclComm_t;
                    // SAFETY: valid out pointer.
                    let rc = unsafe { (t.ncclCommInitRank)(&mut c, n, id, r) };
                    (rc, c.is_null())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        rcs,
        vec![(ncclInvalidArgument, true), (ncclInvalidArgument, true)]
    );
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 0, 0, 0, 0));
}

#[test]
fn abort_wakes_a_rank_blocked_in_all_reduce() {
    let t = table();
    let id = new_id(&t);
    let mut comms = [core::ptr::null_mut::<ncclComm>(); 2];
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let t = &t;
                s.spawn(move || {
                    let mut c: ncclComm_t = core::ptr::null_mut();
                    // SAFETY: valid out pointer.
                    assert_eq!(
                        unsafe { (t.ncclCommInitRank)(&mut c, 2, id, r) },
                        ncclSuccess
                    );
                    c as usize
                })
            })
            .collect();
        for (i, h) in hs.into_iter().enumerate() {
            comms[i] = h.join().unwrap() as ncclComm_t;
        }
    });
    let c0 = comms[0] as usize;
    let c1 = comms[1] as usize;
    let (rc, waited) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let send = [1f32; 8];
            let mut recv = [0f32; 8];
            let start = Instant::now();
            // SAFETY: live buffers; rank 1 never joins, so this blocks until the abort.
            let rc = unsafe {
                (t.ncclAllReduce)(
                    send.as_ptr() as _,
                    recv.as_mut_ptr() as _,
                    8,
                    ncclFloat32,
                    ncclSum,
                    c0 as ncclComm_t,
                    null_stream(),
                )
            };
            assert_eq!(
                recv, [0f32; 8],
                "buffers must not be written after an abort"
            );
            (rc, start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: c1 is live; aborting it from another thread is allowed.
        assert_eq!(unsafe { (t.ncclCommAbort)(c1 as ncclComm_t) }, ncclSuccess);
        h.join().unwrap()
    });
    assert_eq!(rc, ncclRemoteError);
    assert!(waited < Duration::from_secs(2), "woke after {waited:?}");
    let mut st = ncclSuccess;
    // SAFETY: c0 is still a live handle (in error).
    assert_eq!(
        unsafe { (t.ncclCommGetAsyncError)(c0 as ncclComm_t, &mut st) },
        ncclSuccess
    );
    assert_eq!(st, ncclRemoteError);
    // As NCCL (init.cc:2372-2381): a communicator in error is not destroyed, and the
    // refused destroy leaves this thread one group level deep; close it, then abort.
    // SAFETY: c0 is a live handle; refused, it stays live.
    assert_eq!(
        unsafe { (t.ncclCommDestroy)(c0 as ncclComm_t) },
        ncclRemoteError
    );
    // SAFETY: no buffer involved.
    assert_eq!(unsafe { (t.ncclGroupEnd)() }, ncclSuccess);
    // SAFETY: c0 is live; its one teardown.
    assert_eq!(unsafe { (t.ncclCommAbort)(c0 as ncclComm_t) }, ncclSuccess);
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 2, 0, 2, 0));
}

#[test]
fn misuse_is_detected_counted_and_never_crashes() {
    let t = table();
    let (id, comms) = with_ranks(&t, 2, |_, c| c as usize);
    let (c0, c1) = (comms[0] as ncclComm_t, comms[1] as ncclComm_t);
    let buf = [0f32; 4];
    let mut out = [0f32; 4];
    // SAFETY: every call below passes deliberately bad handles/arguments; the provider must
    // detect them without dereferencing anything invalid.
    unsafe {
        // NULL buffers, out-of-range root/peer, unknown dtype/op, NULL out pointers.
        assert_eq!(
            (t.ncclAllReduce)(
                core::ptr::null(),
                out.as_mut_ptr() as _,
                4,
                ncclFloat32,
                ncclSum,
                c0,
                null_stream()
            ),
            ncclInvalidArgument
        );
        assert!(
            last_error(&t).contains("sendbuff is NULL"),
            "{}",
            last_error(&t)
        );
        assert_eq!(
            (t.ncclBroadcast)(
                buf.as_ptr() as _,
                out.as_mut_ptr() as _,
                4,
                ncclFloat32,
                2,
                c0,
                null_stream()
            ),
            ncclInvalidArgument
        );
        assert!(last_error(&t).contains("root 2"), "{}", last_error(&t));
        assert_eq!(
            (t.ncclSend)(buf.as_ptr() as _, 4, ncclFloat32, -1, c0, null_stream()),
            ncclInvalidArgument
        );
        assert_eq!(
            (t.ncclAllReduce)(
                buf.as_ptr() as _,
                out.as_mut_ptr() as _,
                4,
                99,
                ncclSum,
                c0,
                null_stream()
            ),
            ncclInvalidArgument
        );
        assert_eq!(
            (t.ncclAllReduce)(
                buf.as_ptr() as _,
                out.as_mut_ptr() as _,
                4,
                ncclFloat32,
                42,
                c0,
                null_stream()
            ),
            ncclInvalidArgument
        );
        assert_eq!(
            (t.ncclAllGather)(
                buf.as_ptr() as _,
                out.as_mut_ptr() as _,
                usize::MAX / 2,
                ncclFloat32,
                c0,
                null_stream()
            ),
            ncclInvalidArgument
        );
        assert_eq!(
            (t.ncclCommCount)(c0, core::ptr::null_mut()),
            ncclInvalidArgument
        );
        // Bogus handle (never issued): counted only process-wide.
        let bogus = 0xdead_beef_usize as ncclComm_t;
        assert_eq!((t.ncclCommDestroy)(bogus), ncclInvalidArgument);
        assert!(
            last_error(&t).contains("not a communicator"),
            "{}",
            last_error(&t)
        );
        // Teardown, then double destroy / abort and use after destroy.
        assert_eq!((t.ncclCommDestroy)(c0), ncclSuccess);
        assert_eq!((t.ncclCommDestroy)(c0), ncclInvalidUsage);
        assert!(
            last_error(&t).contains("already destroyed"),
            "{}",
            last_error(&t)
        );
        assert_eq!((t.ncclCommAbort)(c0), ncclInvalidUsage);
        let mut n = 0;
        assert_eq!((t.ncclCommCount)(c0, &mut n), ncclInvalidUsage);
        assert_eq!(
            (t.ncclAllReduce)(
                buf.as_ptr() as _,
                out.as_mut_ptr() as _,
                4,
                ncclFloat32,
                ncclSum,
                c0,
                null_stream()
            ),
            ncclInvalidUsage
        );
        assert_eq!((t.ncclCommFinalize)(c1), ncclSuccess);
        assert_eq!((t.ncclCommFinalize)(c1), ncclInvalidArgument);
        assert_eq!((t.ncclCommDestroy)(c1), ncclSuccess);
        assert_eq!((t.ncclCommDestroy)(core::ptr::null_mut()), ncclSuccess);
        assert_eq!((t.ncclGroupEnd)(), ncclInvalidUsage);
    }
    let st = host::stats_for(&id);
    assert_eq!(
        (st.created, st.destroyed, st.aborted, st.finalized, st.live),
        (2, 2, 0, 1, 0)
    );
    assert_eq!(st.misused, 12, "{:?}", host::recent_misuse());
    assert!(host::stats().misused >= 14);
}

#[test]
fn config_is_validated_per_layout() {
    let t = table();
    let init = |cfg: &mut ncclConfig_t| {
        let id = new_id(&t);
        let mut c: ncclComm_t = core::ptr::null_mut();
        // SAFETY: valid pointers; a one-rank init completes at once.
        let rc = unsafe { (t.ncclCommInitRankConfig)(&mut c, 1, id, 0, cfg) };
        if !c.is_null() {
            destroy(&t, c);
        }
        (rc, host::stats_for(&id))
    };
    let mut bad = config(1);
    bad.magic = 0x1234;
    let (rc, st) = init(&mut bad);
    assert_eq!((rc, st.misused, st.created), (ncclInvalidArgument, 1, 0));
    assert!(last_error(&t).contains("magic"), "{}", last_error(&t));
    let mut small = config(1);
    small.size = 40;
    assert_eq!(init(&mut small).0, ncclInvalidArgument);
    assert!(last_error(&t).contains("size 40"));
    let mut big = config(1);
    big.size = core::mem::size_of::<ncclConfig_t>() + 8;
    assert_eq!(init(&mut big).0, ncclInvalidArgument);
    let mut weird = config(7);
    assert_eq!(init(&mut weird).0, ncclInvalidArgument);
    // Each release's layout: (size, version code).
    for (size, version) in [
        (48, 21803),
        (48, 22605),
        (72, 22703),
        (80, 22803),
        (88, 22902),
        (96, 23003),
        (112, 23102),
        (120, 23203),
    ] {
        let mut c = config(1);
        c.size = size;
        c.version = version;
        let (rc, st) = init(&mut c);
        assert_eq!(
            (rc, st.created, st.destroyed, st.misused),
            (ncclSuccess, 1, 1, 0),
            "layout {size}/{version}"
        );
    }
}

#[test]
fn version_emulation_hides_newer_symbols() {
    // SAFETY: the emulated lookup only returns host functions with NCCL's signatures.
    let old = unsafe { FunctionTable::load(host::lookup_as_version(2, 18)) }.unwrap();
    assert!(
        old.ncclAlltoAll.is_none() && old.ncclCommShrink.is_none() && old.ncclMemAlloc.is_none()
    );
    let mut v = 0;
    // SAFETY: valid out pointer.
    assert_eq!(unsafe { (old.ncclGetVersion)(&mut v) }, ncclSuccess);
    assert_eq!(v, 21803);
    // SAFETY: as above.
    let mid = unsafe { FunctionTable::load(host::lookup_as_version(2, 27)) }.unwrap();
    assert!(
        mid.ncclCommShrink.is_some() && mid.ncclMemAlloc.is_some() && mid.ncclAlltoAll.is_none()
    );
    let t = table();
    // SAFETY: valid out pointer.
    assert_eq!(unsafe { (t.ncclGetVersion)(&mut v) }, ncclSuccess);
    assert_eq!(v, 23203);
    assert!(t.ncclAlltoAll.is_some() && t.ncclGather.is_some() && t.ncclCommRegister.is_some());
    assert!(!host::lookup(c"ncclCommWindowRegister").is_null());
    assert!(!host::lookup(c"ncclCommRevoke").is_null() && !host::lookup(c"ncclCommGrow").is_null());
    assert!(
        !host::lookup(c"ncclCommSuspend").is_null() && !host::lookup(c"ncclPutSignal").is_null()
    );
    // SAFETY: as above.
    let v229 = unsafe { FunctionTable::load(host::lookup_as_version(2, 29)) }.unwrap();
    assert!(
        v229.ncclCommSuspend.is_none()
            && v229.ncclCommResume.is_none()
            && v229.ncclCommMemStats.is_none()
            && v229.ncclCommQueryProperties.is_some()
            && v229.ncclPutSignal.is_some()
            && v229.ncclWaitSignal.is_some()
    );
    // SAFETY: as above.
    let v228 = unsafe { FunctionTable::load(host::lookup_as_version(2, 28)) }.unwrap();
    assert!(
        v228.ncclCommRevoke.is_none()
            && v228.ncclCommGrow.is_none()
            && v228.ncclCommGetUniqueId.is_none()
            && v228.ncclCommQueryProperties.is_none()
            && v228.ncclPutSignal.is_none()
            && v228.ncclSignal.is_none()
    );
    // SAFETY: as above.
    let pre = unsafe { FunctionTable::load(host::lookup_as_version(2, 26)) }.unwrap();
    assert!(pre.ncclCommWindowRegister.is_none() && pre.ncclCommRegister.is_some());
    assert!(mid.ncclCommWindowRegister.is_some() && mid.ncclCommWindowDeregister.is_some());
    // SAFETY: unsupported version: every lookup is null, so loading fails.
    assert!(unsafe { FunctionTable::load(host::lookup_as_version(3, 0)) }.is_err());
}

#[test]
fn error_strings_unique_ids_and_mem_alloc() {
    let t = table();
    // SAFETY: the provider returns static NUL-terminated strings.
    let s = |r| {
        unsafe { CStr::from_ptr((t.ncclGetErrorString)(r)) }
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(s(ncclSuccess), "no error");
    assert_eq!(
        s(ncclUnhandledCudaError),
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
    );
    assert_eq!(
        s(ncclRemoteError),
        "remote process exited or there was a network error"
    );
    assert_eq!(s(ncclInProgress), "NCCL operation in progress");
    assert_eq!(s(ncclTimeout), "NCCL timeout");
    assert_eq!(s(77), "unknown result code");
    let (a, b) = (new_id(&t), new_id(&t));
    assert_eq!(&a.internal[..14], &b.internal[..14]);
    assert_eq!(
        a.internal[..14]
            .iter()
            .map(|&c| c as u8)
            .collect::<Vec<_>>(),
        b"nccl-safe-host"
    );
    assert_ne!(a.internal, b.internal);
    let alloc = t.ncclMemAlloc.unwrap();
    let free = t.ncclMemFree.unwrap();
    let mut p: *mut c_void = core::ptr::null_mut();
    // SAFETY: valid out pointer; p is freed once; the second free is detected.
    unsafe {
        assert_eq!(alloc(&mut p, 100), ncclSuccess);
        assert!(!p.is_null());
        (p as *mut u8).write_bytes(7, 100);
        assert_eq!(free(p), ncclSuccess);
        assert_eq!(free(p), ncclInvalidArgument);
    }
}

#[test]
fn grouped_init_of_all_ranks_from_one_thread() {
    let t = table();
    let id = new_id(&t);
    let mut comms = [core::ptr::null_mut::<ncclComm>(); 3];
    // SAFETY: valid out pointers; the inits complete at group end.
    unsafe {
        assert_eq!((t.ncclGroupStart)(), ncclSuccess);
        for (r, c) in comms.iter_mut().enumerate() {
            assert_eq!((t.ncclCommInitRank)(c, 3, id, r as c_int), ncclSuccess);
        }
        assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
    }
    for (r, &c) in comms.iter().enumerate() {
        let mut rank = -1;
        // SAFETY: live comm.
        assert_eq!(unsafe { (t.ncclCommUserRank)(c, &mut rank) }, ncclSuccess);
        assert_eq!(rank, r as c_int);
        destroy(&t, c);
    }
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 3, 3, 0, 0));
}

/// Inits `n` non-blocking ranks on one id, one thread each, waits each out of
/// ncclInProgress, then runs `f(rank, comm)` on each thread.
fn with_non_blocking_ranks<R: Send>(
    t: &FunctionTable,
    n: usize,
    f: impl Fn(usize, ncclComm_t) -> R + Sync,
) -> (ncclUniqueId, Vec<R>) {
    let id = new_id(t);
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    let mut comm: ncclComm_t = core::ptr::null_mut();
                    let mut cfg = config(0);
                    // SAFETY: valid pointers; same id for every rank.
                    let rc = unsafe {
                        (t.ncclCommInitRankConfig)(&mut comm, n as c_int, id, r as c_int, &mut cfg)
                    };
                    assert_eq!(rc, ncclInProgress);
                    assert_eq!(wait_out_of_progress(t, comm), ncclSuccess);
                    f(r, comm)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    });
    (id, out)
}

/// Polls `comm`'s asynchronous state until it is not ncclInProgress (10 s at most).
fn wait_out_of_progress(t: &FunctionTable, comm: ncclComm_t) -> ncclResult_t {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut st = ncclSuccess;
        // SAFETY: a live handle; a valid out pointer.
        assert_eq!(
            unsafe { (t.ncclCommGetAsyncError)(comm, &mut st) },
            ncclSuccess
        );
        if st != ncclInProgress || Instant::now() > deadline {
            return st;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// NCCL 2.28.9 on a non-blocking parent (init.cc:2550-2680, group.cc:706-738): split and
/// shrink return ncclSuccess with the out-pointer still NULL, the parent reads ncclInProgress
/// and refuses every other call with ncclInvalidArgument, and the job stores the child (NULL
/// for NOCOLOR) from its own thread, only then ending the parent's progress.
#[test]
fn a_non_blocking_split_returns_success_and_stores_its_child_later() {
    let t = table();
    let checked = std::sync::Barrier::new(3);
    let (id, out) = with_non_blocking_ranks(&t, 3, |r, comm| {
        // The jobs end only once every rank has looked (a slow GPU, without a race).
        let root = host::root_id_of(comm).expect("a live host communicator");
        host::fault::inject(&root, host::fault::Fault::HeldJobs);
        // A heap out-pointer the job may write after this function looked at it.
        let dest = Box::new(core::sync::atomic::AtomicPtr::<ncclComm>::new(
            0x1 as ncclComm_t,
        ));
        let color = if r == 1 { NCCL_SPLIT_NOCOLOR } else { 5 };
        // SAFETY: live parent; `dest` outlives the job (it is read after the wait).
        let rc = unsafe { (t.ncclCommSplit)(comm, color, 0, dest.as_ptr(), core::ptr::null_mut()) };
        assert_eq!(
            rc, ncclSuccess,
            "NCCL's split returns ncclSuccess, not ncclInProgress"
        );
        assert!(
            dest.load(core::sync::atomic::Ordering::Acquire).is_null(),
            "rank {r}: the child must not be there before the job ends"
        );
        let mut st = ncclSuccess;
        // SAFETY: live parent.
        unsafe { (t.ncclCommGetAsyncError)(comm, &mut st) };
        assert_eq!(st, ncclInProgress, "rank {r}: the parent is in progress");
        let mut n = 0;
        // SAFETY: live parent; the call is refused before it writes `n`.
        let rc = unsafe { (t.ncclCommCount)(comm, &mut n) };
        assert_eq!(rc, ncclInvalidArgument, "rank {r}: {}", last_error(&t));
        assert!(last_error(&t).contains("before the previous operation returned ncclSuccess"));
        checked.wait();
        host::fault::release_jobs(&root);
        assert_eq!(wait_out_of_progress(&t, comm), ncclSuccess);
        let child = dest.load(core::sync::atomic::Ordering::Acquire);
        let size = (!child.is_null()).then(|| {
            let mut n = 0;
            // SAFETY: the child the job stored.
            assert_eq!(unsafe { (t.ncclCommCount)(child, &mut n) }, ncclSuccess);
            destroy(&t, child);
            n
        });
        destroy(&t, comm);
        size
    });
    assert_eq!(out, vec![Some(2), None, Some(2)]);
    let st = host::stats_for(&id);
    // Only the Count refused while in progress counts as misuse.
    assert_eq!(tuple(st), stats(0, 5, 5, 0, 3));
}

/// NCCL's window registration on a non-blocking communicator returns ncclSuccess and its
/// group's thread writes the window later (dev_runtime.cc:891-922); a destroy while it is in
/// flight is refused with ncclInvalidArgument and leaves the calling thread one group level
/// deep (init.cc:2372-2381), so a teardown on that thread afterwards is queued until the
/// level is closed.
/// NCCL discards an empty collective after its argument checks (taskAppend,
/// enqueue.cc:2554-2555 of 2.28.9): it takes no sequence number and waits for no peer, so
/// rank 0's empty all-reduce does not pair with rank 1's next one; its arguments are still
/// checked (a root out of range is refused).
#[test]
fn an_empty_collective_is_discarded() {
    let t = table();
    let all_reduce = |comm: ncclComm_t, n: usize, r: usize| {
        let (send, mut recv) = ([1.0f32 + r as f32; 4], [0.0f32; 4]);
        // SAFETY: a live comm and buffers of 4 elements (n <= 4).
        let rc = unsafe {
            (t.ncclAllReduce)(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                n,
                ncclFloat32,
                ncclSum,
                comm,
                null_stream(),
            )
        };
        (rc, recv)
    };
    let (id, out) = with_ranks(&t, 2, |r, comm| {
        if r == 0 {
            assert_eq!(all_reduce(comm, 0, r).0, ncclSuccess);
            let mut buf = [0.0f32; 1];
            // SAFETY: a live comm; count 0.
            let rc = unsafe {
                (t.ncclBroadcast)(
                    buf.as_ptr().cast(),
                    buf.as_mut_ptr().cast(),
                    0,
                    ncclFloat32,
                    7,
                    comm,
                    null_stream(),
                )
            };
            assert_eq!(rc, ncclInvalidArgument, "root 7 of 2, even when empty");
        }
        let got = all_reduce(comm, 4, r);
        destroy(&t, comm);
        got
    });
    assert_eq!(out, vec![(ncclSuccess, [3.0; 4]); 2]);
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 2, 2, 0, 1));
}

/// A group in which a call failed launches nothing at its end (ncclGroupError, group.cc:671,
/// then groupCleanup, 340-394 of 2.28.9): ncclGroupEnd returns the error, the group's valid
/// operations never write their buffers, and a non-blocking communicator of the group keeps
/// the error as its asynchronous state.
#[test]
fn a_group_with_a_failed_call_runs_nothing() {
    let t = table();
    let all_reduce = |comm: ncclComm_t, dt: ncclDataType_t, recv: &mut [f32; 2]| {
        let send = [1.0f32; 2];
        // SAFETY: a live comm and buffers of 2 elements.
        unsafe {
            (t.ncclAllReduce)(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                2,
                dt,
                ncclSum,
                comm,
                null_stream(),
            )
        }
    };
    for nonblocking in [false, true] {
        let body = |_, comm| {
            let mut recv = [0.0f32; 2];
            // SAFETY: balanced group calls on this thread.
            unsafe { assert_eq!((t.ncclGroupStart)(), ncclSuccess) };
            assert_eq!(all_reduce(comm, ncclFloat32, &mut recv), ncclSuccess);
            assert_eq!(all_reduce(comm, 99, &mut [0.0; 2]), ncclInvalidArgument);
            // SAFETY: as above.
            assert_eq!(unsafe { (t.ncclGroupEnd)() }, ncclInvalidArgument);
            assert_eq!(recv, [0.0; 2], "nothing ran");
            let mut st = ncclInProgress;
            // SAFETY: a live comm, a writable result.
            assert_eq!(
                unsafe { (t.ncclCommGetAsyncError)(comm, &mut st) },
                ncclSuccess
            );
            // SAFETY: the handle, torn down once.
            assert_eq!(unsafe { (t.ncclCommAbort)(comm) }, ncclSuccess);
            st
        };
        let (_, states) = if nonblocking {
            with_non_blocking_ranks(&t, 1, body)
        } else {
            with_ranks(&t, 1, body)
        };
        let want = if nonblocking {
            ncclInvalidArgument
        } else {
            ncclSuccess
        };
        assert_eq!(states, vec![want], "nonblocking: {nonblocking}");
    }
}

/// On a non-blocking communicator NCCL stores an operation's argument error as the
/// communicator's asynchronous error (ncclEnqueueCheck's `fail:`, enqueue.cc:2660-2661 of
/// 2.28.9): ncclCommGetAsyncError reports it from then on, and a valid call that follows
/// is refused with it. A blocking one keeps working.
#[test]
fn an_argument_error_is_sticky_on_a_non_blocking_communicator() {
    let t = table();
    let broadcast = |comm: ncclComm_t, root: c_int| {
        let (send, mut recv) = ([1.0f32; 2], [0.0f32; 2]);
        // SAFETY: a live comm and buffers of 2 elements.
        unsafe {
            (t.ncclBroadcast)(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                2,
                ncclFloat32,
                root,
                comm,
                null_stream(),
            )
        }
    };
    let state = |comm: ncclComm_t| {
        let mut st = ncclInProgress;
        // SAFETY: a live comm, a writable result.
        assert_eq!(
            unsafe { (t.ncclCommGetAsyncError)(comm, &mut st) },
            ncclSuccess
        );
        st
    };
    let (id, _) = with_non_blocking_ranks(&t, 1, |_, comm| {
        assert_eq!(broadcast(comm, 5), ncclInvalidArgument, "root 5 of 1");
        assert_eq!(state(comm), ncclInvalidArgument, "sticky");
        assert_eq!(
            broadcast(comm, 0),
            ncclInvalidArgument,
            "refused from then on"
        );
        // SAFETY: the handle, torn down once (its error refuses a destroy).
        assert_eq!(unsafe { (t.ncclCommAbort)(comm) }, ncclSuccess);
    });
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 1, 0, 1, 1));
    let (id, _) = with_ranks(&t, 1, |_, comm| {
        assert_eq!(broadcast(comm, 5), ncclInvalidArgument);
        assert_eq!(
            state(comm),
            ncclSuccess,
            "a blocking communicator keeps no error"
        );
        assert_eq!(broadcast(comm, 0), ncclSuccess);
        destroy(&t, comm);
    });
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 1, 1, 0, 1));
}

/// A symmetric window must start a multiple of NCCL_WIN_REQUIRED_ALIGNMENT (4096) bytes
/// into its ncclMemAlloc allocation (dev_runtime.cc:605-611 of 2.28.9).
#[test]
fn a_symmetric_window_must_be_aligned_in_its_allocation() {
    let t = table();
    let register = t.ncclCommWindowRegister.expect("window API");
    let deregister = t.ncclCommWindowDeregister.expect("window API");
    let (alloc, free) = (
        t.ncclMemAlloc.expect("mem API"),
        t.ncclMemFree.expect("mem API"),
    );
    let (id, _) = with_ranks(&t, 1, |_, comm| {
        let mut base: *mut c_void = core::ptr::null_mut();
        // SAFETY: a writable out-pointer.
        assert_eq!(unsafe { alloc(&mut base, 8192) }, ncclSuccess);
        let sym = NCCL_WIN_COLL_SYMMETRIC as c_int;
        for (at, want) in [(16, ncclInvalidArgument), (4096, ncclSuccess)] {
            let mut win: ncclWindow_t = core::ptr::null_mut();
            // SAFETY: a live comm, a range inside the allocation, a writable window.
            let rc = unsafe { register(comm, base.cast::<u8>().add(at).cast(), 64, &mut win, sym) };
            assert_eq!(rc, want, "{at} bytes in: {}", last_error(&t));
            if rc == ncclSuccess {
                // SAFETY: the window just registered.
                assert_eq!(unsafe { deregister(comm, win) }, ncclSuccess);
            }
        }
        // SAFETY: the allocation, freed once.
        assert_eq!(unsafe { free(base) }, ncclSuccess);
        destroy(&t, comm);
    });
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 1, 1, 0, 1));
}

#[test]
fn a_window_is_written_later_and_destroy_in_progress_leaves_a_group_open() {
    let t = table();
    let register = t.ncclCommWindowRegister.expect("window API");
    let deregister = t.ncclCommWindowDeregister.expect("window API");
    let (id, _) = with_non_blocking_ranks(&t, 1, |_, comm| {
        let root = host::root_id_of(comm).expect("a live host communicator");
        host::fault::inject(&root, host::fault::Fault::HeldJobs);
        let mut buf = vec![0u8; 64];
        let dest = Box::new(core::sync::atomic::AtomicPtr::<ncclWindow_vidmem>::new(
            core::ptr::null_mut(),
        ));
        // SAFETY: live comm, live buffer, `dest` outlives the job.
        let rc = unsafe { register(comm, buf.as_mut_ptr().cast(), 64, dest.as_ptr(), 0) };
        assert_eq!(rc, ncclSuccess);
        assert!(dest.load(core::sync::atomic::Ordering::Acquire).is_null());
        // SAFETY: a live handle; refused (in progress) without a teardown.
        let rc = unsafe { (t.ncclCommDestroy)(comm) };
        assert_eq!(rc, ncclInvalidArgument, "{}", last_error(&t));
        host::fault::release_jobs(&root);
        assert_eq!(wait_out_of_progress(&t, comm), ncclSuccess);
        let win = dest.load(core::sync::atomic::Ordering::Acquire);
        assert!(!win.is_null(), "the window is written when the job ends");
        // SAFETY: live comm and window.
        assert_eq!(unsafe { deregister(comm, win) }, ncclSuccess);
        // This thread is still inside the level the refused destroy opened: the destroy is
        // queued (ncclSuccess, nothing torn down) until a ncclGroupEnd closes the level.
        let root = host::root_id_of(comm).expect("a live host communicator");
        destroy(&t, comm);
        assert_eq!(host::stats_for(&root).live, 1, "queued, not torn down");
        // SAFETY: closes the level; runs the queued destroy.
        assert_eq!(unsafe { (t.ncclGroupEnd)() }, ncclSuccess);
        assert_eq!(host::stats_for(&root).live, 0);
    });
    // The in-progress destroy counts as misuse.
    assert_eq!(tuple(host::stats_for(&id)), stats(0, 1, 1, 0, 1));
}

/// A window registration inside a group, as NCCL 2.28.9 has it: the call only queues the
/// task with the caller's out-pointer (dev_runtime.cc:902-915) and returns ncclSuccess with
/// `*win` untouched and the communicator's state unchanged; an inner ncclGroupEnd only
/// counts the depth down (group.cc:669); the group's job writes `*win` at the outermost
/// ncclGroupEnd (group.cc:540-567 -> dev_runtime.cc:596, :533), in the call for a blocking
/// communicator and from the group's thread for a non-blocking one (group.cc:706-738),
/// whose state reads ncclInProgress until then. A call that fails inside the group fails
/// the group's end too (`ncclGroupErrCheck`, dev_runtime.cc:918).
#[test]
fn a_window_registered_inside_a_group_is_written_at_its_end() {
    use core::sync::atomic::{AtomicPtr, Ordering::Acquire};
    let t = table();
    let register = t.ncclCommWindowRegister.expect("window API");
    let deregister = t.ncclCommWindowDeregister.expect("window API");
    const UNTOUCHED: usize = 0x8;
    let untouched = || UNTOUCHED as ncclWindow_t;
    let state = |comm: ncclComm_t| {
        let mut st = ncclInternalError;
        // SAFETY: a live comm, a writable result.
        assert_eq!(
            unsafe { (t.ncclCommGetAsyncError)(comm, &mut st) },
            ncclSuccess
        );
        st
    };
    for nonblocking in [false, true] {
        let body = |_, comm: ncclComm_t| {
            let root = host::root_id_of(comm).expect("a live host communicator");
            if nonblocking {
                host::fault::inject(&root, host::fault::Fault::HeldJobs);
            }
            let mut buf = vec![0u8; 64];
            // A heap out-pointer the group's thread may write after this function looked at it.
            let dest = Box::new(AtomicPtr::<ncclWindow_vidmem>::new(untouched()));
            // SAFETY: balanced group calls on this thread; a live comm and buffer; `dest`
            // outlives the group's job (it is read after the wait).
            unsafe {
                assert_eq!((t.ncclGroupStart)(), ncclSuccess);
                assert_eq!((t.ncclGroupStart)(), ncclSuccess);
                let rc = register(comm, buf.as_mut_ptr().cast(), 64, dest.as_ptr(), 0);
                assert_eq!(rc, ncclSuccess, "{}", last_error(&t));
                assert_eq!(dest.load(Acquire), untouched(), "queued, not registered");
                assert_eq!(
                    state(comm),
                    ncclSuccess,
                    "the state is the group end's to set"
                );
                assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
                assert_eq!(
                    dest.load(Acquire),
                    untouched(),
                    "an inner end launches nothing"
                );
                assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
            }
            if nonblocking {
                assert_eq!(
                    dest.load(Acquire),
                    untouched(),
                    "the group's thread writes it"
                );
                assert_eq!(state(comm), ncclInProgress);
                host::fault::release_jobs(&root);
                assert_eq!(wait_out_of_progress(&t, comm), ncclSuccess);
            }
            let win = dest.load(Acquire);
            assert!(
                win != untouched() && !win.is_null(),
                "written at the group's end"
            );
            // SAFETY: live comm and window.
            assert_eq!(unsafe { deregister(comm, win) }, ncclSuccess);
            // A call refused inside the group (a symmetric window outside any ncclMemAlloc
            // allocation, which NCCL refuses in the group's job) fails the group's end.
            dest.store(untouched(), core::sync::atomic::Ordering::Release);
            let sym = NCCL_WIN_COLL_SYMMETRIC as c_int;
            // SAFETY: as above.
            unsafe {
                assert_eq!((t.ncclGroupStart)(), ncclSuccess);
                let rc = register(comm, buf.as_mut_ptr().cast(), 64, dest.as_ptr(), sym);
                assert_eq!(rc, ncclInvalidArgument);
                assert_eq!((t.ncclGroupEnd)(), ncclInvalidArgument);
            }
            assert_eq!(dest.load(Acquire), untouched());
            // SAFETY: the handle, torn down once.
            assert_eq!(unsafe { (t.ncclCommAbort)(comm) }, ncclSuccess);
        };
        if nonblocking {
            with_non_blocking_ranks(&t, 1, body);
        } else {
            with_ranks(&t, 1, body);
        }
    }
}

/// `ncclCommDestroy` sets the communicator's `destroyFlag` before `ncclCommEnsureReady`
/// refuses it (init.cc:2379-2381 of 2.28.9), inside a group too (the check runs in the
/// call, before the reclaim job is queued, :2384), and nothing clears the flag: a revoke of
/// that communicator is refused from then on (init.cc:2457 of 2.28.9, :2651 of 2.29.7).
/// Each refused destroy leaves its own group level open.
#[test]
fn a_refused_destroy_keeps_its_destroy_flag() {
    let t = table();
    let register = t.ncclCommWindowRegister.expect("window API");
    let deregister = t.ncclCommWindowDeregister.expect("window API");
    let revoke = t.ncclCommRevoke.expect("revoke API");
    with_non_blocking_ranks(&t, 1, |_, comm| {
        let root = host::root_id_of(comm).expect("a live host communicator");
        host::fault::inject(&root, host::fault::Fault::HeldJobs);
        let mut buf = vec![0u8; 64];
        let dest = Box::new(core::sync::atomic::AtomicPtr::<ncclWindow_vidmem>::new(
            core::ptr::null_mut(),
        ));
        // SAFETY: live comm, live buffer, `dest` outlives the job; the group levels are
        // closed below.
        unsafe {
            let rc = register(comm, buf.as_mut_ptr().cast(), 64, dest.as_ptr(), 0);
            assert_eq!(rc, ncclSuccess);
            // Inside a group the destroy is refused in the call as well, and not queued.
            assert_eq!((t.ncclGroupStart)(), ncclSuccess);
            let rc = (t.ncclCommDestroy)(comm);
            assert_eq!(rc, ncclInvalidArgument, "{}", last_error(&t));
            assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
            assert_eq!((t.ncclGroupEnd)(), ncclSuccess, "the destroy's own level");
            assert_eq!(host::stats_for(&root).live, 1, "nothing was queued");
            // Outside a group.
            assert_eq!((t.ncclCommDestroy)(comm), ncclInvalidArgument);
            assert_eq!((t.ncclGroupEnd)(), ncclSuccess, "the destroy's own level");
        }
        host::fault::release_jobs(&root);
        assert_eq!(wait_out_of_progress(&t, comm), ncclSuccess);
        let win = dest.load(core::sync::atomic::Ordering::Acquire);
        // SAFETY: live comm and window; then the refused revoke changes nothing.
        unsafe {
            assert_eq!(deregister(comm, win), ncclSuccess);
            let rc = revoke(comm, NCCL_REVOKE_DEFAULT as c_int);
            assert_eq!(rc, ncclInvalidArgument, "the destroy flag stays set");
            assert!(
                last_error(&t).contains("ncclCommDestroy"),
                "{}",
                last_error(&t)
            );
            assert_eq!((t.ncclCommAbort)(comm), ncclSuccess);
        }
    });
}

/// NCCL skips registrations its parameters turn off: `ncclCommRegister` under
/// `NCCL_LOCAL_REGISTER=0` writes a NULL handle and returns ncclSuccess
/// (register/register.cc:118-121 of 2.28.9), and `ncclCommWindowRegister` without
/// symmetric support (`NCCL_WIN_ENABLE=0`, init.cc:1376) and without local registration
/// returns ncclSuccess at once, writing nothing, inside a group too (dev_runtime.cc:902).
/// NCCL reads its parameters once per process, and so does the provider: each case runs
/// in a child process.
#[test]
fn registrations_are_skipped_where_nccls_parameters_turn_them_off() {
    for (local, win) in [("0", "0"), ("0", "1"), ("1", "0")] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_under_registration_parameters"])
            .args(["--ignored", "--nocapture"])
            .env("NCCL_LOCAL_REGISTER", local)
            .env("NCCL_WIN_ENABLE", win)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        let what = format!("NCCL_LOCAL_REGISTER={local} NCCL_WIN_ENABLE={win}");
        assert!(out.status.success(), "{what}: {stderr}");
        assert!(stdout.contains("child: checked"), "{what}: {stdout}");
    }
}

#[test]
#[ignore = "run as a child process by registrations_are_skipped_where_nccls_parameters_turn_them_off"]
fn child_under_registration_parameters() {
    let on = |v: &str| std::env::var(v).expect("run only as a child process") != "0";
    let (local, win_enable) = (on("NCCL_LOCAL_REGISTER"), on("NCCL_WIN_ENABLE"));
    let t = table();
    let register = t.ncclCommRegister.expect("registration API");
    let deregister = t.ncclCommDeregister.expect("registration API");
    let window = t.ncclCommWindowRegister.expect("window API");
    let unwindow = t.ncclCommWindowDeregister.expect("window API");
    let untouched = 0x8usize;
    let (id, _) = with_ranks(&t, 1, |_, comm| {
        let mut buf = vec![0u8; 64];
        let mut handle = untouched as *mut c_void;
        // SAFETY: a live comm and buffer, writable out-pointers; each registration made is
        // released once.
        unsafe {
            assert_eq!(
                register(comm, buf.as_mut_ptr().cast(), 64, &mut handle),
                ncclSuccess
            );
            assert_eq!(
                handle.is_null(),
                !local,
                "a skipped registration's handle is NULL"
            );
            assert_eq!(deregister(comm, handle), ncclSuccess);
            for grouped in [false, true] {
                let mut win = untouched as ncclWindow_t;
                if grouped {
                    assert_eq!((t.ncclGroupStart)(), ncclSuccess);
                }
                let rc = window(comm, buf.as_mut_ptr().cast(), 64, &mut win, 0);
                assert_eq!(rc, ncclSuccess, "{}", last_error(&t));
                if grouped {
                    assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
                }
                let skipped = !(local || win_enable);
                assert_eq!(win as usize == untouched, skipped, "grouped: {grouped}");
                if !skipped {
                    assert_eq!(unwindow(comm, win), ncclSuccess);
                }
            }
        }
        destroy(&t, comm);
    });
    let st = host::stats_for(&id);
    let (buffers, windows) = (local as u64, 2 * (local || win_enable) as u64);
    assert_eq!(
        (st.registered, st.deregistered, st.misused),
        (buffers, buffers, 0),
        "{st:?}"
    );
    assert_eq!(
        (st.windows_registered, st.windows_deregistered),
        (windows, windows),
        "{st:?}"
    );
    println!("child: checked");
}

/// A window registration queued in a group that fails is not run, and writes nothing; NCCL
/// leaves its task queued on the communicator (`groupCleanup`, group.cc:340-397 of 2.28.9,
/// does not empty dev_runtime's `regTaskQueue`, which only the communicator's teardown
/// frees, dev_runtime.cc:114-117), to run first, writing through its stale out-pointer, at
/// the next group end that registers a window there. The provider refuses that next
/// registration instead (ncclInvalidUsage, counted as misuse), once.
#[test]
fn a_window_queued_in_a_failed_group_is_reported_at_the_next_registration() {
    let t = table();
    let register = t.ncclCommWindowRegister.expect("window API");
    let deregister = t.ncclCommWindowDeregister.expect("window API");
    let (id, _) = with_ranks(&t, 1, |_, comm| {
        let mut buf = vec![0u8; 64];
        let (send, mut recv) = ([1.0f32; 2], [0.0f32; 2]);
        let untouched = 0x8 as ncclWindow_t;
        let (mut stale, mut next, mut last) = (untouched, untouched, untouched);
        // SAFETY: balanced group calls; a live comm and buffers that outlive the calls.
        unsafe {
            assert_eq!((t.ncclGroupStart)(), ncclSuccess);
            let rc = register(comm, buf.as_mut_ptr().cast(), 64, &mut stale, 0);
            assert_eq!(rc, ncclSuccess);
            let bad_type = 99;
            let rc = (t.ncclAllReduce)(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                2,
                bad_type,
                ncclSum,
                comm,
                null_stream(),
            );
            assert_eq!(rc, ncclInvalidArgument);
            assert_eq!((t.ncclGroupEnd)(), ncclInvalidArgument);
            assert_eq!(stale, untouched, "a failed group registers nothing");
            let rc = register(comm, buf.as_mut_ptr().cast(), 64, &mut next, 0);
            assert_eq!(rc, ncclInvalidUsage, "the stale registration is reported");
            assert!(last_error(&t).contains("failed"), "{}", last_error(&t));
            assert_eq!((stale, next), (untouched, untouched));
            let rc = register(comm, buf.as_mut_ptr().cast(), 64, &mut last, 0);
            assert_eq!(rc, ncclSuccess, "once");
            assert!(last != untouched && !last.is_null());
            assert_eq!(deregister(comm, last), ncclSuccess);
        }
        destroy(&t, comm);
    });
    let st = host::stats_for(&id);
    // Misuse: the unknown datatype, and the stale registration.
    assert_eq!((st.windows_registered, st.misused), (1, 2), "{st:?}");
}

/// Ranks meeting in the shared segment (`host::shared_unique_id`, as ranks in processes
/// do): a rank whose all-reduce returned aborts at once, while its peer may still be
/// between the collective's last barrier and its return. The peer's all-reduce completes
/// with the sum: its barrier had completed, as a kernel that received its peer's data
/// completes whatever the peer does next. Before, the peer read the abort before the
/// barrier's completion and failed the all-reduce with "rank 1 called ncclCommAbort" (found
/// by the differential row `ncclGroupEnd` in processes).
#[test]
fn a_peer_aborting_right_after_a_shared_collective_does_not_fail_it() {
    let t = table();
    let mut failed = Vec::new();
    for round in 0..300 {
        let id = host::shared_unique_id();
        let got = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let t = &t;
                    s.spawn(move || {
                        let mut comm: ncclComm_t = core::ptr::null_mut();
                        // SAFETY: valid out pointer; the same id for both ranks.
                        let init = unsafe { (t.ncclCommInitRank)(&mut comm, 2, id, r) };
                        assert_eq!(init, ncclSuccess, "{}", last_error(t));
                        let mut x = [1f32; 4];
                        let p = x.as_mut_ptr().cast::<c_void>();
                        // SAFETY: a live buffer; the call runs in place and returns after.
                        let rc = unsafe {
                            (t.ncclAllReduce)(p, p, 4, ncclFloat32, ncclSum, comm, null_stream())
                        };
                        let why = if rc == ncclSuccess {
                            String::new()
                        } else {
                            last_error(t)
                        };
                        // SAFETY: aborted once.
                        assert_eq!(unsafe { (t.ncclCommAbort)(comm) }, ncclSuccess);
                        (rc, x, why)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for (r, (rc, x, why)) in got.into_iter().enumerate() {
            if rc != ncclSuccess || x != [2.0; 4] {
                failed.push(format!("round {round}, rank {r}: {rc} {x:?} {why}"));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 300 rounds: {failed:?}",
        failed.len()
    );
}
