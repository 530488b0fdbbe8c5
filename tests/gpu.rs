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
            g.all_reduce_in_place(comm, buf, ReduceOp::Sum, s).unwrap();
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
