//! The crate's CUDA code path on a CPU: cudarc contexts, streams and buffers over a fake
//! CUDA driver that counts every call (`tests/support/fakes`), and communicators of the host
//! provider presented as NVIDIA's NCCL (`Provider::Nccl`, so `CommDevice::Cuda`, cudarc
//! buffers and the watchdog's CUDA event tracker are what run).
//!
//! What it checks, which only a GPU run could check before:
//! - collectives on cudarc buffers, views and groups give the right values;
//! - the per-operation path makes no driver call of its own: with cudarc's event tracking
//!   off, none at all on the caller's thread; with it on, exactly cudarc's own, the same as
//!   a raw `ncclAllReduce` on the same buffers; and NCCL receives the same calls with the
//!   same arguments (pointers, counts, types, reduction or root, communicator, stream);
//! - the watchdog learns about GPU work from events it records on its own thread, fails a
//!   stalled stream's communicator fast and aborts behind it, without ever synchronizing
//!   the stalled stream;
//! - a stream under graph capture gets no event and no timeout, and past the 64 markers a
//!   stream keeps in flight, none that covers work the stream runs goes into a capture;
//! - a long run with a new stream per step releases every event and stream it made;
//! - a process that exits while the abort behind a stalled stream blocks ends with its own
//!   status, not a signal.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use nccl_safe::diag::{OpState, MIN_NCCL_ABORT_TIMEOUT};
use nccl_safe::{CommDevice, Communicator, Config, Error, Group, ReduceOp, UniqueId};
use support::fakes::{driver, nccl, Counts, Gauge};
use support::{until, within};

/// A CUDA rank over the fakes: its context, a stream, and a world-size-1 communicator.
struct Rank {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Communicator,
    id: UniqueId,
}

fn rank(ordinal: usize, config: &Config, tracking: bool) -> Rank {
    try_rank(ordinal, config, tracking).expect("a communicator on the fake device")
}

fn try_rank(ordinal: usize, config: &Config, tracking: bool) -> Result<Rank, Error> {
    let lib = nccl();
    let ctx = CudaContext::new(ordinal).expect("a fake CUDA context");
    set_tracking(&ctx, tracking);
    let stream = ctx.new_stream().unwrap();
    let id = UniqueId::new_with(&lib).unwrap();
    let comm = Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx.clone()), 1, 0, &id, config)?;
    Ok(Rank {
        ctx,
        stream,
        comm,
        id,
    })
}

fn set_tracking(ctx: &CudaContext, on: bool) {
    // SAFETY: the tests order their streams themselves (one stream per buffer's use, or
    // host-synchronous fakes); it changes only how buffers made after it are tracked.
    unsafe {
        if on {
            ctx.enable_event_tracking()
        } else {
            ctx.disable_event_tracking()
        }
    }
}

#[test]
fn collectives_on_cudarc_buffers_across_ranks() {
    let _serial = serial();
    driver();
    let lib = nccl();
    let world = 3;
    let id = UniqueId::new_with(&lib).unwrap();
    let results = within(Duration::from_secs(60), move || {
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let (lib, id) = (&lib, &id);
                    sc.spawn(move || {
                        let ctx = CudaContext::new(r).unwrap();
                        let s = ctx.new_stream().unwrap();
                        let comm = Communicator::init_rank_in(
                            lib,
                            &CommDevice::Cuda(ctx.clone()),
                            world,
                            r,
                            id,
                            &Config::new().timeout(Duration::from_secs(20)),
                        )
                        .unwrap();
                        let base = r as f32 + 1.0;
                        // Out of place, through views of a larger buffer.
                        let src = s.clone_htod(&[base; 64]).unwrap();
                        let mut dst = s.alloc_zeros::<f32>(64).unwrap();
                        {
                            let view = src.slice(8..24);
                            let mut out = dst.slice_mut(0..16);
                            comm.all_reduce(&view, &mut out, ReduceOp::Sum, &s).unwrap();
                        }
                        let reduced = s.clone_dtoh(&dst).unwrap();
                        // In place, then an all_gather and a broadcast in one group.
                        let mut x = s.clone_htod(&[base as i32; 4]).unwrap();
                        comm.all_reduce_in_place(&mut x, ReduceOp::Max, &s).unwrap();
                        let maxed = s.clone_dtoh(&x).unwrap();
                        let mine = s.clone_htod(&[r as u8; 2]).unwrap();
                        let mut all = s.alloc_zeros::<u8>(2 * world).unwrap();
                        let mut b = s.clone_htod(&[r as f64 * 10.0; 3]).unwrap();
                        {
                            let mut g = Group::new();
                            g.push(comm.all_gather_op(&mine, &mut all, &s).unwrap())
                                .unwrap();
                            g.push(comm.broadcast_in_place_op(&mut b, 1, &s).unwrap())
                                .unwrap();
                            g.end().unwrap();
                        }
                        (
                            reduced,
                            maxed,
                            s.clone_dtoh(&all).unwrap(),
                            s.clone_dtoh(&b).unwrap(),
                        )
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    });
    let sum = (1..=world).sum::<usize>() as f32;
    for (reduced, maxed, all, b) in results {
        assert!(reduced[..16].iter().all(|&v| v == sum), "{reduced:?}");
        assert!(reduced[16..].iter().all(|&v| v == 0.0), "{reduced:?}");
        assert_eq!(maxed, vec![world as i32; 4]);
        assert_eq!(all, vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(b, vec![10.0; 3]);
    }
    assert_eq!(driver().gauge(Gauge::BadHandles), 0);
}

/// One kind of operation, run both ways on the same buffers.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    AllReduce,
    AllReduceInPlace,
    AllGather,
    AllGatherInPlace,
    Broadcast,
    BroadcastInPlace,
    GroupOfFour,
}

const KINDS: [Kind; 7] = [
    Kind::AllReduce,
    Kind::AllReduceInPlace,
    Kind::AllGather,
    Kind::AllGatherInPlace,
    Kind::Broadcast,
    Kind::BroadcastInPlace,
    Kind::GroupOfFour,
];

/// The driver calls on this thread for `n` operations of `kind`, made through the raw
/// table (with cudarc's `device_ptr` guards, as a user of cudarc would) and through the
/// safe layer.
fn calls_per_op(r: &Rank, kind: Kind, n: usize) -> (Counts, Counts) {
    let d = driver();
    let s = &r.stream;
    let lib = r.comm.library().clone();
    let t = lib.table();
    let send: CudaSlice<f32> = s.alloc_zeros(256).unwrap();
    let mut recv: CudaSlice<f32> = s.alloc_zeros(256).unwrap();
    let mut quads: Vec<CudaSlice<f32>> = (0..4).map(|_| s.alloc_zeros(64).unwrap()).collect();
    let raw = r.comm.as_raw();
    let stream = s.cu_stream() as nccl_sys::cudaStream_t;
    let f32_ = nccl_sys::bindings::ncclFloat32;
    let sum = nccl_sys::bindings::ncclSum;
    s.synchronize().unwrap();

    d.mark_this_thread(true);
    support::fakes::record_calls(true);
    let before = d.counts(true);
    for _ in 0..n {
        // SAFETY: a live communicator, buffers of 256 f32 on its device, its stream; the
        // guards are held until the call returned.
        unsafe {
            let rc = match kind {
                Kind::AllReduce => {
                    let (a, _ga) = send.device_ptr(s);
                    let (b, _gb) = recv.device_ptr_mut(s);
                    (t.ncclAllReduce)(a as _, b as _, 256, f32_, sum, raw, stream)
                }
                Kind::AllReduceInPlace => {
                    let (b, _gb) = recv.device_ptr_mut(s);
                    (t.ncclAllReduce)(b as _, b as _, 256, f32_, sum, raw, stream)
                }
                Kind::AllGather => {
                    let (a, _ga) = send.device_ptr(s);
                    let (b, _gb) = recv.device_ptr_mut(s);
                    (t.ncclAllGather)(a as _, b as _, 256, f32_, raw, stream)
                }
                Kind::AllGatherInPlace => {
                    let (b, _gb) = recv.device_ptr_mut(s);
                    (t.ncclAllGather)(b as _, b as _, 256, f32_, raw, stream)
                }
                Kind::Broadcast => {
                    let (a, _ga) = send.device_ptr(s);
                    let (b, _gb) = recv.device_ptr_mut(s);
                    (t.ncclBroadcast)(a as _, b as _, 256, f32_, 0, raw, stream)
                }
                Kind::BroadcastInPlace => {
                    let (b, _gb) = recv.device_ptr_mut(s);
                    (t.ncclBroadcast)(b as _, b as _, 256, f32_, 0, raw, stream)
                }
                Kind::GroupOfFour => {
                    let mut rc = (t.ncclGroupStart)();
                    let mut guards = Vec::with_capacity(4);
                    for q in quads.iter_mut() {
                        let (b, g) = q.device_ptr_mut(s);
                        guards.push(g);
                        rc |= (t.ncclAllReduce)(b as _, b as _, 64, f32_, sum, raw, stream);
                    }
                    rc | (t.ncclGroupEnd)()
                }
            };
            assert_eq!(rc, 0);
        }
    }
    let mid = d.counts(true);
    let raw_calls = support::fakes::record_calls(true);
    for _ in 0..n {
        match kind {
            Kind::AllReduce => r.comm.all_reduce(&send, &mut recv, ReduceOp::Sum, s),
            Kind::AllReduceInPlace => r.comm.all_reduce_in_place(&mut recv, ReduceOp::Sum, s),
            Kind::AllGather => r.comm.all_gather(&send, &mut recv, s),
            Kind::AllGatherInPlace => r.comm.all_gather_in_place(&mut recv, s),
            Kind::Broadcast => r.comm.broadcast(&send, &mut recv, 0, s),
            Kind::BroadcastInPlace => r.comm.broadcast_in_place(&mut recv, 0, s),
            Kind::GroupOfFour => (|| {
                let mut g = Group::new();
                for q in quads.iter_mut() {
                    g.push(r.comm.all_reduce_in_place_op(q, ReduceOp::Sum, s)?)?;
                }
                g.end()
            })(),
        }
        .unwrap();
    }
    let after = d.counts(true);
    let safe_calls = support::fakes::record_calls(false);
    d.mark_this_thread(false);
    // Like with like: NCCL received the same calls, with the same arguments.
    assert_eq!(
        raw_calls.len(),
        n * if kind == Kind::GroupOfFour { 4 } else { 1 }
    );
    assert_eq!(safe_calls, raw_calls, "{kind:?}: NCCL's arguments differ");
    (mid.since(&before), after.since(&mid))
}

/// Calls per operation, for the log.
fn per_op(c: &Counts, n: usize) -> String {
    if c.0.is_empty() {
        return "none".into();
    }
    let each: Vec<String> = (c.0.iter())
        .map(|(name, v)| format!("{name} {}", *v as f64 / n as f64))
        .collect();
    each.join(", ")
}

/// The driver calls of each operation against a raw NCCL call on cudarc's own guards
/// (what cudarc::nccl makes): the same waits and records, less the context check before
/// each of cudarc's records, plus the completion marker's `cuEventRecord` at enqueue (exact
/// completion; no `cuStreamIsCapturing`: the watchdog asks that); with neither tracking
/// nor the marker, none at all.
#[test]
fn the_per_operation_path_makes_no_driver_call_of_its_own() {
    let _serial = serial();
    driver();
    // Fewer than the markers a stream keeps in flight, so none is recorded again.
    const N: usize = 48;
    let mut lines = Vec::new();
    for exact in [false, true] {
        for tracking in [false, true] {
            let r = rank(0, &Config::new().exact_completion(exact), tracking);
            for kind in KINDS {
                // Warm up (the first markers make their events), and let the watchdog
                // retire the markers so their events are spare again.
                calls_per_op(&r, kind, N);
                until(Duration::from_secs(10), || {
                    (r.comm.flight_record().entries.iter()).all(|e| e.state == OpState::Completed)
                })
                .expect("the warm-up's work is seen complete");
                let (raw, safe) = calls_per_op(&r, kind, N);
                lines.push(format!(
                    "exact completion {}, tracking {}: {kind:?}: raw [{}], safe [{}]",
                    if exact { "on" } else { "off" },
                    if tracking { "on" } else { "off" },
                    per_op(&raw, N),
                    per_op(&safe, N)
                ));
                // cudarc's guards record their event after the work (a `cuEventRecord` each,
                // with tracking on), and cudarc binds the context before each record (a
                // `cuCtxGetCurrent`). nccl-safe makes the same records with the context
                // its waits just made current, so it checks no context for them.
                let records = raw.of("cuEventRecord");
                assert_eq!(
                    records > 0,
                    tracking,
                    "{kind:?}: cudarc records an event only with tracking on: raw [{raw}]"
                );
                // The marker at enqueue: one per operation, or per group (one stream). Its
                // event comes from the tracker's spare pool, and is made (a context check
                // and `cuEventCreate`) only while more markers are in flight than were
                // ever spare: how many depends on how many the watchdog's ticks retired
                // during the warm-up, never more than the 64 a stream keeps in flight.
                let (enqueues, made) = match exact {
                    true => (N as u64, safe.of("cuEventCreate")),
                    false => (0, 0),
                };
                assert!(made <= 64, "{kind:?}: {made} events made: safe [{safe}]");
                if !exact && !tracking {
                    assert_eq!(safe.total(), 0, "{kind:?}: safe [{safe}]");
                }
                for (call, expected) in [
                    (
                        "cuCtxGetCurrent",
                        raw.of("cuCtxGetCurrent") - records + made,
                    ),
                    ("cuStreamWaitEvent", raw.of("cuStreamWaitEvent")),
                    ("cuStreamIsCapturing", raw.of("cuStreamIsCapturing")),
                    ("cuEventRecord", records + enqueues),
                    ("cuEventCreate", made),
                ] {
                    assert_eq!(
                        safe.of(call),
                        expected,
                        "{kind:?}, exact {exact}, tracking {tracking}: {call}: raw [{raw}], safe [{safe}]"
                    );
                }
                assert_eq!(
                    safe.total(),
                    raw.total() - records + enqueues + 2 * made,
                    "{kind:?}, exact {exact}, tracking {tracking}: nothing else: raw [{raw}], safe [{safe}]"
                );
            }
        }
    }
    eprintln!("driver calls per operation on the caller's thread:");
    for l in &lines {
        eprintln!("  {l}");
    }
    // The watchdog did query events, on its own thread.
    let all = driver().counts(false);
    assert!(
        all.get("cuEventRecord") > 0 && all.get("cuEventQuery") > 0,
        "[{all}]"
    );
}

/// Set in the children of `collectives_on_cudarc_buffers_across_processes`: `rank:n:id`.
const MP_VAR: &str = "NCCL_SAFE_TEST_CUDA_MP";

/// The CUDA code path with a rank per process, as a launcher starts them: each process
/// loads the fake driver and the host provider presented as NCCL (`Provider::Nccl`), makes
/// a `CommDevice::Cuda` communicator from one shared unique id (the ranks meet in shared
/// memory, as the host provider's processes do), and runs collectives and a group on
/// cudarc buffers; every process checks its values and tears its communicator down once.
#[test]
fn collectives_on_cudarc_buffers_across_processes() {
    const WORLD: usize = 3;
    let id = UniqueId::from_raw(nccl_safe::host::shared_unique_id());
    let hex: String = id.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..WORLD)
        .map(|r| {
            std::process::Command::new(&exe)
                .args([
                    "--exact",
                    "child_cuda_rank_in_a_process",
                    "--ignored",
                    "--nocapture",
                ])
                .env(MP_VAR, format!("{r}:{WORLD}:{hex}"))
                .env("NCCL_SAFE_HOST_TIMEOUT_MS", "20000")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs = within(Duration::from_secs(60), move || {
        kids.into_iter()
            .map(|k| k.wait_with_output().unwrap())
            .collect::<Vec<_>>()
    });
    for (r, out) in outs.iter().enumerate() {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "rank {r}: {}: {text}", out.status);
        assert!(
            text.contains(&format!("@@CUDA-MP-OK rank {r} of {WORLD}")),
            "rank {r}: {text}"
        );
    }
}

/// One rank of `collectives_on_cudarc_buffers_across_processes`, in its own process.
#[test]
#[ignore = "run as a child process by collectives_on_cudarc_buffers_across_processes"]
fn child_cuda_rank_in_a_process() {
    let Ok(spec) = std::env::var(MP_VAR) else {
        panic!("run only as a child process ({MP_VAR} unset)");
    };
    let mut it = spec.split(':');
    let r: usize = it.next().unwrap().parse().unwrap();
    let world: usize = it.next().unwrap().parse().unwrap();
    let hex = it.next().unwrap();
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let id = UniqueId::from_bytes(&bytes).unwrap();
    driver();
    let lib = nccl();
    let ctx = CudaContext::new(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let comm = Communicator::init_rank_in(
        &lib,
        &CommDevice::Cuda(ctx.clone()),
        world,
        r,
        &id,
        &Config::new().timeout(Duration::from_secs(20)),
    )
    .unwrap();
    assert_eq!((comm.rank(), comm.world_size()), (r, world));
    let base = r as f32 + 1.0;
    let mut x = s.clone_htod(&[base; 1000]).unwrap();
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s).unwrap();
    let sum = (1..=world).sum::<usize>() as f32;
    assert!(s.clone_dtoh(&x).unwrap().iter().all(|&v| v == sum));
    let mine = s.clone_htod(&[r as u8; 2]).unwrap();
    let mut all = s.alloc_zeros::<u8>(2 * world).unwrap();
    let mut b = s.clone_htod(&[r as f64 * 10.0; 3]).unwrap();
    {
        let mut g = Group::new();
        g.push(comm.all_gather_op(&mine, &mut all, &s).unwrap())
            .unwrap();
        g.push(comm.broadcast_in_place_op(&mut b, 1, &s).unwrap())
            .unwrap();
        g.end().unwrap();
    }
    let want: Vec<u8> = (0..world as u8).flat_map(|q| [q, q]).collect();
    assert_eq!(s.clone_dtoh(&all).unwrap(), want);
    assert_eq!(s.clone_dtoh(&b).unwrap(), vec![10.0; 3]);
    comm.destroy().map_err(|(_, e)| e).unwrap();
    assert_eq!(driver().gauge(Gauge::BadHandles), 0);
    println!("@@CUDA-MP-OK rank {r} of {world}");
}

/// The tests of this file share the fake driver's gauges: they run one at a time.
/// A communicator used on several streams, each with a burst of 64 markers in flight that
/// the watchdog then retires, makes no event once every slot of its streams' rings has one:
/// a retired range's event stays in its slot for the next range there. Before, retired
/// events went to one spare ring of 64 per communicator, and with three streams refilling
/// the rest were destroyed on the watchdog's thread and made again on the owner's: about
/// 125 `cuEventCreate` per burst of 192 operations on the caller's thread.
#[test]
fn bursts_on_several_streams_make_no_event_once_warm() {
    let _serial = serial();
    const STREAMS: usize = 3;
    const BURST: usize = 64;
    let d = driver();
    let r = rank(0, &Config::new(), false);
    let streams: Vec<Arc<CudaStream>> = (0..STREAMS).map(|_| r.ctx.new_stream().unwrap()).collect();
    let mut bufs: Vec<CudaSlice<f32>> = (streams.iter())
        .map(|s| s.clone_htod(&[1.0f32]).unwrap())
        .collect();
    let mut enqueue = || {
        for (s, b) in streams.iter().zip(bufs.iter_mut()) {
            for _ in 0..BURST {
                r.comm.all_reduce_in_place(b, ReduceOp::Sum, s).unwrap();
            }
        }
    };
    let retired = || {
        until(Duration::from_secs(10), || {
            (r.comm.flight_record().entries.iter()).all(|e| e.state == OpState::Completed)
        })
        .expect("the burst's work is seen complete");
    };
    // Warm-up: every slot of each ring gets its event. The device held behind, so that the
    // watchdog retires nothing during it: a range retired mid-burst (a slow machine, or
    // valgrind) lends its event to the next slot, which then leaves a slot without one
    // for a later burst that outruns the watchdog further.
    d.hold_completion(true);
    enqueue();
    d.hold_completion(false);
    retired();
    let mut burst = || {
        enqueue();
        retired();
    };
    burst();
    d.mark_this_thread(true);
    let before = d.counts(true);
    for _ in 0..3 {
        burst();
    }
    let calls = d.counts(true).since(&before);
    d.mark_this_thread(false);
    assert_eq!(
        calls.of("cuEventCreate"),
        0,
        "events made on the owner's thread in 3 warm bursts of {} operations: [{calls}]",
        STREAMS * BURST
    );
    assert_eq!(
        calls.of("cuEventRecord"),
        (3 * STREAMS * BURST) as u64,
        "[{calls}]"
    );
    for s in &streams {
        s.synchronize().unwrap();
    }
    drop(bufs);
    r.comm.destroy().map_err(|(_, e)| e).unwrap();
}

/// A group over more streams than the owner keeps among its recent ones (8): the streams
/// it uses first leave that cache while the group is filled, with their work staged, and
/// the group's end still publishes (and marks) the work of every stream, so all of it is
/// seen complete. Two groups in a row: the second meets the streams the first evicted.
#[test]
fn a_group_over_more_streams_than_the_recent_ones_publishes_every_streams_work() {
    let _serial = serial();
    const STREAMS: usize = 11;
    let r = rank(0, &Config::new(), false);
    let streams: Vec<Arc<CudaStream>> = (0..STREAMS).map(|_| r.ctx.new_stream().unwrap()).collect();
    let mut bufs: Vec<CudaSlice<f32>> = (streams.iter())
        .map(|s| s.clone_htod(&[1.0f32]).unwrap())
        .collect();
    for round in 0..2 {
        let mut g = Group::new();
        for (s, b) in streams.iter().zip(bufs.iter_mut()) {
            g.push(r.comm.all_reduce_in_place_op(b, ReduceOp::Sum, s).unwrap())
                .unwrap();
        }
        g.end().unwrap();
        let entries = r.comm.flight_record().entries.len();
        assert_eq!(
            entries,
            STREAMS * (round + 1),
            "round {round}: every operation recorded"
        );
        until(Duration::from_secs(10), || {
            (r.comm.flight_record().entries.iter()).all(|e| e.state == OpState::Completed)
        })
        .unwrap_or_else(|| {
            panic!(
                "round {round}: work of the group never seen complete (unpublished):\n{}",
                r.comm.flight_record()
            )
        });
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    drop(bufs);
    r.comm.destroy().map_err(|(_, e)| e).unwrap();
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const TIMEOUT: Duration = Duration::from_millis(300);
/// The bound on every failure: the configured timeout + 1 s.
const BOUND: Duration = Duration::from_millis(1300);

fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. })
}

/// NVIDIA's NCCL takes about 0.5 s to destroy and 1 s to abort an idle communicator (the
/// fake NCCL's default teardown time): with the shortest abort bound init accepts, a
/// healthy drop, destroy and abort report no timeout and leave the device's teardown lane
/// free for the next communicator; a bound below that minimum is refused at init, naming it.
#[test]
fn healthy_teardowns_at_nccls_real_speed_never_time_out() {
    let _serial = serial();
    within(Duration::from_secs(60), || {
        let (destroy, abort) = support::fakes::teardown_time();
        assert!(
            destroy >= Duration::from_millis(500) && abort >= Duration::from_secs(1),
            "the real figures: {destroy:?} {abort:?}"
        );
        let config = Config::new().abort_timeout(MIN_NCCL_ABORT_TIMEOUT);
        let next = || {
            try_rank(6, &config, false)
                .unwrap_or_else(|e| panic!("the lane must be free after a healthy teardown: {e}"))
        };
        let t = Instant::now();
        drop(next().comm);
        assert!(
            t.elapsed() >= destroy,
            "the drop destroyed it: {:?}",
            t.elapsed()
        );
        next().comm.destroy().map_err(|(_, e)| e).unwrap();
        let t = Instant::now();
        next().comm.abort().unwrap();
        assert!(t.elapsed() >= abort, "{:?}", t.elapsed());
        drop(next());
        let short = Config::new().abort_timeout(Duration::from_millis(200));
        let Err(e) = try_rank(6, &short, false) else {
            panic!("an abort bound below the minimum was accepted");
        };
        assert!(
            matches!(&e, Error::InvalidArgument { reason, .. } if reason.contains("minimum")),
            "{e}"
        );
    });
}

/// With ranks of one communicator in one process (a rank per GPU in threads), NVIDIA's
/// NCCL frees them all in the teardown of the last one (init.cc `commReclaim`): its
/// destroy or abort takes their number times one communicator's (the fake NCCL does the
/// same). With the shortest abort bound init accepts, four ranks' healthy destroys and
/// aborts still report no timeout and leave every device's teardown lane free: the bound
/// grows by `NCCL_RECLAIM_PER_LOCAL_RANK` per other rank in the process.
#[test]
fn the_last_local_ranks_reclaim_of_its_siblings_is_within_the_bound() {
    let _serial = serial();
    driver();
    const WORLD: usize = 4;
    const FIRST: usize = 4;
    within(Duration::from_secs(120), || {
        let lib = nccl();
        let config = Config::new().abort_timeout(MIN_NCCL_ABORT_TIMEOUT);
        for abort in [false, true] {
            let id = UniqueId::new_with(&lib).unwrap();
            let comms: Vec<Communicator> = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..WORLD)
                    .map(|r| {
                        let (lib, id, config) = (&lib, &id, &config);
                        sc.spawn(move || {
                            let ctx = CudaContext::new(FIRST + r).unwrap();
                            // An earlier test's abort behind a stall may still hold the
                            // device's lane: it finishes once its stall was released.
                            let first = Instant::now();
                            loop {
                                match Communicator::init_rank_in(
                                    lib,
                                    &CommDevice::Cuda(ctx.clone()),
                                    WORLD,
                                    r,
                                    id,
                                    config,
                                ) {
                                    Err(Error::TeardownWedged { .. })
                                        if first.elapsed() < Duration::from_secs(30) =>
                                    {
                                        std::thread::sleep(Duration::from_millis(20))
                                    }
                                    c => break c.unwrap(),
                                }
                            }
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let t = Instant::now();
            let results: Vec<Result<(), Error>> = std::thread::scope(|sc| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        sc.spawn(move || {
                            if abort {
                                c.abort()
                            } else {
                                c.destroy().map_err(|(_, e)| e)
                            }
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let took = t.elapsed();
            let (destroy, abort_time) = support::fakes::teardown_time();
            let each = if abort { abort_time } else { destroy };
            assert!(
                took >= each * WORLD as u32,
                "the last teardown reclaims every rank: {took:?}"
            );
            for (r, res) in results.into_iter().enumerate() {
                res.unwrap_or_else(|e| panic!("abort {abort}: rank {r}: {e}"));
            }
            // Every device's lane is free for the next communicator.
            for d in FIRST..FIRST + WORLD {
                let id = UniqueId::new_with(&lib).unwrap();
                let ctx = CudaContext::new(d).unwrap();
                let c =
                    Communicator::init_rank_in(&lib, &CommDevice::Cuda(ctx), 1, 0, &id, &config)
                        .unwrap_or_else(|e| panic!("abort {abort}: device {d}: {e}"));
                support::fakes::set_teardown_time(Duration::ZERO, Duration::ZERO);
                c.destroy().map_err(|(_, e)| e).unwrap();
                support::fakes::set_teardown_time(destroy, abort_time);
            }
            let st = support::assert_balanced(&id);
            assert_eq!(st.created, WORLD as u64);
        }
    });
}

/// A device fault leaves the context with a sticky error: every later driver call of its
/// work returns it. The watchdog's query of its marker meets it and fails the
/// communicator at once (not after the 20 s timeout) with the driver's error as
/// `Error::Cuda`, and it never takes the error cudarc recorded for the context (here by
/// hand, as a failed asynchronous free records it) away from the user's `check_err`.
#[test]
fn a_sticky_cuda_error_fails_fast_as_a_cuda_error_and_stays_the_users() {
    use cudarc::driver::{sys::CUresult, DriverError};
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let config = Config::new().timeout(Duration::from_secs(20));
        let r = rank(7, &config, false);
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        d.sticky_error(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS as i32);
        r.ctx
            .record_err::<()>(Err(DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)));
        r.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
            .unwrap();
        let t = Instant::now();
        let failed = until(Duration::from_secs(5), || r.comm.is_failed());
        d.sticky_error(0);
        failed
            .unwrap_or_else(|| panic!("is_failed() still false {:?} after the fault", t.elapsed()));
        let e = r
            .comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Cuda(DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS))
            ),
            "{e}"
        );
        assert_eq!(
            r.ctx.check_err(),
            Err(DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)),
            "the user's recorded error was taken"
        );
        drop((x, r));
    });
}

/// cudarc keeps a context's asynchronous failure (a failed event record in a buffer's drop,
/// say) for the user's next `check_err`, and its `bind_to_thread` takes it: made on the
/// owner's thread, it would hand the user's error to the crate's call, which would fail
/// with it, and leave the user's `check_err` clean. So init, registration and its release,
/// NCCL memory and destroy make the context current without taking it: each succeeds, and
/// the user's `check_err` still returns the error recorded before it (here by hand, as
/// cudarc records one), with event tracking on, as cudarc's default.
#[test]
fn the_owners_recorded_cuda_error_stays_the_users_through_init_register_and_destroy() {
    use cudarc::driver::{sys::CUresult, DriverError};
    let _serial = serial();
    driver();
    within(Duration::from_secs(60), move || {
        let lib = nccl();
        let ctx = CudaContext::new(6).unwrap();
        set_tracking(&ctx, true);
        let stream = ctx.new_stream().unwrap();
        let mut buf = stream.alloc_zeros::<f32>(256).unwrap();
        stream.synchronize().unwrap();
        let users = || Err::<(), _>(DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED));
        let kept = |what: &str| {
            assert_eq!(
                ctx.check_err(),
                users(),
                "{what} took the user's recorded error"
            );
        };
        let id = UniqueId::new_with(&lib).unwrap();

        ctx.record_err(users());
        let device = CommDevice::Cuda(ctx.clone());
        let comm = Communicator::init_rank_in(&lib, &device, 1, 0, &id, &Config::new())
            .unwrap_or_else(|e| panic!("init failed with the user's error: {e}"));
        kept("init");

        ctx.record_err(users());
        let reg = comm
            .register(&mut buf)
            .unwrap_or_else(|e| panic!("register failed with the user's error: {e}"));
        kept("register");
        ctx.record_err(users());
        drop(reg);
        kept("the registration's release");

        if lib.table().ncclMemAlloc.is_some() {
            ctx.record_err(users());
            let mem = nccl_safe::NcclMemory::<f32>::alloc_zeros(&comm, 16, &stream)
                .unwrap_or_else(|e| panic!("ncclMemAlloc failed with the user's error: {e}"));
            kept("NcclMemory::alloc_zeros");
            stream.synchronize().unwrap();
            ctx.record_err(users());
            drop(mem);
            kept("NcclMemory's release");
        }

        ctx.record_err(users());
        comm.destroy()
            .map_err(|(_, e)| e)
            .unwrap_or_else(|e| panic!("destroy failed with the user's error: {e}"));
        kept("destroy");
        let st = support::assert_balanced(&id);
        assert_eq!((st.created, st.destroyed, st.aborted), (1, 1, 0));
        drop((buf, stream));
    });
}

/// A GPU's stuck stream, on the CUDA path: the collective is accepted, the watchdog's
/// events on the stream never complete, the communicator fails fast, and the watchdog's
/// abort runs on a thread of its own, where it blocks in the driver behind the stalled
/// stream (the fake NCCL's abort frees through the driver on the communicator's device, as
/// NVIDIA's does, whatever context the thread has: no fault is injected). Nothing
/// synchronizes the stalled stream, and the caller's next call fails without a driver
/// call.
#[test]
fn a_stalled_stream_fails_fast_and_is_aborted_behind_it() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let config = Config::new()
            .timeout(TIMEOUT)
            .abort_timeout(Duration::from_secs(20));
        let r = rank(1, &config, false);
        let waits = d.gauge(Gauge::StalledWaits);
        let records = d.counts(false).get("cuEventRecord");
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();

        d.stall(&r.stream, true);
        let start = Instant::now();
        r.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
            .expect("a collective behind a stalled stream is accepted");
        let failed = until(BOUND, || r.comm.is_failed())
            .expect("is_failed() within timeout + 1 s of the stalled collective");
        assert!(
            failed >= TIMEOUT / 2,
            "failed after {failed:?}, before the timeout"
        );

        d.mark_this_thread(true);
        let before = d.counts(true);
        let e = r
            .comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
            .expect_err("the next call fails");
        let quiet = d.counts(true).since(&before);
        d.mark_this_thread(false);
        assert!(is_timeout(&e), "{e}");
        assert!(e.to_string().contains("did not complete in time"), "{e}");
        assert!(start.elapsed() <= BOUND, "{:?}", start.elapsed());
        assert_eq!(
            quiet.total(),
            0,
            "failing fast called the driver: [{quiet}]"
        );
        assert!(matches!(r.comm.async_error(), Err(Error::Timeout { .. })));

        until(BOUND, || d.gauge(Gauge::ReleasesInProgress) >= 1)
            .expect("the watchdog's abort runs, and blocks in the driver behind the stall");
        assert!(
            d.counts(false).get("cuEventRecord") > records,
            "the watchdog recorded events on the stream"
        );
        let t = Instant::now();
        let Rank {
            ctx,
            stream,
            comm,
            id,
        } = r;
        drop(comm);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "dropping a communicator whose abort blocks took {:?}",
            t.elapsed()
        );
        assert_eq!(
            d.gauge(Gauge::StalledWaits),
            waits,
            "something synchronized the stalled stream"
        );

        d.stall(&stream, false);
        let st = support::assert_balanced(&id);
        assert_eq!((st.created, st.aborted, st.destroyed), (1, 1, 0));
        drop((x, stream, ctx));
    });
}

/// A group's work that never completes is reported by its first operation on the stream:
/// the marker of a group's end covers every operation the group put on that stream, and
/// the range keeps the oldest one's record (a single operation's range, the operation
/// itself, is found without searching the journal; a group's is searched for).
#[test]
fn a_stuck_groups_timeout_names_its_first_operation_on_the_stream() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let config = Config::new()
            .timeout(TIMEOUT)
            .abort_timeout(Duration::from_secs(20));
        let r = rank(1, &config, false);
        let mut bufs: Vec<CudaSlice<f32>> = (1..=4)
            .map(|n| r.stream.alloc_zeros::<f32>(n).unwrap())
            .collect();
        // One operation completes first: the group's range is not the queue's first.
        r.comm
            .all_reduce_in_place(&mut bufs[3], ReduceOp::Sum, &r.stream)
            .unwrap();
        r.stream.synchronize().unwrap();
        d.stall(&r.stream, true);
        let mut g = Group::new();
        for b in bufs[..3].iter_mut() {
            g.push(
                r.comm
                    .all_reduce_in_place_op(b, ReduceOp::Sum, &r.stream)
                    .unwrap(),
            )
            .unwrap();
        }
        g.end()
            .expect("a group behind a stalled stream is accepted");
        until(BOUND, || r.comm.is_failed()).expect("is_failed() within the bound");
        let e = r
            .comm
            .all_reduce_in_place(&mut bufs[3], ReduceOp::Sum, &r.stream)
            .expect_err("the next call fails");
        assert!(is_timeout(&e), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("ncclAllReduce(float x 1) (seq 1) on rank 0")
                && text.contains("because ncclAllReduce seq 1 on rank 0"),
            "the report names the group's first operation (seq 1, 1 element), not a later one: {text}"
        );
        let Rank {
            ctx,
            stream,
            comm,
            id,
        } = r;
        drop(comm);
        d.stall(&stream, false);
        let st = support::assert_balanced(&id);
        assert_eq!((st.created, st.aborted, st.destroyed), (1, 1, 0));
        drop((bufs, stream, ctx));
    });
}

/// While a stream is being captured into a graph, its collectives raise no timeout however
/// long the capture. Their markers are recorded at enqueue without asking whether the
/// stream is capturing (no `cuStreamIsCapturing` on the caller's thread), so each is a
/// captured event, as cudarc's own write-event record is. The watchdog asks instead, and
/// queries none of them while the capture is open (the fake counts a query CUDA calls
/// invalid). Once the capture ends, the captured markers' queries fail as CUDA's do
/// (`CUDA_ERROR_CAPTURED_EVENT`), which reads as complete though the captured work never
/// ran on the stream: the stream stays stalled. The communicator is healthy and is
/// destroyed normally.
#[test]
fn a_capturing_stream_raises_no_timeout_and_its_markers_are_not_queried_during_the_capture() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let r = rank(2, &Config::new().timeout(TIMEOUT), false);
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        let on_capturing = d.gauge(Gauge::RecordsOnCapturing);
        let in_capture = d.gauge(Gauge::QueriesInCapture);

        d.set_capturing(&r.stream, true);
        d.stall(&r.stream, true); // nothing captured runs on the stream
        d.mark_this_thread(true);
        let before = d.counts(true);
        for _ in 0..10 {
            r.comm
                .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
                .unwrap();
        }
        let calls = d.counts(true).since(&before);
        d.mark_this_thread(false);
        assert_eq!(calls.of("cuStreamIsCapturing"), 0, "[{calls}]");
        assert_eq!(d.gauge(Gauge::RecordsOnCapturing), on_capturing + 10);
        let asked = d.counts(false).get("cuStreamIsCapturing");
        std::thread::sleep(TIMEOUT * 4);
        assert!(!r.comm.is_failed(), "captured work timed out");
        assert!(
            d.counts(false).get("cuStreamIsCapturing") > asked,
            "the watchdog asked whether the stream was capturing"
        );
        assert_eq!(
            d.gauge(Gauge::QueriesInCapture),
            in_capture,
            "a marker was queried while its capture was open"
        );

        // The capture ends; nothing it captured runs on the stream (still stalled).
        d.set_capturing(&r.stream, false);
        until(Duration::from_secs(10), || {
            (r.comm.flight_record().entries.iter()).all(|e| e.state == OpState::Completed)
        })
        .expect("the captured collectives are seen complete once the capture ended");
        d.stall(&r.stream, false);
        r.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
            .unwrap();
        std::thread::sleep(TIMEOUT * 2);
        assert!(!r.comm.is_failed());
        // The graph holds the captured collectives until it is destroyed, and NCCL's destroy
        // waits for that (the next test): the user destroys the graph first.
        assert_eq!(support::fakes::destroy_graphs(&r.stream), 10);
        let id = r.id;
        r.comm.destroy().map_err(|(_, e)| e).unwrap();
        let st = support::assert_balanced(&id);
        assert_eq!((st.created, st.aborted, st.destroyed), (1, 0, 1));
        assert_eq!(d.gauge(Gauge::QueriesInCapture), in_capture);
    });
}

/// Captures that begin and end while the watchdog sweeps: 40 rounds of a capture with a few
/// collectives in it and a few after it, paced against the watchdog's 10 ms tick so that
/// its questions fall before, inside and after the captures. The watchdog never queries a
/// marker inside the capture that recorded it (it asks whether the stream is capturing
/// under the queue's lock, which the owner's marker needs too), never times out captured
/// work, and retires everything once the last capture ended.
#[test]
fn captures_that_come_and_go_under_the_watchdog_are_never_queried_inside() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let r = rank(5, &Config::new().timeout(TIMEOUT), false);
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        let (on_capturing, in_capture) = (
            d.gauge(Gauge::RecordsOnCapturing),
            d.gauge(Gauge::QueriesInCapture),
        );
        let mut captured = 0;
        for round in 0..40u64 {
            d.set_capturing(&r.stream, true);
            for _ in 0..(1 + round % 3) {
                r.comm
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
                    .unwrap();
                captured += 1;
            }
            std::thread::sleep(Duration::from_millis(round % 4 * 4));
            d.set_capturing(&r.stream, false);
            for _ in 0..(round % 2) {
                r.comm
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
                    .unwrap();
            }
            std::thread::sleep(Duration::from_millis(round % 5 * 3));
        }
        assert_eq!(d.gauge(Gauge::RecordsOnCapturing), on_capturing + captured);
        until(Duration::from_secs(10), || {
            (r.comm.flight_record().entries.iter()).all(|e| e.state == OpState::Completed)
        })
        .expect("every collective is seen complete once the captures ended");
        assert!(!r.comm.is_failed(), "captured work timed out");
        assert_eq!(
            d.gauge(Gauge::QueriesInCapture),
            in_capture,
            "a marker was queried inside the capture that recorded it"
        );
        assert_eq!(support::fakes::destroy_graphs(&r.stream), captured as usize);
        let id = r.id;
        r.comm.destroy().map_err(|(_, e)| e).unwrap();
        let st = support::assert_balanced(&id);
        assert_eq!((st.created, st.aborted, st.destroyed), (1, 0, 1));
        drop((x, r.stream, r.ctx));
    });
}

/// Past the 64 markers a stream keeps in flight (work enqueued faster than the watchdog's
/// tick retires it), a marker is recorded again after later work, covering what it covered
/// before. Such a marker must never be recorded into a capture: it would become a captured
/// event, which reads as complete once the capture ended, and the stuck work it covered
/// would be retired (no timeout, and a teardown that destroys instead of aborting). Here
/// the device is held behind while 64 collectives are enqueued (none is seen complete),
/// the stream stalls under 64 more, and 40 are captured. Once the device catches up, the
/// first collectives are seen complete, the stalled ones (and the captured ones behind
/// them) never are: they time out, and the watchdog aborts the communicator. The owner
/// asks whether the stream is capturing for none of the first 64 collectives, and before
/// each marker it records again after them.
#[test]
fn a_marker_recorded_again_under_capture_never_retires_stuck_work() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        const TIMEOUT: Duration = Duration::from_secs(1);
        const FRESH: usize = 64; // the markers a stream keeps in flight
        const STUCK: usize = 64;
        const CAPTURED: usize = 40;
        let config = Config::new()
            .timeout(TIMEOUT)
            .abort_timeout(Duration::from_secs(20))
            .flight_record_len(256);
        let r = rank(2, &config, false);
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        let mut all_reduce = |n: usize| {
            for _ in 0..n {
                r.comm
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
                    .unwrap();
            }
        };

        d.mark_this_thread(true);
        let c0 = d.counts(true);
        d.hold_completion(true);
        all_reduce(FRESH); // done on the device, not yet seen so
        let c1 = d.counts(true);
        d.stall(&r.stream, true);
        all_reduce(STUCK);
        let c2 = d.counts(true);
        d.set_capturing(&r.stream, true);
        all_reduce(CAPTURED); // never run on the stream
        d.set_capturing(&r.stream, false);
        d.mark_this_thread(false);
        // The graph goes before the communicator, as NCCL requires (its teardown waits for
        // every graph that holds work of it).
        assert_eq!(support::fakes::destroy_graphs(&r.stream), CAPTURED);
        d.hold_completion(false);

        let ours = || {
            let e = r.comm.flight_record().entries;
            let ours = e[e.len() - (FRESH + STUCK + CAPTURED)..].to_vec();
            assert!(ours
                .iter()
                .all(|o| o.op == nccl_sys::EntryPoint::ncclAllReduce));
            ours
        };
        until(Duration::from_secs(10), || {
            ours()[0].state == OpState::Completed
        })
        .expect("the work before the stall is seen complete");
        std::thread::sleep(Duration::from_millis(50)); // five of the watchdog's ticks
        let retired = (ours()[FRESH..].iter())
            .filter(|e| e.state == OpState::Completed)
            .count();
        assert_eq!(
            retired,
            0,
            "{retired} of the {STUCK} stalled collectives and the {CAPTURED} captured ones behind them were retired"
        );
        until(TIMEOUT + BOUND, || r.comm.is_failed()).expect("the stalled collectives time out");

        d.stall(&r.stream, false);
        let Rank {
            ctx,
            stream,
            comm,
            id,
        } = r;
        drop(comm);
        let st = support::assert_balanced(&id);
        assert_eq!(
            (st.created, st.aborted, st.destroyed),
            (1, 1, 0),
            "the stalled work's communicator is aborted, not destroyed"
        );
        drop((x, stream, ctx));

        // The cost: no question while fewer markers are in flight, one per marker recorded
        // again past them.
        let (fresh, stuck) = (c1.since(&c0), c2.since(&c1));
        assert_eq!(fresh.of("cuStreamIsCapturing"), 0, "[{fresh}]");
        assert_eq!(stuck.of("cuStreamIsCapturing"), STUCK as u64, "[{stuck}]");
    });
}

/// An owner that waits for its own work at teardown leaves its thread's stream-capture mode
/// as its user set it. With lazy completion it marks that work itself (asking first
/// whether the stream is capturing), and it asks again before it queries the markers; only
/// the watchdog's thread is put in relaxed capture mode for such calls, since a user
/// capturing in global mode may rely on the mode of its own threads.
#[test]
fn a_teardown_leaves_the_owners_capture_mode_alone() {
    let _serial = serial();
    let d = driver();
    const TRIES: usize = 4;
    within(Duration::from_secs(60), move || {
        let mut marked_here = 0;
        // Each teardown takes NCCL's time (the fakes keep it): a few tries.
        for _ in 0..TRIES {
            let r = rank(4, &Config::new().exact_completion(false), false);
            let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
            r.stream.synchronize().unwrap();
            d.mark_this_thread(true);
            let before = d.counts(true);
            r.comm
                .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
                .unwrap();
            // At once: most often before the watchdog's next tick has marked the work.
            let id = r.id;
            r.comm.destroy().map_err(|(_, e)| e).unwrap();
            let calls = d.counts(true).since(&before);
            d.mark_this_thread(false);
            assert_eq!(
                calls.of("cuThreadExchangeStreamCaptureMode"),
                0,
                "the owner's capture mode was changed: [{calls}]"
            );
            if calls.of("cuStreamIsCapturing") > 0 {
                marked_here += 1;
            }
            let st = support::assert_balanced(&id);
            assert_eq!((st.created, st.aborted, st.destroyed), (1, 0, 1));
            drop((x, r.stream, r.ctx));
        }
        assert!(
            marked_here > 0,
            "in {TRIES} tries the owner never marked its own work at teardown"
        );
        eprintln!("the owner marked its work at teardown in {marked_here} of {TRIES} tries");
    });
}

/// A long run that uses a new stream every few steps (and cudarc's event tracking) makes
/// the watchdog keep a bounded set of streams and events, and releases every one of them
/// with the communicator: nothing leaks, nothing is released twice.
#[test]
fn a_long_run_on_new_streams_releases_every_event_and_stream() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(120), move || {
        let (streams0, events0) = (d.gauge(Gauge::LiveStreams), d.gauge(Gauge::LiveEvents));
        let r = rank(3, &Config::new().timeout(Duration::from_secs(30)), true);
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        let mut most = (0, 0);
        for _ in 0..40 {
            let s = r.ctx.new_stream().unwrap();
            for _ in 0..25 {
                r.comm
                    .all_reduce_in_place(&mut x, ReduceOp::Sum, &s)
                    .unwrap();
            }
            s.synchronize().unwrap();
            drop(s);
            // Let the watchdog see this stream before the next one.
            std::thread::sleep(Duration::from_millis(15));
            most.0 = most.0.max(d.gauge(Gauge::LiveStreams) - streams0);
            most.1 = most.1.max(d.gauge(Gauge::LiveEvents) - events0);
        }
        // The communicator's own stream, the buffer's 2 events, the events of the 8
        // streams the owner caches (a slot keeps its event: as many as were ever in
        // flight on the stream, 25 here, at most 64), and 64 spare events (those of the
        // streams that left the cache).
        assert!(most.0 <= 1 + 16 + 1, "live streams peaked at {}", most.0);
        assert!(
            most.1 <= 2 + 8 * 25 + 64,
            "live events peaked at {}",
            most.1
        );
        let id = r.id;
        let Rank {
            ctx, stream, comm, ..
        } = r;
        comm.destroy().map_err(|(_, e)| e).unwrap();
        drop((x, stream, ctx));
        let settled = until(Duration::from_secs(5), || {
            d.gauge(Gauge::LiveStreams) == streams0 && d.gauge(Gauge::LiveEvents) == events0
        });
        assert!(
            settled.is_some(),
            "after the run: {} streams and {} events more than before (peaks {most:?})",
            d.gauge(Gauge::LiveStreams) - streams0,
            d.gauge(Gauge::LiveEvents) - events0
        );
        assert_eq!(d.gauge(Gauge::BadHandles), 0, "a released handle was used");
        support::assert_balanced(&id);
        eprintln!("peaks over the run: {} streams, {} events", most.0, most.1);
    });
}

// ---- a process that exits while the abort behind a stalled stream blocks ----------------

const CHILD_VAR: &str = "NCCL_SAFE_TEST_CUDA_EXIT_CHILD";

/// Completion is learned per stream, and recorded at enqueue: a broadcast on a compute
/// stream, then at once (before the watchdog's next tick) a long backlog there (the stream
/// stalls, as behind a wait on another stream's work), while the communicator's all-reduces
/// on its own stream complete. Nothing times out: the backlog was enqueued after the
/// broadcast, so it does not count against it. (With the marker recorded lazily, on the
/// watchdog's tick, it landed behind the backlog and the communicator failed after one
/// timeout, blaming the finished broadcast: what an H100 showed.)
#[test]
fn another_streams_backlog_never_times_out_a_communicator() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let config = Config::new().timeout(TIMEOUT);
        let r = rank(1, &config, false);
        let compute = r.ctx.new_stream().unwrap();
        let mut x = compute.alloc_zeros::<f32>(16).unwrap();
        let mut y = r.stream.alloc_zeros::<f32>(16).unwrap();
        compute.synchronize().unwrap();
        r.comm.broadcast_in_place(&mut x, 0, &compute).unwrap();
        d.stall(&compute, true);
        let start = Instant::now();
        while start.elapsed() < TIMEOUT * 4 {
            r.comm
                .all_reduce_in_place(&mut y, ReduceOp::Sum, &r.stream)
                .expect("the communicator is healthy");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!r.comm.is_failed(), "another stream's backlog timed it out");
        // Its own work is seen done, although the compute stream's is not.
        until(Duration::from_secs(5), || {
            r.comm
                .flight_record()
                .entries
                .iter()
                .all(|e| e.state == OpState::Completed)
        })
        .unwrap_or_else(|| panic!("{}", r.comm.flight_record()));
        // NCCL's destroy frees through the driver, which waits for every stream of the
        // device (the model of tests/support/fakes): release the backlog first.
        d.stall(&compute, false);
        let Rank { comm, id, .. } = r;
        comm.destroy().map_err(|(_, e)| e).unwrap();
        let st = nccl_safe::host::stats_for(&id.to_raw());
        assert_eq!((st.created, st.destroyed, st.aborted), (1, 1, 0));
        drop((x, y));
    });
}

/// `CU_STREAM_PER_THREAD` (handle 0x2, candle's stream) is the calling thread's own stream:
/// a collective enqueued on it behind a stall is watched there, and times out. (Marked from
/// the watchdog's thread, 0x2 was the watchdog's own per-thread stream, which never stalls:
/// the stuck collective was seen complete and never timed out.)
#[test]
fn work_on_the_per_thread_stream_is_watched_on_the_callers_stream() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let config = Config::new()
            .timeout(TIMEOUT)
            .abort_timeout(MIN_NCCL_ABORT_TIMEOUT);
        let r = rank(1, &config, false);
        let pts = r.ctx.per_thread_stream();
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        d.stall(&pts, true);
        let t = Instant::now();
        r.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &pts)
            .expect("the collective is enqueued");
        let failed = until(TIMEOUT * 4 + Duration::from_secs(1), || r.comm.is_failed());
        d.stall(&pts, false);
        assert!(
            failed.is_some(),
            "the stuck collective on the per-thread stream was never timed out"
        );
        let took = t.elapsed();
        assert!(
            took >= TIMEOUT,
            "timed out after {took:?}, before its timeout"
        );
        let e = r
            .comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        let Rank { comm, id, .. } = r;
        drop(comm);
        let st = support::assert_balanced(&id);
        assert_eq!((st.created, st.aborted, st.destroyed), (1, 1, 0));
        drop(x);
    });
}

/// A capture of the caller's per-thread stream (`CU_STREAM_PER_THREAD`, candle's): the
/// watchdog cannot ask whether it is capturing (0x2 on the watchdog's thread is the
/// watchdog's own stream), so the owner asks at enqueue for that stream and records no
/// marker into the capture. Nothing is queried inside the capture, nothing times out, and
/// after the capture the work is seen complete.
#[test]
fn a_capture_of_the_per_thread_stream_is_asked_about_on_the_callers_thread() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let r = rank(1, &Config::new().timeout(TIMEOUT), false);
        let pts = r.ctx.per_thread_stream();
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        let in_capture = d.gauge(Gauge::QueriesInCapture);
        d.set_capturing(&pts, true); // this thread's per-thread stream
        for _ in 0..5 {
            r.comm
                .all_reduce_in_place(&mut x, ReduceOp::Sum, &pts)
                .unwrap();
        }
        std::thread::sleep(TIMEOUT * 4);
        assert!(!r.comm.is_failed(), "captured work timed out");
        assert_eq!(
            d.gauge(Gauge::QueriesInCapture),
            in_capture,
            "a marker was queried inside the capture that recorded it"
        );
        d.set_capturing(&pts, false);
        until(Duration::from_secs(10), || {
            (r.comm.flight_record().entries.iter()).all(|e| e.state == OpState::Completed)
        })
        .expect("the captured collectives are seen complete");
        assert_eq!(support::fakes::destroy_graphs(&pts), 5);
        let id = r.id;
        r.comm.destroy().map_err(|(_, e)| e).unwrap();
        let st = support::assert_balanced(&id);
        assert_eq!((st.created, st.aborted, st.destroyed), (1, 0, 1));
        drop(x);
    });
}

/// What a teardown beside a live graph may take past its bound before the test calls it
/// unbounded (the fake's destroy takes 0.5 s of it).
const GRAPH_SLACK: Duration = Duration::from_millis(1500);

/// Whether a teardown's error names a live CUDA graph holding the communicator's work as
/// the likely cause.
fn names_the_graph(e: &Error) -> bool {
    let text = e.to_string();
    text.contains("CUDA graph") && text.contains("destroy the graph")
}

/// One captured all-reduce on rank `r`'s stream, whose capture then ends: the graph it
/// made lives on (the user keeps it to replay), holding the communicator's work.
fn capture_one(d: &support::fakes::FakeDriver, r: &Rank) {
    let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
    r.stream.synchronize().unwrap();
    d.set_capturing(&r.stream, true);
    r.comm
        .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
        .unwrap();
    d.set_capturing(&r.stream, false);
}

/// Device `ordinal`'s teardown lane is wedged by a teardown (queued just before the call
/// that returned at its bound) whose report names the graph; once the graph is destroyed
/// (`destroy_graphs`, which must release one launch), the teardown completes and the lane
/// frees up.
fn wedged_until_the_graph_goes(ordinal: usize, config: &Config, stream: &CudaStream) {
    // The teardown began a few milliseconds after the bound started: past that, it counts
    // as wedged.
    std::thread::sleep(Duration::from_millis(500));
    let e = match try_rank(ordinal, config, false) {
        Err(e @ Error::TeardownWedged { .. }) => e,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a new communicator on the device was not refused: the lane is free"),
    };
    assert!(names_the_graph(&e), "{e}");
    assert_eq!(support::fakes::destroy_graphs(stream), 1);
    let free = until(Duration::from_secs(10), || {
        try_rank(ordinal, config, false).is_ok_and(|r| r.comm.destroy().is_ok())
    });
    free.expect("the lane frees up once the graph is destroyed");
}

/// A CUDA graph that captured a collective holds its communicator: NVIDIA's destroy and
/// abort wait until every such graph is destroyed (`commDestroySync`, init.cc:2232-2234 of
/// 2.28.9, which the fake NCCL follows). `destroy()` runs on the device's teardown lane,
/// like every other teardown: it returns at `Config::abort_timeout` with `Error::Timeout`
/// naming the captured work's graph as the likely cause, and hands back a communicator
/// without its handle (the destroy goes on in the background; dropping what came back tears
/// nothing down again). A new communicator on the device is refused as wedged, for the same
/// cause, until the user destroys the graph; then the destroy completes, once.
#[test]
fn destroy_beside_a_live_graph_is_bounded_and_names_the_graph() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(40), move || {
        let config = Config::new()
            .timeout(TIMEOUT)
            .abort_timeout(MIN_NCCL_ABORT_TIMEOUT);
        let r = rank(2, &config, false);
        capture_one(d, &r);
        let t = Instant::now();
        let (back, e) = r
            .comm
            .destroy()
            .expect_err("NCCL's destroy waits for the graph");
        let took = t.elapsed();
        assert!(
            took < MIN_NCCL_ABORT_TIMEOUT + GRAPH_SLACK,
            "destroy took {took:?}"
        );
        assert!(is_timeout(&e) && names_the_graph(&e), "{e}");
        assert!(back.is_failed());
        let t = Instant::now();
        drop(back);
        assert!(
            t.elapsed() < Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );
        wedged_until_the_graph_goes(2, &config, &r.stream);
        let st = support::assert_balanced(&r.id);
        assert_eq!((st.created, st.destroyed, st.aborted), (1, 1, 0));
    });
}

/// The same for a communicator dropped beside a live graph: the drop returns within
/// `Config::abort_timeout`, and the teardown left blocked on the lane is reported (and
/// refuses new communicators on the device) naming the graph, until the graph is destroyed.
#[test]
fn drop_beside_a_live_graph_is_bounded_and_names_the_graph() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(40), move || {
        let config = Config::new()
            .timeout(TIMEOUT)
            .abort_timeout(MIN_NCCL_ABORT_TIMEOUT);
        let r = rank(3, &config, false);
        capture_one(d, &r);
        let t = Instant::now();
        drop(r.comm);
        let took = t.elapsed();
        assert!(
            took < MIN_NCCL_ABORT_TIMEOUT + GRAPH_SLACK,
            "drop took {took:?}"
        );
        wedged_until_the_graph_goes(3, &config, &r.stream);
        let st = support::assert_balanced(&r.id);
        assert_eq!((st.created, st.destroyed, st.aborted), (1, 1, 0));
    });
}

/// The marker at enqueue from a thread where the stream's context is not current (a
/// worker thread of the user's, with cudarc's tracking off, so nothing bound it there): the
/// driver may refuse a stream's calls then (the fake does), and the tracker makes the
/// context current and tries again. Its collective is watched like any other: complete
/// when healthy, timed out (not failed with a CUDA error) behind a stalled stream.
#[test]
fn a_marker_is_recorded_from_a_thread_without_the_streams_context() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let config = Config::new()
            .timeout(TIMEOUT)
            .abort_timeout(MIN_NCCL_ABORT_TIMEOUT);
        let r = rank(1, &config, false);
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        // One collective here first: once the watchdog retired it, its marker's event is
        // spare, so the worker's marker makes no event (which would make the context
        // current before the record is tried).
        r.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
            .unwrap();
        until(Duration::from_secs(10), || {
            (r.comm.flight_record().entries.iter()).all(|e| e.state == OpState::Completed)
        })
        .expect("the first collective is seen complete");
        let Rank {
            comm, stream, id, ..
        } = r;
        // The communicator moves to a fresh thread and back (it is Send, not Sync).
        let issue = |comm: Communicator, x: &mut CudaSlice<f32>| {
            std::thread::scope(|sc| {
                sc.spawn(|| {
                    d.mark_this_thread(true);
                    let before = d.counts(true);
                    let rc = comm.all_reduce_in_place(x, ReduceOp::Sum, &stream);
                    let calls = d.counts(true).since(&before);
                    d.mark_this_thread(false);
                    (comm, rc, calls)
                })
                .join()
                .unwrap()
            })
        };
        // Healthy: the first record fails, the context is made current, the second records.
        let (comm, rc, calls) = issue(comm, &mut x);
        rc.expect("the collective is enqueued");
        assert_eq!(
            (calls.of("cuEventCreate"), calls.of("cuEventRecord")),
            (0, 2),
            "tried without the context, then with it: [{calls}]"
        );
        assert_eq!(calls.of("cuCtxSetCurrent"), 1, "[{calls}]");
        until(Duration::from_secs(10), || {
            (comm.flight_record().entries.iter()).all(|e| e.state == OpState::Completed)
        })
        .expect("the collective is seen complete");
        assert!(!comm.is_failed(), "a healthy communicator failed");
        // Behind a stalled stream: timed out, blaming the collective.
        d.stall(&stream, true);
        let (comm, rc, _) = issue(comm, &mut x);
        rc.expect("the collective is enqueued");
        let failed = until(TIMEOUT * 4 + Duration::from_secs(1), || comm.is_failed());
        d.stall(&stream, false);
        assert!(failed.is_some(), "the stuck collective was never timed out");
        let e = comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &stream)
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        drop(comm);
        let st = support::assert_balanced(&id);
        assert_eq!((st.created, st.aborted, st.destroyed), (1, 1, 0));
        drop(x);
    });
}

/// Seeds of [`seeded_stalls_of_another_stream`].
const STALL_SEEDS: u64 = 8;

/// Several streams, seeded (the chaos test's stalls, where the host provider has only one
/// stream): a communicator's collectives on two or three streams of one device; then one
/// compute stream stalls and is released after a random delay, well within the timeout
/// (up to 30 % of it) or past it plus a second, while collectives go on completing on the
/// other streams. Half the seeds also issue one collective on the stalled stream itself.
///
/// Invariants: a communicator whose own work is on healthy streams is never timed out by
/// another stream's backlog (every call succeeds, `is_failed()` stays false until a
/// timeout after the release, and its work on the healthy streams is seen complete while
/// the stall lasts); with its own collective behind a stall released well within the
/// timeout, the same (no false alarm); with one behind a stall that outlasts timeout + 1 s,
/// it fails within timeout + 1 s of that collective and its next call is
/// `Error::Timeout`. Every handle is torn down once and none is misused.
#[test]
fn seeded_stalls_of_another_stream() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(120), move || {
        for seed in 1..=STALL_SEEDS {
            stall_round(d, seed);
        }
    });
}

fn stall_round(d: &'static support::fakes::FakeDriver, seed: u64) {
    // xorshift64* on a splitmix64 of the seed.
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    let mut state = (z ^ (z >> 31)) | 1;
    let mut below = |n: u64| {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    };
    let config = Config::new()
        .timeout(TIMEOUT)
        .abort_timeout(MIN_NCCL_ABORT_TIMEOUT);
    // An earlier round's failed communicator was aborted on the device's teardown lane,
    // blocked behind its stall past the bound, and finishes once the stall is released: a
    // new communicator on the device is refused (`TeardownWedged`) until it has.
    let first = Instant::now();
    let r = loop {
        match try_rank(1, &config, false) {
            Ok(r) => break r,
            Err(Error::TeardownWedged { .. }) if first.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("seed {seed}: a communicator on the fake device: {e}"),
        }
    };
    // Stream 0 is the communicator's; stream 1 stalls; stream 2 (some seeds) is healthy.
    let mut streams = vec![r.stream.clone(), r.ctx.new_stream().unwrap()];
    if below(2) == 0 {
        streams.push(r.ctx.new_stream().unwrap());
    }
    let mut bufs: Vec<CudaSlice<f32>> = streams
        .iter()
        .map(|s| s.alloc_zeros::<f32>(16).unwrap())
        .collect();
    for s in &streams {
        s.synchronize().unwrap();
    }
    let own = below(2) == 0;
    let early = below(2) == 0;
    let release_after = if early {
        TIMEOUT * below(31) as u32 / 100
    } else {
        BOUND + Duration::from_millis(100 + below(200))
    };
    let what = format!(
        "seed {seed}: {} streams, own collective on the stalled one: {own}, released after {release_after:?}",
        streams.len()
    );
    // The stream of each collective, by sequence number.
    let mut on: Vec<usize> = Vec::new();
    let mut run = |i: usize, on: &mut Vec<usize>| {
        on.push(i);
        r.comm
            .all_reduce_in_place(&mut bufs[i], ReduceOp::Sum, &streams[i])
    };
    for _ in 0..1 + below(3) {
        let i = below(streams.len() as u64) as usize;
        run(i, &mut on).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    until(Duration::from_secs(5), || {
        r.comm
            .flight_record()
            .entries
            .iter()
            .all(|e| e.state == OpState::Completed)
    })
    .unwrap_or_else(|| panic!("{what}: {}", r.comm.flight_record()));

    d.stall(&streams[1], true);
    let stalled_at = Instant::now();
    let own_at = own.then(|| {
        run(1, &mut on).unwrap_or_else(|e| panic!("{what}: behind the stall: {e}"));
        Instant::now()
    });
    let healthy: Vec<usize> = (0..streams.len()).filter(|&i| i != 1).collect();
    let mut failed_at = None;
    while stalled_at.elapsed() < release_after {
        let i = healthy[below(healthy.len() as u64) as usize];
        match run(i, &mut on) {
            Ok(()) => {}
            Err(e) if own && !early && is_timeout(&e) => {
                failed_at.get_or_insert(Instant::now());
                break;
            }
            Err(e) => panic!("{what}: a collective on a healthy stream failed: {e}"),
        }
        if r.comm.is_failed() {
            assert!(own && !early, "{what}: failed by another stream's backlog");
            failed_at.get_or_insert(Instant::now());
            break;
        }
        std::thread::sleep(Duration::from_millis(5 + below(25)));
    }
    if !own || early {
        // The healthy streams' work is seen complete while the stall lasts.
        until(Duration::from_secs(1), || {
            r.comm
                .flight_record()
                .entries
                .iter()
                .filter(|e| on[e.seq as usize] != 1)
                .all(|e| e.state == OpState::Completed)
        })
        .unwrap_or_else(|| panic!("{what}: {}", r.comm.flight_record()));
    }
    let wait = release_after.saturating_sub(stalled_at.elapsed());
    std::thread::sleep(wait);
    d.stall(&streams[1], false);
    let released_at = Instant::now();
    if let Some(t) = own_at.filter(|_| !early) {
        // Its own collective waited longer than timeout + 1 s.
        let failed = failed_at.is_some()
            || until(BOUND.saturating_sub(t.elapsed()), || r.comm.is_failed()).is_some();
        assert!(
            failed,
            "{what}: is_failed() still false {:?} after its stalled collective",
            t.elapsed()
        );
        let e = run(0, &mut on).expect_err("the next call fails");
        assert!(is_timeout(&e), "{what}: {e}");
    } else {
        // No false alarm: watched until a timeout after the release.
        let watch = released_at + TIMEOUT + Duration::from_millis(100);
        while Instant::now() < watch {
            assert!(
                !r.comm.is_failed(),
                "{what}: failed without a fault of its own"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        until(Duration::from_secs(5), || {
            r.comm
                .flight_record()
                .entries
                .iter()
                .all(|e| e.state == OpState::Completed)
        })
        .unwrap_or_else(|| panic!("{what}: {}", r.comm.flight_record()));
    }
    let failed = r.comm.is_failed();
    let Rank { comm, id, .. } = r;
    if failed {
        drop(comm);
    } else {
        comm.destroy()
            .map_err(|(_, e)| e)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    let st = support::assert_balanced(&id);
    eprintln!("stall round {what}: failed {failed}");
    assert_eq!(st.created, 1, "{what}: {st:?}");
    assert_eq!(st.aborted, failed as u64, "{what}: {st:?}");
    assert_eq!(d.gauge(Gauge::BadHandles), 0, "{what}");
    drop((bufs, streams));
}

/// Behind a stalled stream every teardown returns within the abort bound (+100 ms) with
/// the op timeout far away: `abort()`, the drop of a healthy communicator whose work is
/// stuck, and the drop of NCCL memory. Their calls block in the fake driver's device-wide
/// wait (as NVIDIA's do in `cudaFree`), are left on the device's teardown lane and
/// reported; once the stall is released they complete, each handle torn down once.
#[test]
fn teardowns_behind_a_stalled_stream_keep_the_abort_bound() {
    let _serial = serial();
    let d = driver();
    within(Duration::from_secs(60), move || {
        let bound = MIN_NCCL_ABORT_TIMEOUT;
        let slack = Duration::from_millis(100);
        let config = Config::new()
            .timeout(Duration::from_secs(4))
            .abort_timeout(bound);
        // abort(): before, it drained until the op timeout (4 s).
        let r = rank(5, &config, false);
        let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
        r.stream.synchronize().unwrap();
        d.stall(&r.stream, true);
        r.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
            .unwrap();
        let (comm, id1, stream) = (r.comm, r.id, r.stream);
        let t = Instant::now();
        let e = comm.abort().expect_err("the abort blocks behind the stall");
        assert!(
            t.elapsed() < bound + slack,
            "abort() took {:?}",
            t.elapsed()
        );
        assert!(is_timeout(&e), "{e}");
        // A new communicator on that device is refused while the abort is wedged (its call
        // began just after the bound started).
        std::thread::sleep(slack);
        let ctx = CudaContext::new(5).unwrap();
        let e = Communicator::init_rank_in(
            &nccl(),
            &CommDevice::Cuda(ctx),
            1,
            0,
            &UniqueId::new_with(&nccl()).unwrap(),
            &config,
        )
        .expect_err("the device's teardown lane is wedged");
        assert!(matches!(e, Error::TeardownWedged { .. }), "{e}");
        // Drop of a healthy communicator whose work never completes (on another device).
        let r2 = rank(2, &config, false);
        let mut y = r2.stream.alloc_zeros::<f32>(16).unwrap();
        r2.stream.synchronize().unwrap();
        d.stall(&r2.stream, true);
        r2.comm
            .all_reduce_in_place(&mut y, ReduceOp::Sum, &r2.stream)
            .unwrap();
        assert!(!r2.comm.is_failed());
        let (comm2, id2, stream2) = (r2.comm, r2.id, r2.stream);
        let t = Instant::now();
        drop(comm2);
        assert!(t.elapsed() < bound + slack, "drop took {:?}", t.elapsed());
        // NCCL memory: its free waits for the device.
        let lib = nccl();
        if lib.table().ncclMemAlloc.is_some() {
            let helper = rank(3, &config, false);
            let mem = nccl_safe::NcclMemory::<f32>::alloc_zeros(&helper.comm, 16, &helper.stream)
                .expect("NCCL memory on the fake device");
            helper.stream.synchronize().unwrap();
            d.stall(&helper.stream, true);
            let waits = d.gauge(Gauge::ReleaseWaits);
            let t = Instant::now();
            drop(mem);
            assert!(
                t.elapsed() < bound + slack,
                "NcclMemory drop took {:?}",
                t.elapsed()
            );
            until(Duration::from_secs(5), || {
                d.gauge(Gauge::ReleaseWaits) > waits
            })
            .expect("the free waits behind the stalled stream");
            // A registration: NCCL unmaps it through the driver, which waits for the
            // device. Its drop returns at the bound and fails the communicator, whose own
            // teardown is then queued behind the deregistration, never beside it.
            let reg_rank = rank(4, &config, false);
            let mut buf = reg_rank.stream.alloc_zeros::<f32>(256).unwrap();
            let reg = reg_rank.comm.register(&mut buf).expect("a registration");
            reg_rank.stream.synchronize().unwrap();
            d.stall(&reg_rank.stream, true);
            let waits = d.gauge(Gauge::ReleaseWaits);
            let t = Instant::now();
            drop(reg);
            assert!(
                t.elapsed() < bound + slack,
                "Registration drop took {:?}",
                t.elapsed()
            );
            until(Duration::from_secs(5), || {
                d.gauge(Gauge::ReleaseWaits) > waits
            })
            .expect("the deregistration waits behind the stalled stream");
            assert!(reg_rank.comm.is_failed());
            let reg_id = reg_rank.id;
            let t = Instant::now();
            drop(reg_rank.comm);
            assert!(
                t.elapsed() < bound + slack,
                "the drop of its communicator took {:?}",
                t.elapsed()
            );
            d.stall(&stream, false);
            d.stall(&stream2, false);
            d.stall(&helper.stream, false);
            d.stall(&reg_rank.stream, false);
            drop(helper);
            until(Duration::from_secs(10), || {
                nccl_safe::host::stats_for(&reg_id.to_raw()).live == 0
            })
            .expect("the registration's communicator is torn down once the stall is released");
            let st = nccl_safe::host::stats_for(&reg_id.to_raw());
            assert_eq!(
                (st.registered, st.deregistered, st.aborted, st.misused),
                (1, 1, 1, 0),
                "{st:?}"
            );
            drop(buf);
        } else {
            d.stall(&stream, false);
            d.stall(&stream2, false);
        }
        for id in [id1, id2] {
            until(Duration::from_secs(10), || {
                nccl_safe::host::stats_for(&id.to_raw()).live == 0
            })
            .expect("the teardowns complete once the stall is released");
            let st = nccl_safe::host::stats_for(&id.to_raw());
            assert_eq!(
                (st.created, st.destroyed + st.aborted, st.misused),
                (1, 1, 0),
                "{st:?}"
            );
        }
        drop((x, y, stream, stream2));
    });
}

/// The child's part (run only as a child process, see
/// `a_process_exits_cleanly_behind_a_stalled_stream`): a stalled stream, the watchdog's
/// timeout and its blocked abort, then the process ends as `NCCL_SAFE_TEST_CUDA_EXIT_CHILD`
/// says: `exit3` (`std::process::exit(3)`) or `return` (the harness's main returns 0).
#[test]
#[ignore = "run as a child process by a_process_exits_cleanly_behind_a_stalled_stream"]
fn child_exits_behind_a_stalled_stream() {
    let Ok(mode) = std::env::var(CHILD_VAR) else {
        panic!("run only as a child process ({CHILD_VAR} unset)");
    };
    let d = driver();
    // The exit guard waits for the blocked abort up to this bound, then ends the process.
    let config = Config::new()
        .timeout(TIMEOUT)
        .abort_timeout(support::EXIT_CHILD_ABORT_TIMEOUT);
    let r = rank(0, &config, false);
    let mut x = r.stream.alloc_zeros::<f32>(16).unwrap();
    d.stall(&r.stream, true);
    r.comm
        .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
        .unwrap();
    until(Duration::from_secs(5), || {
        d.gauge(Gauge::ReleasesInProgress) == 1
    })
    .expect("the watchdog's abort blocks in the driver behind the stall");
    assert!(r.comm.is_failed());
    // As a process that ends without dropping anything.
    std::mem::forget((x, r));
    println!("child: abort blocked, ending with {mode}");
    if mode == "exit3" {
        std::process::exit(3);
    }
}

/// The process ends with its own status, never a signal, while the watchdog's abort is
/// blocked behind a stalled stream (the host provider's exit handler crashes it otherwise,
/// as the CUDA runtime's teardown does). 10 children, 5 at a time.
#[test]
fn a_process_exits_cleanly_behind_a_stalled_stream() {
    for (mode, want) in [("exit3", 3), ("return", 0)] {
        let children: Vec<_> = (0..5)
            .map(|_| support::spawn_child("child_exits_behind_a_stalled_stream", CHILD_VAR, mode))
            .collect();
        for c in children {
            support::check_child_exit(c, "child: abort blocked", want, Duration::from_secs(60));
        }
    }
}

/// A `StreamBound` of a slice on `CU_STREAM_PER_THREAD` (a different stream on every
/// thread, so "its own stream" would not be one stream) is refused, and the slice comes
/// back whole; a slice of a stream of its own binds, runs its collectives and comes back
/// with their result.
#[test]
fn a_stream_bound_needs_a_stream_of_its_own() {
    let r = rank(0, &Config::default(), true);
    let per_thread = r.ctx.per_thread_stream();
    let x = per_thread.clone_htod(&[2.0f32; 8]).unwrap();
    let (x, e) = nccl_safe::StreamBound::new(x).expect_err("CU_STREAM_PER_THREAD");
    assert!(
        matches!(&e, Error::InvalidArgument { .. }) && e.to_string().contains("PER_THREAD"),
        "{e}"
    );
    assert_eq!(per_thread.clone_dtoh(&x).unwrap(), vec![2.0f32; 8]);

    let x = r.stream.clone_htod(&[2.0f32; 8]).unwrap();
    let mut x = nccl_safe::StreamBound::new(x).map_err(|(_, e)| e).unwrap();
    assert_eq!((x.len(), x.is_empty()), (8, false));
    r.comm
        .all_reduce_in_place(&mut x, ReduceOp::Sum, &r.stream)
        .unwrap();
    let x = x.into_inner();
    assert_eq!(r.stream.clone_dtoh(&x).unwrap(), vec![2.0f32; 8]);
}

/// Restores the fake NCCL's launch delay when dropped.
struct LaunchDelay;

impl LaunchDelay {
    fn set(d: Duration) -> LaunchDelay {
        support::fakes::set_launch_delay(d);
        LaunchDelay
    }
}

impl Drop for LaunchDelay {
    fn drop(&mut self) {
        support::fakes::set_launch_delay(Duration::from_millis(2));
    }
}

/// A wait for NCCL's launch that fails (here the launch, on NCCL's group thread, outlasts
/// the timeout: a peer late to connect) must not end the buffers' borrows or release
/// cudarc's guards while the launch may still come: the call returns only once the launch
/// has ended (the communicator aborted, which joins it), within the bounds. Alone and in a
/// group, on two ranks; and with `Config::elastic`, where the watchdog's revoke (which
/// joins the launch too) leaves the handle to its owner for a shrink.
#[test]
fn a_failed_wait_returns_only_once_nccls_launch_has_ended() {
    let _serial = serial();
    driver();
    let lib = nccl();
    let _delay = LaunchDelay::set(Duration::from_secs(30));
    within(Duration::from_secs(120), move || {
        for (grouped, elastic) in [(false, false), (true, false), (false, true), (true, true)] {
            let stale_before = support::fakes::stale_group_jobs().len();
            let id = UniqueId::new_with(&lib).unwrap();
            std::thread::scope(|sc| {
                for r in 0..2 {
                    let lib = Arc::clone(&lib);
                    sc.spawn(move || {
                        let ctx = CudaContext::new(0).unwrap();
                        let stream = ctx.new_stream().unwrap();
                        let cfg = Config::new().timeout(TIMEOUT).elastic(elastic);
                        let dev = CommDevice::Cuda(ctx.clone());
                        let comm = Communicator::init_rank_in(&lib, &dev, 2, r, &id, &cfg).unwrap();
                        let raw = comm.as_raw() as usize;
                        let mut x = stream.clone_htod(&[1.0f32; 8]).unwrap();
                        let t0 = Instant::now();
                        let r_op = if grouped {
                            Group::run(|g| {
                                g.push(comm.all_reduce_in_place_op(&mut x, ReduceOp::Sum, &stream)?)
                            })
                        } else {
                            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &stream)
                        };
                        let e = r_op.expect_err("the launch outlasts the timeout");
                        assert_eq!(
                            support::fakes::launches_pending(raw),
                            0,
                            "rank {r} (grouped: {grouped}): returned with NCCL's launch still to come: {e}"
                        );
                        let bound = TIMEOUT + MIN_NCCL_ABORT_TIMEOUT + BOUND;
                        assert!(t0.elapsed() < bound, "rank {r} (grouped: {grouped}, elastic: {elastic}): {:?}: {e}", t0.elapsed());
                        assert!(comm.is_failed());
                        if elastic {
                            // NCCL's group job is linked while the launch runs: a revoke
                            // would leave it dangling, so the handle is aborted instead,
                            // and the error says it cannot be shrunk.
                            assert!(!comm.is_revoked(), "rank {r}: revoked with the launch in flight: {e}");
                            assert!(e.to_string().contains("could not be revoked"), "rank {r}: {e}");
                            let shrunk = comm.shrink_after_failure(&[1 - r]).expect_err("an aborted communicator cannot be shrunk");
                            assert!(shrunk.to_string().contains("could not be revoked"), "rank {r}: {shrunk}");
                        }
                        drop(x);
                        drop(comm);
                    });
                }
            });
            let stale = support::fakes::stale_group_jobs();
            assert_eq!(
                stale[stale_before..],
                [] as [String; 0],
                "grouped: {grouped}, elastic: {elastic}"
            );
        }
    });
}
