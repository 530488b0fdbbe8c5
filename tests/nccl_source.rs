//! NVIDIA's NCCL itself, built from source (`scripts/build-nccl.sh`), over the fake CUDA
//! runtime and driver and the fake NVML (`tests/support/fakes`): the crate's contract with
//! NCCL checked against NCCL's own host code, where the other tests check it against the
//! host provider and the fake NCCL, which follow our reading of NCCL's source.
//!
//! NCCL's kernels are not built: a launch is recorded and nothing runs, so no collective
//! moves data between ranks (those checks stay on the host provider). What runs is NCCL's:
//! bootstrap over sockets, topology, transports set up over sockets, the group machinery
//! (thread-local depth, the thread a non-blocking group's launch runs on,
//! `ncclInProgress`), the jobs that write out-pointers, and teardown.

#![allow(non_upper_case_globals)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use nccl_safe::{CommDevice, Communicator, Config, ReduceOp, UniqueId};
use support::fakes::{source_nccl, RuntimeGauge};
use support::within;

const VERSION: &str = "2.28.9-1";

fn config() -> Config {
    Config::new().timeout(Duration::from_secs(30))
}

/// One rank: NCCL's init over the fakes, an out-of-place all_reduce (NCCL's one-rank path
/// copies, through the fake runtime's `cudaMemcpyAsync`: the data does move), and destroy.
#[test]
fn one_rank_inits_reduces_and_destroys_on_nccls_own_host_code() {
    let lib = source_nccl(VERSION);
    assert_eq!(lib.version().to_string(), "2.28.9");
    within(Duration::from_secs(60), move || {
        let ctx = CudaContext::new(0).unwrap();
        let s = ctx.new_stream().unwrap();
        let id = UniqueId::new_with(&lib).unwrap();
        let comm =
            Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx.clone()), 1, 0, &id, &config())
                .expect("NCCL's init over the fakes");
        let x = s.clone_htod(&[1.0f32, 2.0, 3.0]).unwrap();
        let mut y = s.alloc_zeros::<f32>(3).unwrap();
        comm.all_reduce(&x, &mut y, ReduceOp::Sum, &s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(s.clone_dtoh(&y).unwrap(), vec![1.0, 2.0, 3.0]);
        comm.destroy().map_err(|(_, e)| e).unwrap();
    });
}

/// Runs `f(rank, comm)` on `n` ranks in threads (fake devices 0..n) over NCCL built from
/// source, each with its own communicator of one id.
fn with_ranks<R: Send>(
    n: usize,
    config: &Config,
    f: impl Fn(usize, Communicator, &Arc<cudarc::driver::CudaStream>) -> R + Sync,
) -> Vec<R> {
    let lib = source_nccl(VERSION);
    let id = UniqueId::new_with(&lib).unwrap();
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (lib, id, f) = (&lib, &id, &f);
                sc.spawn(move || {
                    let ctx = CudaContext::new(r).unwrap();
                    let s = ctx.new_stream().unwrap();
                    let comm =
                        Communicator::init_rank_in(lib, &CommDevice::Cuda(ctx), n, r, id, config)
                            .expect("NCCL's init over sockets");
                    f(r, comm, &s)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// Init, split and shrink through the safe API on NCCL's own host code, 3 and 4 ranks: the
/// children NCCL's jobs write, with their sizes and ranks, and a destroy of each.
#[test]
fn split_and_shrink_give_the_children_nccls_jobs_write() {
    source_nccl(VERSION);
    let got = within(Duration::from_secs(120), || {
        with_ranks(3, &config(), |r, comm, _| {
            assert_eq!((comm.world_size(), comm.rank()), (3, r));
            let half = comm.split(Some((r % 2) as u32), r as i32).unwrap().unwrap();
            let split = (half.world_size(), half.rank());
            let shrunk = (r != 2).then(|| {
                let small = comm.shrink(&[2]).unwrap();
                let got = (small.world_size(), small.rank());
                small.destroy().map_err(|(_, e)| e).unwrap();
                got
            });
            half.destroy().map_err(|(_, e)| e).unwrap();
            comm.destroy().map_err(|(_, e)| e).unwrap();
            (split, shrunk)
        })
    });
    assert_eq!(
        got,
        vec![
            ((2, 0), Some((2, 0))),
            ((1, 0), Some((2, 1))),
            ((2, 1), None)
        ]
    );
    let sizes = within(Duration::from_secs(120), || {
        with_ranks(4, &config(), |_, comm, _| {
            let n = comm.world_size();
            comm.destroy().map_err(|(_, e)| e).unwrap();
            n
        })
    });
    assert_eq!(sizes, vec![4; 4]);
}

/// A group of collectives on two ranks: NCCL's non-blocking group end returns
/// ncclInProgress and launches from its own thread; the crate waits for it and returns Ok,
/// and each rank's kernels were launched. No kernel runs here, so NCCL's proxy would wait
/// for them forever: each rank aborts (a destroy would wait for the proxy's work).
#[test]
fn a_group_of_collectives_on_two_ranks_is_launched_by_nccls_thread() {
    source_nccl(VERSION);
    let launches = || {
        support::fakes::driver()
            .runtime_gauge(RuntimeGauge::KernelLaunches)
            .unwrap()
    };
    let before = launches();
    within(Duration::from_secs(120), || {
        with_ranks(2, &config(), |r, comm, s| {
            let mut x = s.clone_htod(&[r as f32; 64]).unwrap();
            let mut y = s.clone_htod(&[r as i32; 8]).unwrap();
            let mut g = nccl_safe::Group::new();
            g.push(
                comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, s)
                    .unwrap(),
            )
            .unwrap();
            g.push(comm.broadcast_in_place_op(&mut y, 0, s).unwrap())
                .unwrap();
            g.end().expect("the group's launch, on NCCL's thread");
            // A single collective is NCCL's implicit group: the same path.
            comm.all_reduce_in_place(&mut x, ReduceOp::Max, s).unwrap();
            comm.abort().unwrap();
        })
    });
    assert!(
        launches() >= before + 4,
        "two launches per rank: {before} -> {}",
        launches()
    );
}

/// An init whose peer never comes ends with the crate's timeout, and its abort returns.
#[test]
fn an_init_whose_peer_never_comes_times_out() {
    let lib = source_nccl(VERSION);
    let err = within(Duration::from_secs(60), move || {
        let ctx = CudaContext::new(0).unwrap();
        let id = UniqueId::new_with(&lib).unwrap();
        let cfg = Config::new().timeout(Duration::from_secs(2));
        Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx), 2, 0, &id, &cfg)
            .expect_err("no peer: no communicator")
    });
    assert!(
        matches!(err, nccl_safe::Error::Timeout { .. }),
        "a timeout, not {err}"
    );
}

use support::differential::{buf, ptr, Target};

/// NCCL 2.28.9 and the host provider as NCCL 2.28.
const TARGET: Target = Target {
    version: VERSION,
    host: (2, 28),
    config_size: 80,
    code: 22809,
};

fn same(
    row: &str,
    n: usize,
    scenario: impl Fn(&mut support::differential::Rank) + Sync + Send + Copy + 'static,
) {
    support::differential::same(&TARGET, row, n, scenario)
}

/// [`same`], then with each rank in a process of its own (`test`: the calling test).
fn same_in_processes(
    test: &str,
    row: &str,
    n: usize,
    scenario: impl Fn(&mut support::differential::Rank) + Sync + Send + Copy + 'static,
) {
    support::differential::same_in_processes(&TARGET, test, row, n, scenario)
}

use nccl_sys::bindings::*;

/// ncclCommInitRankConfig (init.cc:1964-2042): the handle is written in the call, the call
/// returns ncclInProgress, and every other call is refused (ncclCommEnsureReady) until the
/// init job ends.
#[test]
fn contract_init_is_in_progress_and_refuses_calls_until_ready() {
    same_in_processes(
        "contract_init_is_in_progress_and_refuses_calls_until_ready",
        "ncclCommInitRankConfig",
        2,
        |k| {
            let comm = if k.r == 0 {
                let c = k.init(2, 0);
                k.state(c, "before the peer arrives");
                k.count(c, "before the peer arrives");
                k.seq.wait();
                c
            } else {
                k.seq.wait();
                k.init(2, 1)
            };
            k.settle(comm, "init");
            k.count(comm, "ready");
            // SAFETY: a ready handle, destroyed once.
            k.call("destroy", unsafe { (k.t.ncclCommDestroy)(comm) });
        },
    );
}

/// ncclCommDestroy on a communicator still initializing (init.cc:2357-2392): refused with
/// ncclInvalidArgument after entering a group level that is never left, which the next
/// ncclGroupEnd of the thread closes.
#[test]
fn contract_destroy_while_in_progress_is_refused_and_leaves_a_group_level_open() {
    same_in_processes(
        "contract_destroy_while_in_progress_is_refused_and_leaves_a_group_level_open",
        "ncclCommDestroy",
        2,
        |k| {
            let comm = if k.r == 0 {
                let c = k.init(2, 0);
                // SAFETY: a live handle; NCCL refuses it (nothing is freed).
                k.call("destroy while in progress", unsafe {
                    (k.t.ncclCommDestroy)(c)
                });
                // SAFETY: closes the level the refused destroy left open, if any.
                k.call("group end after it", unsafe { (k.t.ncclGroupEnd)() });
                // SAFETY: no group is open now.
                k.call("a second group end", unsafe { (k.t.ncclGroupEnd)() });
                k.seq.wait();
                c
            } else {
                k.seq.wait();
                k.init(2, 1)
            };
            k.settle(comm, "init");
            // SAFETY: a ready handle, destroyed once.
            k.call("destroy when ready", unsafe { (k.t.ncclCommDestroy)(comm) });
        },
    );
}

/// ncclCommSplit on a non-blocking parent (init.cc:2550-2680): ncclSuccess with the job
/// still running, the child NULL in the call and stored by the job, the parent in progress
/// meanwhile.
#[test]
fn contract_split_returns_success_and_its_job_writes_the_child() {
    same_in_processes(
        "contract_split_returns_success_and_its_job_writes_the_child",
        "ncclCommSplit",
        2,
        |k| {
            let parent = k.init(2, k.r);
            k.settle(parent, "init");
            k.seq.wait();
            let mut child: ncclComm_t = core::ptr::null_mut();
            if k.r == 0 {
                // SAFETY: a ready parent, a valid out-pointer that outlives the job (this
                // function waits for the job below).
                let got =
                    unsafe { (k.t.ncclCommSplit)(parent, 0, 0, &mut child, core::ptr::null_mut()) };
                k.call("split", got);
                k.check("child written in the call", !child.is_null());
                k.state(parent, "parent before the peer splits");
                k.count(parent, "parent before the peer splits");
                k.seq.wait();
            } else {
                k.seq.wait();
                // SAFETY: as above.
                let got =
                    unsafe { (k.t.ncclCommSplit)(parent, 0, 1, &mut child, core::ptr::null_mut()) };
                k.call("split", got);
            }
            k.settle(parent, "parent after the split");
            // SAFETY: the job has ended (the parent left ncclInProgress): it wrote `child`.
            let child = unsafe { core::ptr::read_volatile(&child) };
            k.check("child written by the job", !child.is_null());
            k.settle(child, "child");
            k.count(child, "child");
            // SAFETY: ready handles, each destroyed once.
            unsafe {
                k.call("destroy child", (k.t.ncclCommDestroy)(child));
                k.call("destroy parent", (k.t.ncclCommDestroy)(parent));
            }
        },
    );
}

/// ncclCommFinalize (init.cc:2263-2302): ncclInProgress or ncclSuccess, then ready; a
/// second finalize is refused. The call returns the asynchronous state read after the group
/// end has started the flush's thread (:2289-2293), and that thread may have ended by then
/// (CI saw ncclSuccess once in processes): either answer is NCCL's.
#[test]
fn contract_finalize_is_in_progress_then_a_second_is_refused() {
    same_in_processes(
        "contract_finalize_is_in_progress_then_a_second_is_refused",
        "ncclCommFinalize",
        2,
        |k| {
            let comm = k.init(2, k.r);
            k.settle(comm, "init");
            // SAFETY: a ready handle.
            let got = unsafe { (k.t.ncclCommFinalize)(comm) };
            k.call_racing("finalize", got, &[ncclInProgress, ncclSuccess]);
            k.settle(comm, "finalize");
            // SAFETY: as above.
            k.call("second finalize", unsafe { (k.t.ncclCommFinalize)(comm) });
            // SAFETY: destroyed once.
            k.call("destroy", unsafe { (k.t.ncclCommDestroy)(comm) });
        },
    );
}

/// A collective in a group of a non-blocking communicator with two ranks (group.cc:646-765,
/// enqueue.cc:2620-2663): queued (ncclSuccess) inside the group; the group's end returns
/// ncclInProgress (the launch runs on the group's thread) and the state reads ncclInProgress
/// until that thread ends. NCCL's kernels do not run here, so the communicator is then
/// aborted rather than destroyed (a destroy waits for the proxy's work).
#[test]
fn contract_a_group_of_a_collective_ends_in_progress_with_two_ranks() {
    same_in_processes(
        "contract_a_group_of_a_collective_ends_in_progress_with_two_ranks",
        "ncclGroupEnd",
        2,
        |k| {
            let comm = k.init(2, k.r);
            k.settle(comm, "init");
            let mut x = buf(16);
            // SAFETY: live buffers; the communicator is aborted before `x` is dropped.
            unsafe {
                k.call("group start", (k.t.ncclGroupStart)());
                k.call(
                    "all_reduce in the group",
                    (k.t.ncclAllReduce)(
                        ptr(&mut x),
                        ptr(&mut x),
                        16,
                        ncclFloat32,
                        ncclSum,
                        comm,
                        core::ptr::null_mut(),
                    ),
                );
                k.call("group end", (k.t.ncclGroupEnd)());
            }
            k.settle(comm, "launch");
            // SAFETY: aborted once.
            k.call("abort", unsafe { (k.t.ncclCommAbort)(comm) });
        },
    );
}

/// A collective on one rank (enqueue.cc:2620-2663): ncclSuccess, run in the call.
#[test]
fn contract_a_one_rank_collective_runs_in_the_call() {
    same("a collective, one rank", 1, |k| {
        let comm = k.init(1, 0);
        k.settle(comm, "init");
        let (mut a, mut b) = (buf(8), vec![0f32; 8]);
        // SAFETY: live buffers, waited for below.
        unsafe {
            k.call(
                "all_reduce",
                (k.t.ncclAllReduce)(
                    ptr(&mut a),
                    ptr(&mut b),
                    8,
                    ncclFloat32,
                    ncclSum,
                    comm,
                    core::ptr::null_mut(),
                ),
            );
        }
        k.state(comm, "after the all_reduce");
        // SAFETY: destroyed once.
        k.call("destroy", unsafe { (k.t.ncclCommDestroy)(comm) });
    });
}

/// ncclCommAbort of a communicator whose init waits for a peer that never comes
/// (init.cc:2502-2541): ncclSuccess, in the call.
#[test]
fn contract_abort_ends_an_init_whose_peer_never_comes() {
    same("ncclCommAbort", 1, |k| {
        let comm = k.init(2, 0);
        std::thread::sleep(Duration::from_millis(100));
        k.state(comm, "waiting for the peer");
        // SAFETY: aborted once.
        k.call("abort", unsafe { (k.t.ncclCommAbort)(comm) });
    });
}

/// Run by [`two_processes_init_split_and_destroy`] in each child: `NCCL_SAFE_CHILD` is
/// `RANK:ID` (the id's bytes in hex).
#[test]
#[ignore = "run in a child process by two_processes_init_split_and_destroy"]
fn child_rank_inits_splits_and_destroys() {
    let Ok(arg) = std::env::var("NCCL_SAFE_CHILD") else {
        panic!("run by two_processes_init_split_and_destroy")
    };
    let (rank, hex) = arg.split_once(':').unwrap();
    let rank: usize = rank.parse().unwrap();
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let lib = source_nccl(VERSION);
    let id = UniqueId::from_bytes(&bytes).unwrap();
    // Each process is one rank on its own fake device (NCCL refuses two ranks of one
    // communicator on one device of one host).
    let ctx = CudaContext::new(rank).unwrap();
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx), 2, rank, &id, &config())
        .expect("NCCL's init across processes");
    let child = comm.split(Some(0), -(rank as i32)).unwrap().unwrap();
    println!(
        "rank {rank}: split rank {} of {}",
        child.rank(),
        child.world_size()
    );
    child.destroy().map_err(|(_, e)| e).unwrap();
    comm.destroy().map_err(|(_, e)| e).unwrap();
    println!("rank {rank}: destroyed");
}

/// Two processes, one rank each, over NCCL's bootstrap and socket transport: init, a split
/// whose keys reverse the ranks, and destroy; each exits 0.
#[test]
fn two_processes_init_split_and_destroy() {
    let lib = source_nccl(VERSION);
    let id = UniqueId::new_with(&lib).unwrap();
    let hex: String = id.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let children: Vec<_> = (0..2)
        .map(|r| {
            support::spawn_child(
                "child_rank_inits_splits_and_destroys",
                "NCCL_SAFE_CHILD",
                &format!("{r}:{hex}"),
            )
        })
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let mark = format!("rank {r}: split rank {} of 2", 1 - r);
        support::check_child_exit(child, &mark, 0, Duration::from_secs(90));
    }
}

/// ncclCommShrink of a non-blocking parent (init.cc:2550-2680, 2.27+): as a split, ncclSuccess
/// with the job running, the child NULL in the call and stored by the job; the excluded
/// rank takes no part.
#[test]
fn contract_shrink_returns_success_and_its_job_writes_the_child() {
    same_in_processes(
        "contract_shrink_returns_success_and_its_job_writes_the_child",
        "ncclCommShrink",
        3,
        |k| {
            let parent = k.init(3, k.r);
            k.settle(parent, "init");
            k.seq.wait();
            let shrink = k.t.ncclCommShrink.expect("NCCL 2.28 has ncclCommShrink");
            let mut child: ncclComm_t = core::ptr::null_mut();
            let mut exclude = [2];
            let mut call = |k: &mut support::differential::Rank, child: &mut ncclComm_t| {
                // SAFETY: a ready parent; the out-pointer outlives the job (waited for below);
                // the exclude list lives across the call.
                let got = unsafe {
                    shrink(
                        parent,
                        exclude.as_mut_ptr(),
                        1,
                        child,
                        core::ptr::null_mut(),
                        0,
                    )
                };
                k.call("shrink", got);
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
            // SAFETY: destroyed once.
            k.call("destroy parent", unsafe { (k.t.ncclCommDestroy)(parent) });
        },
    );
}

/// ncclCommWindowRegister on a non-blocking communicator without symmetric support
/// (dev_runtime.cc:891-922): ncclSuccess with the registration still running, `*win`
/// written by the group's job (the local registration's handle, :596), the communicator in
/// progress meanwhile; deregistration in the call. On memory from ncclMemAlloc.
#[test]
fn contract_window_registration_is_written_by_its_job() {
    same_in_processes(
        "contract_window_registration_is_written_by_its_job",
        "ncclCommWindowRegister",
        2,
        |k| {
            let comm = k.init(2, k.r);
            k.settle(comm, "init");
            let register = k.t.ncclCommWindowRegister.expect("2.28 has windows");
            let deregister = k.t.ncclCommWindowDeregister.expect("2.28 has windows");
            let mut mem: *mut core::ffi::c_void = core::ptr::null_mut();
            let alloc = k.t.ncclMemAlloc.expect("2.28 has ncclMemAlloc");
            let free = k.t.ncclMemFree.expect("2.28 has ncclMemFree");
            // SAFETY: a valid out-pointer.
            k.call("ncclMemAlloc", unsafe { alloc(&mut mem, 1 << 16) });
            let mut win: ncclWindow_t = core::ptr::null_mut();
            // SAFETY: live memory of 64 KiB; the out-pointer outlives the job (waited below).
            k.call("window register", unsafe {
                register(comm, mem, 1 << 16, &mut win, 0)
            });
            k.settle(comm, "registration");
            // SAFETY: the job has ended: it wrote `win`.
            let win = unsafe { core::ptr::read_volatile(&win) };
            k.check("window written by the job", !win.is_null());
            // SAFETY: the window of this communicator, deregistered once.
            k.call("window deregister", unsafe { deregister(comm, win) });
            // SAFETY: from ncclMemAlloc, freed once after the deregistration.
            k.call("ncclMemFree", unsafe { free(mem) });
            k.seq.wait();
            // SAFETY: destroyed once.
            k.call("destroy", unsafe { (k.t.ncclCommDestroy)(comm) });
        },
    );
}

/// ncclCommRegister / ncclCommDeregister (register/register.cc:116-168): local, in the call,
/// the handle written in it.
#[test]
fn contract_local_registration_is_in_the_call() {
    same_in_processes(
        "contract_local_registration_is_in_the_call",
        "ncclCommRegister",
        2,
        |k| {
            let comm = k.init(2, k.r);
            k.settle(comm, "init");
            let register = k.t.ncclCommRegister.expect("2.28 has ncclCommRegister");
            let deregister = k.t.ncclCommDeregister.expect("2.28 has ncclCommDeregister");
            let alloc = k.t.ncclMemAlloc.expect("2.28 has ncclMemAlloc");
            let free = k.t.ncclMemFree.expect("2.28 has ncclMemFree");
            let mut mem: *mut core::ffi::c_void = core::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            k.call("ncclMemAlloc", unsafe { alloc(&mut mem, 1 << 16) });
            let mut handle: *mut core::ffi::c_void = core::ptr::null_mut();
            // SAFETY: live memory of 64 KiB, a valid out-pointer.
            k.call("register", unsafe {
                register(comm, mem, 1 << 16, &mut handle)
            });
            k.check("handle written in the call", !handle.is_null());
            k.state(comm, "after the registration");
            // SAFETY: the handle of this communicator, deregistered once.
            k.call("deregister", unsafe { deregister(comm, handle) });
            // SAFETY: from ncclMemAlloc, freed once.
            k.call("ncclMemFree", unsafe { free(mem) });
            k.seq.wait();
            // SAFETY: destroyed once.
            k.call("destroy", unsafe { (k.t.ncclCommDestroy)(comm) });
        },
    );
}

/// ncclCommAbort of a parent whose split job waits for a peer that never splits
/// (init.cc:2502-2541): the abort fails the job's child and joins the job, which stores its
/// out-pointer at its end (init.cc:1612-1614); then the abort returns.
#[test]
fn contract_abort_during_a_split_joins_its_job() {
    same_in_processes(
        "contract_abort_during_a_split_joins_its_job",
        "ncclCommAbort (split in flight)",
        2,
        |k| {
            let parent = k.init(2, k.r);
            k.settle(parent, "init");
            k.seq.wait();
            if k.r == 0 {
                let mut child: ncclComm_t = core::ptr::null_mut();
                // SAFETY: a ready parent; `child` outlives the job (the abort joins it).
                let got =
                    unsafe { (k.t.ncclCommSplit)(parent, 0, 0, &mut child, core::ptr::null_mut()) };
                k.call("split", got);
                std::thread::sleep(Duration::from_millis(100));
                k.state(parent, "the peer never splits");
                // SAFETY: aborted once; the job is joined by it.
                k.call("abort", unsafe { (k.t.ncclCommAbort)(parent) });
                // SAFETY: the job has ended (joined by the abort).
                let child = unsafe { core::ptr::read_volatile(&child) };
                k.check("child stored by the failed job", !child.is_null());
                if !child.is_null() {
                    // SAFETY: a child NCCL handed out, torn down once.
                    k.call("abort child", unsafe { (k.t.ncclCommAbort)(child) });
                }
            }
            k.seq.wait();
            if k.r == 1 {
                // SAFETY: destroyed once (its peer is gone: abort, which never blocks on it).
                k.call("abort", unsafe { (k.t.ncclCommAbort)(parent) });
            }
        },
    );
}
