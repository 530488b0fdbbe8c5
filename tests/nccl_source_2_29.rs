//! NVIDIA's NCCL 2.29.7, built from source over the fake CUDA runtime (see
//! `tests/nccl_source.rs`): the calls 2.29 added, revoke and grow, against NCCL's own host
//! code, and the differential checks of their contract rows against the host provider as
//! NCCL 2.29.
#![allow(non_upper_case_globals)]

mod support;

use std::sync::mpsc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use nccl_safe::{CommDevice, Communicator, Config, UniqueId};
use nccl_sys::bindings::*;
use support::differential::{Rank, Target};
use support::fakes::source_nccl;
use support::within;

const VERSION: &str = "2.29.7-1";

/// NCCL 2.29.7 and the host provider as NCCL 2.29.
const TARGET: Target = Target {
    version: VERSION,
    host: (2, 29),
    config_size: 88,
    code: 22907,
};

fn same(row: &str, n: usize, scenario: impl Fn(&mut Rank) + Sync + Send + Copy + 'static) {
    support::differential::same(&TARGET, row, n, scenario)
}

/// [`same`], then with each rank in a process of its own (`test`: the calling test).
fn same_in_processes(
    test: &str,
    row: &str,
    n: usize,
    scenario: impl Fn(&mut Rank) + Sync + Send + Copy + 'static,
) {
    support::differential::same_in_processes(&TARGET, test, row, n, scenario)
}

fn config() -> Config {
    Config::new().timeout(Duration::from_secs(30))
}

/// ncclCommRevoke (init.cc:2602-2693 of 2.29.7): ncclInProgress, the job's own result
/// once it ends; a second revoke refused (ncclInvalidArgument, :2647-2658), collectives
/// refused afterwards (ncclInvalidUsage, enqueue.cc:2983-2986), destroy allowed.
#[test]
fn contract_revoke_is_in_progress_then_refuses_collectives_and_allows_destroy() {
    same_in_processes(
        "contract_revoke_is_in_progress_then_refuses_collectives_and_allows_destroy",
        "ncclCommRevoke",
        2,
        |k| {
            let comm = k.init(2, k.r);
            k.settle(comm, "init");
            k.seq.wait();
            let t = k.t;
            let revoke = t.ncclCommRevoke.expect("NCCL 2.29 has ncclCommRevoke");
            // SAFETY: a ready handle; flags 0.
            k.call("revoke", unsafe { revoke(comm, 0) });
            k.settle(comm, "revoke");
            // SAFETY: as above.
            k.call("second revoke", unsafe { revoke(comm, 0) });
            let mut x = support::differential::buf(4);
            let p = support::differential::ptr(&mut x);
            // SAFETY: live buffers; NCCL refuses the call before touching them.
            k.call("all_reduce after the revoke", unsafe {
                (t.ncclAllReduce)(p, p, 4, ncclFloat32, ncclSum, comm, core::ptr::null_mut())
            });
            k.seq.wait();
            // SAFETY: destroyed once.
            k.call("destroy", unsafe { (t.ncclCommDestroy)(comm) });
        },
    );
}

/// ncclCommRevoke with flags other than 0: refused with nothing changed.
#[test]
fn contract_revoke_with_flags_is_refused() {
    same("ncclCommRevoke (flags)", 1, |k| {
        let comm = k.init(1, 0);
        k.settle(comm, "init");
        let revoke = k.t.ncclCommRevoke.expect("NCCL 2.29 has ncclCommRevoke");
        // SAFETY: a ready handle; NCCL refuses the flags.
        k.call("revoke with flags 1", unsafe { revoke(comm, 1) });
        k.state(comm, "after the refusal");
        // SAFETY: destroyed once.
        k.call("destroy", unsafe { (k.t.ncclCommDestroy)(comm) });
    });
}

/// Revoke, then shrink through the safe API (the path `shrink_after_failure` takes after
/// an error), 3 ranks: rank 2 leaves, the others revoke and shrink to 2.
#[test]
fn revoke_then_shrink_through_the_safe_api() {
    let lib = source_nccl(VERSION);
    let id = UniqueId::new_with(&lib).unwrap();
    let got = within(Duration::from_secs(120), move || {
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let (lib, id) = (&lib, &id);
                    sc.spawn(move || {
                        let ctx = CudaContext::new(r).unwrap();
                        let comm = Communicator::init_rank_in(
                            lib,
                            &CommDevice::Cuda(ctx),
                            3,
                            r,
                            id,
                            &config(),
                        )
                        .unwrap();
                        if r == 2 {
                            comm.destroy().map_err(|(_, e)| e).unwrap();
                            return None;
                        }
                        comm.revoke().unwrap();
                        let small = comm.shrink_after_failure(&[2]).unwrap();
                        let got = (small.world_size(), small.rank());
                        small.destroy().map_err(|(_, e)| e).unwrap();
                        drop(comm);
                        Some(got)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    });
    assert_eq!(got, vec![Some((2, 0)), Some((2, 1)), None]);
}

/// Grow through the safe API on NCCL's own host code: 2 ranks grow to 3, the root's id
/// handed to the new rank; every rank sees the new size, and the parent stays usable
/// (its size, a split of it).
#[test]
fn grow_adds_a_rank_and_leaves_the_parent_usable() {
    let lib = source_nccl(VERSION);
    let id = UniqueId::new_with(&lib).unwrap();
    let got = within(Duration::from_secs(120), move || {
        let (tx, rx) = mpsc::channel::<UniqueId>();
        std::thread::scope(|sc| {
            let newcomer = {
                let lib = &lib;
                sc.spawn(move || {
                    let grow_id = rx.recv().unwrap();
                    let ctx = CudaContext::new(2).unwrap();
                    let big = Communicator::join_grown_in(
                        lib,
                        &CommDevice::Cuda(ctx),
                        3,
                        2,
                        &grow_id,
                        &config(),
                    )
                    .unwrap();
                    let got = (big.rank(), big.world_size());
                    big.destroy().map_err(|(_, e)| e).unwrap();
                    got
                })
            };
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let (lib, id, tx) = (&lib, &id, tx.clone());
                    sc.spawn(move || {
                        let ctx = CudaContext::new(r).unwrap();
                        let comm = Communicator::init_rank_in(
                            lib,
                            &CommDevice::Cuda(ctx),
                            2,
                            r,
                            id,
                            &config(),
                        )
                        .unwrap();
                        let big = if r == 0 {
                            let grow_id = comm.grow_id().unwrap();
                            tx.send(grow_id).unwrap();
                            comm.grow(3, Some(&grow_id)).unwrap()
                        } else {
                            comm.grow(3, None).unwrap()
                        };
                        let got = (big.rank(), big.world_size());
                        big.destroy().map_err(|(_, e)| e).unwrap();
                        let alone = comm.split(Some(r as u32), 0).unwrap().unwrap();
                        assert_eq!(alone.world_size(), 1);
                        alone.destroy().map_err(|(_, e)| e).unwrap();
                        comm.destroy().map_err(|(_, e)| e).unwrap();
                        got
                    })
                })
                .collect();
            let mut all: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            all.push(newcomer.join().unwrap());
            all
        })
    });
    assert_eq!(got, vec![(0, 3), (1, 3), (2, 3)]);
}

/// ncclCommShrink with NCCL_SHRINK_ABORT after a revoke (init.cc:2740-2858 of 2.29.7), the
/// call `shrink_after_failure` makes: rank 2 is lost (aborted), ranks 0 and 1 revoke, then
/// shrink it out, one after the other. What each call returns, whether the child is
/// written in the call or by the job, and the states of parent and child.
#[test]
fn contract_shrink_abort_after_a_revoke_excludes_the_lost_rank() {
    same_in_processes(
        "contract_shrink_abort_after_a_revoke_excludes_the_lost_rank",
        "ncclCommShrink (NCCL_SHRINK_ABORT)",
        3,
        |k| {
            let parent = k.init(3, k.r);
            k.settle(parent, "init");
            k.seq.wait();
            if k.r == 2 {
                // SAFETY: aborted once, never used again.
                k.call("abort (the lost rank)", unsafe {
                    (k.t.ncclCommAbort)(parent)
                });
            }
            k.seq.wait();
            let revoke = k.t.ncclCommRevoke.expect("NCCL 2.29 has ncclCommRevoke");
            let shrink = k.t.ncclCommShrink.expect("NCCL 2.29 has ncclCommShrink");
            if k.r < 2 {
                // SAFETY: a ready handle; flags 0.
                k.call("revoke", unsafe { revoke(parent, 0) });
                k.settle(parent, "revoke");
            }
            k.seq.wait();
            let mut child: ncclComm_t = core::ptr::null_mut();
            let mut exclude = [2];
            let abort = NCCL_SHRINK_ABORT as core::ffi::c_int;
            let mut call = |k: &mut Rank, child: &mut ncclComm_t| {
                // SAFETY: a revoked parent; the out-pointer outlives the job (waited for
                // below); the exclude list lives across the call.
                let got = unsafe {
                    shrink(
                        parent,
                        exclude.as_mut_ptr(),
                        1,
                        child,
                        core::ptr::null_mut(),
                        abort,
                    )
                };
                k.call("shrink (abort)", got);
            };
            match k.r {
                0 => {
                    call(k, &mut child);
                    k.check("child written in the call", !child.is_null());
                    k.state(parent, "parent before the peer shrinks");
                    k.seq.wait();
                }
                1 => {
                    k.seq.wait();
                    call(k, &mut child);
                }
                _ => {
                    k.seq.wait();
                }
            }
            if k.r < 2 {
                k.settle(parent, "parent after the shrink");
                // SAFETY: the job has ended (the parent left ncclInProgress): it wrote `child`.
                let child = unsafe { core::ptr::read_volatile(&child) };
                k.check("child written by the job", !child.is_null());
                k.settle(child, "child");
                k.count(child, "child");
                // SAFETY: destroyed once.
                k.call("destroy child", unsafe { (k.t.ncclCommDestroy)(child) });
            }
            k.seq.wait();
            if k.r < 2 {
                // SAFETY: destroyed once.
                k.call("destroy parent", unsafe { (k.t.ncclCommDestroy)(parent) });
            }
        },
    );
}

/// ncclCommGetUniqueId then ncclCommGrow (init.cc:2860-3010 of 2.29.7): ranks 0 and 1 grow
/// to 3 with a new rank 2, the root's id handed over; the calls one after the other. What
/// each returns, whether the new handle is written in the call, the new communicator's
/// state and size, and the parent's size after it.
#[test]
fn contract_grow_is_in_progress_until_every_rank_joined() {
    same_in_processes(
        "contract_grow_is_in_progress_until_every_rank_joined",
        "ncclCommGrow",
        3,
        |k| {
            let parent = (k.r < 2).then(|| k.init(2, k.r));
            if let Some(p) = parent {
                k.settle(p, "init");
            }
            k.seq.wait();
            if k.r == 0 {
                let get =
                    k.t.ncclCommGetUniqueId
                        .expect("NCCL 2.29 has ncclCommGetUniqueId");
                let mut id = ncclUniqueId { internal: [0; 128] };
                // SAFETY: a ready parent, a valid out-pointer.
                k.call("get grow id", unsafe { get(parent.unwrap(), &mut id) });
                k.check("id written", id.internal.iter().any(|&b| b != 0));
                k.seq.hand(id);
            }
            k.seq.wait();
            let grow = k.t.ncclCommGrow.expect("NCCL 2.29 has ncclCommGrow");
            let id = k.seq.handed();
            let mut big: ncclComm_t = core::ptr::null_mut();
            let mut config = k.config();
            for turn in 0..3 {
                if turn == k.r {
                    // SAFETY: a ready parent (or none, for the new rank); the id lives across
                    // the call (NCCL copies it); the out-pointer outlives the job (waited for
                    // below); a null config inherits the parent's.
                    let got = unsafe {
                        match parent {
                            Some(p) => grow(
                                p,
                                3,
                                if k.r == 0 { &id } else { core::ptr::null() },
                                -1,
                                &mut big,
                                core::ptr::null_mut(),
                            ),
                            None => grow(core::ptr::null_mut(), 3, &id, 2, &mut big, &mut config),
                        }
                    };
                    k.call("grow", got);
                    k.check("new handle written in the call", !big.is_null());
                    if let Some(p) = parent {
                        k.state(p, "parent during the grow");
                        // The new rank has not called yet: the grown communicator waits.
                        k.state(big, "grown before the new rank called");
                    }
                }
                k.seq.wait();
            }
            if let Some(p) = parent {
                k.settle(p, "parent after the grow");
            }
            // SAFETY: every rank has called: the job ends (bounded by `settle`) and writes
            // the handle before its state leaves ncclInProgress.
            let big = unsafe { core::ptr::read_volatile(&big) };
            k.check("new handle written", !big.is_null());
            if !big.is_null() {
                k.settle(big, "grown");
                k.count(big, "grown");
            }
            if let Some(p) = parent {
                k.count(p, "parent after the grow");
            }
            k.seq.wait();
            if !big.is_null() {
                // SAFETY: destroyed once.
                k.call("destroy grown", unsafe { (k.t.ncclCommDestroy)(big) });
            }
            k.seq.wait();
            if let Some(p) = parent {
                // SAFETY: destroyed once.
                k.call("destroy parent", unsafe { (k.t.ncclCommDestroy)(p) });
            }
        },
    );
}

/// A boundary rank's grow waits in NCCL's call for the root's id (init.cc:2913-2924,
/// `bcastGrowHandle`'s bootstrap receive, bootstrap.cc:481): without `Config::elastic`,
/// rank 1 grows while rank 0 never calls `grow_id`. The watchdog revokes rank 1's
/// communicator where it is (it never aborts one under its grow call), NCCL's abort flags
/// end the receive, and the grow returns an error with the handle still rank 1's.
#[test]
#[cfg(feature = "diag")]
fn a_grow_waiting_for_its_id_is_ended_by_the_watchdogs_revoke() {
    let lib = source_nccl(VERSION);
    let id = UniqueId::new_with(&lib).unwrap();
    let grown = std::sync::atomic::AtomicBool::new(false);
    within(Duration::from_secs(120), move || {
        std::thread::scope(|sc| {
            for r in 0..2 {
                let (lib, id, grown) = (&lib, &id, &grown);
                sc.spawn(move || {
                    let ctx = CudaContext::new(r).unwrap();
                    // The grow's bound is the communicator's timeout (1 s); NCCL's own init
                    // gets a wider one, since it can take longer than that on a loaded machine.
                    let cfg = Config::new().timeout(Duration::from_secs(1));
                    let comm = Communicator::init_rank_nonblocking_in(
                        lib,
                        &CommDevice::Cuda(ctx),
                        2,
                        r,
                        id,
                        &cfg,
                    )
                    .unwrap()
                    .wait(Duration::from_secs(60))
                    .unwrap();
                    if r == 0 {
                        while !grown.load(std::sync::atomic::Ordering::SeqCst) {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        return;
                    }
                    let e = comm.grow(3, None).unwrap_err();
                    grown.store(true, std::sync::atomic::Ordering::SeqCst);
                    assert!(comm.is_revoked(), "not revoked: {e}");
                    assert!(!comm.as_raw().is_null(), "the handle was taken: {e}");
                });
            }
        });
    });
}
