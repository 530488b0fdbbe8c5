//! The fake CUDA driver's stream-order model (`tests/support/fakes/cuda.c`, "stream
//! order"), and the crate's collectives under it.
//!
//! The fake runs every operation inside its call, in the order the host issues them: one
//! of the orders a GPU may pick, and the kindest. The model holds CUDA's real rule beside
//! it: two streams are ordered only by events and host synchronization, so every pair of
//! accesses to the same memory (one a write) that those leave unordered is a race, which a
//! GPU may run the other way round. Checked here:
//! - the model finds the races CUDA allows (write then read, read then write, a free while
//!   another stream reads, a collective on a buffer another stream is writing), and none
//!   where an event or a host synchronization orders the two;
//! - a collective of the crate on a buffer written on another stream is ordered by cudarc's
//!   event tracking, which the crate keeps by taking every pointer through cudarc;
//! - a `StreamBound` (no cudarc call per operation) is ordered by its two ends, and without
//!   them the same collectives race.
//!
//! One test: the model's gauges are process-wide, so nothing else may run beside it.

mod support;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use nccl_safe::{CommDevice, Communicator, Config, Group, ReduceOp, StreamBound, UniqueId};
use support::fakes::{driver, nccl, Gauge};

const N: usize = 64;

/// The races the model finds while `f` runs.
fn races_in(f: impl FnOnce()) -> i64 {
    let before = driver().gauge(Gauge::Races);
    f();
    driver().gauge(Gauge::Races) - before
}

/// A buffer of `N` ones written on `stream`.
fn written(stream: &Arc<CudaStream>) -> CudaSlice<f32> {
    stream.clone_htod(&[1.0f32; N]).unwrap()
}

/// `x` copied on `stream` (a read of `x` there).
fn read(stream: &Arc<CudaStream>, x: &CudaSlice<f32>) -> CudaSlice<f32> {
    stream.clone_dtod(x).unwrap()
}

#[test]
fn cuda_stream_order_is_modelled_and_collectives_keep_it() {
    let d = driver();
    d.check_order(true);
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: until re-enabled below, the scenarios order their streams themselves, or
    // are races on purpose; only buffers made after the call are affected.
    unsafe { ctx.disable_event_tracking() };
    let a = ctx.new_stream().unwrap();
    let b = ctx.new_stream().unwrap();
    let checked = d.gauge(Gauge::AccessesChecked);

    // Written on one stream, read on another, nothing between them.
    let n = races_in(|| {
        let x = written(&a);
        let _y = read(&b, &x);
        ctx.synchronize().unwrap(); // the frees below come after everything
    });
    assert!(n >= 1, "a read on another stream, unordered, was not seen");
    let first = d.last_race();
    assert!(
        first.contains("write (cuMemcpyHtoDAsync_v2")
            && first.contains("read (cuMemcpyDtoDAsync_v2"),
        "{first}"
    );

    // The same, ordered by an event: no race.
    let n = races_in(|| {
        let x = written(&a);
        let e = a.record_event(None).unwrap();
        b.wait(&e).unwrap();
        let _y = read(&b, &x);
        ctx.synchronize().unwrap();
    });
    assert_eq!(n, 0, "{}", d.last_race());

    // The same, ordered by the host's wait for the first stream: no race.
    let n = races_in(|| {
        let x = written(&a);
        a.synchronize().unwrap();
        let _y = read(&b, &x);
        ctx.synchronize().unwrap();
    });
    assert_eq!(n, 0, "{}", d.last_race());

    // Read on another stream, then overwritten on the first without waiting for it.
    let n = races_in(|| {
        let mut x = written(&a);
        a.synchronize().unwrap();
        let _y = read(&b, &x);
        a.memset_zeros(&mut x).unwrap();
        ctx.synchronize().unwrap();
    });
    assert!(
        n >= 1,
        "an overwrite before another stream's read was not seen"
    );

    // Freed on its stream while another stream may still read it.
    let n = races_in(|| {
        let x = written(&a);
        a.synchronize().unwrap();
        let _y = read(&b, &x);
        drop(x); // cudarc frees it on `a`, without a wait (tracking is off)
        ctx.synchronize().unwrap();
    });
    assert!(n >= 1, "a free while another stream reads was not seen");

    // A collective on `b` of a buffer written on `a`: NCCL's accesses reach the model
    // through the fake NCCL, so without an order it is a race...
    let lib = nccl();
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(
        &lib,
        &CommDevice::Cuda(ctx.clone()),
        1,
        0,
        &id,
        &Config::default(),
    )
    .unwrap();
    let n = races_in(|| {
        let mut x = written(&a);
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &b).unwrap();
        ctx.synchronize().unwrap();
    });
    assert!(n >= 1, "a collective on an unordered buffer was not seen");

    // ... and with cudarc's event tracking on (its default), the crate takes the pointer
    // through cudarc, which makes `b` wait for the write and the free wait for `b`.
    // SAFETY: cudarc orders the buffers made from here on.
    unsafe { ctx.enable_event_tracking() };
    let n = races_in(|| {
        let mut x = written(&a);
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &b).unwrap();
        let _y = read(&a, &x);
        drop(x);
        ctx.synchronize().unwrap();
    });
    assert_eq!(n, 0, "{}", d.last_race());

    // A buffer of the communication stream `b`, written on `a`, reduced on `b` with no
    // cudarc wait or record per operation, then read on `a`. First without its ends (the
    // collectives untracked, as a StreamBound's are, and nothing recorded after them): the
    // read on `a` waits only for the old write, so it races the collectives...
    let reduced = |x: &mut CudaSlice<f32>| {
        for _ in 0..3 {
            comm.all_reduce_in_place(x, ReduceOp::Sum, &b).unwrap();
        }
    };
    let n = races_in(|| {
        let mut x = b.alloc_zeros::<f32>(N).unwrap();
        a.memcpy_htod(&[1.0f32; N], &mut x).unwrap();
        b.wait(&a.record_event(None).unwrap()).unwrap();
        // SAFETY: on purpose, the collectives below are not tracked.
        unsafe { ctx.disable_event_tracking() };
        reduced(&mut x);
        // SAFETY: back to cudarc's ordering for what follows.
        unsafe { ctx.enable_event_tracking() };
        let _y = read(&a, &x);
        ctx.synchronize().unwrap();
    });
    assert!(
        n >= 1,
        "collectives with no record after them were not seen"
    );
    // ... and under a StreamBound, whose two ends order it: no race, and the collectives
    // make none of cudarc's calls (only the crate's completion marker).
    let n = races_in(|| {
        let mut x = b.alloc_zeros::<f32>(N).unwrap();
        a.memcpy_htod(&[1.0f32; N], &mut x).unwrap();
        let mut x = StreamBound::new(x).map_err(|(_, e)| e).unwrap();
        d.mark_this_thread(true);
        let before = d.counts(true);
        for _ in 0..3 {
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &b).unwrap();
        }
        let calls = d.counts(true).since(&before);
        d.mark_this_thread(false);
        // No cudarc wait or record: the only events recorded are the crate's completion
        // markers, one per collective with the `diag` feature (the default exact
        // completion), and none without it.
        assert_eq!(calls.of("cuStreamWaitEvent"), 0, "{calls}");
        let markers = if cfg!(feature = "diag") { 3 } else { 0 };
        assert_eq!(
            calls.of("cuEventRecord"),
            markers,
            "the markers only: {calls}"
        );
        let x = x.into_inner();
        let y = read(&a, &x);
        assert_eq!(a.clone_dtoh(&y).unwrap(), vec![1.0f32; N]);
        drop(x);
        ctx.synchronize().unwrap();
    });
    assert_eq!(n, 0, "{}", d.last_race());
    // Dropped rather than handed back: cudarc's free on `b` follows the collectives too.
    let n = races_in(|| {
        let mut x = b.alloc_zeros::<f32>(N).unwrap();
        a.memcpy_htod(&[1.0f32; N], &mut x).unwrap();
        let mut x = StreamBound::new(x).map_err(|(_, e)| e).unwrap();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &b).unwrap();
        drop(x);
        ctx.synchronize().unwrap();
    });
    assert_eq!(n, 0, "{}", d.last_race());
    // On another stream than its own: refused before NCCL sees it.
    let mut x = StreamBound::new(b.alloc_zeros::<f32>(N).unwrap())
        .map_err(|(_, e)| e)
        .unwrap();
    let e = comm
        .all_reduce_in_place(&mut x, ReduceOp::Sum, &a)
        .unwrap_err();
    assert!(
        matches!(&e, nccl_safe::Error::InvalidArgument { .. })
            && e.to_string().contains("StreamBound"),
        "{e}"
    );
    drop(x);

    drop(comm);

    // Two ranks: NCCL launches a group of non-blocking communicators from its own thread
    // after ncclGroupEnd returned ncclInProgress (the fake NCCL does too), so cudarc's
    // events must be recorded only once the launch is done, or a read on another stream
    // that waits for them is not ordered after NCCL's write.
    let id = UniqueId::new_with(&lib).unwrap();
    let n = races_in(|| {
        std::thread::scope(|s| {
            for rank in 0..2 {
                let (lib, id) = (&lib, &id);
                s.spawn(move || {
                    let ctx = CudaContext::new(rank).unwrap();
                    let (a, b) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
                    let dev = CommDevice::Cuda(ctx.clone());
                    let comm =
                        Communicator::init_rank_in(lib, &dev, 2, rank, id, &Config::default())
                            .unwrap();
                    let mut x = written(&a);
                    let mut g = Group::new();
                    g.push(
                        comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &b)
                            .unwrap(),
                    )
                    .unwrap();
                    g.end().unwrap();
                    let y = read(&a, &x);
                    assert_eq!(a.clone_dtoh(&y).unwrap(), vec![2.0f32; N]);
                    drop(x);
                    ctx.synchronize().unwrap();
                    drop(comm);
                });
            }
        });
    });
    assert_eq!(n, 0, "{}", d.last_race());

    // One thread, one group over the communicators of two devices (two contexts): each
    // buffer's cudarc event is recorded after the group, when the current context is at
    // most one of the two. The crate records it without binding the context first, and
    // binds it (through cudarc) only when the driver refuses; a record lost there leaves
    // the reads on the compute streams racing the collectives.
    let n = races_in(|| {
        let mut ranks: Vec<_> = (0..2)
            .map(|dev| {
                let ctx = CudaContext::new(dev).unwrap();
                let (a, b) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
                let id = UniqueId::new_with(&lib).unwrap();
                let comm = Communicator::init_rank_in(
                    &lib,
                    &CommDevice::Cuda(ctx.clone()),
                    1,
                    0,
                    &id,
                    &Config::default(),
                )
                .unwrap();
                let x = written(&a);
                (ctx, a, b, comm, x)
            })
            .collect();
        {
            let mut g = Group::new();
            for (_, _, b, comm, x) in ranks.iter_mut() {
                g.push(comm.all_reduce_in_place_op(x, ReduceOp::Sum, b).unwrap())
                    .unwrap();
            }
            g.end().unwrap();
        }
        for (ctx, a, _, comm, x) in ranks {
            let y = read(&a, &x);
            assert_eq!(a.clone_dtoh(&y).unwrap(), vec![1.0f32; N]);
            drop(x);
            ctx.synchronize().unwrap();
            drop(comm);
        }
    });
    assert_eq!(n, 0, "{}", d.last_race());

    assert!(d.gauge(Gauge::AccessesChecked) > checked + 20);
    assert_eq!(d.gauge(Gauge::UntrackedOps), 0);
}
