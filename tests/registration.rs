//! fp8 element types, NCCL memory, buffer registration and windows, on the host provider:
//! every rule of the safe layer, with the provider's counters proving each allocation is
//! freed once and each registration deregistered once.

mod support;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use float8::{F8E4M3, F8E5M2};
use nccl_launch::Launcher;
use nccl_safe::host::{self, stats_for, HostStats};
use nccl_safe::{
    CommDevice, Communicator, Config, DataType, Error, Group, Library, Memory, NcclMemory,
    NcclType, ReduceOp, SendBuffer, Stream, UniqueId, Version, WindowFlags,
};
use nccl_sys::bindings::{ncclInvalidUsage, ncclSuccess};

use support::within;

const LIMIT: Duration = Duration::from_secs(60);

/// Serializes the tests that read process-wide counters (`mem_allocated`, `mem_freed`).
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `world` ranks on `lib` (a host provider), each with its own communicator of one
/// fresh id, and destroys them; returns the id's counters.
fn ranks_on(
    lib: Arc<Library>,
    world: usize,
    f: impl Fn(&Communicator) + Send + Sync + 'static,
) -> (UniqueId, HostStats) {
    within(LIMIT, move || {
        let id = UniqueId::new_with(&lib).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let (lib, f, id) = (&lib, &f, &id);
                    s.spawn(move || {
                        let comm = Communicator::init_rank_in(
                            lib,
                            &CommDevice::Host,
                            world,
                            rank,
                            id,
                            &Config::new(),
                        )
                        .unwrap();
                        f(&comm);
                        comm.destroy().map_err(|(_, e)| e).unwrap();
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        });
        let st = stats_for(&id.to_raw());
        (id, st)
    })
}

fn ranks(world: usize, f: impl Fn(&Communicator) + Send + Sync + 'static) -> HostStats {
    let (id, st) = ranks_on(Library::host(), world, f);
    support::assert_balanced(&id);
    st
}

#[track_caller]
fn assert_unsupported<T: std::fmt::Debug>(
    r: nccl_safe::Result<T>,
    symbol: &str,
    needs: (u32, u32),
) {
    match r {
        Err(Error::Unsupported {
            symbol: s,
            needs: n,
            found,
        }) => {
            assert_eq!(s, symbol);
            assert_eq!(n, Version::new(needs.0, needs.1, 0));
            assert!(found < n, "{found} < {n}");
        }
        other => panic!("expected Unsupported({symbol}), got {other:?}"),
    }
}

#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(r: nccl_safe::Result<T>, op: &str, says: &str) {
    match r {
        Err(Error::InvalidArgument { call: o, reason }) => {
            assert_eq!(o, op, "{reason}");
            assert!(reason.contains(says), "{reason:?} should say {says:?}");
        }
        other => panic!("expected InvalidArgument from {op}, got {other:?}"),
    }
}

// ---- fp8 -------------------------------------------------------------------------------

fn fp8_collectives<T: NcclType + PartialEq + std::fmt::Debug>(
    of: fn(f32) -> T,
    name: &'static str,
) {
    let st = ranks(3, move |comm| {
        let r = comm.rank() as f32;
        let s = Stream::Host;
        // 1 + 2 + 3, 0.5 * 3, -(1 + 2 + 3): exact in both formats.
        let send = vec![of(r + 1.0), of(0.5), of(-(r + 1.0))];
        let mut recv = vec![of(0.0); 3];
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
            .unwrap();
        assert_eq!(recv, vec![of(6.0), of(1.5), of(-6.0)], "{name} sum");
        comm.all_reduce(&send, &mut recv, ReduceOp::Max, &s)
            .unwrap();
        assert_eq!(recv, vec![of(3.0), of(0.5), of(-1.0)], "{name} max");
        let mut gathered = vec![of(0.0); 9];
        comm.all_gather(&send, &mut gathered, &s).unwrap();
        assert_eq!(
            gathered[3..6],
            vec![of(2.0), of(0.5), of(-2.0)][..],
            "{name} gather"
        );
        let mut b = vec![of(r); 2];
        comm.broadcast_in_place(&mut b, 2, &s).unwrap();
        assert_eq!(b, vec![of(2.0); 2], "{name} broadcast");
        let pre = comm.create_pre_mul_sum(of(2.0)).unwrap();
        comm.all_reduce(&send, &mut recv, &pre, &s).unwrap();
        assert_eq!(recv, vec![of(12.0), of(3.0), of(-12.0)], "{name} premulsum");
    });
    assert_eq!(st.misused, 0);
}

#[test]
fn fp8_e4m3_and_e5m2_reduce_through_the_safe_layer() {
    let _g = serial();
    assert_eq!(F8E4M3::DATA_TYPE, DataType::Float8e4m3);
    assert_eq!(F8E5M2::DATA_TYPE, DataType::Float8e5m2);
    assert_eq!(
        (DataType::Float8e4m3.size(), DataType::Float8e5m2.size()),
        (1, 1)
    );
    assert_eq!(
        DataType::Float8e4m3.to_raw(),
        nccl_sys::bindings::ncclFloat8e4m3
    );
    assert_eq!(
        DataType::Float8e5m2.to_raw(),
        nccl_sys::bindings::ncclFloat8e5m2
    );
    assert_eq!(DataType::Float8e4m3.name(), "f8e4m3");
    fp8_collectives(F8E4M3::from_f32, "e4m3");
    fp8_collectives(F8E5M2::from_f32, "e5m2");
}

#[test]
fn fp8_saturates_as_the_host_provider_documents() {
    let _g = serial();
    // e4m3 has no infinity: 448 + 448 saturates to 448 (NCCL's satfinite conversion).
    ranks(2, |comm| {
        let send = vec![F8E4M3::from_f32(448.0)];
        let mut recv = vec![F8E4M3::from_f32(0.0)];
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &Stream::Host)
            .unwrap();
        assert_eq!(recv[0].to_f32(), 448.0);
    });
}

#[test]
fn fp8_on_an_nccl_older_than_2_24_is_unsupported_before_nccl_sees_it() {
    let _g = serial();
    let old = Library::host_as_version(2, 23).unwrap();
    let (_, st) = ranks_on(old, 2, |comm| {
        let s = Stream::Host;
        let send = vec![F8E4M3::from_f32(1.0); 4];
        let mut recv = send.clone();
        assert_unsupported(
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s),
            "ncclFloat8e4m3",
            (2, 24),
        );
        let mut b = vec![F8E5M2::from_f32(1.0); 2];
        assert_unsupported(
            comm.broadcast_in_place(&mut b, 0, &s),
            "ncclFloat8e5m2",
            (2, 24),
        );
        assert_unsupported(
            comm.send(&b, 1 - comm.rank(), &s),
            "ncclFloat8e5m2",
            (2, 24),
        );
        assert_unsupported(
            comm.create_pre_mul_sum(F8E4M3::from_f32(2.0)),
            "ncclFloat8e4m3",
            (2, 24),
        );
        let mut g = Group::new();
        assert_unsupported(
            comm.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &s)
                .and_then(|op| g.push(op)),
            "ncclFloat8e4m3",
            (2, 24),
        );
        drop(g);
        // The refusal left the communicator usable; other types still work.
        assert!(!comm.is_failed());
        let mut x = vec![1.0f32; 2];
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s).unwrap();
        assert_eq!(x, vec![2.0; 2]);
    });
    assert_eq!(st.misused, 0);
    // 2.24 is enough.
    let (_, st) = ranks_on(Library::host_as_version(2, 24).unwrap(), 2, |comm| {
        let mut v = vec![F8E5M2::from_f32(1.5); 2];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum, &Stream::Host)
            .unwrap();
        assert_eq!(v, vec![F8E5M2::from_f32(3.0); 2]);
    });
    assert_eq!(st.misused, 0);
}

// ---- NcclMemory ------------------------------------------------------------------------

#[test]
fn nccl_memory_is_a_buffer_of_every_collective_and_is_freed_once() {
    let _g = serial();
    let before = host::stats();
    Launcher::host(3)
        .run(|rank| {
            let (comm, s, r) = (rank.comm(), rank.stream(), rank.rank());
            let mut grads = NcclMemory::<f32>::alloc_zeros(comm, 6, s)?;
            assert_eq!((grads.len(), grads.memory()), (6, Memory::Host));
            assert!(grads.cuda_view().is_err());
            assert_eq!(grads.to_vec(s)?, vec![0.0; 6], "zeroed");
            grads.copy_from_host(&[r as f32 + 1.0; 6], s)?;
            // In place, and as send and receive buffer of another NcclMemory.
            comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, s)?;
            assert_eq!(grads.as_host_slice()?, &[6.0; 6]);
            let mut out = NcclMemory::<f32>::alloc_zeros(comm, 6, s)?;
            comm.all_reduce(&grads, &mut out, ReduceOp::Max, s)?;
            assert_eq!(out.to_vec(s)?, vec![6.0; 6]);
            // Views: every rank's 2-element block of `out` comes from an all-gather of a
            // view of `grads`.
            grads.as_host_slice_mut()?[2] = 10.0 * r as f32;
            let part = grads.slice(2..4)?;
            assert_eq!(SendBuffer::<f32>::len(&part), 2);
            comm.all_gather(&part, &mut out, s)?;
            assert_eq!(out.to_vec(s)?, vec![0.0, 6.0, 10.0, 6.0, 20.0, 6.0]);
            let mut block = out.slice_mut(2 * r..2 * r + 2)?;
            comm.broadcast_in_place(&mut block, 0, s)?;
            assert_eq!(&out.to_vec(s)?[2 * r..2 * r + 2], &[0.0, 6.0]);
            // Explicit free reports; the other one is freed on drop.
            out.free()?;
            Ok(())
        })
        .unwrap();
    let after = host::stats();
    assert_eq!(after.mem_allocated - before.mem_allocated, 6);
    assert_eq!(after.mem_freed - before.mem_freed, 6);
    assert_eq!(after.misused, before.misused);
}

#[test]
fn nccl_memory_is_checked_like_any_buffer() {
    let _g = serial();
    let before = host::stats();
    ranks(2, |comm| {
        let s = Stream::Host;
        let mut empty = NcclMemory::<u8>::alloc_zeros(comm, 0, &s).unwrap();
        assert!(empty.is_empty() && empty.to_vec(&s).unwrap().is_empty());
        comm.all_reduce_in_place(&mut empty, ReduceOp::Sum, &s)
            .unwrap();
        assert_invalid(comm.register(&mut empty), "ncclCommRegister", "empty");
        assert_invalid(
            NcclMemory::<u64>::alloc_zeros(comm, usize::MAX / 4, &s),
            "ncclMemAlloc",
            "overflow",
        );
        let mut m = NcclMemory::<i32>::alloc_zeros(comm, 4, &s).unwrap();
        assert!(matches!(
            m.copy_from_host(&[1, 2, 3], &s),
            Err(Error::LengthMismatch {
                expected: 4,
                actual: 3,
                ..
            })
        ));
        let mut short = [0; 5];
        assert!(matches!(
            m.copy_to_host(&mut short, &s),
            Err(Error::LengthMismatch {
                expected: 4,
                actual: 5,
                ..
            })
        ));
        assert_invalid(m.slice(3..5), "NcclMemory::slice", "not within");
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = m.slice_mut(3..1);
        assert_invalid(reversed, "NcclMemory::slice_mut", "not within");
        assert_invalid(
            m.cuda_view_mut(),
            "NcclMemory::cuda_view_mut",
            "no CUDA view",
        );
        // A collective checks an NcclMemory's length as any buffer's.
        let mut three = NcclMemory::<i32>::alloc_zeros(comm, 3, &s).unwrap();
        assert!(matches!(
            comm.all_reduce(&m, &mut three, ReduceOp::Sum, &s),
            Err(Error::LengthMismatch { .. })
        ));
        assert!(!comm.is_failed());
    });
    let after = host::stats();
    assert_eq!(after.mem_allocated - before.mem_allocated, 6);
    assert_eq!(after.mem_freed - before.mem_freed, 6);
    assert_eq!(after.misused, before.misused);
}

#[test]
fn nccl_memory_before_2_19_is_unsupported() {
    let _g = serial();
    let old = Library::host_as_version(2, 18).unwrap();
    assert_unsupported(
        NcclMemory::<f32>::alloc_zeros_in(&old, 4, Stream::Host),
        "ncclMemAlloc",
        (2, 19),
    );
    let new = Library::host_as_version(2, 19).unwrap();
    let m = NcclMemory::<f32>::alloc_zeros_in(&new, 4, Stream::Host).unwrap();
    assert_eq!(m.len(), 4);
    m.free().unwrap();
}

// ---- registration ----------------------------------------------------------------------

#[test]
fn a_registered_buffer_needs_no_extra_argument_and_is_deregistered_once() {
    let _g = serial();
    let st = ranks(2, |comm| {
        let s = Stream::Host;
        let mut buf = vec![1i32; 8];
        {
            let mut reg = comm.register(&mut buf).unwrap();
            assert_eq!(SendBuffer::<i32>::len(&reg), 8);
            assert!(!reg.as_raw().is_null());
            for _ in 0..3 {
                comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &s)
                    .unwrap();
            }
            reg.as_mut_slice()[0] = 100;
            let mut out = vec![0i32; 8];
            comm.all_reduce(&reg, &mut out, ReduceOp::Max, &s).unwrap();
            assert_eq!(out[..2], [100, 8]);
            assert_eq!(reg.buffer()[1], 8);
        }
        assert_eq!(buf[..2], [100, 8]);
        // NcclMemory registered, explicit deregistration, then registered again.
        let mut mem = NcclMemory::<f64>::alloc_zeros(comm, 4, &s).unwrap();
        let mut reg = comm.register(&mut mem).unwrap();
        reg.copy_from_host(&[2.0; 4], &s).unwrap();
        comm.all_reduce_in_place(&mut reg, ReduceOp::Prod, &s)
            .unwrap();
        reg.deregister().unwrap();
        let reg = comm.register(&mut mem).unwrap();
        assert_eq!(reg.buffer().to_vec(&s).unwrap(), vec![4.0; 4]);
    });
    assert_eq!((st.registered, st.deregistered), (6, 6));
    assert_eq!((st.double_deregistered, st.unknown_deregistered), (0, 0));
    assert_eq!((st.live_at_teardown, st.misused), (0, 0));
}

#[test]
fn registered_buffers_work_inside_a_group() {
    let _g = serial();
    let comms = Communicator::init_all(&[CommDevice::Host, CommDevice::Host]).unwrap();
    let id = host::root_id_of(comms[0].as_raw()).unwrap();
    let (mut a, mut b) = (vec![1u32; 4], vec![2u32; 4]);
    {
        let mut ra = comms[0].register(&mut a).unwrap();
        let mut rb = comms[1].register(&mut b).unwrap();
        let mut g = Group::new();
        comms[0]
            .all_reduce_in_place_op(&mut ra, ReduceOp::Sum, &Stream::Host)
            .and_then(|op| g.push(op))
            .unwrap();
        comms[1]
            .all_reduce_in_place_op(&mut rb, ReduceOp::Sum, &Stream::Host)
            .and_then(|op| g.push(op))
            .unwrap();
        g.end().unwrap();
    }
    assert_eq!((a, b), (vec![3; 4], vec![3; 4]));
    for c in comms {
        c.destroy().map_err(|(_, e)| e).unwrap();
    }
    let st = stats_for(&id);
    assert_eq!((st.registered, st.deregistered, st.misused), (2, 2, 0));
}

#[test]
fn registration_rules_give_typed_errors_and_keep_the_communicator() {
    let _g = serial();
    let st = ranks(2, |comm| {
        let mut empty: Vec<f32> = Vec::new();
        assert_invalid(comm.register(&mut empty), "ncclCommRegister", "empty");
        let mut buf = vec![0u8; 16];
        assert_invalid(
            comm.register_window(&mut buf, WindowFlags::COLL_SYMMETRIC),
            "ncclCommWindowRegister",
            "NcclMemory",
        );
        assert_invalid(
            comm.register_window(&mut empty, WindowFlags::empty()),
            "ncclCommWindowRegister",
            "empty",
        );
        assert!(!comm.is_failed());
        // Still fine afterwards.
        let mut reg = comm.register(&mut buf).unwrap();
        comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &Stream::Host)
            .unwrap();
    });
    assert_eq!(
        (st.registered, st.deregistered, st.windows_registered),
        (2, 2, 0)
    );
    assert_eq!(st.misused, 0);
}

#[test]
fn registration_before_2_19_and_windows_before_2_27_are_unsupported() {
    let _g = serial();
    let (_, st) = ranks_on(Library::host_as_version(2, 18).unwrap(), 1, |comm| {
        let mut v = vec![1.0f32; 4];
        assert_unsupported(comm.register(&mut v), "ncclCommRegister", (2, 19));
        assert_unsupported(
            comm.register_window(&mut v, WindowFlags::empty()),
            "ncclCommWindowRegister",
            (2, 27),
        );
    });
    assert_eq!(st.misused, 0);
    let (_, st) = ranks_on(Library::host_as_version(2, 26).unwrap(), 1, |comm| {
        let mut v = vec![1.0f32; 4];
        let reg = comm.register(&mut v).unwrap();
        drop(reg);
        assert_unsupported(
            comm.register_window(&mut v, WindowFlags::empty()),
            "ncclCommWindowRegister",
            (2, 27),
        );
    });
    assert_eq!((st.registered, st.deregistered), (1, 1));
    let (_, st) = ranks_on(Library::host_as_version(2, 29).unwrap(), 1, |comm| {
        let mut m = NcclMemory::<f32>::alloc_zeros(comm, 4, Stream::Host).unwrap();
        assert_unsupported(
            comm.register_window(&mut m, WindowFlags::STRICT_ORDERING),
            "NCCL_WIN_STRICT_ORDERING",
            (2, 30),
        );
        comm.register_window(&mut m, WindowFlags::COLL_SYMMETRIC)
            .unwrap()
            .deregister()
            .unwrap();
    });
    assert_eq!((st.windows_registered, st.windows_deregistered), (1, 1));
}

// ---- windows ---------------------------------------------------------------------------

#[test]
fn symmetric_windows_on_nccl_memory_and_its_views() {
    let _g = serial();
    let st = ranks(3, |comm| {
        let s = Stream::Host;
        let r = comm.rank() as f32;
        let mut mem = NcclMemory::<f32>::alloc_zeros(comm, 2048, &s).unwrap();
        {
            let mut win = comm
                .register_window(&mut mem, WindowFlags::COLL_SYMMETRIC)
                .unwrap();
            assert_eq!(win.flags(), WindowFlags::COLL_SYMMETRIC);
            assert!(!win.as_raw().is_null());
            win.copy_from_host(&[r + 1.0; 2048], &s).unwrap();
            comm.all_reduce_in_place(&mut win, ReduceOp::Sum, &s)
                .unwrap();
            let mut out = vec![0.0f32; 3 * 2048];
            comm.all_gather(&win, &mut out, &s).unwrap();
            assert_eq!(out, vec![6.0; 3 * 2048]);
        }
        assert_eq!(mem.to_vec(&s).unwrap(), vec![6.0; 2048]);
        // A window of a view: part of an ncclMemAlloc allocation is still symmetric, when
        // it starts a multiple of 4096 bytes in (NCCL_WIN_REQUIRED_ALIGNMENT).
        let mut view = mem.slice_mut(1024..2048).unwrap();
        let mut win = comm
            .register_window(&mut view, WindowFlags::COLL_SYMMETRIC)
            .unwrap();
        comm.all_reduce_in_place(&mut win, ReduceOp::Max, &s)
            .unwrap();
        win.deregister().unwrap();
        // 16 bytes in: NCCL's job would refuse it and fail the communicator; refused first.
        let mut view = mem.slice_mut(4..8).unwrap();
        match comm.register_window(&mut view, WindowFlags::COLL_SYMMETRIC) {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("starts 16 bytes in"), "{reason}")
            }
            other => panic!("a misaligned symmetric window: {other:?}"),
        }
        assert!(!comm.is_failed());
        // A plain (non-symmetric) window on ordinary host memory.
        let mut v = vec![1u8; 3];
        let mut win = comm.register_window(&mut v, WindowFlags::empty()).unwrap();
        comm.all_reduce_in_place(&mut win, ReduceOp::Sum, &s)
            .unwrap();
        drop(win);
        assert_eq!(v, vec![3; 3]);
    });
    assert_eq!((st.windows_registered, st.windows_deregistered), (9, 9));
    assert_eq!((st.live_at_teardown, st.misused), (0, 0));
}

// ---- the host provider's misuse counters -----------------------------------------------

#[test]
fn double_and_unknown_deregistrations_are_counted_as_misuse() {
    let _g = serial();
    let (_, st) = ranks_on(Library::host(), 1, |comm| {
        let t = comm.library().table();
        let dereg = t.ncclCommDeregister.unwrap();
        let wdereg = t.ncclCommWindowDeregister.unwrap();
        let mut v = vec![0i64; 4];
        let reg = comm.register(&mut v).unwrap();
        let token = reg.as_raw();
        reg.deregister().unwrap();
        let mut m = NcclMemory::<u8>::alloc_zeros(comm, 64, Stream::Host).unwrap();
        let win = comm
            .register_window(&mut m, WindowFlags::COLL_SYMMETRIC)
            .unwrap();
        let w = win.as_raw();
        win.deregister().unwrap();
        // SAFETY: the host provider checks every handle; these are the misuses it counts.
        unsafe {
            assert_eq!(dereg(comm.as_raw(), token), ncclInvalidUsage);
            assert_eq!(
                dereg(comm.as_raw(), 0x1234_5670 as *mut _),
                ncclInvalidUsage
            );
            assert_eq!(dereg(comm.as_raw(), std::ptr::null_mut()), ncclSuccess);
            assert_eq!(wdereg(comm.as_raw(), w), ncclInvalidUsage);
            assert_eq!(wdereg(comm.as_raw(), token.cast()), ncclInvalidUsage);
            assert_eq!(wdereg(comm.as_raw(), std::ptr::null_mut()), ncclSuccess);
        }
    });
    assert_eq!((st.double_deregistered, st.unknown_deregistered), (2, 2));
    assert_eq!(st.misused, 4);
    assert_eq!((st.registered, st.deregistered), (1, 1));
    assert_eq!((st.windows_registered, st.windows_deregistered), (1, 1));
}

#[test]
fn a_registration_of_another_communicator_is_unknown_to_this_one() {
    let _g = serial();
    let comms = Communicator::init_all(&[CommDevice::Host, CommDevice::Host]).unwrap();
    let id = host::root_id_of(comms[0].as_raw()).unwrap();
    let dereg = comms[0].library().table().ncclCommDeregister.unwrap();
    let mut v = vec![0.0f32; 2];
    let reg = comms[0].register(&mut v).unwrap();
    // SAFETY: the host provider checks the handle against the communicator.
    let r = unsafe { dereg(comms[1].as_raw(), reg.as_raw()) };
    assert_eq!(r, ncclInvalidUsage);
    drop(reg);
    for c in comms {
        c.destroy().map_err(|(_, e)| e).unwrap();
    }
    let st = stats_for(&id);
    assert_eq!((st.unknown_deregistered, st.misused), (1, 1));
    assert_eq!(
        (st.registered, st.deregistered, st.live_at_teardown),
        (1, 1, 0)
    );
}

#[test]
fn a_communicator_torn_down_with_live_registrations_releases_and_counts_them() {
    let _g = serial();
    // Only a leaked guard (or a failure) lets this happen through the safe layer.
    let st = ranks(2, |comm| {
        let v = Box::leak(Box::new(vec![0u32; 4]));
        std::mem::forget(comm.register(v).unwrap());
        let m = Box::leak(Box::new(
            NcclMemory::<u32>::alloc_zeros(comm, 4, Stream::Host).unwrap(),
        ));
        std::mem::forget(
            comm.register_window(m, WindowFlags::COLL_SYMMETRIC)
                .unwrap(),
        );
    });
    assert_eq!((st.registered, st.deregistered), (2, 0));
    assert_eq!((st.windows_registered, st.windows_deregistered), (2, 0));
    assert_eq!((st.live_at_teardown, st.misused), (4, 0));
}

#[test]
fn after_a_failure_registrations_are_released_and_windows_left_to_the_abort() {
    let _g = serial();
    let (id, st) = within(LIMIT, || {
        let id = CommDevice::Host.unique_id().unwrap();
        std::thread::scope(|s| {
            for rank in 0..2 {
                let id = &id;
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, id, &Config::new())
                            .unwrap();
                    let mut v = vec![1.0f32; 4];
                    let mut m = NcclMemory::<f32>::alloc_zeros(&comm, 4, Stream::Host).unwrap();
                    let mut reg = comm.register(&mut v).unwrap();
                    let mut win = comm
                        .register_window(&mut m, WindowFlags::COLL_SYMMETRIC)
                        .unwrap();
                    comm.all_reduce_in_place(&mut win, ReduceOp::Sum, &Stream::Host)
                        .unwrap();
                    if rank == 1 {
                        // Rank 1 leaves: its window and registration go first, then it aborts.
                        drop((win, reg));
                        comm.abort().unwrap();
                        return;
                    }
                    // Rank 0's next collective fails, which marks its communicator failed;
                    // rank 1 never issued it (its window's deregistration took that
                    // collective's number), so the whole clique fails (chaos seed 919).
                    let r = comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &Stream::Host);
                    assert!(r.is_err(), "{r:?}");
                    assert!(comm.is_failed());
                    // A failed clique's handles may be under the watchdog's abort: the
                    // deregistration is skipped, and so is the collective window
                    // deregistration (its peer is gone); both are left to the abort.
                    drop(reg);
                    assert!(matches!(
                        win.deregister(),
                        Err(Error::CommunicatorFailed { .. })
                    ));
                    drop(comm); // aborts (failed)
                });
            }
        });
        let st = stats_for(&id.to_raw());
        (id, st)
    });
    let _ = id;
    assert_eq!((st.registered, st.deregistered), (2, 1));
    assert_eq!((st.windows_registered, st.windows_deregistered), (2, 1));
    assert_eq!((st.live_at_teardown, st.misused), (2, 0));
    assert_eq!(st.created, st.destroyed + st.aborted);
}

/// A rank that panics while holding a window skips the collective deregistration (its
/// peers are elsewhere and would never join it) and marks its communicator failed, which
/// is then aborted: its thread ends at once. Before, the panicking rank blocked in the
/// deregistration until its peer deregistered too, here never (the peer waits for it to
/// end): both hung until the 60 s timeout. (The host provider's window deregistration is
/// local, unlike NCCL's, so here only the registration's skip shows in its counters.) A
/// registration dropped during a panic is skipped the same way.
#[test]
fn a_panic_holding_a_window_or_registration_fails_the_peers_at_once() {
    let _g = serial();
    let config = Config::new()
        .timeout(Duration::from_secs(60))
        .abort_timeout(Duration::from_secs(5));
    for window in [true, false] {
        let id = UniqueId::new_with(&Library::host()).unwrap();
        let took = within(LIMIT, {
            let config = config.clone();
            move || {
                let registered = std::sync::Barrier::new(2);
                std::thread::scope(|s| {
                    let panicker = s.spawn(|| {
                        let c =
                            Communicator::init_rank(&CommDevice::Host, 2, 0, &id, &config).unwrap();
                        let mut buf = vec![0f32; 16];
                        if window {
                            let _w = c.register_window(&mut buf, WindowFlags::empty()).unwrap();
                            registered.wait();
                            panic!("rank 0 panics holding a window");
                        } else {
                            let _r = c.register(&mut buf).unwrap();
                            registered.wait();
                            panic!("rank 0 panics holding a registration");
                        }
                    });
                    let c = Communicator::init_rank(&CommDevice::Host, 2, 1, &id, &config).unwrap();
                    let mut buf = vec![0f32; 16];
                    let w = window.then(|| c.register_window(&mut buf, WindowFlags::empty()));
                    registered.wait();
                    // Rank 1 holds its window until rank 0's thread has ended.
                    let t = std::time::Instant::now();
                    assert!(panicker.join().is_err());
                    let took = t.elapsed();
                    drop(w);
                    let r = c.all_reduce_in_place(&mut [1.0f32][..], ReduceOp::Sum, &Stream::Host);
                    assert!(r.is_err(), "rank 0 is gone");
                    took
                })
            }
        });
        assert!(
            took < Duration::from_secs(5),
            "window {window}: rank 0 ended after {took:?}"
        );
        let st = stats_for(&id.to_raw());
        assert_eq!((st.created, st.misused), (2, 0), "{st:?}");
        if !window {
            // Skipped: still registered when the abort tore the communicator down.
            assert_eq!((st.deregistered, st.live_at_teardown), (0, 1), "{st:?}");
        }
    }
}
