//! One-sided puts and signals on windows (`ncclPutSignal`, `ncclSignal`, `ncclWaitSignal`,
//! NCCL 2.29+) on the host provider, ranks in threads and in processes (the shared-memory
//! segment's path, also from threads on a shared id): data moves between ranks with put and
//! wait, a bare signal is counted like a put's, each misuse is a typed error before NCCL
//! sees it (the communicator stays usable), each call on an NCCL before 2.29 is
//! `Unsupported`, and the provider's C ABI refuses what NCCL 2.30.7's `rmaTaskAppend`
//! refuses.

mod support;

use std::time::Duration;

use nccl_launch::Launcher;
use nccl_safe::{
    CommDevice, Communicator, Config, Error, Library, NcclMemory, ReduceOp, Signal, SignalWait,
    Stream, UniqueId, Version, WindowFlags,
};
use support::assert_balanced;

const SYM: WindowFlags = WindowFlags::COLL_SYMMETRIC;

fn config() -> Config {
    Config::new().timeout(Duration::from_secs(30))
}

/// Three ranks in a ring: each puts its rank's values into the next rank's window, at an
/// offset of its own, then signals the rank before it with no data; each rank waits for
/// the put of the rank before it and the signal of the rank after it, and reads the data.
/// Twice, so the second round's signals are counted apart from the first's.
#[test]
fn puts_and_signals_move_data_between_ranks_in_threads() {
    Launcher::host(3)
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let (me, n) = (rank.rank(), rank.world_size());
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            let mut src = NcclMemory::<i32>::alloc_zeros(comm, 64, s.clone())?;
            let mut dst = NcclMemory::<i32>::alloc_zeros(comm, 64, s.clone())?;
            let mut src = comm.register_window(&mut src, SYM)?;
            let mut dst = comm.register_window(&mut dst, SYM)?;
            for round in 0..2i32 {
                let vals: Vec<i32> = (0..64)
                    .map(|i| 1000 * round + 100 * me as i32 + i)
                    .collect();
                src.copy_from_host(&vals, s)?;
                // Elements 10..14 of my source land at element 4 * me of the next rank's.
                dst.put_signal(&src, 10..14, next, 4 * me, Signal::DEFAULT, s)?;
                comm.signal(prev, Signal::DEFAULT, s)?;
                let waits = [SignalWait::new(prev, 1), SignalWait::new(next, 1)];
                dst.wait_signal(&waits, s)?;
                let got = dst.buffer().to_vec(s)?;
                let want: Vec<i32> = (10..14)
                    .map(|i| 1000 * round + 100 * prev as i32 + i)
                    .collect();
                assert_eq!(
                    got[4 * prev..4 * prev + 4],
                    want[..],
                    "rank {me} round {round}"
                );
                // Nothing else was written.
                for (i, v) in got.iter().enumerate() {
                    if !(4 * prev..4 * prev + 4).contains(&i) {
                        assert_eq!(*v, 0, "rank {me} round {round} element {i}");
                    }
                }
                dst.as_host_slice_mut()?.fill(0);
                // The next round's puts start after every rank read this one's.
                let mut sync = [0u8; 1];
                comm.all_reduce_in_place(&mut sync, ReduceOp::Sum, s)?;
            }
            Ok(())
        })
        .unwrap();
}

/// A put into another window than the one waited on lands in the next wait on that window:
/// the wait's window is the only memory it writes (the host provider; the wait holds it
/// mutably).
#[test]
fn a_put_into_another_window_lands_in_a_wait_on_that_window() {
    Launcher::host(2)
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let (me, peer) = (rank.rank(), 1 - rank.rank());
            let mut a = NcclMemory::<u8>::alloc_zeros(comm, 16, s.clone())?;
            let mut b = NcclMemory::<u8>::alloc_zeros(comm, 16, s.clone())?;
            let mut a = comm.register_window(&mut a, SYM)?;
            let mut b = comm.register_window(&mut b, SYM)?;
            a.copy_from_host(&[me as u8 + 1; 16], s)?;
            b.put_signal(&a, 0..16, peer, 0, Signal::DEFAULT, s)?;
            a.wait_signal(&[SignalWait::new(peer, 1)], s)?;
            // Counted, but its data is for `b`, which the wait did not hold.
            assert_eq!(b.buffer().to_vec(s)?, vec![0; 16]);
            comm.signal(peer, Signal::DEFAULT, s)?;
            b.wait_signal(&[SignalWait::new(peer, 1)], s)?;
            assert_eq!(b.buffer().to_vec(s)?, vec![peer as u8 + 1; 16]);
            Ok(())
        })
        .unwrap();
}

/// Puts to every peer in one `Group` (an all-to-all dispatch): rank r writes its block into
/// block r of every other rank's window at the group's end, then waits for one signal from
/// each peer and finds each peer's block in place. The group keeps both windows borrowed
/// until its end.
#[test]
fn puts_to_every_peer_in_a_group() {
    Launcher::host(4)
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let (me, n) = (rank.rank(), rank.world_size());
            let mut src = NcclMemory::<i64>::alloc_zeros(comm, 4, s.clone())?;
            let mut dst = NcclMemory::<i64>::alloc_zeros(comm, 4 * n, s.clone())?;
            let mut src = comm.register_window(&mut src, SYM)?;
            let mut dst = comm.register_window(&mut dst, SYM)?;
            src.copy_from_host(&[me as i64 * 11 + 1; 4], s)?;
            let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
            let mut g = nccl_safe::Group::new();
            for &p in &peers {
                g.push(dst.put_signal_op(&src, 0..4, p, 4 * me, Signal::DEFAULT, s)?)?;
            }
            g.end()?;
            let waits: Vec<SignalWait> = peers.iter().map(|&p| SignalWait::new(p, 1)).collect();
            dst.wait_signal(&waits, s)?;
            let got = dst.buffer().to_vec(s)?;
            for p in 0..n {
                let want = if p == me { 0 } else { p as i64 * 11 + 1 };
                assert_eq!(got[4 * p..4 * p + 4], [want; 4], "rank {me}, block {p}");
            }
            // A signal described and run on its own, like any operation.
            comm.signal_op(peers[0], Signal::DEFAULT, s)?.run()?;
            Ok(())
        })
        .unwrap();
}

/// The group rule: while a `Group` holds an operation, a put, a signal and a wait run at
/// once, alone (the crate leaves no NCCL group open while the caller's code runs), so the
/// put's source window can be deregistered and freed before the group's end.
#[test]
fn one_sided_calls_while_a_group_is_filled_run_at_once() {
    Launcher::host(2)
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let (me, peer) = (rank.rank(), 1 - rank.rank());
            let mut grads = vec![1.0f32; 4];
            let mut dst = NcclMemory::<u32>::alloc_zeros(comm, 8, s.clone())?;
            let mut dst = comm.register_window(&mut dst, SYM)?;
            nccl_safe::Group::run(|g| {
                g.push(comm.all_reduce_in_place_op(&mut grads, ReduceOp::Sum, s)?)?;
                let mut src = NcclMemory::<u32>::alloc_zeros(comm, 8, s.clone())?;
                let mut w = comm.register_window(&mut src, SYM)?;
                w.copy_from_host(&[me as u32 + 7; 8], s)?;
                dst.put_signal(&w, 0..8, peer, 0, Signal::DEFAULT, s)?;
                comm.signal(peer, Signal::DEFAULT, s)?;
                dst.wait_signal(&[SignalWait::new(peer, 2)], s)?;
                assert_eq!(dst.buffer().to_vec(s)?, vec![peer as u32 + 7; 8]);
                drop(w);
                src.free()?; // before the group's end: NCCL must be done with it
                Ok(())
            })?;
            assert_eq!(grads, vec![2.0; 4], "the group's own work");
            Ok(())
        })
        .unwrap();
}

/// A wait for a signal that never comes ends in the watchdog's timeout, not a hang: rank 0
/// waits for rank 1, which sends nothing; rank 0's wait fails within a few timeouts, and
/// its communicator is failed.
#[test]
#[cfg(feature = "diag")]
fn a_wait_for_a_signal_that_never_comes_times_out() {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new().timeout(Duration::from_millis(500));
    let done = std::sync::Barrier::new(2);
    support::within(Duration::from_secs(30), move || {
        std::thread::scope(|s| {
            for rank in 0..2 {
                let (id, cfg, done) = (&id, cfg.clone(), &done);
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, id, &cfg).unwrap();
                    let mut m = NcclMemory::<f32>::alloc_zeros(&comm, 8, Stream::Host).unwrap();
                    let mut w = comm.register_window(&mut m, SYM).unwrap();
                    if rank == 0 {
                        let started = std::time::Instant::now();
                        let e = w
                            .wait_signal(&[SignalWait::new(1, 1)], &Stream::Host)
                            .unwrap_err();
                        assert!(started.elapsed() < Duration::from_secs(10), "{e}");
                        assert!(comm.is_failed(), "{e}");
                    }
                    done.wait();
                    drop(w);
                });
            }
        })
    });
}

/// Every misuse is a typed error before NCCL sees it, and the communicator stays usable:
/// a put past the window's end, a source range past the source's end, a peer outside the
/// communicator, a signal index or context NCCL does not have, a window that is not
/// symmetric, a wait on no signals, on 0 signals, from a peer out of range.
#[test]
fn misuse_is_a_typed_error_and_the_communicator_stays_usable() {
    Launcher::host(2)
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let peer = 1 - rank.rank();
            let mut src = NcclMemory::<f32>::alloc_zeros(comm, 32, s.clone())?;
            let mut dst = NcclMemory::<f32>::alloc_zeros(comm, 32, s.clone())?;
            let mut plain = NcclMemory::<f32>::alloc_zeros(comm, 32, s.clone())?;
            let src = comm.register_window(&mut src, SYM)?;
            let mut dst = comm.register_window(&mut dst, SYM)?;
            let plain = comm.register_window(&mut plain, WindowFlags::empty())?;
            let d = Signal::DEFAULT;
            let invalid = |r: Result<(), Error>, what: &str, words: &str| match r {
                Err(Error::InvalidArgument { reason, .. }) if reason.contains(words) => {}
                other => panic!("{what}: expected InvalidArgument ({words}), got {other:?}"),
            };
            let out_of_range = |r: Result<(), Error>, what: &str| match r {
                Err(Error::RankOutOfRange { rank: 2, .. }) => {}
                other => panic!("{what}: expected RankOutOfRange, got {other:?}"),
            };
            // 4 elements at 29: ends at 33, past 32.
            let past = dst.put_signal(&src, 0..4, peer, 29, d, s);
            invalid(past, "put past the end", "past the window's end");
            let huge = dst.put_signal(&src, 0..4, peer, usize::MAX - 1, d, s);
            invalid(huge, "offset that overflows", "past the window's end");
            let src_past = dst.put_signal(&src, 30..34, peer, 0, d, s);
            invalid(src_past, "source range past its end", "outside the source");
            out_of_range(dst.put_signal(&src, 0..4, 2, 0, d, s), "put to rank 2");
            out_of_range(comm.signal(2, d, s), "signal to rank 2");
            let idx1 = Signal { index: 1, ctx: 0 };
            let ctx1 = Signal { index: 0, ctx: 1 };
            invalid(
                dst.put_signal(&src, 0..4, peer, 0, idx1, s),
                "signal index 1",
                "signal index 1",
            );
            invalid(comm.signal(peer, ctx1, s), "context 1", "context 1");
            let sym = "not symmetric";
            invalid(
                plain.put_signal(&src, 0..4, peer, 0, d, s),
                "plain target",
                sym,
            );
            invalid(
                dst.put_signal(&plain, 0..4, peer, 0, d, s),
                "plain source",
                sym,
            );
            invalid(dst.wait_signal(&[], s), "no waits", "0 waits");
            let zero = SignalWait::new(peer, 0);
            invalid(dst.wait_signal(&[zero], s), "0 signals", "the count is 1");
            let far = SignalWait::new(2, 1);
            out_of_range(dst.wait_signal(&[far], s), "wait on rank 2");
            let on_idx1 = SignalWait {
                signal: idx1,
                ..SignalWait::new(peer, 1)
            };
            invalid(
                dst.wait_signal(&[on_idx1], s),
                "wait on index 1",
                "signal index 1",
            );
            // Nothing reached NCCL: the communicator is healthy and the ranks still agree.
            assert!(!comm.is_failed());
            let mut x = vec![1u32; 4];
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, s)?;
            assert_eq!(x, vec![2; 4]);
            // A well-formed put still goes through.
            dst.put_signal(&src, 0..4, peer, 28, d, s)?;
            dst.wait_signal(&[SignalWait::new(peer, 1)], s)?;
            drop(plain);
            Ok(())
        })
        .unwrap();
}

/// Each one-sided call on an NCCL before 2.29 is `Unsupported`, naming the entry point and
/// 2.29, before anything reaches NCCL (the communicator stays healthy).
#[test]
fn each_one_sided_call_on_an_nccl_before_2_29_is_unsupported() {
    let lib = Library::host_as_version(2, 28).unwrap();
    let v = lib.version();
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &config()).unwrap();
    let unsupported = |e: Result<(), Error>, sym: &str| match e {
        Err(Error::Unsupported {
            symbol,
            needs,
            found,
        }) if symbol == sym && needs == Version::new(2, 29, 0) && found == v => {}
        other => panic!("{sym}: expected Unsupported, got {other:?}"),
    };
    let s = Stream::Host;
    let mut a = NcclMemory::<f32>::alloc_zeros(&comm, 8, s.clone()).unwrap();
    let mut b = NcclMemory::<f32>::alloc_zeros(&comm, 8, s.clone()).unwrap();
    {
        let a = comm.register_window(&mut a, SYM).unwrap();
        let mut b = comm.register_window(&mut b, SYM).unwrap();
        let d = Signal::DEFAULT;
        unsupported(b.put_signal(&a, 0..8, 0, 0, d, &s), "ncclPutSignal");
        unsupported(comm.signal(0, d, &s), "ncclSignal");
        unsupported(
            b.wait_signal(&[SignalWait::new(0, 1)], &s),
            "ncclWaitSignal",
        );
    }
    assert!(!comm.is_failed());
    drop((a, b));
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);
}

/// The provider's C ABI, as NCCL 2.30.7's `rmaTaskAppend` (enqueue.cc:2807-2908) and
/// `ArgsCheck` (misc/argcheck.cc:203-206): a peer outside the communicator, a signal index,
/// context or flags other than 0, a null window or source, a source outside a symmetric
/// window, no wait descriptors and a descriptor of opCnt 0 are each ncclInvalidArgument;
/// then a well-formed put and wait move the data.
#[test]
fn the_providers_one_sided_calls_refuse_what_nccl_refuses() {
    use nccl_safe::host;
    use nccl_sys::bindings::*;
    use std::ffi::{c_int, c_void};
    // SAFETY: the host provider's lookup returns functions with NCCL's signatures.
    let t = unsafe { nccl_sys::FunctionTable::load(host::lookup) }.unwrap();
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { (t.ncclGetUniqueId)(&mut id) }, ncclSuccess);
    let (put, sig, wait) = (
        t.ncclPutSignal.unwrap(),
        t.ncclSignal.unwrap(),
        t.ncclWaitSignal.unwrap(),
    );
    std::thread::scope(|s| {
        for rank in 0..2 {
            let t = &t;
            s.spawn(move || unsafe {
                // SAFETY (the whole thread): every pointer passed is live and sized as
                // NCCL's contract asks; the handle is destroyed once, at the end.
                let st: cudaStream_t = std::ptr::null_mut();
                let mut comm: ncclComm_t = std::ptr::null_mut();
                assert_eq!((t.ncclCommInitRank)(&mut comm, 2, id, rank), ncclSuccess);
                let peer = 1 - rank;
                let mut mem: *mut c_void = std::ptr::null_mut();
                assert_eq!((t.ncclMemAlloc.unwrap())(&mut mem, 4096), ncclSuccess);
                let mut win: ncclWindow_t = std::ptr::null_mut();
                let sym = NCCL_WIN_COLL_SYMMETRIC as c_int;
                let reg = (t.ncclCommWindowRegister.unwrap())(comm, mem, 4096, &mut win, sym);
                assert_eq!(reg, ncclSuccess);
                let plain = [7u8; 64];
                let src = mem.cast_const();
                let bad =
                    |r: ncclResult_t, what: &str| assert_eq!(r, ncclInvalidArgument, "{what}");
                bad(
                    put(src, 4, ncclInt8, 2, win, 0, 0, 0, 0, comm, st),
                    "peer 2",
                );
                bad(
                    put(src, 4, ncclInt8, -1, win, 0, 0, 0, 0, comm, st),
                    "peer -1",
                );
                bad(
                    put(src, 4, ncclInt8, peer, win, 0, 1, 0, 0, comm, st),
                    "sigIdx 1",
                );
                bad(
                    put(src, 4, ncclInt8, peer, win, 0, 0, 1, 0, comm, st),
                    "ctx 1",
                );
                bad(
                    put(src, 4, ncclInt8, peer, win, 0, 0, 0, 1, comm, st),
                    "flags 1",
                );
                let null_win = std::ptr::null_mut();
                bad(
                    put(src, 4, ncclInt8, peer, null_win, 0, 0, 0, 0, comm, st),
                    "null window",
                );
                let null = std::ptr::null();
                bad(
                    put(null, 4, ncclInt8, peer, win, 0, 0, 0, 0, comm, st),
                    "null source",
                );
                let outside = plain.as_ptr().cast();
                bad(
                    put(outside, 4, ncclInt8, peer, win, 0, 0, 0, 0, comm, st),
                    "plain source",
                );
                bad(sig(peer, 1, 0, 0, comm, st), "signal sigIdx 1");
                bad(sig(2, 0, 0, 0, comm, st), "signal to peer 2");
                let mut d = ncclWaitSignalDesc_t {
                    opCnt: 0,
                    peer,
                    sigIdx: 0,
                    ctx: 0,
                };
                bad(wait(1, &mut d, comm, st), "opCnt 0");
                bad(wait(0, &mut d, comm, st), "nDesc 0");
                bad(wait(1, std::ptr::null_mut(), comm, st), "null descriptors");
                d.opCnt = 1;
                d.sigIdx = 1;
                bad(wait(1, &mut d, comm, st), "descriptor sigIdx 1");
                // Well-formed: my bytes 0..4 into the peer's window at 100.
                std::slice::from_raw_parts_mut(mem.cast::<u8>(), 4).fill(rank as u8 + 1);
                let ok = put(src, 4, ncclInt8, peer, win, 100, 0, 0, 0, comm, st);
                assert_eq!(ok, ncclSuccess);
                d.sigIdx = 0;
                assert_eq!(wait(1, &mut d, comm, st), ncclSuccess);
                let got = std::slice::from_raw_parts(mem.cast::<u8>().add(100), 4);
                assert_eq!(got, [peer as u8 + 1; 4]);
                let dereg = (t.ncclCommWindowDeregister.unwrap())(comm, win);
                assert_eq!(dereg, ncclSuccess);
                assert_eq!((t.ncclCommDestroy)(comm), ncclSuccess);
                assert_eq!((t.ncclMemFree.unwrap())(mem), ncclSuccess);
            });
        }
    });
}

/// One rank of a ring on communicator `comm` (`n` ranks): rank r puts 8 values into block
/// r of the next rank's window and signals the rank before it; every rank waits for both
/// and checks the block of the rank before it; twice.
fn ring_round_trip(comm: &Communicator, n: usize) -> nccl_safe::Result<()> {
    let s = &Stream::Host;
    let me = comm.rank();
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let mut src = NcclMemory::<f64>::alloc_zeros(comm, 8, s.clone())?;
    let mut dst = NcclMemory::<f64>::alloc_zeros(comm, 8 * n, s.clone())?;
    let mut src = comm.register_window(&mut src, SYM)?;
    let mut dst = comm.register_window(&mut dst, SYM)?;
    for round in 0..2 {
        let vals: Vec<f64> = (0..8).map(|i| (100 * round + 10 * me + i) as f64).collect();
        src.copy_from_host(&vals, s)?;
        dst.put_signal(&src, 0..8, next, 8 * me, Signal::DEFAULT, s)?;
        comm.signal(prev, Signal::DEFAULT, s)?;
        dst.wait_signal(&[SignalWait::new(prev, 1), SignalWait::new(next, 1)], s)?;
        let got = dst.buffer().to_vec(s)?;
        let want: Vec<f64> = (0..8)
            .map(|i| (100 * round + 10 * prev + i) as f64)
            .collect();
        assert_eq!(
            got[8 * prev..8 * prev + 8],
            want[..],
            "rank {me} round {round}"
        );
        // The next round's puts start after every rank read this one's.
        let mut sync = [0u8; 1];
        comm.all_reduce_in_place(&mut sync, ReduceOp::Sum, s)?;
    }
    Ok(())
}

/// The ring on a shared id (`host::shared_unique_id`), ranks in threads: every one-sided
/// call goes through the shared-memory segment's path, as across processes; nothing is left
/// in `/dev/shm`.
#[test]
fn puts_and_signals_through_the_shared_segment() {
    let id = UniqueId::from_raw(nccl_safe::host::shared_unique_id());
    let seg = nccl_safe::host::shared_segment_path(&id.to_raw()).unwrap();
    std::thread::scope(|s| {
        for rank in 0..3 {
            let id = &id;
            s.spawn(move || {
                let comm =
                    Communicator::init_rank(&CommDevice::Host, 3, rank, id, &config()).unwrap();
                ring_round_trip(&comm, 3).unwrap();
                // A signal no wait takes: its file goes with its receiver's communicator.
                comm.signal((rank + 1) % 3, Signal::DEFAULT, &Stream::Host)
                    .unwrap();
                let mut sync = [0u8; 1];
                comm.all_reduce_in_place(&mut sync, ReduceOp::Sum, &Stream::Host)
                    .unwrap();
                comm.destroy().map_err(|(_, e)| e).unwrap();
            });
        }
    });
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.path().display().to_string())
        .filter(|p| p.starts_with(&seg))
        .collect();
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

const CHILD_VAR: &str = "NCCL_SAFE_TEST_ONE_SIDED";

/// The ring across processes: this test binary re-run as 3 ranks (`rank:n:id` in
/// [`CHILD_VAR`]), each exiting 0 once its checks passed.
#[test]
fn puts_and_signals_between_ranks_in_processes() {
    let id = UniqueId::from_raw(nccl_safe::host::shared_unique_id());
    let hex: String = id.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let children: Vec<_> = (0..3)
        .map(|r| support::spawn_child("one_sided_child", CHILD_VAR, &format!("{r}:3:{hex}")))
        .collect();
    for c in children {
        support::check_child_exit(c, "one-sided child done", 0, Duration::from_secs(60));
    }
}

/// A rank of [`puts_and_signals_between_ranks_in_processes`] (only run as its child).
#[test]
#[ignore]
fn one_sided_child() {
    let Ok(spec) = std::env::var(CHILD_VAR) else {
        return;
    };
    let mut it = spec.split(':');
    let rank: usize = it.next().unwrap().parse().unwrap();
    let n: usize = it.next().unwrap().parse().unwrap();
    let hex = it.next().unwrap();
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let id = UniqueId::from_bytes(&bytes).unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, n, rank, &id, &config()).unwrap();
    assert_eq!(comm.properties().unwrap().host_rma, Some(true));
    ring_round_trip(&comm, n).unwrap();
    comm.destroy().map_err(|(_, e)| e).unwrap();
    println!("one-sided child done");
}
