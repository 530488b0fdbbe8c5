//! Collectives on `CU_STREAM_PER_THREAD` (0x2, candle's stream) with two or more ranks,
//! under the fake CUDA driver's stream-order model (`tests/support/fakes/cuda.c`).
//!
//! NCCL launches the work of a non-blocking communicator of several ranks from its group's
//! thread, where 0x2 is that thread's own per-thread stream: the fake NCCL does the same
//! (`tests/support/fakes/mod.rs`, `launch`), so a collective passed 0x2 as it is would be
//! ordered with nothing the caller enqueued. The crate runs it on a relay stream joined to
//! and from the caller's per-thread stream by events; the model must see no race between
//! the caller's write, the collective, the caller's read and the buffer's free.
//!
//! One test: the model's gauges are process-wide, so nothing else may run beside it.

mod support;

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nccl_safe::{CommDevice, Communicator, Config, Group, Library, ReduceOp, UniqueId};
use support::fakes::{driver, nccl, Gauge};

const N: usize = 64;

/// `world` ranks in threads, each writing a buffer on its per-thread stream, reducing it
/// there (alone, then in a group) and reading it back there; the races the model saw.
fn races_with(lib: &Arc<Library>, ctx: &Arc<CudaContext>, world: usize) -> i64 {
    let d = driver();
    let before = d.gauge(Gauge::Races);
    let id = UniqueId::new_with(lib).unwrap();
    std::thread::scope(|s| {
        for r in 0..world {
            let (lib, ctx, id) = (Arc::clone(lib), Arc::clone(ctx), id);
            s.spawn(move || {
                let dev = CommDevice::Cuda(Arc::clone(&ctx));
                let comm =
                    Communicator::init_rank_in(&lib, &dev, world, r, &id, &Config::new()).unwrap();
                let s = ctx.per_thread_stream();
                let mut x = s.clone_htod(&[1.0f32; N]).unwrap();
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s).unwrap();
                let single = s.clone_dtoh(&x).unwrap();
                assert_eq!(single, vec![world as f32; N]);
                // Read on another stream too, ordered only by cudarc's event on the buffer:
                // recorded as the operation's guard dropped, it must come after the
                // relay's work on the per-thread stream.
                let other = ctx.new_stream().unwrap();
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s).unwrap();
                let elsewhere = other.clone_dtoh(&x).unwrap();
                assert_eq!(elsewhere, vec![(world * world) as f32; N]);
                // And a write on another stream into a buffer the collective read (out of
                // place): ordered by cudarc's read event, after the relay's work.
                let mut sum = s.clone_htod(&[0.0f32; N]).unwrap();
                comm.all_reduce(&x, &mut sum, ReduceOp::Sum, &s).unwrap();
                other.memcpy_htod(&[5.0f32; N], &mut x).unwrap();
                let summed = other.clone_dtoh(&sum).unwrap();
                assert_eq!(summed, vec![(world * world * world) as f32; N]);
                let overwritten = other.clone_dtoh(&x).unwrap();
                assert_eq!(overwritten, vec![5.0f32; N]);
                let mut y = s.clone_htod(&[2.0f32; N]).unwrap();
                Group::run(|g| {
                    g.push(comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &s)?)?;
                    g.push(comm.all_reduce_in_place_op(&mut y, ReduceOp::Max, &s)?)
                })
                .unwrap();
                let grouped = other.clone_dtoh(&x).unwrap();
                assert_eq!(grouped, vec![5.0 * world as f32; N]);
                drop((x, y)); // freed on the per-thread stream
                s.synchronize().unwrap();
                comm.destroy().map_err(|(_, e)| e).unwrap();
            });
        }
    });
    d.gauge(Gauge::Races) - before
}

#[test]
fn collectives_on_the_per_thread_stream_are_ordered_with_the_callers_work() {
    let d = driver();
    d.check_order(true);
    let ctx = CudaContext::new(0).unwrap();
    let lib = nccl();
    let checked = d.gauge(Gauge::AccessesChecked);
    for world in [2, 3] {
        let n = races_with(&lib, &ctx, world);
        assert_eq!(n, 0, "{world} ranks: {}", d.last_race());
    }
    // One rank: NCCL launches inside the call, on the caller's own per-thread stream.
    assert_eq!(races_with(&lib, &ctx, 1), 0, "{}", d.last_race());
    assert!(
        d.gauge(Gauge::AccessesChecked) > checked,
        "the model checked nothing"
    );
    assert_eq!(d.gauge(Gauge::UntrackedOps), 0);
    d.check_order(false);
}
