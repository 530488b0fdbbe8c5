//! The group rule (ARCHITECTURE.md, "The group rule"): NCCL's group state belongs to the
//! thread, and inside an open group NCCL only queues every call until the outermost
//! `ncclGroupEnd`. A `Group` therefore keeps its operations and makes `ncclGroupStart`, their
//! calls and `ncclGroupEnd` in one go at its end, so no NCCL group is ever open while the
//! caller's code runs. Each test here is a safe call sequence that, with a group left open
//! across the caller's code, returned `Ok` with its work only queued and its borrows ended.

use nccl_launch::Launcher;
use nccl_safe::{Group, ReduceOp, Stream, WindowFlags};

const S: Stream = Stream::Host;

/// A single collective while a `Group` holds operations runs at once, alone: its buffer is
/// written when the call returns, and may be dropped before the group ends.
#[test]
fn a_single_collective_while_a_group_is_filled_runs_before_it_returns() {
    Launcher::host(2)
        .run(|rank| {
            let (comm, n) = (rank.comm(), rank.world_size() as f32);
            let mut grads = vec![1.0f32; 4];
            Group::run(|g| {
                g.push(comm.all_reduce_in_place_op(&mut grads, ReduceOp::Sum, &S)?)?;
                let mut tmp = vec![1.0f32; 16];
                comm.all_reduce_in_place(&mut tmp, ReduceOp::Sum, &S)?;
                assert_eq!(tmp, vec![n; 16], "the single all_reduce's result on return");
                drop(tmp); // freed before the group's end: NCCL must be done with it
                Ok(())
            })?;
            assert_eq!(grads, vec![n; 4], "the group's own work");
            Ok(())
        })
        .unwrap();
}

/// A `Group` leaked with `mem::forget` (safe) leaves nothing queued: its operations never
/// run, and a later group on the same thread is launched by its own end.
#[test]
fn a_leaked_group_leaves_nothing_queued_for_later_groups() {
    Launcher::host(2)
        .run(|rank| {
            let (comm, n) = (rank.comm(), rank.world_size() as u32);
            let mut leaked = vec![1u32; 8];
            let mut g = Group::new();
            g.push(comm.all_reduce_in_place_op(&mut leaked, ReduceOp::Sum, &S)?)?;
            std::mem::forget(g);
            let mut out = vec![1u32; 8];
            Group::run(|g| g.push(comm.all_reduce_in_place_op(&mut out, ReduceOp::Sum, &S)?))?;
            assert_eq!(out, vec![n; 8], "the later group ran by its own end");
            assert_eq!(leaked, vec![1; 8], "the leaked group's operation never ran");
            drop(leaked);
            // A single operation after it runs at once too.
            let mut x = vec![2u32; 3];
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S)?;
            assert_eq!(x, vec![2 * n; 3]);
            Ok(())
        })
        .unwrap();
}

/// A `Group` ended while another is being filled launches its work by its own end (NCCL
/// would only count a nested group's depth down and launch nothing).
#[test]
fn a_group_inside_a_group_is_launched_by_its_own_end() {
    Launcher::host(3)
        .run(|rank| {
            let (comm, n) = (rank.comm(), rank.world_size() as i64);
            let (mut outer, mut inner) = (vec![1i64; 2], vec![10i64; 5]);
            let mut g = Group::new();
            g.push(comm.all_reduce_in_place_op(&mut outer, ReduceOp::Sum, &S)?)?;
            Group::run(|g2| {
                g2.push(comm.all_reduce_in_place_op(&mut inner, ReduceOp::Sum, &S)?)
            })?;
            assert_eq!(
                inner,
                vec![10 * n; 5],
                "the inner group's result at its end"
            );
            drop(inner);
            g.end()?;
            assert_eq!(outer, vec![n; 2]);
            Ok(())
        })
        .unwrap();
}

/// Registration, windows, a new communicator and teardown while a `Group` holds
/// operations: each runs at once, outside the group (NCCL would queue a window's
/// registration with the caller's out-pointer and write it at the group's end).
#[test]
fn registration_windows_and_creation_while_a_group_is_filled_run_at_once() {
    Launcher::host(2)
        .run(|rank| {
            let (comm, n) = (rank.comm(), rank.world_size() as f32);
            let mut x = vec![1.0f32; 4];
            let mut g = Group::new();
            g.push(comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)?)?;

            let mut w = vec![1.0f32; 16];
            let mut win = comm.register_window(&mut w, WindowFlags::empty())?;
            assert!(
                !win.as_raw().is_null(),
                "the window's handle, written in the call"
            );
            comm.all_reduce_in_place(&mut win, ReduceOp::Sum, &S)?;
            win.deregister()?;
            assert_eq!(w, vec![n; 16]);

            let mut r = vec![3.0f32; 4];
            let mut reg = comm.register(&mut r)?;
            comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &S)?;
            drop(reg);
            assert_eq!(r, vec![3.0 * n; 4]);

            let child = comm.split(Some(0), rank.rank() as i32)?.expect("a child");
            let mut c = vec![5u8; 2];
            child.all_reduce_in_place(&mut c, ReduceOp::Sum, &S)?;
            assert_eq!(c, vec![5 * rank.world_size() as u8; 2]);
            child.destroy().map_err(|(_, e)| e)?;

            g.end()?;
            assert_eq!(x, vec![n; 4]);
            Ok(())
        })
        .unwrap();
}

/// A window registered while a `Group` holds operations is registered by its call, its
/// handle written before it returns: inside an open NCCL group the registration would only
/// be queued with the caller's out-pointer, written at the group's end (dev_runtime.cc:
/// 909-915, :533/:596 of 2.28.9; the host provider does the same), after the call had
/// returned and freed it.
#[test]
fn a_window_registered_while_a_group_is_filled_has_its_handle_on_return() {
    Launcher::host(2)
        .run(|rank| {
            let comm = rank.comm();
            let mut x = vec![1.0f32; 4];
            let mut g = Group::new();
            g.push(comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)?)?;
            let mut w = vec![0u8; 64];
            let win = comm.register_window(&mut w, WindowFlags::empty())?;
            assert!(!win.as_raw().is_null(), "the window's handle on return");
            win.deregister()?;
            g.end()?;
            assert_eq!(x, vec![rank.world_size() as f32; 4]);
            Ok(())
        })
        .unwrap();
}
