//! GPU-only tests: cudarc buffers, stream ordering, groups across devices.
//!
//! They need a machine with at least one NVIDIA GPU and NCCL (`pip install
//! nvidia-nccl-cu12` in the active environment, or `NCCL_LIBRARY`). Run them with
//! `cargo test --test gpu -- --ignored`.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nccl_safe::launch::{cuda_device_count, Launcher};
use nccl_safe::{Communicator, Device, Group, ReduceOp};

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn all_reduce_cudarc_slices_on_every_gpu() {
    let sums = Launcher::all_devices()
        .unwrap()
        .run(|rank| {
            let stream = rank.cuda_stream().expect("a CUDA rank");
            let mut x = stream.clone_htod(&vec![rank.rank() as f32 + 1.0; 1 << 20])?;
            rank.comm()
                .all_reduce_in_place(&mut x, ReduceOp::Sum, stream)?;
            let host = stream.clone_dtoh(&x)?;
            Ok(host[0])
        })
        .unwrap();
    let n = cuda_device_count() as f32;
    assert!(sums.iter().all(|&s| s == n * (n + 1.0) / 2.0), "{sums:?}");
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn out_of_place_views_and_a_second_stream_keep_order() {
    // The buffer is written on stream A; the collective runs on stream B. cudarc's event
    // tracking (kept alive through our guards) must order B after A.
    let results = Launcher::all_devices()
        .unwrap()
        .run(|rank| {
            let b = rank.cuda_stream().expect("a CUDA rank");
            let Device::Cuda(ctx) = rank.device() else {
                unreachable!()
            };
            let a = ctx.new_stream()?;
            let src = a.clone_htod(&vec![2.0f64; 1 << 22])?;
            let mut dst = b.alloc_zeros::<f64>(1 << 22)?;
            {
                let view = src.slice(..);
                let mut out = dst.slice_mut(..);
                rank.comm().all_reduce(&view, &mut out, ReduceOp::Sum, b)?;
            }
            Ok(b.clone_dtoh(&dst)?)
        })
        .unwrap();
    let n = cuda_device_count() as f64;
    assert!(results.iter().all(|v| v.iter().all(|&x| x == 2.0 * n)));
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn one_thread_drives_every_device_in_a_group() {
    let n = cuda_device_count();
    let contexts: Vec<Arc<CudaContext>> = (0..n).map(|i| CudaContext::new(i).unwrap()).collect();
    let devices: Vec<Device> = contexts.iter().cloned().map(Device::Cuda).collect();
    let comms = Communicator::init_all(&devices).unwrap();
    let streams: Vec<_> = contexts.iter().map(|c| c.new_stream().unwrap()).collect();
    let mut bufs: Vec<_> = streams
        .iter()
        .enumerate()
        .map(|(i, s)| s.clone_htod(&vec![i as i32; 4096]).unwrap())
        .collect();
    {
        let mut g = Group::new();
        for ((comm, buf), s) in comms.iter().zip(bufs.iter_mut()).zip(&streams) {
            comm.all_reduce_in_place_op(buf, ReduceOp::Sum, s)
                .and_then(|op| g.push(op))
                .unwrap();
        }
        g.end().unwrap();
    }
    let want = (n * (n - 1) / 2) as i32;
    for (buf, s) in bufs.iter().zip(&streams) {
        assert!(s.clone_dtoh(buf).unwrap().iter().all(|&x| x == want));
    }
    for c in comms {
        c.destroy().map_err(|(_, e)| e).unwrap();
    }
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn nccl_memory_collectives_views_and_cudarc_copies() {
    use nccl_safe::{Memory, NcclMemory};
    let sums = Launcher::all_devices()
        .unwrap()
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let stream = rank.cuda_stream().expect("a CUDA rank");
            let n = 1 << 20;
            let mut mem = NcclMemory::<f32>::alloc_zeros(comm, n, s)?;
            assert_eq!(mem.memory(), Memory::Device(comm.device().unwrap()));
            assert!(mem.to_vec(s)?.iter().all(|&x| x == 0.0), "zeroed");
            // cudarc's own copy into the memory, through its CUDA view.
            stream.memcpy_htod(
                &vec![rank.rank() as f32 + 1.0; n],
                &mut mem.cuda_view_mut()?,
            )?;
            comm.all_reduce_in_place(&mut mem, ReduceOp::Sum, s)?;
            // A view as the send buffer of an all-gather into another NcclMemory.
            let mut out = NcclMemory::<f32>::alloc_zeros(comm, 2 * comm.world_size(), s)?;
            comm.all_gather(&mem.slice(0..2)?, &mut out, s)?;
            let gathered = stream.clone_dtoh(&out.cuda_view()?)?;
            out.free()?;
            let first = mem.to_vec(s)?[0];
            assert!(gathered.iter().all(|&x| x == first));
            Ok(first)
        })
        .unwrap();
    let n = cuda_device_count() as f32;
    assert!(sums.iter().all(|&s| s == n * (n + 1.0) / 2.0), "{sums:?}");
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn registered_buffers_need_no_extra_argument() {
    use nccl_safe::{Error, NcclMemory};
    let sums = Launcher::all_devices()
        .unwrap()
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let stream = rank.cuda_stream().expect("a CUDA rank");
            // Host memory is refused by NVIDIA's NCCL, with a typed error.
            let mut host = vec![0.0f32; 16];
            assert!(matches!(
                comm.register(&mut host),
                Err(Error::InvalidArgument { .. })
            ));
            let mut x = stream.clone_htod(&vec![1.0f32; 1 << 20])?;
            let mut mem = NcclMemory::<f32>::alloc_zeros(comm, 1 << 20, s)?;
            {
                let mut rx = comm.register(&mut x)?;
                let mut rm = comm.register(&mut mem)?;
                for _ in 0..3 {
                    comm.all_reduce_in_place(&mut rx, ReduceOp::Sum, s)?;
                }
                comm.all_reduce(&rx, &mut rm, ReduceOp::Sum, s)?;
                // cudarc's copies take the registration as the buffer.
                let back = stream.clone_dtoh(&rx)?;
                assert!(back.iter().all(|&v| v == back[0]));
                rm.deregister()?;
            }
            Ok(mem.to_vec(s)?[0])
        })
        .unwrap();
    let n = cuda_device_count() as f32;
    assert!(sums.iter().all(|&s| s == n.powi(4)), "{sums:?}");
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn symmetric_window_collective() {
    use nccl_safe::{Error, NcclMemory, WindowFlags};
    let sums = Launcher::all_devices()
        .unwrap()
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let stream = rank.cuda_stream().expect("a CUDA rank");
            let mut plain = stream.alloc_zeros::<f32>(1024)?;
            match comm.register_window(&mut plain, WindowFlags::COLL_SYMMETRIC) {
                Err(Error::InvalidArgument { .. }) => {}
                Err(Error::Unsupported { .. }) => return Ok(None), // NCCL < 2.27
                other => panic!("a cudarc slice is no symmetric window: {other:?}"),
            }
            let mut mem = NcclMemory::<f32>::alloc_zeros(comm, 1 << 20, s)?;
            mem.copy_from_host(&vec![rank.rank() as f32 + 1.0; 1 << 20], s)?;
            {
                let mut win = comm.register_window(&mut mem, WindowFlags::COLL_SYMMETRIC)?;
                comm.all_reduce_in_place(&mut win, ReduceOp::Sum, s)?;
                stream.synchronize()?;
            }
            Ok(Some(mem.to_vec(s)?[0]))
        })
        .unwrap();
    let n = cuda_device_count() as f32;
    for s in sums.into_iter().flatten() {
        assert_eq!(s, n * (n + 1.0) / 2.0);
    }
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn fp8_all_reduce_on_the_gpu() {
    use float8::F8E4M3;
    use nccl_safe::{Error, Version};
    let got = Launcher::all_devices()
        .unwrap()
        .run(|rank| {
            let stream = rank.cuda_stream().expect("a CUDA rank");
            let mut x = stream.clone_htod(&vec![F8E4M3::from_f32(1.0); 4096])?;
            match rank
                .comm()
                .all_reduce_in_place(&mut x, ReduceOp::Sum, stream)
            {
                Err(Error::Unsupported { needs, .. }) => {
                    assert_eq!(needs, Version::new(2, 24, 0));
                    return Ok(None);
                }
                r => r?,
            }
            Ok(Some(stream.clone_dtoh(&x)?[0].to_f32()))
        })
        .unwrap();
    let n = cuda_device_count() as f32;
    for v in got.into_iter().flatten() {
        assert_eq!(v, n);
    }
}
