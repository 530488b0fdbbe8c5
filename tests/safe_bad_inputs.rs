//! Every bad input the safe layer checks returns its typed error before NCCL sees it, and
//! the communicator stays usable (a correct all_reduce follows every batch of bad calls).

mod support;

use nccl_safe::error::BufferRole;
use nccl_safe::{
    CommDevice, Communicator, Config, Error, Group, Library, ReduceOp, Stream, UniqueId, Version,
    UNIQUE_ID_BYTES,
};
use support::{assert_balanced, run_ranks};

const S: Stream = Stream::Host;

/// Matches `$e` against `Err($p)`, printing what came back otherwise.
macro_rules! assert_err {
    ($e:expr, $p:pat $(if $g:expr)?) => {
        match $e {
            Err($p) $(if $g)? => {}
            other => panic!(
                "{}: expected Err({}), got {:?}",
                stringify!($e),
                stringify!($p),
                other
            ),
        }
    };
}

/// A correct all_reduce over all ranks: proves the communicator is still usable.
fn still_usable(comm: &Communicator) {
    assert!(
        !comm.is_failed(),
        "a rejected argument must not fail the communicator"
    );
    let mut x = vec![1i32; 4];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &S).unwrap();
    assert_eq!(x, vec![comm.world_size() as i32; 4]);
}

#[test]
fn wrong_lengths_follow_each_collectives_rule() {
    run_ranks(3, |comm| {
        let w = 3;
        let r = comm.rank();
        let four = vec![1.0f32; 4];
        let mut three = vec![0.0f32; 3];
        let mut twelve = vec![0.0f32; 12];
        let mut ten = vec![0.0f32; 10];
        let l = |e: nccl_safe::Result<()>| e;

        // all_reduce / reduce: recv = send.
        assert_err!(
            l(comm.all_reduce(&four, &mut three, ReduceOp::Sum, &S)),
            Error::LengthMismatch {
                call: "ncclAllReduce",
                role: BufferRole::Recv,
                expected: 4,
                actual: 3,
                ..
            }
        );
        assert_err!(
            l(comm.reduce(&four, &mut three, ReduceOp::Sum, 0, &S)),
            Error::LengthMismatch {
                call: "ncclReduce",
                role: BufferRole::Recv,
                expected: 4,
                actual: 3,
                ..
            }
        );
        // broadcast: send = recv.
        assert_err!(
            l(comm.broadcast(&four, &mut three, 0, &S)),
            Error::LengthMismatch {
                call: "ncclBroadcast",
                role: BufferRole::Send,
                expected: 3,
                actual: 4,
                ..
            }
        );
        // all_gather: recv = world x send.
        assert_err!(
            l(comm.all_gather(&four, &mut ten, &S)),
            Error::LengthMismatch {
                call: "ncclAllGather",
                role: BufferRole::Recv,
                expected: 12,
                actual: 10,
                ..
            }
        );
        // reduce_scatter: send = world x recv.
        assert_err!(
            l(comm.reduce_scatter(&four, &mut three, ReduceOp::Sum, &S)),
            Error::LengthMismatch {
                call: "ncclReduceScatter",
                role: BufferRole::Send,
                expected: 9,
                actual: 4,
                ..
            }
        );
        // all_to_all: send a multiple of world, recv = send.
        assert_err!(
            l(comm.all_to_all(&four, &mut twelve, &S)),
            Error::LengthMismatch {
                call: "ncclAlltoAll",
                actual: 4,
                expected: 6,
                ..
            }
        );
        assert_err!(
            l(comm.all_to_all(&vec![0.0f32; 12], &mut ten, &S)),
            Error::LengthMismatch {
                call: "ncclAlltoAll",
                role: BufferRole::Recv,
                expected: 12,
                actual: 10,
                ..
            }
        );
        // In-place forms whose buffer holds world_size blocks: not a multiple of 3.
        assert_err!(
            l(comm.all_gather_in_place(&mut ten, &S)),
            Error::LengthMismatch {
                call: "ncclAllGather",
                actual: 10,
                expected: 12,
                ..
            }
        );
        assert_err!(
            l(comm.reduce_scatter_in_place(&mut ten, ReduceOp::Sum, &S)),
            Error::LengthMismatch {
                call: "ncclReduceScatter",
                actual: 10,
                expected: 12,
                ..
            }
        );
        // gather / scatter: the root's buffer holds world blocks (checked on the root).
        if r == 1 {
            assert_err!(
                l(comm.gather(&four, &mut ten, 1, &S)),
                Error::LengthMismatch {
                    call: "ncclGather",
                    role: BufferRole::Recv,
                    expected: 12,
                    actual: 10,
                    ..
                }
            );
            assert_err!(
                l(comm.scatter(&ten, &mut three, 1, &S)),
                Error::LengthMismatch {
                    call: "ncclScatter",
                    role: BufferRole::Send,
                    expected: 9,
                    actual: 10,
                    ..
                }
            );
        }
        // Group forms reject the same way (and the group still ends cleanly).
        {
            let mut g = Group::new();
            assert_err!(
                comm.all_gather_op(&four, &mut ten, &S)
                    .and_then(|op| g.push(op)),
                Error::LengthMismatch {
                    call: "ncclAllGather",
                    ..
                }
            );
            assert_err!(
                comm.reduce_scatter_op(&four, &mut three, ReduceOp::Sum, &S)
                    .and_then(|op| g.push(op)),
                Error::LengthMismatch {
                    call: "ncclReduceScatter",
                    ..
                }
            );
            g.end().unwrap();
        }
        let _ = w;
        still_usable(comm);
    });
}

/// The safe layer asks of each buffer the length its collective's row in nccl-sys gives
/// ([`Collective::lengths`], which the host provider reads too), on the root and off it,
/// for every collective: each rank describes each collective with every pair of buffer
/// lengths up to `MAX`, and a pair is accepted exactly when the row accepts both for some
/// count; a refused one names a buffer and the length that makes the pair accepted. The
/// match below has an arm per row, so a new collective cannot be left out.
#[test]
fn every_collective_takes_the_lengths_of_its_row() {
    use nccl_sys::{Collective, Extent};
    const N: usize = 3;
    const ROOT: usize = 1;
    const MAX: usize = 3 * N + 1;
    run_ranks(N, |comm| {
        let me = comm.rank();
        // Send to the next rank, receive from the previous one: only described, never run.
        let peer = (me + 1) % N;
        for &c in Collective::ALL {
            let row = |ns: usize, nr: usize| {
                (0..=MAX * N).any(|count| {
                    let (s, r) = c.lengths(count, N, me == ROOT).unwrap();
                    s.accepts(ns) && r.accepts(nr)
                })
            };
            // Lengths to try, and to look for a fix among (up to a world of MAX blocks).
            let lens = |e: Extent, up: usize| if e == Extent::Unused { 0..=0 } else { 0..=up };
            let (send_ext, recv_ext) = c.extents();
            for ns in lens(send_ext, MAX) {
                for nr in lens(recv_ext, MAX) {
                    let send = vec![1.0f32; ns];
                    let mut recv = vec![0.0f32; nr];
                    let (send, recv) = (&send, &mut recv);
                    let sum = ReduceOp::Sum;
                    let described = match c {
                        Collective::AllReduce => comm.all_reduce_op(send, recv, sum, &S),
                        Collective::Broadcast => comm.broadcast_op(send, recv, ROOT, &S),
                        Collective::Reduce => comm.reduce_op(send, recv, sum, ROOT, &S),
                        Collective::AllGather => comm.all_gather_op(send, recv, &S),
                        Collective::ReduceScatter => comm.reduce_scatter_op(send, recv, sum, &S),
                        Collective::AllToAll => comm.all_to_all_op(send, recv, &S),
                        Collective::Gather => comm.gather_op(send, recv, ROOT, &S),
                        Collective::Scatter => comm.scatter_op(send, recv, ROOT, &S),
                        Collective::Send => comm.send_op(send, peer, &S),
                        Collective::Recv => comm.recv_op(recv, peer, &S),
                    }
                    .map(drop);
                    let at = format!("{c} on rank {me}: send {ns}, recv {nr}");
                    match (row(ns, nr), described) {
                        (true, Ok(())) => {}
                        (false, Err(Error::LengthMismatch { role, expected, .. })) => {
                            // The buffer it names could have `expected` for some count, and
                            // when only one of the two can put the pair right, it is that one.
                            let send_fixes = lens(send_ext, MAX * N).any(|x| row(x, nr));
                            let recv_fixes = lens(recv_ext, MAX * N).any(|x| row(ns, x));
                            let named_send = role == BufferRole::Send;
                            let alone = |send: bool| {
                                (0..=MAX * N).any(|count| {
                                    let (s, r) = c.lengths(count, N, me == ROOT).unwrap();
                                    if send {
                                        s.accepts(expected)
                                    } else {
                                        r.accepts(expected)
                                    }
                                })
                            };
                            assert!(
                                alone(named_send),
                                "{at}: {role} = {expected} is not the row's"
                            );
                            if send_fixes != recv_fixes {
                                assert_eq!(named_send, send_fixes, "{at}: names the {role}");
                            }
                        }
                        (ok, got) => panic!("{at}: the row accepts it: {ok}, got {got:?}"),
                    }
                }
            }
        }
        still_usable(comm);
    });
}

#[test]
fn roots_and_peers_out_of_range() {
    run_ranks(2, |comm| {
        let send = vec![1u8; 2];
        let mut recv = vec![0u8; 2];
        let mut big = vec![0u8; 4];
        let root = |e: nccl_safe::Result<()>, op: &str| match e {
            Err(Error::RankOutOfRange {
                call: o,
                what: "root",
                rank: 2,
                world_size: 2,
            }) if o == op => {}
            other => panic!("{op}: expected RankOutOfRange root 2, got {other:?}"),
        };
        root(comm.broadcast(&send, &mut recv, 2, &S), "ncclBroadcast");
        root(comm.broadcast_in_place(&mut recv, 2, &S), "ncclBroadcast");
        root(
            comm.reduce(&send, &mut recv, ReduceOp::Max, 2, &S),
            "ncclReduce",
        );
        root(
            comm.reduce_in_place(&mut recv, ReduceOp::Max, 2, &S),
            "ncclReduce",
        );
        root(comm.gather(&send, &mut big, 2, &S), "ncclGather");
        root(comm.scatter(&big, &mut recv, 2, &S), "ncclScatter");
        assert_err!(
            comm.send(&send, 2, &S),
            Error::RankOutOfRange {
                call: "ncclSend",
                what: "peer",
                rank: 2,
                world_size: 2
            }
        );
        assert_err!(
            comm.recv(&mut recv, usize::MAX, &S),
            Error::RankOutOfRange {
                call: "ncclRecv",
                what: "peer",
                rank: usize::MAX,
                ..
            }
        );
        let mut g = Group::new();
        assert_err!(
            comm.send_op(&send, 5, &S).and_then(|op| g.push(op)),
            Error::RankOutOfRange {
                call: "ncclSend",
                what: "peer",
                rank: 5,
                ..
            }
        );
        assert_err!(
            comm.broadcast_op(&send, &mut recv, 3, &S)
                .and_then(|op| g.push(op)),
            Error::RankOutOfRange {
                call: "ncclBroadcast",
                what: "root",
                rank: 3,
                ..
            }
        );
        drop(g);
        still_usable(comm);
    });
}

#[test]
fn in_place_descriptions_reject_like_the_plain_forms_and_the_group_goes_on() {
    run_ranks(3, |comm| {
        let r = comm.rank();
        let mut ten = vec![1i32; 10]; // not 3 equal blocks
        let mut nine = vec![1i32; 9];
        let mut g = Group::new();
        assert_err!(
            comm.all_gather_in_place_op(&mut ten, &S),
            Error::LengthMismatch {
                call: "ncclAllGather",
                role: BufferRole::Recv,
                expected: 12,
                actual: 10,
                rule: "in place: buffer = world_size x block",
            }
        );
        assert_err!(
            comm.reduce_scatter_in_place_op(&mut ten, ReduceOp::Sum, &S),
            Error::LengthMismatch {
                call: "ncclReduceScatter",
                expected: 12,
                actual: 10,
                ..
            }
        );
        assert_err!(
            comm.reduce_in_place_op(&mut ten, ReduceOp::Sum, 3, &S),
            Error::RankOutOfRange {
                call: "ncclReduce",
                what: "root",
                rank: 3,
                ..
            }
        );
        assert_err!(
            comm.broadcast_in_place_op(&mut ten, usize::MAX, &S),
            Error::RankOutOfRange {
                call: "ncclBroadcast",
                what: "root",
                rank: usize::MAX,
                ..
            }
        );
        // Nothing was enqueued: the group takes a correct operation and ends cleanly.
        g.push(
            comm.reduce_scatter_in_place_op(&mut nine, ReduceOp::Sum, &S)
                .unwrap(),
        )
        .unwrap();
        g.end().unwrap();
        assert_eq!(&nine[3 * r..3 * r + 3], &[3, 3, 3]);
        assert_eq!(ten, vec![1; 10], "a refused operation wrote its buffer");
        still_usable(comm);
    });
}

#[test]
fn init_rejects_world_size_zero_and_rank_past_the_world() {
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new();
    assert_err!(
        Communicator::init_rank(&CommDevice::Host, 0, 0, &id, &cfg),
        Error::InvalidArgument {
            call: "ncclCommInitRankConfig",
            ..
        }
    );
    assert_err!(
        Communicator::init_rank(&CommDevice::Host, 2, 2, &id, &cfg),
        Error::RankOutOfRange {
            what: "rank",
            rank: 2,
            world_size: 2,
            ..
        }
    );
    assert_err!(
        Communicator::init_rank_nonblocking(&CommDevice::Host, 3, 7, &id, &cfg),
        Error::RankOutOfRange {
            what: "rank",
            rank: 7,
            world_size: 3,
            ..
        }
    );
    assert_err!(
        Communicator::init_all(&[]),
        Error::InvalidArgument {
            call: "ncclCommInitAll",
            ..
        }
    );
    // None of them reached NCCL: the id is still fresh and can form a communicator.
    let st = nccl_safe::host::stats_for(&id.to_raw());
    assert_eq!((st.created, st.misused), (0, 0), "{st:?}");
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &cfg).unwrap();
    still_usable(&comm);
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);
}

#[test]
fn entry_points_newer_than_the_library_are_unsupported() {
    let lib = Library::host_as_version(2, 18).unwrap();
    let v218 = Version::new(2, 18, 3);
    assert_eq!(lib.version(), v218);
    let id = UniqueId::new_with(&lib).unwrap();
    let comm =
        Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &Config::new()).unwrap();
    let send = vec![1i64; 2];
    let mut recv = vec![0i64; 2];
    let unsupported = |e: nccl_safe::Result<()>, sym: &str, minor: u32| match e {
        Err(Error::Unsupported {
            symbol,
            needs,
            found,
        }) if symbol == sym && needs == Version::new(2, minor, 0) && found == v218 => {}
        other => panic!("{sym}: expected Unsupported, got {other:?}"),
    };
    unsupported(comm.all_to_all(&send, &mut recv, &S), "ncclAlltoAll", 28);
    unsupported(comm.gather(&send, &mut recv, 0, &S), "ncclGather", 28);
    unsupported(comm.scatter(&send, &mut recv, 0, &S), "ncclScatter", 28);
    unsupported(comm.shrink(&[]).map(drop), "ncclCommShrink", 27);
    let mut g = Group::new();
    assert_err!(
        comm.all_to_all_op(&send, &mut recv, &S)
            .and_then(|op| g.push(op)),
        Error::Unsupported {
            symbol: "ncclAlltoAll",
            ..
        }
    );
    g.end().unwrap();
    still_usable(&comm);
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_balanced(&id);
}

#[test]
fn config_fields_newer_than_the_library_are_unsupported() {
    let lib = Library::host_as_version(2, 18).unwrap();
    let id = UniqueId::new_with(&lib).unwrap();
    let init = |cfg: Config| Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &cfg);
    assert_err!(
        init(Config::new().comm_name("x")),
        Error::Unsupported { symbol: "commName", needs, found }
            if needs == Version::new(2, 27, 0) && found == Version::new(2, 18, 3)
    );
    assert_err!(
        init(Config::new().max_p2p_peers(2)),
        Error::Unsupported { symbol: "maxP2pPeers", needs, .. } if needs == Version::new(2, 30, 0)
    );
    assert_err!(
        init(Config::new().traffic_class(1)),
        Error::Unsupported {
            symbol: "trafficClass",
            ..
        }
    );
    // Fields 2.18 has are fine, and the id was not consumed by the failed attempts.
    let comm = init(Config::new().split_share(0).max_ctas(4)).unwrap();
    still_usable(&comm);
    drop(comm);
    assert_balanced(&id);
    // The current host provider accepts the same name.
    let id = CommDevice::Host.unique_id().unwrap();
    let cfg = Config::new().comm_name("x");
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &cfg).unwrap();
    still_usable(&comm);
    drop(comm);
    assert_balanced(&id);
}

#[test]
fn pre_mul_sum_of_another_communicator_is_refused() {
    let comms = Communicator::init_all(&[CommDevice::Host, CommDevice::Host]).unwrap();
    {
        let op0 = comms[0].create_pre_mul_sum(2.0f32).unwrap();
        let mut x = vec![1.0f32; 2];
        assert_err!(
            comms[1].all_reduce_in_place(&mut x, &op0, &S),
            Error::InvalidArgument {
                call: "ncclAllReduce",
                ..
            }
        );
        assert_err!(
            comms[1].reduce_scatter(&[1.0f32; 4][..], &mut x, &op0, &S),
            Error::InvalidArgument {
                call: "ncclReduceScatter",
                ..
            }
        );
        let mut g = Group::new();
        assert_err!(
            comms[1]
                .all_reduce_in_place_op(&mut x, &op0, &S)
                .and_then(|op| g.push(op)),
            Error::InvalidArgument {
                call: "ncclAllReduce",
                ..
            }
        );
        g.end().unwrap();
        assert!(!comms[1].is_failed());
        // Used on its own communicator (with the peer in one group) it works.
        let op1 = comms[1].create_pre_mul_sum(3.0f32).unwrap();
        let (mut a, mut b) = (vec![1.0f32; 2], vec![1.0f32; 2]);
        let mut g = Group::new();
        comms[0]
            .all_reduce_in_place_op(&mut a, &op0, &S)
            .and_then(|op| g.push(op))
            .unwrap();
        comms[1]
            .all_reduce_in_place_op(&mut b, &op1, &S)
            .and_then(|op| g.push(op))
            .unwrap();
        g.end().unwrap();
        assert_eq!((a, b), (vec![5.0; 2], vec![5.0; 2]));
    }
    let id = UniqueId::from_raw(nccl_safe::host::root_id_of(comms[0].as_raw()).unwrap());
    for c in comms {
        c.destroy().map_err(|(_, e)| e).unwrap();
    }
    assert_balanced(&id);
}

#[test]
fn split_color_past_i32_max_and_bad_shrink_lists() {
    run_ranks(3, |comm| {
        let r = comm.rank();
        assert_err!(
            comm.split(Some(i32::MAX as u32 + 1), 0),
            Error::InvalidArgument {
                call: "ncclCommSplit",
                ..
            }
        );
        assert_err!(
            comm.split(Some(u32::MAX), 0),
            Error::InvalidArgument {
                call: "ncclCommSplit",
                ..
            }
        );
        assert_err!(
            comm.shrink(&[r]),
            Error::InvalidArgument {
                call: "ncclCommShrink",
                ..
            }
        );
        assert_err!(
            comm.shrink(&[3]),
            Error::RankOutOfRange {
                call: "ncclCommShrink",
                what: "excluded rank",
                rank: 3,
                world_size: 3
            }
        );
        let other = (r + 1) % 3;
        assert_err!(
            comm.shrink(&[other, other]),
            Error::InvalidArgument {
                call: "ncclCommShrink",
                ..
            }
        );
        still_usable(comm);
        // i32::MAX itself is a valid color.
        let child = comm.split(Some(i32::MAX as u32), 0).unwrap().unwrap();
        assert_eq!(child.world_size(), 3);
        still_usable(&child);
    });
}

#[test]
fn a_group_mixing_two_libraries_is_refused() {
    let lib_a = Library::host();
    let lib_b = Library::host_as_version(2, 28).unwrap();
    let (id_a, id_b) = (
        UniqueId::new_with(&lib_a).unwrap(),
        UniqueId::new_with(&lib_b).unwrap(),
    );
    let a =
        Communicator::init_rank_in(&lib_a, &CommDevice::Host, 1, 0, &id_a, &Config::new()).unwrap();
    let b =
        Communicator::init_rank_in(&lib_b, &CommDevice::Host, 1, 0, &id_b, &Config::new()).unwrap();
    let (mut x, mut y) = (vec![1u32; 2], vec![1u32; 2]);
    let mut g = Group::new();
    a.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)
        .and_then(|op| g.push(op))
        .unwrap();
    assert_err!(
        b.all_reduce_in_place_op(&mut y, ReduceOp::Sum, &S)
            .and_then(|op| g.push(op)),
        Error::InvalidArgument {
            call: "ncclAllReduce",
            ..
        }
    );
    g.end().unwrap();
    still_usable(&a);
    still_usable(&b);
    drop((a, b));
    assert_balanced(&id_a);
    assert_balanced(&id_b);
}

#[test]
fn a_host_device_on_nvidias_nccl_is_refused_without_a_gpu() {
    let lib = Library::load_from(support::real_nccl("2.32.3")).expect("real NCCL loads");
    let id = UniqueId::new_with(&lib).unwrap();
    assert_err!(
        Communicator::init_rank_in(&lib, &CommDevice::Host, 1, 0, &id, &Config::new()),
        Error::InvalidArgument {
            call: "ncclCommInitRankConfig",
            ..
        }
    );
}

#[test]
fn unique_id_from_wrong_bytes_or_bad_hex() {
    for n in [0, 1, UNIQUE_ID_BYTES - 1, UNIQUE_ID_BYTES + 1] {
        assert_err!(
            UniqueId::from_bytes(&vec![0u8; n]),
            Error::InvalidArgument {
                call: "UniqueId::from_bytes",
                ..
            }
        );
    }
    assert!(UniqueId::from_bytes(&[0u8; UNIQUE_ID_BYTES]).is_ok());
    let good = "ab".repeat(UNIQUE_ID_BYTES);
    assert_eq!(
        good.parse::<UniqueId>().unwrap(),
        UniqueId::from_bytes(&[0xab; UNIQUE_ID_BYTES]).unwrap()
    );
    let mut bad_digit = good.clone();
    bad_digit.replace_range(10..12, "zz");
    let mut non_ascii = "ab".repeat(UNIQUE_ID_BYTES - 1);
    non_ascii.push('é'); // two bytes: right length, not ASCII
    for text in [
        String::new(),
        "ab".into(),
        "ab".repeat(UNIQUE_ID_BYTES + 1),
        bad_digit,
        non_ascii,
    ] {
        assert_err!(
            text.parse::<UniqueId>(),
            Error::InvalidArgument {
                call: "UniqueId::from_str",
                ..
            }
        );
    }
}

#[test]
fn unique_id_text_with_plus_signs_is_not_hex() {
    assert_err!(
        "+1".repeat(UNIQUE_ID_BYTES).parse::<UniqueId>(),
        Error::InvalidArgument {
            call: "UniqueId::from_str",
            ..
        }
    );
}

/// Inside an open NCCL group a communicator's creation (an init, split, shrink or grow)
/// and a revoke are only queued until the group's end, and return ncclSuccess with a
/// split's child still NULL. A `Group` never leaves NCCL's group open while the caller's
/// code runs, so each of them made while a `Group` holds an operation runs at once, on its
/// own, with its usual checks. An empty exclude list is refused as NCCL refuses it
/// (init.cc:2561-2562).
#[test]
fn a_communicators_creation_while_a_group_is_filled_runs_on_its_own() {
    let id = CommDevice::Host.unique_id().unwrap();
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new()).unwrap();
    let mut x = vec![1.0f32; 4];
    Group::run(|g| {
        g.push(comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &S)?)?;
        let child = comm.split(Some(0), 0)?.expect("a child, made at once");
        assert_eq!((child.world_size(), child.rank()), (1, 0));
        still_usable(&child);
        drop(child);
        let other = CommDevice::Host.unique_id()?;
        let c2 = Communicator::init_rank(&CommDevice::Host, 1, 0, &other, &Config::new())?;
        still_usable(&c2);
        drop(c2);
        let all = Communicator::init_all(&[CommDevice::Host])?;
        assert_eq!(all.len(), 1);
        Ok(())
    })
    .unwrap();
    assert_eq!(x, vec![1.0; 4], "the group's own work ran");
    assert!(!comm.is_failed() && !comm.is_revoked());
    assert_err!(
        comm.shrink(&[]),
        Error::InvalidArgument { call: "ncclCommShrink", ref reason }
            if reason.contains("no rank is excluded")
    );
    let child = comm
        .split(Some(0), 0)
        .unwrap()
        .expect("after the group, a child");
    assert_eq!((child.world_size(), child.rank()), (1, 0));
    still_usable(&child);
    drop(child);
    still_usable(&comm);
    drop(comm);
    assert_balanced(&id);
}
