//! GPU-only tests: cudarc buffers, stream ordering, groups across devices, a stuck stream
//! (the watchdog fails fast, aborts behind it, and the process still exits cleanly), and
//! collectives captured into CUDA graphs and replayed.
//!
//! They need a machine with at least one NVIDIA GPU and NCCL (`pip install
//! nvidia-nccl-cu12` in the active environment, or `NCCL_LIBRARY`). Run them with
//! `cargo test --test gpu -- --ignored`.

mod support;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use nccl_launch::{cuda_device_count, Launcher};
use nccl_safe::{CommDevice, Communicator, Config, Error, Group, Library, ReduceOp, UniqueId};

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
            let CommDevice::Cuda(ctx) = rank.device() else {
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
    let devices: Vec<CommDevice> = contexts.iter().cloned().map(CommDevice::Cuda).collect();
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
            assert_eq!(mem.memory(), Memory::Device(comm.cuda_ordinal().unwrap()));
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

// ---- a stuck stream --------------------------------------------------------------------

/// The watchdog's limit in the stuck-stream tests.
const TIMEOUT: Duration = Duration::from_secs(3);
/// What a user may wait for a verdict: the limit plus one second.
const BOUND: Duration = Duration::from_secs(4);

/// A 4-byte word of pinned host memory mapped into the device (`cuMemHostAlloc` with
/// `CU_MEMHOSTALLOC_DEVICEMAP`): a stream told to wait for it (`cuStreamWaitValue32`)
/// blocks until the host writes it, like a stream behind a kernel that never ends. A word
/// from cudarc's stream-ordered pool is refused by the wait with
/// `CUDA_ERROR_INVALID_VALUE`, hence the mapped host memory.
struct HostWord {
    host: *mut u32,
    dev: sys::CUdeviceptr,
}

// SAFETY: the word is plain pinned memory, written with volatile stores from whichever
// thread holds the `HostWord`; CUDA allows host memory to be used from any thread.
unsafe impl Send for HostWord {}

impl HostWord {
    fn new(ctx: &Arc<CudaContext>) -> HostWord {
        ctx.bind_to_thread().unwrap();
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `p` is a writable out-pointer; 4 bytes of mapped pinned memory.
        unsafe { sys::cuMemHostAlloc(&mut p, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .result()
            .expect("cuMemHostAlloc");
        let host = p.cast::<u32>();
        // SAFETY: `host` points to the 4 writable, aligned bytes just allocated.
        unsafe { host.write_volatile(0) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `p` is mapped pinned memory of the current context; `dev` is writable.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) }
            .result()
            .expect("cuMemHostGetDevicePointer");
        HostWord { host, dev }
    }

    /// Makes `stream` wait until the word is at least 1.
    fn block(&self, stream: &CudaStream) {
        // SAFETY: `dev` is the device address of a live mapped word (freed only after the
        // stream has passed the wait: see `free`).
        unsafe {
            sys::cuStreamWaitValue32_v2(
                stream.cu_stream(),
                self.dev,
                1,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        }
        .result()
        .expect("cuStreamWaitValue32");
    }

    /// Lets every stream waiting on the word go.
    fn release(&self) {
        // SAFETY: `host` is live until `free`, which consumes `self`.
        unsafe { self.host.write_volatile(1) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Releases the word, waits for `stream` to pass it, frees it.
    fn free(self, stream: &CudaStream) {
        self.release();
        stream
            .synchronize()
            .expect("the stream drains once released");
        // SAFETY: allocated by cuMemHostAlloc; no stream waits on it any more.
        unsafe { sys::cuMemFreeHost(self.host.cast()) }
            .result()
            .expect("cuMemFreeHost");
        std::mem::forget(self);
    }
}

impl Drop for HostWord {
    /// On a failed test: release the stream (the 4 bytes leak rather than be freed under a
    /// stream that may still read them).
    fn drop(&mut self) {
        self.release();
    }
}

/// Polls `f` until it is true or `limit` passes; the time it took.
fn until(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// A world-size-1 communicator on device 0 whose stream is blocked, with an `all_reduce`
/// queued behind the block.
struct Stuck {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Communicator,
    word: HostWord,
    send: CudaSlice<f32>,
    recv: CudaSlice<f32>,
}

fn stuck(abort_timeout: Duration) -> Stuck {
    let lib = Library::load().expect("NVIDIA's NCCL");
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let id = UniqueId::new_with(&lib).unwrap();
    let config = Config::new().timeout(TIMEOUT).abort_timeout(abort_timeout);
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx.clone()), 1, 0, &id, &config)
        .unwrap();
    let send = stream.clone_htod(&[1.0f32; 256]).unwrap();
    let mut recv = stream.alloc_zeros::<f32>(256).unwrap();
    stream.synchronize().unwrap();
    let word = HostWord::new(&ctx);
    word.block(&stream);
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
        .expect("queued behind the blocked stream");
    Stuck {
        ctx,
        stream,
        comm,
        word,
        send,
        recv,
    }
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn a_stuck_stream_fails_fast_then_aborts_behind_it() {
    let Stuck {
        ctx,
        stream,
        comm,
        word,
        send,
        mut recv,
    } = stuck(Duration::from_secs(20));
    let queued = Instant::now();
    let failed = until(BOUND, || comm.is_failed());
    assert!(
        failed.is_some(),
        "is_failed() still false {:?} after the stuck all_reduce",
        queued.elapsed()
    );
    eprintln!("is_failed() after {:?}", queued.elapsed());

    // The next call, on another thread so that a hang cannot hang the test: the word is
    // released if it has not answered within the bound.
    let (tx, rx) = mpsc::channel();
    let caller = std::thread::spawn(move || {
        let start = Instant::now();
        let r = comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream);
        let _ = tx.send((r, start.elapsed()));
        (comm, stream, send, recv)
    });
    let answer = rx.recv_timeout(BOUND);
    if answer.is_err() {
        word.release();
    }
    let (comm, stream, send, recv) = caller.join().expect("the caller thread");
    let (result, took) = answer.expect("the call after the timeout answered within 4 s");
    match result {
        Err(e @ Error::Timeout { .. }) => eprintln!("next call after {took:?}: {e}"),
        other => panic!("the call after the timeout must be Error::Timeout: {other:?}"),
    }
    assert!(took <= BOUND, "{took:?}");

    // Release the stream: the abort behind it can finish, and teardown ends.
    word.release();
    let (tx, rx) = mpsc::channel();
    let teardown = std::thread::spawn(move || {
        let start = Instant::now();
        drop(comm);
        let _ = tx.send(start.elapsed());
        word.free(&stream);
        drop((send, recv));
    });
    let took = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("teardown ends once the stream is released");
    eprintln!("teardown after release: {took:?}");
    teardown.join().expect("teardown thread");
    ctx.check_err().unwrap();
}

/// Set in the child of `a_process_exits_cleanly_while_the_abort_waits_on_a_stuck_stream`.
const CHILD_VAR: &str = "NCCL_SAFE_GPU_TEST_CHILD";
const CHILD_MARK: &str = "child: abort waits on the stuck stream, exiting with 3";

/// The child: a stuck stream, the watchdog's abort waiting behind it, and
/// `std::process::exit(3)` while it waits. Fails unless `CHILD_VAR` is set (its parent sets
/// it; a run of the ignored tests skips it with `--skip child_`).
#[test]
#[ignore = "a child process of a GPU test"]
fn child_exits_while_the_abort_waits_on_a_stuck_stream() {
    if std::env::var_os(CHILD_VAR).is_none() {
        panic!("run only as a child process ({CHILD_VAR} unset; run the suite with --skip child_)");
    }
    let s = stuck(support::EXIT_CHILD_ABORT_TIMEOUT);
    assert!(
        until(BOUND, || s.comm.is_failed()).is_some(),
        "is_failed() within 4 s"
    );
    // The abort starts right after the communicator is marked failed and then waits on
    // the stream, which is never released.
    std::thread::sleep(Duration::from_millis(500));
    println!("{CHILD_MARK}");
    std::mem::forget(s); // as a process that ends without dropping anything
    std::process::exit(3);
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn a_process_exits_cleanly_while_the_abort_waits_on_a_stuck_stream() {
    let child = support::spawn_child(
        "child_exits_while_the_abort_waits_on_a_stuck_stream",
        CHILD_VAR,
        "1",
    );
    let took = support::check_child_exit(child, CHILD_MARK, 3, Duration::from_secs(60));
    eprintln!("child exited with 3 after {took:?}");
}

// ---- CUDA graphs -----------------------------------------------------------------------

/// Device 0 with cudarc's event tracking off (its events break capture with
/// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`), a stream, and a world-size-1 communicator with
/// a 3 s watchdog limit, so that a false timeout for captured work would show.
fn graph_rank() -> (Arc<CudaContext>, Arc<CudaStream>, Communicator) {
    let lib = Library::load().expect("NVIDIA's NCCL");
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: every buffer of these tests is allocated, used, read back and freed on the
    // one stream made below, so no use needs ordering across streams.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let id = UniqueId::new_with(&lib).unwrap();
    let config = Config::new().timeout(TIMEOUT);
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx.clone()), 1, 0, &id, &config)
        .unwrap();
    (ctx, stream, comm)
}

const GLOBAL: sys::CUstreamCaptureMode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn a_captured_all_reduce_replays_a_thousand_times() {
    const N: usize = 256;
    const REPLAYS: usize = 1000;
    let (ctx, stream, comm) = graph_rank();
    let world = comm.world_size() as f32;
    let input: Vec<f32> = (0..N).map(|i| (i % 7) as f32 + 1.0).collect();
    let send = stream.clone_htod(&input).unwrap();
    let mut recv = stream.alloc_zeros::<f32>(N).unwrap();
    // Every replay's result is copied to its own slot: each slot proves one replay.
    let mut history = stream.alloc_zeros::<f32>(N * REPLAYS).unwrap();
    stream.synchronize().unwrap();

    stream.begin_capture(GLOBAL).unwrap();
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
        .expect("an all_reduce under capture");
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("the capture made a graph");
    stream.synchronize().unwrap();
    assert!(
        stream.clone_dtoh(&recv).unwrap().iter().all(|&x| x == 0.0),
        "capturing must not run the all_reduce"
    );

    for i in 0..REPLAYS {
        stream.memset_zeros(&mut recv).unwrap();
        graph.launch().unwrap();
        let mut slot = history.slice_mut(i * N..(i + 1) * N);
        stream.memcpy_dtod(&recv, &mut slot).unwrap();
    }
    stream.synchronize().unwrap();
    let got = stream.clone_dtoh(&history).unwrap();
    for (i, slot) in got.chunks(N).enumerate() {
        for (j, &x) in slot.iter().enumerate() {
            assert_eq!(x, world * input[j], "replay {i}, element {j}");
        }
    }

    // No false timeout for the captured work: past the limit, the communicator is fine
    // and a plain call still works.
    std::thread::sleep(TIMEOUT + Duration::from_secs(1));
    assert!(
        !comm.is_failed(),
        "a false timeout after capture and replay"
    );
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
        .expect("a plain call after replays");
    stream.synchronize().unwrap();
    assert_eq!(
        stream.clone_dtoh(&recv).unwrap(),
        input.iter().map(|x| world * x).collect::<Vec<_>>()
    );
    drop(graph);
    drop((send, recv, history));
    comm.destroy().map_err(|(_, e)| e).unwrap();
    ctx.check_err().unwrap();
}

#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn a_captured_group_replays() {
    const N: usize = 1024;
    const REPLAYS: usize = 100;
    let (ctx, stream, comm) = graph_rank();
    let world = comm.world_size() as i32;
    let a: Vec<i32> = (0..N as i32).collect();
    let send = stream.clone_htod(&a).unwrap();
    let mut recv = stream.alloc_zeros::<i32>(N).unwrap();
    let mut acc = stream.clone_htod(&a).unwrap();
    stream.synchronize().unwrap();

    stream.begin_capture(GLOBAL).unwrap();
    {
        let mut g = Group::new();
        g.push(
            comm.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &stream)
                .unwrap(),
        )
        .unwrap();
        g.push(
            comm.all_reduce_in_place_op(&mut acc, ReduceOp::Max, &stream)
                .unwrap(),
        )
        .unwrap();
        g.end().expect("a group under capture");
    }
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("the capture made a graph");
    for _ in 0..REPLAYS {
        stream.memset_zeros(&mut recv).unwrap();
        graph.launch().unwrap();
    }
    stream.synchronize().unwrap();
    let want: Vec<i32> = a.iter().map(|x| world * x).collect();
    assert_eq!(stream.clone_dtoh(&recv).unwrap(), want);
    // Max over ranks of the same input is the input, replay after replay.
    assert_eq!(stream.clone_dtoh(&acc).unwrap(), a);
    std::thread::sleep(TIMEOUT + Duration::from_secs(1));
    assert!(!comm.is_failed(), "a false timeout after a captured group");
    drop(graph);
    drop((send, recv, acc));
    comm.destroy().map_err(|(_, e)| e).unwrap();
    ctx.check_err().unwrap();
}

/// NCCL's destroy waits until every CUDA graph that captured work of the communicator is
/// destroyed (`commDestroySync`, init.cc:2232-2234 of 2.28.9), which the fake NCCL follows
/// (`tests/cuda_path.rs`, `destroy_beside_a_live_graph_is_bounded_and_names_the_graph`):
/// here NVIDIA's own. `destroy()` beside a live graph returns at `Config::abort_timeout`
/// with `Error::Timeout` naming the graph; a new communicator on the device is refused as
/// wedged, naming it too, until the graph is dropped; then the destroy left on the lane
/// completes and the lane frees up.
#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn destroy_beside_a_live_graph_returns_at_its_bound_naming_the_graph() {
    let bound = nccl_safe::diag::MIN_NCCL_ABORT_TIMEOUT;
    let lib = Library::load().expect("NVIDIA's NCCL");
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: every buffer here is used on the one stream made below.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let device = CommDevice::Cuda(ctx.clone());
    let config = Config::new().timeout(TIMEOUT).abort_timeout(bound);
    let init = || {
        let id = UniqueId::new_with(&lib).unwrap();
        Communicator::init_rank_in(&lib, &device, 1, 0, &id, &config)
    };
    let comm = init().unwrap();
    let send = stream.clone_htod(&[1.0f32; 256]).unwrap();
    let mut recv = stream.alloc_zeros::<f32>(256).unwrap();
    stream.synchronize().unwrap();
    stream.begin_capture(GLOBAL).unwrap();
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
        .expect("an all_reduce under capture");
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("the capture made a graph");
    graph.launch().unwrap();
    stream.synchronize().unwrap();

    let t = Instant::now();
    let (back, e) = comm
        .destroy()
        .expect_err("NCCL's destroy waits for the graph");
    let took = t.elapsed();
    assert!(
        took < bound + Duration::from_secs(2),
        "destroy took {took:?}"
    );
    assert!(
        matches!(e, Error::Timeout { .. }) && e.to_string().contains("CUDA graph"),
        "{e}"
    );
    drop(back);
    std::thread::sleep(Duration::from_millis(500));
    match init() {
        Err(e @ Error::TeardownWedged { .. }) => {
            assert!(e.to_string().contains("CUDA graph"), "{e}")
        }
        other => panic!("a new communicator beside the blocked destroy: {other:?}"),
    }

    drop(graph);
    let limit = Instant::now() + Duration::from_secs(30);
    let next = loop {
        match init() {
            Ok(c) => break c,
            Err(Error::TeardownWedged { .. }) if Instant::now() < limit => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("the lane did not free up once the graph was dropped: {e}"),
        }
    };
    next.destroy().map_err(|(_, e)| e).unwrap();
    drop((send, recv));
    ctx.check_err().unwrap();
}

/// Completion is learned per stream: a compute stream blocked behind a long backlog (here a
/// wait on a host word) after one broadcast on it does not time out the communicator,
/// whose all-reduces on its own stream complete.
#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn another_streams_backlog_never_times_out_a_communicator_on_a_gpu() {
    let lib = Library::load().expect("NVIDIA's NCCL");
    let ctx = CudaContext::new(0).unwrap();
    let (comm_stream, compute) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let id = UniqueId::new_with(&lib).unwrap();
    let config = Config::new().timeout(TIMEOUT);
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx.clone()), 1, 0, &id, &config)
        .unwrap();
    let mut x = compute.alloc_zeros::<f32>(256).unwrap();
    let mut y = comm_stream.alloc_zeros::<f32>(256).unwrap();
    comm.broadcast_in_place(&mut x, 0, &compute).unwrap();
    compute.synchronize().unwrap();
    let word = HostWord::new(&ctx);
    word.block(&compute);
    let start = Instant::now();
    while start.elapsed() < TIMEOUT * 3 {
        comm.all_reduce_in_place(&mut y, ReduceOp::Sum, &comm_stream)
            .expect("the communicator is healthy");
        comm_stream.synchronize().unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    let failed = comm.is_failed();
    word.free(&compute);
    assert!(
        !failed,
        "another stream's backlog timed the communicator out"
    );
    comm.destroy().map_err(|(_, e)| e).unwrap();
    drop((x, y));
}

/// `CU_STREAM_PER_THREAD` (candle's stream) is the calling thread's: a collective enqueued
/// on it behind a wait on a host word is watched there and times out; the fake twin is
/// `work_on_the_per_thread_stream_is_watched_on_the_callers_stream` in tests/cuda_path.rs.
#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn work_on_the_per_thread_stream_is_watched_on_a_gpu() {
    let lib = Library::load().expect("NVIDIA's NCCL");
    let ctx = CudaContext::new(0).unwrap();
    let pts = ctx.per_thread_stream();
    let id = UniqueId::new_with(&lib).unwrap();
    let config = Config::new()
        .timeout(TIMEOUT)
        .abort_timeout(nccl_safe::diag::MIN_NCCL_ABORT_TIMEOUT);
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx.clone()), 1, 0, &id, &config)
        .unwrap();
    let mut x = pts.alloc_zeros::<f32>(256).unwrap();
    pts.synchronize().unwrap();
    let word = HostWord::new(&ctx);
    word.block(&pts);
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &pts)
        .expect("the collective is enqueued");
    let failed = until(TIMEOUT * 3 + Duration::from_secs(2), || comm.is_failed());
    word.release();
    assert!(
        failed.is_some(),
        "a collective stuck on the per-thread stream was never timed out"
    );
    drop(comm);
    word.free(&pts);
    drop(x);
    ctx.check_err().unwrap();
}

/// Behind a blocked stream, `abort()` returns within its bound (200 ms, + 100 ms) while
/// the operation timeout is 3 s; then, on a second communicator, a drop of NCCL memory
/// whose free waits for the device does too. Whatever blocks is left on the device's
/// teardown lane and finishes once the stream is released.
#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn teardowns_behind_a_blocked_stream_keep_the_abort_bound_on_a_gpu() {
    let bound = Duration::from_millis(200);
    let limit = bound + Duration::from_millis(100);
    let Stuck {
        ctx,
        stream,
        comm,
        word,
        send,
        recv,
    } = stuck(bound);
    let t = Instant::now();
    let r = comm.abort();
    let took = t.elapsed();
    eprintln!("abort() behind the blocked stream: {r:?} after {took:?}");
    if took >= limit {
        word.release();
    }
    assert!(took < limit, "abort() took {took:?}");
    word.free(&stream);
    drop((send, recv));
    ctx.check_err().unwrap();
}

/// The drop of NCCL memory waits for the device (as `cudaFree` does): behind a blocked
/// stream it returns within its communicator's abort bound, and the free finishes on the
/// device's teardown lane once the stream is released.
#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn nccl_memory_dropped_behind_a_blocked_stream_keeps_the_abort_bound_on_a_gpu() {
    let bound = nccl_safe::diag::MIN_NCCL_ABORT_TIMEOUT;
    let lib = Library::load().expect("NVIDIA's NCCL");
    if lib.table().ncclMemAlloc.is_none() {
        panic!("ncclMemAlloc needs NCCL 2.19+: {}", lib.version());
    }
    let ctx = CudaContext::new(0).unwrap();
    let (s, blocked) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let config = Config::new().timeout(TIMEOUT).abort_timeout(bound);
    // Another test's abort may still hold the device's teardown lane: wait for it.
    let mut comm = None;
    until(Duration::from_secs(30), || {
        let id = UniqueId::new_with(&lib).unwrap();
        match Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx.clone()), 1, 0, &id, &config) {
            Ok(c) => {
                comm = Some(c);
                true
            }
            Err(Error::TeardownWedged { .. }) => false,
            Err(e) => panic!("{e}"),
        }
    })
    .expect("the device's teardown lane frees up");
    let comm = comm.unwrap();
    let mem = nccl_safe::NcclMemory::<f32>::alloc_zeros(&comm, 1 << 20, &s).unwrap();
    s.synchronize().unwrap();
    let word = HostWord::new(&ctx);
    word.block(&blocked);
    let t = Instant::now();
    drop(mem);
    let took = t.elapsed();
    eprintln!("NcclMemory drop behind the blocked stream: {took:?}");
    word.free(&blocked);
    assert!(
        took < bound + Duration::from_millis(100),
        "the drop took {took:?}"
    );
    drop(comm);
    ctx.check_err().unwrap();
}

/// What the tracker relies on, put to the driver. The owner records its completion marker
/// without a `cuStreamIsCapturing` first (one driver call less per operation) and leaves
/// the capture check to the watchdog thread, which runs in relaxed capture mode: it asks
/// `cuStreamIsCapturing` of the stream after it took the markers to query, and queries only
/// when no capture is open (`src/diag/supervise/tracker.rs`). That is sound only if, on that thread:
/// - a query of an event last recorded in a capture that has ended fails with
///   `CUDA_ERROR_CAPTURED_EVENT` (CUDA's documented "not permitted on an event which was
///   last recorded in a capturing stream"), so the watchdog can read it as complete;
/// - such a query, made while a later capture is open on the same stream, leaves that
///   capture valid;
/// - the event, recorded again outside a capture (the tracker recycles its events),
///   reports that work again.
///
/// What a query does during the capture that recorded the event (the plan never makes
/// one) is printed, not asserted.
#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn a_marker_recorded_under_capture_can_be_checked_from_the_watchdogs_thread() {
    use cudarc::driver::result::{event, stream as raw_stream};
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: the one buffer below is used on the one stream made here.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let mut scratch = stream.alloc_zeros::<u8>(64).unwrap();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
    let (marker, open) = (event::create(flags).unwrap(), event::create(flags).unwrap());
    let (cu, m, o) = (stream.cu_stream() as usize, marker as usize, open as usize);
    // A query from a thread of its own in relaxed capture mode, as the watchdog's.
    let query_elsewhere = |ev: usize| {
        let ctx = ctx.clone();
        std::thread::spawn(move || {
            ctx.bind_to_thread().unwrap();
            let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
            // SAFETY: `mode` is writable; only this thread's mode changes.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
                .result()
                .unwrap();
            // SAFETY: the stream and the event are alive until the thread is joined.
            let capturing = unsafe { raw_stream::is_capturing(cu as sys::CUstream) }.unwrap();
            // SAFETY: as above.
            let q = unsafe { event::query(ev as sys::CUevent) };
            (capturing, q.err().map(|e| e.0))
        })
        .join()
        .unwrap()
    };
    let none = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let captured = Some(sys::CUresult::CUDA_ERROR_CAPTURED_EVENT);

    // Capture 1 records the marker behind some work, and ends.
    stream.begin_capture(GLOBAL).unwrap();
    stream.memset_zeros(&mut scratch).unwrap();
    // SAFETY: both handles are alive; recording into a capturing stream is legal.
    unsafe { event::record(marker, stream.cu_stream()) }.unwrap();
    let g1 = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap();
    let after = query_elsewhere(m);
    println!("PROBE after the capture ended: {after:?}");
    assert_eq!(after, (none, captured), "a marker of an ended capture");

    // Capture 2 is open on the same stream while the old marker is queried.
    stream.begin_capture(GLOBAL).unwrap();
    stream.memset_zeros(&mut scratch).unwrap();
    let during = query_elsewhere(m);
    println!("PROBE during a later capture: {during:?}");
    let g2 = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    println!(
        "PROBE that later capture ended with {:?}",
        g2.as_ref().map(|g| g.is_some())
    );
    assert_eq!(during.1, captured, "the old marker, during a later capture");
    let valid = g2.as_ref().map(|g| g.is_some());
    assert!(
        matches!(valid, Ok(true)),
        "the later capture must stay valid: {valid:?}"
    );

    // Capture 3: a query of the marker it records, while it is open (printed only).
    stream.begin_capture(GLOBAL).unwrap();
    stream.memset_zeros(&mut scratch).unwrap();
    // SAFETY: as above.
    unsafe { event::record(open, stream.cu_stream()) }.unwrap();
    let inside = query_elsewhere(o);
    let g3 = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    println!(
        "PROBE a query inside the capture that recorded the event: {inside:?}; the capture \
         ended with {:?}",
        g3.as_ref().map(|g| g.is_some())
    );
    let _ = ctx.check_err();

    // Recorded again outside any capture, the marker reports that work.
    // SAFETY: as above.
    unsafe { event::record(marker, stream.cu_stream()) }.unwrap();
    stream.synchronize().unwrap();
    let again = query_elsewhere(m);
    println!("PROBE recorded again outside a capture: {again:?}");
    assert_eq!(again, (none, None), "a recycled marker");
    drop((g1, g2, g3));
    // SAFETY: nothing uses the events any more.
    unsafe {
        event::destroy(marker).unwrap();
        event::destroy(open).unwrap();
    }
}

/// A `StreamBound` on a real GPU beside a compute stream: the input is written on the
/// compute stream (a large copy, still running when the collective is enqueued unless the
/// binding's wait orders them), reduced out of place on the communication stream with no
/// cudarc event work, and read back on the compute stream after `into_inner`.
#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn a_stream_bound_buffer_is_ordered_with_a_compute_stream_on_a_gpu() {
    const N: usize = 1 << 24;
    let lib = Library::load().expect("NVIDIA's NCCL");
    let ctx = CudaContext::new(0).unwrap();
    let (comm_stream, compute) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let id = UniqueId::new_with(&lib).unwrap();
    let dev = CommDevice::Cuda(ctx.clone());
    let comm = Communicator::init_rank_in(&lib, &dev, 1, 0, &id, &Config::new()).unwrap();
    let host = vec![1.5f32; N];
    for _ in 0..3 {
        let mut send = comm_stream.alloc_zeros::<f32>(N).unwrap();
        let recv = comm_stream.alloc_zeros::<f32>(N).unwrap();
        comm_stream.synchronize().unwrap();
        compute.memcpy_htod(&host, &mut send).unwrap();
        let send = nccl_safe::StreamBound::new(send)
            .map_err(|(_, e)| e)
            .unwrap();
        let mut recv = nccl_safe::StreamBound::new(recv)
            .map_err(|(_, e)| e)
            .unwrap();
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &comm_stream)
            .unwrap();
        let recv = recv.into_inner();
        let got = compute.clone_dtoh(&recv).unwrap();
        assert!(got.iter().all(|&v| v == 1.5), "an unordered read or write");
        drop(send);
    }
    comm.destroy().map_err(|(_, e)| e).unwrap();
    ctx.check_err().unwrap();
}

/// Under `NCCL_CHECK_POINTERS=1` NCCL checks every buffer pointer a collective is given
/// (misc/argcheck.cc:71-83 of 2.28.9), off the root of a gather or scatter too: every
/// collective the crate issues on device memory passes. With one GPU every rank is the
/// root; the off-root buffers are checked only with more. NCCL reads the variable once per
/// process, hence the child process.
#[test]
#[ignore = "needs a GPU: cargo test --test gpu -- --ignored"]
fn every_collective_passes_nccls_pointer_checks() {
    let child = support::spawn_child(
        "child_runs_every_collective_with_checked_pointers",
        "NCCL_CHECK_POINTERS",
        "1",
    );
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("child: every collective ran"));
}

#[test]
#[ignore = "a child process of a GPU test"]
fn child_runs_every_collective_with_checked_pointers() {
    assert_eq!(
        std::env::var("NCCL_CHECK_POINTERS").as_deref(),
        Ok("1"),
        "run only as a child process (run the suite with --skip child_)"
    );
    Launcher::all_devices()
        .unwrap()
        .run(|rank| {
            let (comm, s) = (rank.comm(), rank.stream());
            let stream = rank.cuda_stream().expect("a CUDA rank");
            let (r, n, k) = (rank.rank(), comm.world_size(), 4);
            let one = stream.clone_htod(&vec![r as f32 + 1.0; k])?;
            let mut out = stream.alloc_zeros::<f32>(k)?;
            let mut all = stream.alloc_zeros::<f32>(k * n)?;
            let mut all2 = stream.alloc_zeros::<f32>(k * n)?;
            comm.all_reduce(&one, &mut out, ReduceOp::Sum, s)?;
            comm.broadcast(&one, &mut out, 0, s)?;
            comm.reduce(&one, &mut out, ReduceOp::Sum, 0, s)?;
            comm.all_gather(&one, &mut all, s)?;
            comm.reduce_scatter(&all, &mut out, ReduceOp::Sum, s)?;
            comm.all_to_all(&all, &mut all2, s)?;
            // Off the root, `all` is passed though NCCL's header calls it unused.
            comm.gather(&one, &mut all, 0, s)?;
            comm.scatter(&all2, &mut out, 0, s)?;
            Group::run(|g| {
                g.push(comm.send_op(&one, (r + 1) % n, s)?)?;
                g.push(comm.recv_op(&mut out, (r + n - 1) % n, s)?)?;
                Ok(())
            })?;
            let got = stream.clone_dtoh(&out)?;
            assert_eq!(got, vec![((r + n - 1) % n) as f32 + 1.0; k]);
            Ok(())
        })
        .unwrap();
    println!("child: every collective ran");
}
