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

fn config() -> Config {
    Config::new().timeout(Duration::from_secs(30))
}

/// ncclCommRevoke (init.cc:2602-2693 of 2.29.7): ncclInProgress, the job's own result
/// once it ends; a second revoke refused (ncclInvalidArgument, :2647-2658), collectives
/// refused afterwards (ncclInvalidUsage, enqueue.cc:2983-2986), destroy allowed.
#[test]
fn contract_revoke_is_in_progress_then_refuses_collectives_and_allows_destroy() {
    same("ncclCommRevoke", 2, |k| {
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
    });
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

/// A boundary rank's grow waits in NCCL's call for the root's id (init.cc:2913-2924,
/// `bcastGrowHandle`'s bootstrap receive, bootstrap.cc:481): without `Config::elastic`,
/// rank 1 grows while rank 0 never calls `grow_id`. The watchdog revokes rank 1's
/// communicator where it is (it never aborts one under its grow call), NCCL's abort flags
/// end the receive, and the grow returns an error with the handle still rank 1's.
#[test]
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
                    let cfg = Config::new().timeout(Duration::from_secs(1));
                    let comm =
                        Communicator::init_rank_in(lib, &CommDevice::Cuda(ctx), 2, r, id, &cfg)
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
