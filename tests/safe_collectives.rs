//! The safe layer's collectives on the host provider: every operation x every dtype x
//! world sizes 1..=4, results checked against values computed here; every reduction on
//! all_reduce; PreMulSum; groups over several communicators; split, shrink and
//! non-blocking init. Every run also checks that each handle was torn down exactly once.

mod support;

use std::time::Duration;

use half::{bf16, f16};
use nccl_safe::host::{root_id_of, stats_for};
use nccl_safe::{
    CommDevice, Communicator, Config, Error, Group, ReduceOp, ResultCode, Stream, UniqueId,
    DEFAULT_TIMEOUT,
};
use support::{assert_balanced, run_ranks, El};

const COUNT: usize = 5;
const S: Stream = Stream::Host;

/// Rank `r`'s element `i`: small, varied, negative too where the type allows.
fn val(signed: bool, r: usize, i: usize) -> i64 {
    let v = ((i * 3 + r * 5) % 7) as i64;
    if signed {
        v - 3
    } else {
        v
    }
}

fn vals<T: El>(r: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| T::of(val(T::SIGNED, r, i))).collect()
}

fn sum_of(signed: bool, world: usize, i: usize) -> i64 {
    (0..world).map(|r| val(signed, r, i)).sum()
}

fn of_all<T: El>(v: impl IntoIterator<Item = i64>) -> Vec<T> {
    v.into_iter().map(T::of).collect()
}

/// A sentinel that no computed value equals, to see untouched buffers.
fn sentinel<T: El>(n: usize) -> Vec<T> {
    vec![T::of(99); n]
}

fn check_all_collectives<T: El>() {
    for world in 1..=4 {
        run_ranks(world, |comm| {
            let r = comm.rank();
            let sg = T::SIGNED;
            let sums: Vec<T> = of_all((0..COUNT).map(|i| sum_of(sg, world, i)));

            // all_reduce, out of place and in place.
            let send = vals::<T>(r, COUNT);
            let mut recv = sentinel::<T>(COUNT);
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &S)
                .unwrap();
            assert_eq!(recv, sums, "all_reduce world {world}");
            let mut buf = vals::<T>(r, COUNT);
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &S)
                .unwrap();
            assert_eq!(buf, sums, "all_reduce_in_place world {world}");

            for root in 0..world {
                // broadcast, out of place and in place.
                let mut recv = sentinel::<T>(COUNT);
                comm.broadcast(&send, &mut recv, root, &S).unwrap();
                assert_eq!(recv, vals::<T>(root, COUNT), "broadcast root {root}");
                let mut buf = if r == root {
                    vals::<T>(r, COUNT)
                } else {
                    sentinel(COUNT)
                };
                comm.broadcast_in_place(&mut buf, root, &S).unwrap();
                assert_eq!(buf, vals::<T>(root, COUNT), "broadcast_in_place {root}");

                // reduce: only the root's receive buffer is written.
                let mut recv = sentinel::<T>(COUNT);
                comm.reduce(&send, &mut recv, ReduceOp::Sum, root, &S)
                    .unwrap();
                let want = if r == root {
                    sums.clone()
                } else {
                    sentinel(COUNT)
                };
                assert_eq!(recv, want, "reduce root {root} on rank {r}");
                let mut buf = vals::<T>(r, COUNT);
                comm.reduce_in_place(&mut buf, ReduceOp::Sum, root, &S)
                    .unwrap();
                let want = if r == root {
                    sums.clone()
                } else {
                    vals(r, COUNT)
                };
                assert_eq!(buf, want, "reduce_in_place root {root} on rank {r}");

                // gather: rank i's block at i * COUNT on the root.
                let mut recv = sentinel::<T>(COUNT * world);
                comm.gather(&send, &mut recv, root, &S).unwrap();
                let want: Vec<T> = if r == root {
                    (0..world).flat_map(|q| vals::<T>(q, COUNT)).collect()
                } else {
                    sentinel(COUNT * world)
                };
                assert_eq!(recv, want, "gather root {root} on rank {r}");

                // scatter: block r of the root's send to rank r.
                let big: Vec<T> = of_all((0..COUNT * world).map(|i| val(sg, root, i)));
                let mut recv = sentinel::<T>(COUNT);
                comm.scatter(&big, &mut recv, root, &S).unwrap();
                let want: Vec<T> = of_all((0..COUNT).map(|k| val(sg, root, r * COUNT + k)));
                assert_eq!(recv, want, "scatter root {root} on rank {r}");
            }

            // all_gather, out of place and in place.
            let gathered: Vec<T> = (0..world).flat_map(|q| vals::<T>(q, COUNT)).collect();
            let mut recv = sentinel::<T>(COUNT * world);
            comm.all_gather(&send, &mut recv, &S).unwrap();
            assert_eq!(recv, gathered, "all_gather world {world}");
            let mut buf = sentinel::<T>(COUNT * world);
            buf[r * COUNT..(r + 1) * COUNT].copy_from_slice(&send);
            comm.all_gather_in_place(&mut buf, &S).unwrap();
            assert_eq!(buf, gathered, "all_gather_in_place world {world}");

            // reduce_scatter: block r of the element-wise sum, out of place and in place.
            let big: Vec<T> = vals(r, COUNT * world);
            let block: Vec<T> = of_all((0..COUNT).map(|k| sum_of(sg, world, r * COUNT + k)));
            let mut recv = sentinel::<T>(COUNT);
            comm.reduce_scatter(&big, &mut recv, ReduceOp::Sum, &S)
                .unwrap();
            assert_eq!(recv, block, "reduce_scatter world {world}");
            let mut buf = big.clone();
            comm.reduce_scatter_in_place(&mut buf, ReduceOp::Sum, &S)
                .unwrap();
            assert_eq!(
                &buf[r * COUNT..(r + 1) * COUNT],
                &block[..],
                "reduce_scatter_in_place"
            );

            // send/recv ring in one group.
            let next = (r + 1) % world;
            let prev = (r + world - 1) % world;
            let mut got = sentinel::<T>(COUNT);
            let mut g = Group::new();
            comm.send_op(&send, next, &S)
                .and_then(|op| g.push(op))
                .unwrap();
            comm.recv_op(&mut got, prev, &S)
                .and_then(|op| g.push(op))
                .unwrap();
            g.end().unwrap();
            assert_eq!(got, vals::<T>(prev, COUNT), "ring world {world}");

            // all_to_all: block j of rank i's send lands in block i of rank j's recv.
            let mut recv = sentinel::<T>(COUNT * world);
            comm.all_to_all(&big, &mut recv, &S).unwrap();
            let want: Vec<T> = (0..world)
                .flat_map(|i| (0..COUNT).map(move |k| T::of(val(sg, i, r * COUNT + k))))
                .collect();
            assert_eq!(recv, want, "all_to_all world {world}");
        });
    }
}

/// Every in-place form pushed into one group per root (the five run in order in the group),
/// each result checked; then the same descriptions run alone.
fn check_in_place_forms_in_a_group<T: El>() {
    for world in 1..=4 {
        run_ranks(world, |comm| {
            let r = comm.rank();
            let sg = T::SIGNED;
            let sums: Vec<T> = of_all((0..COUNT).map(|i| sum_of(sg, world, i)));
            let gathered: Vec<T> = (0..world).flat_map(|q| vals::<T>(q, COUNT)).collect();
            let block: Vec<T> = of_all((0..COUNT).map(|k| sum_of(sg, world, r * COUNT + k)));
            for root in 0..world {
                let mut ar = vals::<T>(r, COUNT);
                let mut bc = if r == root {
                    vals::<T>(r, COUNT)
                } else {
                    sentinel(COUNT)
                };
                let mut rd = vals::<T>(r, COUNT);
                let mut ag = sentinel::<T>(COUNT * world);
                ag[r * COUNT..(r + 1) * COUNT].copy_from_slice(&vals::<T>(r, COUNT));
                let mut rs = vals::<T>(r, COUNT * world);
                let mut g = Group::new();
                g.push(
                    comm.all_reduce_in_place_op(&mut ar, ReduceOp::Sum, &S)
                        .unwrap(),
                )
                .unwrap();
                g.push(comm.broadcast_in_place_op(&mut bc, root, &S).unwrap())
                    .unwrap();
                g.push(
                    comm.reduce_in_place_op(&mut rd, ReduceOp::Sum, root, &S)
                        .unwrap(),
                )
                .unwrap();
                g.push(comm.all_gather_in_place_op(&mut ag, &S).unwrap())
                    .unwrap();
                g.push(
                    comm.reduce_scatter_in_place_op(&mut rs, ReduceOp::Sum, &S)
                        .unwrap(),
                )
                .unwrap();
                g.end().unwrap();
                assert_eq!(ar, sums, "all_reduce_in_place in a group, world {world}");
                assert_eq!(
                    bc,
                    vals::<T>(root, COUNT),
                    "broadcast_in_place, root {root}"
                );
                let want = if r == root {
                    sums.clone()
                } else {
                    vals(r, COUNT)
                };
                assert_eq!(rd, want, "reduce_in_place in a group, root {root} on {r}");
                assert_eq!(
                    ag, gathered,
                    "all_gather_in_place in a group, world {world}"
                );
                assert_eq!(
                    &rs[r * COUNT..(r + 1) * COUNT],
                    &block[..],
                    "reduce_scatter_in_place in a group, world {world}"
                );
            }
            // The same descriptions, run alone.
            let mut ag = sentinel::<T>(COUNT * world);
            ag[r * COUNT..(r + 1) * COUNT].copy_from_slice(&vals::<T>(r, COUNT));
            comm.all_gather_in_place_op(&mut ag, &S)
                .unwrap()
                .run()
                .unwrap();
            assert_eq!(ag, gathered, "all_gather_in_place_op run alone");
            let mut rs = vals::<T>(r, COUNT * world);
            comm.reduce_scatter_in_place_op(&mut rs, ReduceOp::Sum, &S)
                .unwrap()
                .run()
                .unwrap();
            assert_eq!(&rs[r * COUNT..(r + 1) * COUNT], &block[..], "run alone");
        });
    }
}

macro_rules! per_dtype {
    ($($name:ident => $t:ty),* $(,)?) => {$(
        #[test]
        fn $name() {
            check_all_collectives::<$t>();
            check_reductions::<$t>();
            check_pre_mul_sum::<$t>();
            check_in_place_forms_in_a_group::<$t>();
        }
    )*};
}

per_dtype! {
    collectives_i8 => i8, collectives_u8 => u8, collectives_i32 => i32,
    collectives_u32 => u32, collectives_i64 => i64, collectives_u64 => u64,
    collectives_f16 => f16, collectives_bf16 => bf16, collectives_f32 => f32,
    collectives_f64 => f64,
}

/// Sum, Prod, Max, Min and Avg on all_reduce (and Avg on an exact multiple of the world).
fn check_reductions<T: El>() {
    for world in 1..=4 {
        run_ranks(world, |comm| {
            let r = comm.rank();
            let sg = T::SIGNED;
            let prod_val = |q: usize, i: usize| -> i64 {
                let table: [i64; 5] = if sg {
                    [1, 2, -1, 3, -2]
                } else {
                    [1, 2, 1, 3, 2]
                };
                table[(i + 2 * q) % 5]
            };
            // Avg: rank weights summing to 2 * world, so the mean is exact.
            let weight = |q: usize| -> i64 {
                if q + 1 < world {
                    q as i64 + 1
                } else {
                    2 * world as i64 - (world as i64 - 1) * world as i64 / 2
                }
            };
            let k = |i: usize| -> i64 {
                let table: [i64; 3] = if sg { [1, -2, 3] } else { [1, 2, 3] };
                table[i % 3]
            };
            let cases: [(ReduceOp, Vec<T>, Vec<T>); 5] = [
                (
                    ReduceOp::Sum,
                    vals(r, COUNT),
                    of_all((0..COUNT).map(|i| sum_of(sg, world, i))),
                ),
                (
                    ReduceOp::Prod,
                    of_all((0..COUNT).map(|i| prod_val(r, i))),
                    of_all((0..COUNT).map(|i| (0..world).map(|q| prod_val(q, i)).product())),
                ),
                (
                    ReduceOp::Max,
                    vals(r, COUNT),
                    of_all((0..COUNT).map(|i| (0..world).map(|q| val(sg, q, i)).max().unwrap())),
                ),
                (
                    ReduceOp::Min,
                    vals(r, COUNT),
                    of_all((0..COUNT).map(|i| (0..world).map(|q| val(sg, q, i)).min().unwrap())),
                ),
                (
                    ReduceOp::Avg,
                    of_all((0..COUNT).map(|i| weight(r) * k(i))),
                    of_all((0..COUNT).map(|i| 2 * k(i))),
                ),
            ];
            for (op, send, want) in cases {
                let mut recv = sentinel::<T>(COUNT);
                comm.all_reduce(&send, &mut recv, op, &S).unwrap();
                assert_eq!(recv, want, "{op:?} world {world} rank {r}");
            }
        });
    }
}

/// PreMulSum with rank r's scalar r + 1: sum over ranks of (r + 1) * x_r, on all_reduce,
/// reduce and reduce_scatter, plain and in a group.
fn check_pre_mul_sum<T: El>() {
    for world in 1..=4 {
        run_ranks(world, |comm| {
            let r = comm.rank();
            let sg = T::SIGNED;
            let op = comm.create_pre_mul_sum(T::of(r as i64 + 1)).unwrap();
            let weighted =
                |i: usize| -> i64 { (0..world).map(|q| (q as i64 + 1) * val(sg, q, i)).sum() };
            let want: Vec<T> = of_all((0..COUNT).map(weighted));
            let send = vals::<T>(r, COUNT);
            let mut recv = sentinel::<T>(COUNT);
            comm.all_reduce(&send, &mut recv, &op, &S).unwrap();
            assert_eq!(recv, want, "PreMulSum all_reduce world {world}");

            let mut recv = sentinel::<T>(COUNT);
            comm.reduce(&send, &mut recv, &op, 0, &S).unwrap();
            if r == 0 {
                assert_eq!(recv, want, "PreMulSum reduce");
            }

            let big = vals::<T>(r, COUNT * world);
            let mut recv = sentinel::<T>(COUNT);
            comm.reduce_scatter(&big, &mut recv, &op, &S).unwrap();
            let block: Vec<T> = of_all((0..COUNT).map(|k| weighted(r * COUNT + k)));
            assert_eq!(recv, block, "PreMulSum reduce_scatter");

            let mut buf = vals::<T>(r, COUNT);
            let mut g = Group::new();
            comm.all_reduce_in_place_op(&mut buf, &op, &S)
                .and_then(|op| g.push(op))
                .unwrap();
            g.end().unwrap();
            assert_eq!(buf, want, "PreMulSum in a group");
        });
    }
}

#[test]
fn one_thread_drives_four_communicators_in_a_group() {
    let comms = Communicator::init_all(&[
        CommDevice::Host,
        CommDevice::Host,
        CommDevice::Host,
        CommDevice::Host,
    ])
    .unwrap();
    let id = UniqueId::from_raw(root_id_of(comms[0].as_raw()).expect("root id"));
    assert_eq!(comms.len(), 4);
    let sends: Vec<Vec<f32>> = (0..4).map(|r| vals::<f32>(r, COUNT)).collect();
    let mut recvs: Vec<Vec<f32>> = vec![vec![0.0; COUNT]; 4];
    let mut in_place: Vec<Vec<i64>> = (0..4).map(|r| vals::<i64>(r, COUNT)).collect();
    {
        let mut g = Group::new();
        for ((c, s), r) in comms.iter().zip(&sends).zip(recvs.iter_mut()) {
            assert_eq!(c.world_size(), 4);
            c.all_reduce_op(s, r, ReduceOp::Sum, &S)
                .and_then(|op| g.push(op))
                .unwrap();
        }
        for (c, b) in comms.iter().zip(in_place.iter_mut()) {
            c.all_reduce_in_place_op(b, ReduceOp::Max, &S)
                .and_then(|op| g.push(op))
                .unwrap();
        }
        g.end().unwrap();
    }
    let sums: Vec<f32> = of_all((0..COUNT).map(|i| sum_of(true, 4, i)));
    let maxes: Vec<i64> = (0..COUNT)
        .map(|i| (0..4).map(|q| val(true, q, i)).max().unwrap())
        .collect();
    for r in 0..4 {
        assert_eq!(recvs[r], sums, "rank {r}");
        assert_eq!(in_place[r], maxes, "rank {r}");
    }
    // Group::run form, with a broadcast from rank 2.
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|r| vec![r as u8; COUNT]).collect();
    Group::run(|g| {
        for (c, b) in comms.iter().zip(bufs.iter_mut()) {
            g.push(c.broadcast_in_place_op(b, 2, &S)?)?;
        }
        Ok(())
    })
    .unwrap();
    assert!(bufs.iter().all(|b| b == &vec![2u8; COUNT]));
    for (r, c) in comms.into_iter().enumerate() {
        assert_eq!(c.rank(), r);
        c.destroy().map_err(|(_, e)| e).unwrap();
    }
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.destroyed, st.aborted), (4, 4, 0));
}

/// Fixed-size arrays are buffers, as slices and vectors are.
#[test]
fn arrays_are_buffers() {
    let st = run_ranks(3, |comm| {
        let r = comm.rank() as f32;
        let send = [r + 1.0; 4];
        let mut recv = [0.0f32; 4];
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &S)
            .unwrap();
        assert_eq!(recv, [6.0; 4]);
        let mut loss = [r];
        comm.all_reduce_in_place(&mut loss, ReduceOp::Max, &S)
            .unwrap();
        assert_eq!(loss, [2.0]);
        let mut all = [0.0f32; 3];
        comm.all_gather(&[r], &mut all, &S).unwrap();
        assert_eq!(all, [0.0, 1.0, 2.0]);
    });
    assert_eq!((st.created, st.destroyed, st.aborted), (3, 3, 0));
}

#[test]
fn split_by_color_key_and_none() {
    // 4 ranks: even / odd colors, keys reversing the order; rank 3 opts out with None.
    let st = run_ranks(4, |comm| {
        let r = comm.rank();
        let color = if r == 3 { None } else { Some((r % 2) as u32) };
        let key = -(r as i32);
        let child = comm.split(color, key).unwrap();
        match (r, &child) {
            (3, None) => {}
            (3, Some(_)) => panic!("NOCOLOR rank got a communicator"),
            (_, None) => panic!("rank {r} got no communicator"),
            (_, Some(c)) => {
                // Even: ranks {0, 2}, keys {0, -2} -> rank 2 first. Odd: rank 1 alone.
                let (want_rank, want_world) = match r {
                    0 => (1, 2),
                    2 => (0, 2),
                    _ => (0, 1),
                };
                assert_eq!(
                    (c.rank(), c.world_size()),
                    (want_rank, want_world),
                    "rank {r}"
                );
                let mut x = vec![r as i32 + 1; 3];
                c.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                let want = if r % 2 == 0 { 1 + 3 } else { 2 };
                assert_eq!(x, vec![want; 3]);
            }
        }
        // The parent still works after the split.
        let mut y = vec![1u64; 2];
        comm.all_reduce_in_place(&mut y, ReduceOp::Sum, &S).unwrap();
        assert_eq!(y, vec![4; 2]);
        if let Some(c) = child {
            c.destroy().map_err(|(_, e)| e).unwrap();
        }
    });
    // 4 parents + 3 children (rank 3 got none).
    assert_eq!((st.created, st.destroyed, st.aborted), (7, 7, 0));
}

#[test]
fn split_with_equal_keys_orders_by_rank() {
    let st = run_ranks(3, |comm| {
        let child = comm.split(Some(7), 0).unwrap().expect("child");
        assert_eq!((child.rank(), child.world_size()), (comm.rank(), 3));
        let mut x = vec![comm.rank() as f64; 1];
        child.all_gather_in_place(&mut vec![0.0f64; 3], &S).unwrap();
        child
            .all_reduce_in_place(&mut x, ReduceOp::Max, &S)
            .unwrap();
        assert_eq!(x, vec![2.0]);
        drop(child); // drop of a healthy child destroys it
    });
    assert_eq!((st.created, st.destroyed, st.aborted), (6, 6, 0));
}

#[test]
fn shrink_excludes_ranks_and_the_rest_keep_working() {
    let id = CommDevice::Host.unique_id().unwrap();
    std::thread::scope(|s| {
        for rank in 0..4 {
            s.spawn(move || {
                let comm = Communicator::init_rank(&CommDevice::Host, 4, rank, &id, &Config::new())
                    .unwrap();
                if rank != 1 {
                    let small = comm.shrink(&[1]).unwrap();
                    assert_eq!(small.world_size(), 3);
                    let want_rank = if rank == 0 { 0 } else { rank - 1 };
                    assert_eq!(small.rank(), want_rank);
                    let mut x = vec![rank as i32; 4];
                    small
                        .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                        .unwrap();
                    assert_eq!(x, vec![2 + 3; 4]);
                    small.destroy().map_err(|(_, e)| e).unwrap();
                }
                // The parent (whose collective sequence the excluded rank no longer
                // shares) is destroyed normally everywhere.
                comm.destroy().map_err(|(_, e)| e).unwrap();
            });
        }
    });
    let st = assert_balanced(&id);
    assert_eq!((st.created, st.destroyed, st.aborted), (7, 7, 0));
}

#[test]
fn non_blocking_init_then_wait_then_collectives() {
    for world in 1..=4 {
        let id = CommDevice::Host.unique_id().unwrap();
        std::thread::scope(|s| {
            for rank in 0..world {
                s.spawn(move || {
                    let pending = Communicator::init_rank_nonblocking(
                        &CommDevice::Host,
                        world,
                        rank,
                        &id,
                        &Config::new(),
                    )
                    .unwrap();
                    let _ = pending.is_ready().unwrap();
                    let comm = pending.wait(Duration::from_secs(30)).unwrap();
                    assert_eq!((comm.rank(), comm.world_size()), (rank, world));
                    let mut x = vec![rank as u32 + 1; 3];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                    assert_eq!(x, vec![(world * (world + 1) / 2) as u32; 3]);
                    // A non-blocking parent: split completes through the same wait path.
                    let child = comm.split(Some(0), 0).unwrap().expect("child");
                    let mut z = vec![1.0f32; 2];
                    child
                        .all_reduce_in_place(&mut z, ReduceOp::Sum, &S)
                        .unwrap();
                    assert_eq!(z, vec![world as f32; 2]);
                    child.finalize(DEFAULT_TIMEOUT).unwrap();
                    comm.finalize(Duration::from_secs(30)).unwrap();
                });
            }
        });
        let st = assert_balanced(&id);
        assert_eq!(st.created, 2 * world as u64);
        assert_eq!(st.finalized, 2 * world as u64);
        assert_eq!(st.aborted, 0);
    }
}

#[test]
fn init_rank_with_a_non_blocking_config_returns_a_ready_communicator() {
    let st = {
        let id = CommDevice::Host.unique_id().unwrap();
        std::thread::scope(|s| {
            for rank in 0..2 {
                s.spawn(move || {
                    let cfg = Config::new().blocking(false);
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &cfg).unwrap();
                    let mut x = vec![bf16::from_f32(1.5); 2];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
                    assert_eq!(x, vec![bf16::from_f32(3.0); 2]);
                });
            }
        });
        stats_for(&id.to_raw())
    };
    assert_eq!(
        (st.created, st.destroyed, st.live, st.misused),
        (2, 2, 0, 0)
    );
}

/// One thread drives three ranks through gather and scatter inside one group each.
#[test]
fn gather_and_scatter_in_a_group_driven_by_one_thread() {
    let comms =
        Communicator::init_all(&[CommDevice::Host, CommDevice::Host, CommDevice::Host]).unwrap();
    let sends: Vec<Vec<i32>> = (0..3).map(|r| vec![r + 1; 2]).collect();
    let mut recvs: Vec<Vec<i32>> = (0..3)
        .map(|r| if r == 2 { vec![0; 6] } else { Vec::new() })
        .collect();
    let mut g = Group::new();
    for ((c, s), r) in comms.iter().zip(&sends).zip(recvs.iter_mut()) {
        c.gather_op(s, r, 2, &Stream::Host)
            .and_then(|op| g.push(op))
            .unwrap();
    }
    g.end().unwrap();
    assert_eq!(recvs[2], vec![1, 1, 2, 2, 3, 3]);

    let root_send: Vec<u32> = vec![7, 8, 9];
    let empty: Vec<u32> = Vec::new();
    let mut outs = vec![vec![0u32; 1]; 3];
    let mut g = Group::new();
    for (rank, (c, o)) in comms.iter().zip(outs.iter_mut()).enumerate() {
        let send = if rank == 0 { &root_send } else { &empty };
        c.scatter_op(send, o, 0, &Stream::Host)
            .and_then(|op| g.push(op))
            .unwrap();
    }
    g.end().unwrap();
    assert_eq!(outs, vec![vec![7], vec![8], vec![9]]);
}

#[test]
fn one_thread_drives_every_in_place_form_on_three_communicators_in_a_group() {
    let comms =
        Communicator::init_all(&[CommDevice::Host, CommDevice::Host, CommDevice::Host]).unwrap();
    let n = comms.len();
    // Per rank: all-reduce, broadcast, reduce, all-gather and reduce-scatter buffers.
    let mut bufs: Vec<[Vec<i32>; 5]> = (0..n)
        .map(|r| {
            let v = r as i32;
            [
                vec![v + 1; 2],
                vec![10 * v; 2],
                vec![v + 1; 2],
                (0..n).map(|q| if q == r { 5 * v } else { -1 }).collect(),
                (0..n as i32).map(|q| q + v).collect(),
            ]
        })
        .collect();
    Group::run(|g| {
        for (c, [ar, bc, rd, ag, rs]) in comms.iter().zip(bufs.iter_mut()) {
            g.push(c.all_reduce_in_place_op(ar, ReduceOp::Prod, &S)?)?;
            g.push(c.broadcast_in_place_op(bc, 1, &S)?)?;
            g.push(c.reduce_in_place_op(rd, ReduceOp::Max, 2, &S)?)?;
            g.push(c.all_gather_in_place_op(ag, &S)?)?;
            g.push(c.reduce_scatter_in_place_op(rs, ReduceOp::Sum, &S)?)?;
        }
        Ok(())
    })
    .unwrap();
    for (r, [ar, bc, rd, ag, rs]) in bufs.iter().enumerate() {
        assert_eq!(ar, &vec![6, 6], "all_reduce_in_place on {r}");
        assert_eq!(bc, &vec![10, 10], "broadcast_in_place on {r}");
        let want = if r == 2 {
            vec![3, 3]
        } else {
            vec![r as i32 + 1; 2]
        };
        assert_eq!(rd, &want, "reduce_in_place on {r}");
        assert_eq!(ag, &vec![0, 5, 10], "all_gather_in_place on {r}");
        // Block r of the sum over ranks q of (r + q): 3r + 3.
        assert_eq!(rs[r], 3 * r as i32 + 3, "reduce_scatter_in_place on {r}");
    }
    for c in comms {
        c.destroy().map_err(|(_, e)| e).unwrap();
    }
}

#[test]
fn an_op_enqueues_nothing_until_it_runs_and_keeps_its_reduction() {
    let id = CommDevice::Host.unique_id().unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new()).unwrap();
    let half = comm.create_pre_mul_sum(0.5f32).unwrap();
    let mut x = vec![4.0f32, 8.0];
    let op = comm.all_reduce_in_place_op(&mut x, &half, &S).unwrap();
    assert_eq!(op.name(), "ncclAllReduce");
    assert_eq!(op.comm().rank(), 0);
    drop(op);
    assert_eq!(x, vec![4.0, 8.0], "a dropped Op was enqueued");
    comm.all_reduce_in_place_op(&mut x, &half, &S)
        .unwrap()
        .run()
        .unwrap();
    assert_eq!(x, vec![2.0, 4.0]);
    // A description that fails its checks starts no group: the group stays usable.
    let mut g = Group::new();
    let mut odd = vec![1.0f32; 3];
    assert!(comm
        .reduce_scatter_in_place_op(&mut odd, ReduceOp::Sum, &S)
        .is_ok());
    let two = Communicator::init_all(&[CommDevice::Host, CommDevice::Host]).unwrap();
    assert!(matches!(
        two[0].all_gather_in_place_op(&mut odd, &S),
        Err(nccl_safe::Error::LengthMismatch {
            call: "ncclAllGather",
            ..
        })
    ));
    g.push(comm.all_reduce_in_place_op(&mut x, &half, &S).unwrap())
        .unwrap();
    g.end().unwrap();
    assert_eq!(x, vec![1.0, 2.0]);
    for c in two {
        c.destroy().map_err(|(_, e)| e).unwrap();
    }
    drop(half);
    comm.destroy().map_err(|(_, e)| e).unwrap();
}

/// NCCL keeps `commName` by pointer and reads it after the init call returned (2.28.9
/// init.cc:1251, in the asynchronous init), and a split child made without a config
/// inherits the pointer: the name must live as long as the communicator and its children,
/// not only through the call, and not only as long as the caller's `Config`.
#[test]
fn a_comm_name_outlives_the_init_call_and_reaches_split_children() {
    const NAME: &str = "layer-7-gradient-buckets";
    let id = CommDevice::Host.unique_id().unwrap();
    std::thread::scope(|s| {
        for rank in 0..2 {
            s.spawn(move || {
                let comm = {
                    let cfg = Config::new().comm_name(NAME);
                    Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &cfg).unwrap()
                }; // the caller's Config is gone here
                   // Churn the allocator, so that a freed string would be reused.
                let noise: Vec<Vec<u8>> = (0..256).map(|i| vec![i as u8; NAME.len() + 1]).collect();
                // SAFETY: the name lives as long as the communicator (what is tested).
                let name = unsafe { nccl_safe::host::comm_name(comm.as_raw()) };
                assert_eq!(name.as_deref(), Some(NAME), "rank {rank}");
                let child = comm.split(Some(0), rank as i32).unwrap().expect("a color");
                drop(comm);
                drop(noise);
                let _more: Vec<Vec<u8>> = (0..256).map(|i| vec![i as u8; NAME.len() + 1]).collect();
                // SAFETY: as above, through the child.
                let name = unsafe { nccl_safe::host::comm_name(child.as_raw()) };
                assert_eq!(name.as_deref(), Some(NAME), "rank {rank}'s child");
                let mut x = vec![1u8; 4];
                child
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, &S)
                    .unwrap();
                assert_eq!(x, vec![2; 4]);
            });
        }
    });
    assert_balanced(&id);
}

/// `into_raw` gives the handle away, and NCCL still holds the `commName` pointer of the
/// config it was made with and reads it again later: a split's profiler init reads the
/// parent's (2.28.9 profiler.cc:192), and a child made without a config inherits the
/// pointer (init.cc:1798-1801). So the name outlives the communicator given away, its
/// caller's `Config`, and allocations of its size made since, as the host provider (which
/// keeps the pointer as NCCL does) reads it through the raw handle and through a child
/// split from it in C. (A freed name is a use after free here, which valgrind reports:
/// `scripts/valgrind-host.sh`; `config.rs` shows the string's life without reading it.)
#[test]
fn a_comm_name_outlives_into_raw_for_nccls_later_reads() {
    use nccl_sys::bindings::{ncclInProgress, ncclSuccess};
    const NAME: &str = "handed-over-to-c";
    let lib = nccl_safe::Library::host();
    let t = lib.table();
    let id = CommDevice::Host.unique_id().unwrap();
    // The caller's Config goes with the block, the communicator with `into_raw`.
    let raw = {
        let cfg = Config::new().comm_name(NAME);
        let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &cfg).unwrap();
        comm.into_raw()
    };
    // Churn the allocator at the size of the string's allocation (an `Arc<CStr>`: two
    // counts, then the bytes), so that a freed string would be reused.
    let size = 2 * std::mem::size_of::<usize>() + NAME.len() + 1;
    let noise: Vec<Vec<u8>> = (0..256).map(|i| vec![i as u8; size]).collect();
    // SAFETY: `raw` is a live host communicator; its name is alive (what is tested).
    let name = unsafe { nccl_safe::host::comm_name(raw) };
    assert_eq!(name.as_deref(), Some(NAME));
    // A split in C, without a config: the child keeps the parent's pointer.
    let mut child = std::ptr::null_mut();
    // SAFETY: `raw` is live and ours; `child` is writable; a null config is allowed.
    let r = unsafe { (t.ncclCommSplit)(raw, 0, 0, &mut child, std::ptr::null_mut()) };
    assert!(r == ncclSuccess || r == ncclInProgress, "{r}");
    let mut state = ncclInProgress;
    while state == ncclInProgress {
        // SAFETY: `raw` is live; `state` is writable.
        assert_eq!(
            unsafe { (t.ncclCommGetAsyncError)(raw, &mut state) },
            ncclSuccess
        );
    }
    assert_eq!(state, ncclSuccess);
    assert!(!child.is_null());
    drop(noise);
    let _more: Vec<Vec<u8>> = (0..256).map(|i| vec![i as u8; size]).collect();
    // SAFETY: as above, through the child.
    let name = unsafe { nccl_safe::host::comm_name(child) };
    assert_eq!(name.as_deref(), Some(NAME), "the child's");
    for c in [child, raw] {
        // SAFETY: each is live and ours: its one teardown.
        assert_eq!(unsafe { (t.ncclCommDestroy)(c) }, ncclSuccess);
    }
    assert_balanced(&id);
}

/// NCCL discards an empty collective after checking its arguments (taskAppend,
/// enqueue.cc:2554-2555 of 2.28.9): it takes no sequence number and waits for no peer, so
/// one rank's empty all-reduce and broadcast do not pair with its peer's next collective,
/// and the diagnostics do not count them either: a peer that then leaves is no departure
/// the first rank waits for (that false alarm was a race, so the pattern runs 20 times).
#[test]
fn an_empty_collective_involves_no_peer() {
    for _ in 0..20 {
        run_ranks(2, |comm| {
            if comm.rank() == 0 {
                let (send, mut recv) = (Vec::<f32>::new(), Vec::<f32>::new());
                comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &S)
                    .unwrap();
                comm.broadcast_in_place(&mut recv, 1, &S).unwrap();
            }
            let mut x = vec![1.0f32 + comm.rank() as f32; 4];
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
            assert_eq!(x, vec![3.0; 4]);
            // Every rank's record holds the one collective both called, seq 0.
            #[cfg(feature = "diag")]
            {
                let seqs: Vec<u64> = comm.flight_record().entries.iter().map(|e| e.seq).collect();
                assert_eq!(seqs, vec![0], "rank {}", comm.rank());
            }
        });
    }
}

const CHECK_POINTERS: &str = "NCCL_CHECK_POINTERS";

/// `NCCL_CHECK_POINTERS=1` makes NCCL check a gather's `recvbuff` and a scatter's `sendbuff`
/// off the root too, though its header says they are unused there (misc/argcheck.cc:71-83
/// of 2.28.9): the crate passes the caller's buffer, so these calls run; an empty one is
/// passed as null, which NCCL refuses with a typed error. The host provider reads the
/// variable once per process, as NCCL does, hence the child process.
#[test]
fn gather_and_scatter_run_under_nccl_check_pointers() {
    let child = support::spawn_child("child_checks_pointers", CHECK_POINTERS, "1");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("child: pointers checked"));
}

#[test]
#[ignore = "run as a child process by gather_and_scatter_run_under_nccl_check_pointers"]
fn child_checks_pointers() {
    assert_eq!(
        std::env::var(CHECK_POINTERS).as_deref(),
        Ok("1"),
        "run only as a child process"
    );
    run_ranks(3, |comm| {
        let r = comm.rank();
        // Off the root, a gather's recv sized as the root's (any other length is refused
        // before NCCL sees it) and a scatter's send of any length are passed, untouched.
        let mut short = vec![-1i32; 1];
        let e = comm.gather(&[1i32], &mut short, 0, &S);
        if r == 0 {
            assert!(matches!(e, Err(Error::LengthMismatch { .. })), "{e:?}");
        } else {
            let e = e.unwrap_err();
            assert!(
                e.to_string()
                    .contains("off the root, recv is empty or world_size x send"),
                "{e}"
            );
        }
        let mut recv = if r == 0 { vec![0i32; 3] } else { vec![-1; 3] };
        comm.gather(&[r as i32 + 1], &mut recv, 0, &S).unwrap();
        let want = if r == 0 { vec![1, 2, 3] } else { vec![-1; 3] };
        assert_eq!(recv, want);
        let send = if r == 0 {
            vec![7i32, 8, 9]
        } else {
            vec![-1; 2]
        };
        let mut out = [0i32];
        comm.scatter(&send, &mut out, 0, &S).unwrap();
        assert_eq!(out, [7 + r as i32]);
    });
    // Off the root, an empty buffer is a null pointer, which NCCL refuses at once (and the
    // crate then holds the communicator failed, to be dropped). No rank leaves before both
    // calls returned, or the calls would be reported as waiting for it.
    let (id, both) = (
        CommDevice::Host.unique_id().unwrap(),
        std::sync::Barrier::new(3),
    );
    std::thread::scope(|sc| {
        for rank in 0..3 {
            let (id, both) = (&id, &both);
            sc.spawn(move || {
                let comm = Communicator::init_rank(&CommDevice::Host, 3, rank, id, &Config::new());
                let comm = comm.unwrap();
                both.wait();
                let err = match rank {
                    0 => Ok(()),
                    1 => comm.gather(&[1i32], &mut Vec::<i32>::new(), 0, &S),
                    _ => comm.scatter(&Vec::<i32>::new(), &mut [0i32], 0, &S),
                };
                both.wait();
                if rank > 0 {
                    let err = err.unwrap_err();
                    assert_eq!(err.code(), Some(ResultCode::InvalidArgument), "{err}");
                    assert!(err.to_string().contains("is not a valid pointer"), "{err}");
                }
            });
        }
    });
    // The provider follows NCCL's rule: a broadcast's send and a reduce's recv are
    // checked only on the root, every other buffer everywhere.
    use nccl_sys::bindings::*;
    // SAFETY: the host provider's lookup returns functions with NCCL's signatures.
    let t = unsafe { nccl_sys::FunctionTable::load(nccl_safe::host::lookup) }.unwrap();
    let mut c = [core::ptr::null_mut(); 2];
    // SAFETY: two out-pointers; a null device list means devices 0 and 1.
    let rc = unsafe { (t.ncclCommInitAll)(c.as_mut_ptr(), 2, core::ptr::null()) };
    assert_eq!(rc, ncclSuccess);
    let mut b = [[1.0f32; 2]; 3];
    let [b0, b1, b2] = b
        .each_mut()
        .map(|b| b.as_mut_ptr().cast::<core::ffi::c_void>());
    let (f, null, s) = (ncclFloat32, core::ptr::null_mut(), core::ptr::null_mut());
    // SAFETY: live communicators, and buffers of 2 floats or null, in a group where one
    // thread drives both ranks.
    unsafe {
        assert_eq!((t.ncclGroupStart)(), ncclSuccess);
        assert_eq!((t.ncclBroadcast)(b0, b0, 2, f, 0, c[0], s), ncclSuccess);
        assert_eq!((t.ncclBroadcast)(null, b1, 2, f, 0, c[1], s), ncclSuccess);
        assert_eq!(
            (t.ncclReduce)(b0, b2, 2, f, ncclSum, 0, c[0], s),
            ncclSuccess
        );
        assert_eq!(
            (t.ncclReduce)(b1, null, 2, f, ncclSum, 0, c[1], s),
            ncclSuccess
        );
        assert_eq!((t.ncclGroupEnd)(), ncclSuccess);
        for rc in [
            (t.ncclGather.unwrap())(b1, null, 2, f, 0, c[1], s),
            (t.ncclScatter.unwrap())(null, b1, 2, f, 0, c[1], s),
            (t.ncclBroadcast)(b1, null, 2, f, 0, c[1], s),
            (t.ncclReduce)(null, b1, 2, f, ncclSum, 0, c[1], s),
            (t.ncclAllReduce)(b1, null, 0, f, ncclSum, c[1], s),
        ] {
            assert_eq!(rc, ncclInvalidArgument);
        }
        for comm in c {
            assert_eq!((t.ncclCommDestroy)(comm), ncclSuccess);
        }
    }
    assert_eq!(b[2], [2.0; 2]);
    println!("child: pointers checked");
}
