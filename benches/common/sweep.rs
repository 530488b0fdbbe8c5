//! The sweep: ranks as threads, nccl-tests' timing (warm-up, barrier, `-n` iterations
//! ending in a stream synchronize, averaged), a separate correctness check, and the table.

use std::io::Write;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use cudarc::driver::CudaContext;
use nccl_safe::{
    AsStream, CallContext, CommDevice, Communicator, Config, DataType, Group, Library, Provider,
    RecvBuffer, ReduceOp, SendBuffer, UniqueId, WindowFlags,
};

use super::data::{self, SENTINEL};
use super::options::{Average, Backend, Options, Register};
use super::ranks::{BoxError, CudaRank, Elem, HostRank, NcclMemRank, Rank, Result};
use super::report::{self, Collective, Measure, Measured, Row, RunInfo};

/// A barrier that every rank can break: a failing rank aborts it, so the others return
/// an error instead of waiting for ever.
pub struct Barrier {
    n: usize,
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Barrier {
    /// A barrier for `n` ranks.
    pub fn new(n: usize) -> Barrier {
        Barrier {
            n,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    /// Waits for every rank; an error once any rank aborted.
    pub fn wait(&self) -> Result<()> {
        let mut s = self.state.lock().map_err(|_| "barrier poisoned")?;
        if s.2 {
            return Err("another rank failed".into());
        }
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.n {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while s.1 == generation && !s.2 {
            s = self.cv.wait(s).map_err(|_| "barrier poisoned")?;
        }
        if s.2 {
            return Err("another rank failed".into());
        }
        Ok(())
    }

    /// Breaks the barrier for every rank.
    pub fn abort(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.2 = true;
        }
        self.cv.notify_all();
    }
}

/// What the ranks share: a barrier and slots to combine per-rank values.
struct Shared {
    barrier: Barrier,
    slots: Mutex<Vec<f64>>,
    ranks: usize,
}

impl Shared {
    /// Every rank passes its value; every rank gets `combine` of all of them.
    fn all_reduce(&self, rank: usize, value: f64, combine: fn(&[f64]) -> f64) -> Result<f64> {
        self.slots.lock().map_err(|_| "poisoned")?[rank] = value;
        self.barrier.wait()?;
        let out = combine(&self.slots.lock().map_err(|_| "poisoned")?);
        self.barrier.wait()?;
        Ok(out)
    }
}

fn combine_for(a: Average) -> fn(&[f64]) -> f64 {
    match a {
        Average::Rank0 => |v| v[0],
        Average::Mean => |v| v.iter().sum::<f64>() / v.len() as f64,
        Average::Min => |v| v.iter().cloned().fold(f64::MAX, f64::min),
        Average::Max => |v| v.iter().cloned().fold(0.0, f64::max),
    }
}

/// A message from rank 0 to the printing thread.
enum Msg {
    /// A collective's table starts.
    Start(Collective),
    /// One row.
    Row(Row),
    /// The collective is done.
    End(Collective),
    /// A line to print as is (a skipped collective).
    Note(String),
}

/// Buffers of one measurement.
enum Bufs<O> {
    OutOfPlace { send: O, recv: O },
    InPlace { buf: O },
}

/// The buffers a collective is issued on: the owned buffers themselves, or their
/// registrations (`-R`), which stand for them.
type BufRefs<'a, T> = Bufs<&'a mut (dyn RecvBuffer<T> + 'a)>;

/// Calls `f` with `owned`'s buffers as `-R` asks: as they are (`-R 0`), registered with
/// `ncclCommRegister` (`-R 1`), or as symmetric windows (`-R 2`, a collective: every rank
/// calls this in the same order). Deregistered when `f` returns. A measurement with an
/// empty buffer (nothing to register) runs unregistered.
fn with_registered<R: Rank, T: Elem, X>(
    rank: &R,
    owned: &mut Bufs<R::Owned<T>>,
    mode: Register,
    f: impl FnOnce(&mut BufRefs<'_, T>) -> Result<X>,
) -> Result<X> {
    let comm = rank.comm();
    let empty = match &*owned {
        Bufs::OutOfPlace { send, recv } => send.is_empty() || recv.is_empty(),
        Bufs::InPlace { buf } => buf.is_empty(),
    };
    let mode = if empty { Register::None } else { mode };
    let sym = WindowFlags::COLL_SYMMETRIC;
    match (mode, owned) {
        (Register::None, Bufs::OutOfPlace { send, recv }) => f(&mut Bufs::OutOfPlace {
            send: &mut **send,
            recv: &mut **recv,
        }),
        (Register::None, Bufs::InPlace { buf }) => f(&mut Bufs::InPlace { buf: &mut **buf }),
        (Register::Local, Bufs::OutOfPlace { send, recv }) => {
            let mut send = comm.register(&mut **send)?;
            let mut recv = comm.register(&mut **recv)?;
            f(&mut Bufs::OutOfPlace {
                send: &mut send,
                recv: &mut recv,
            })
        }
        (Register::Local, Bufs::InPlace { buf }) => {
            let mut buf = comm.register(&mut **buf)?;
            f(&mut Bufs::InPlace { buf: &mut buf })
        }
        (Register::Symmetric, Bufs::OutOfPlace { send, recv }) => {
            let mut send = comm.register_window(&mut **send, sym)?;
            let mut recv = comm.register_window(&mut **recv, sym)?;
            f(&mut Bufs::OutOfPlace {
                send: &mut send,
                recv: &mut recv,
            })
        }
        (Register::Symmetric, Bufs::InPlace { buf }) => {
            let mut buf = comm.register_window(&mut **buf, sym)?;
            f(&mut Bufs::InPlace { buf: &mut buf })
        }
    }
}

/// One collective on one rank's buffers, through the safe layer (and, for the in-place
/// all_to_all and sendrecv that it cannot express, through the raw table).
fn issue<R: Rank, T: Elem>(
    rank: &R,
    coll: Collective,
    bufs: &mut BufRefs<'_, T>,
    redop: ReduceOp,
    root: usize,
) -> Result<()> {
    let comm = rank.comm();
    let s = rank.stream();
    let n = comm.world_size();
    let me = comm.rank();
    match bufs {
        Bufs::OutOfPlace { send, recv } => {
            let (send, recv) = (&**send, &mut **recv);
            match coll {
                Collective::AllReduce => comm.all_reduce(send, recv, redop, s)?,
                Collective::AllGather => comm.all_gather(send, recv, s)?,
                Collective::Broadcast => comm.broadcast(send, recv, root, s)?,
                Collective::Reduce => comm.reduce(send, recv, redop, root, s)?,
                Collective::ReduceScatter => comm.reduce_scatter(send, recv, redop, s)?,
                Collective::AllToAll => comm.all_to_all(send, recv, s)?,
                Collective::Send => {
                    let mut g = Group::new();
                    g.push(comm.send_op(send, (me + 1) % n, s)?)?;
                    g.push(comm.recv_op(recv, (me + n - 1) % n, s)?)?;
                    g.end()?;
                }
                other => unmeasured(other),
            }
        }
        Bufs::InPlace { buf } => match coll {
            Collective::AllReduce => comm.all_reduce_in_place(&mut **buf, redop, s)?,
            Collective::AllGather => comm.all_gather_in_place(&mut **buf, s)?,
            Collective::Broadcast => comm.broadcast_in_place(&mut **buf, root, s)?,
            Collective::Reduce => comm.reduce_in_place(&mut **buf, redop, root, s)?,
            Collective::ReduceScatter => comm.reduce_scatter_in_place(&mut **buf, redop, s)?,
            Collective::AllToAll | Collective::Send => raw_in_place(rank, coll, &mut **buf)?,
            other => unmeasured(other),
        },
    }
    Ok(())
}

/// In-place all_to_all and sendrecv (send buffer == receive buffer, as nccl-tests runs
/// them): the safe layer has no in-place form for them, so the bench calls the function
/// table directly.
fn raw_in_place<R: Rank, T: Elem>(
    rank: &R,
    coll: Collective,
    buf: &mut (dyn RecvBuffer<T> + '_),
) -> Result<()> {
    let comm = rank.comm();
    let lib = comm.library();
    let t = lib.table();
    let (n, me) = (comm.world_size(), comm.rank());
    let len = buf.len();
    let dt = T::DATA_TYPE.to_raw();
    let raw_comm = comm.as_raw();
    let ctx = CallContext {
        comm: raw_comm,
        rank: Some(me),
        caller: None,
    };
    let stream = rank.stream().as_stream();
    // The guard records the stream's use of the buffer when dropped, after the calls.
    let (p, _guard) = buf.recv_ptr(stream);
    let stream = stream.raw();
    {
        match coll {
            Collective::AllToAll => {
                let f = lib.optional(t.ncclAlltoAll, "ncclAlltoAll")?;
                // SAFETY: `p` holds `len` = n x (len / n) elements of T in the memory this
                // provider reads (the safe layer checked the same buffer kind for the
                // out-of-place run); send == recv is NCCL's in-place form.
                let r = unsafe { f(p, p, len / n, dt, raw_comm, stream) };
                launched(comm, lib, "ncclAlltoAll", r, ctx)?;
            }
            _ => {
                let (next, prev) = (((me + 1) % n) as i32, ((me + n - 1) % n) as i32);
                // SAFETY: as above, `p` holds `len` elements; the send and the receive are
                // paired inside one group, and the group is always closed.
                unsafe {
                    lib.check("ncclGroupStart", (t.ncclGroupStart)(), ctx)?;
                    let a = (t.ncclSend)(p, len, dt, next, raw_comm, stream);
                    let b = (t.ncclRecv)(p, len, dt, prev, raw_comm, stream);
                    let end = (t.ncclGroupEnd)();
                    lib.check("ncclSend", a, ctx)?;
                    lib.check("ncclRecv", b, ctx)?;
                    launched(comm, lib, "ncclGroupEnd", end, ctx)?;
                }
            }
        }
        Ok(())
    }
}

/// The result `r` of a launching call `name`: NCCL's ncclInProgress on a non-blocking
/// communicator of two or more ranks (the crate's are: its group's thread launches the work)
/// is waited out, as the safe layer does, before the buffer's guard records the stream's use.
fn launched(
    comm: &Communicator,
    lib: &Library,
    name: &'static str,
    r: nccl_sys::bindings::ncclResult_t,
    ctx: CallContext,
) -> Result<()> {
    if r != nccl_sys::bindings::ncclInProgress {
        return Ok(lib.check(name, r, ctx)?);
    }
    let limit = std::time::Duration::from_secs(60);
    let until = Instant::now() + limit;
    while comm.async_error()? {
        if Instant::now() > until {
            let what = format!("the launch of {name}");
            return Err(nccl_safe::Error::Timeout {
                what,
                timeout: limit,
            }
            .into());
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// A buffer's contents, element by element (generated on demand, never stored as `f64`).
type Gen<'a> = Box<dyn Fn(usize) -> f64 + Send + Sync + 'a>;

/// The inputs of one measurement, per buffer (length and contents), and the expected output.
struct Plan<'a> {
    send: (usize, Gen<'a>),
    recv: (usize, Gen<'a>),
    in_place: (usize, Gen<'a>),
    /// Expected contents of the checked output range (index from its start).
    expected: Gen<'a>,
    /// Which range of the output buffer is checked (empty: nothing, e.g. reduce off-root).
    checked: std::ops::Range<usize>,
}

fn sentinel<'a>(len: usize) -> (usize, Gen<'a>) {
    (len, Box::new(|_| SENTINEL))
}

fn plan<'a>(
    coll: Collective,
    count: usize,
    n: usize,
    me: usize,
    op: ReduceOp,
    root: usize,
    integer: bool,
) -> Plan<'a> {
    let block = coll.counts(count, n).param;
    let b = block.max(1);
    let red_in = move |i| data::reduce_input(op, me, i, n);
    let red_out = move |i| data::reduce_expected(op, i, n, integer);
    let mv = data::move_input;
    match coll {
        Collective::AllReduce | Collective::Reduce => Plan {
            send: (count, Box::new(red_in)),
            recv: sentinel(count),
            in_place: (count, Box::new(red_in)),
            expected: Box::new(red_out),
            checked: if coll == Collective::Reduce && me != root {
                0..0
            } else {
                0..count
            },
        },
        Collective::Broadcast => Plan {
            send: (count, Box::new(move |i| mv(root, i))),
            recv: sentinel(count),
            in_place: if me == root {
                (count, Box::new(move |i| mv(root, i)))
            } else {
                sentinel(count)
            },
            expected: Box::new(move |i| mv(root, i)),
            checked: 0..count,
        },
        Collective::AllGather => Plan {
            send: (block, Box::new(move |j| mv(me, j))),
            recv: sentinel(block * n),
            in_place: (
                block * n,
                Box::new(move |k| if k / b == me { mv(me, k % b) } else { SENTINEL }),
            ),
            expected: Box::new(move |k| mv(k / b, k % b)),
            checked: 0..block * n,
        },
        Collective::ReduceScatter => Plan {
            send: (block * n, Box::new(red_in)),
            recv: sentinel(block),
            in_place: (block * n, Box::new(red_in)),
            expected: Box::new(move |j| red_out(me * block + j)),
            checked: 0..block,
        },
        Collective::AllToAll => Plan {
            send: (block * n, Box::new(move |k| mv(me, k))),
            recv: sentinel(block * n),
            in_place: (block * n, Box::new(move |k| mv(me, k))),
            expected: Box::new(move |k| mv(k / b, me * block + k % b)),
            checked: 0..block * n,
        },
        Collective::Send => Plan {
            send: (count, Box::new(move |i| mv(me, i))),
            recv: sentinel(count),
            in_place: (count, Box::new(move |i| mv(me, i))),
            expected: Box::new(move |i| mv((me + n - 1) % n, i)),
            checked: 0..count,
        },
        other => unmeasured(other),
    }
}

/// A collective outside [`report::MEASURED`], which options never pick.
fn unmeasured(c: Collective) -> ! {
    unreachable!("the bandwidth bench does not measure {c}")
}

fn to_elems<T: Elem>((len, f): &(usize, Gen<'_>)) -> Vec<T> {
    (0..*len).map(|i| T::from_f64(f(i))).collect()
}

/// Buffers for a measurement, filled per `plan`.
fn buffers<R: Rank, T: Elem>(rank: &R, p: &Plan<'_>, in_place: bool) -> Result<Bufs<R::Owned<T>>> {
    Ok(if in_place {
        Bufs::InPlace {
            buf: rank.upload(to_elems::<T>(&p.in_place))?,
        }
    } else {
        Bufs::OutOfPlace {
            send: rank.upload(to_elems::<T>(&p.send))?,
            recv: rank.upload(to_elems::<T>(&p.recv))?,
        }
    })
}

/// Settings that do not change during a sweep.
struct Ctx<'a> {
    opts: &'a Options,
    shared: &'a Shared,
    tx: Option<mpsc::Sender<Msg>>,
}

/// nccl-tests' `BenchTime` for one size and one placement: returns the time and #wrong.
fn bench_time<R: Rank, T: Elem>(
    rank: &R,
    cx: &Ctx<'_>,
    coll: Collective,
    count: usize,
    in_place: bool,
) -> Result<(f64, Option<u64>)> {
    let o = cx.opts;
    let comm = rank.comm();
    let (n, me) = (comm.world_size(), comm.rank());
    let p = plan(coll, count, n, me, o.redop, o.root, T::INTEGER);
    let mut bufs = buffers::<R, T>(rank, &p, in_place)?;
    // Registration (`-R`) is set up before the clock starts, as nccl-tests does.
    let seconds = with_registered(rank, &mut bufs, o.register, |regs| {
        // One untimed operation, then every rank starts the timed loop together.
        issue(rank, coll, regs, o.redop, o.root)?;
        rank.synchronize()?;
        cx.shared.barrier.wait()?;
        let start = Instant::now();
        for _ in 0..o.iters {
            issue(rank, coll, regs, o.redop, o.root)?;
            if o.blocking {
                rank.synchronize()?;
            }
        }
        rank.synchronize()?;
        Ok(start.elapsed().as_secs_f64() / o.iters as f64)
    })?;
    let seconds = cx.shared.all_reduce(me, seconds, combine_for(o.average))?;

    let mut wrong = None;
    // nccl-tests times in-place sendrecv (send buffer == receive buffer) but does not
    // check it: the result of a buffer both sent and overwritten is not defined.
    let checks = if in_place && coll == Collective::Send {
        0
    } else {
        o.check
    };
    for _ in 0..checks {
        // Fresh inputs with a known result, one operation, then compare.
        match &mut bufs {
            Bufs::InPlace { buf } => rank.write(buf, &to_elems::<T>(&p.in_place))?,
            Bufs::OutOfPlace { send, recv } => {
                rank.write(send, &to_elems::<T>(&p.send))?;
                rank.write(recv, &to_elems::<T>(&p.recv))?;
            }
        }
        cx.shared.barrier.wait()?;
        with_registered(rank, &mut bufs, o.register, |regs| {
            issue(rank, coll, regs, o.redop, o.root)?;
            rank.synchronize()
        })?;
        let out = match &bufs {
            Bufs::InPlace { buf } => rank.download::<T>(buf)?,
            Bufs::OutOfPlace { recv, .. } => rank.download::<T>(recv)?,
        };
        // In place, reduce_scatter leaves its block at this rank's offset of the buffer.
        let offset = if in_place && coll == Collective::ReduceScatter {
            me * p.checked.len()
        } else {
            0
        };
        let range = p.checked.start + offset..p.checked.end + offset;
        let tolerant = o.redop == ReduceOp::Avg && !T::INTEGER && coll.reduces();
        let mine = data::count_wrong::<T>(&out[range], &p.expected, tolerant);
        let total = cx.shared.all_reduce(me, mine as f64, |v| v.iter().sum())? as u64;
        wrong = Some(total);
        if total != 0 {
            break;
        }
    }
    Ok((seconds, wrong))
}

/// Every collective of the sweep, on one rank.
fn sweep_rank<R: Rank, T: Elem>(rank: &R, cx: &Ctx<'_>) -> Result<()> {
    let o = cx.opts;
    let comm = rank.comm();
    let n = comm.world_size();
    let elem = T::DATA_TYPE.size();
    let send = |m: Msg| {
        if let Some(tx) = &cx.tx {
            let _ = tx.send(m);
        }
    };
    for &coll in &o.collectives {
        if coll == Collective::AllToAll && comm.library().table().ncclAlltoAll.is_none() {
            send(Msg::Note(format!(
                "# all_to_all: skipped: NCCL {} has no ncclAlltoAll (2.28+)",
                comm.library().version()
            )));
            continue;
        }
        send(Msg::Start(coll));
        cx.shared.barrier.wait()?;
        // Warm-up at the largest and the smallest size, as nccl-tests does.
        for bytes in [o.max_bytes, o.min_bytes] {
            let p = plan(
                coll,
                bytes / elem,
                n,
                comm.rank(),
                o.redop,
                o.root,
                T::INTEGER,
            );
            let mut bufs = buffers::<R, T>(rank, &p, false)?;
            with_registered(rank, &mut bufs, o.register, |regs| {
                for _ in 0..o.warmup_iters {
                    issue(rank, coll, regs, o.redop, o.root)?;
                }
                rank.synchronize()
            })?;
        }
        for bytes in o.sizes() {
            let count = bytes / elem;
            let (t_oop, w_oop) = bench_time::<R, T>(rank, cx, coll, count, false)?;
            let (t_ip, w_ip) = bench_time::<R, T>(rank, cx, coll, count, true)?;
            let c = coll.counts(count, n);
            let measure = |t: f64, w| {
                let (algbw, busbw) = coll.bandwidth(c.param, elem, t, n);
                Measure {
                    time_us: t * 1.0e6,
                    algbw,
                    busbw,
                    wrong: w,
                }
            };
            send(Msg::Row(Row {
                collective: coll,
                size: c.send.max(c.recv) * elem,
                count: c.param,
                dtype: T::DATA_TYPE.name(),
                redop: if coll.reduces() {
                    o.redop.name()
                } else {
                    "none"
                },
                root: if coll.has_root() { o.root as i64 } else { -1 },
                out_of_place: measure(t_oop, w_oop),
                in_place: measure(t_ip, w_ip),
            }));
        }
        send(Msg::End(coll));
    }
    Ok(())
}

/// The sweep on `rank`'s own buffers, or (`-R 1`, `-R 2`) on buffers from `ncclMemAlloc`.
fn sweep_alloc<R: Rank>(rank: &R, cx: &Ctx<'_>) -> Result<()>
where
    R::Stream: Clone + Into<nccl_safe::Stream>,
{
    match cx.opts.register {
        Register::None => sweep_typed(rank, cx),
        Register::Local | Register::Symmetric => sweep_typed(&NcclMemRank(rank), cx),
    }
}

fn sweep_typed<R: Rank>(rank: &R, cx: &Ctx<'_>) -> Result<()> {
    match cx.opts.dtype {
        DataType::Int8 => sweep_rank::<R, i8>(rank, cx),
        DataType::Uint8 => sweep_rank::<R, u8>(rank, cx),
        DataType::Int32 => sweep_rank::<R, i32>(rank, cx),
        DataType::Uint32 => sweep_rank::<R, u32>(rank, cx),
        DataType::Int64 => sweep_rank::<R, i64>(rank, cx),
        DataType::Uint64 => sweep_rank::<R, u64>(rank, cx),
        DataType::Float16 => sweep_rank::<R, half::f16>(rank, cx),
        DataType::Float32 => sweep_rank::<R, f32>(rank, cx),
        DataType::Float64 => sweep_rank::<R, f64>(rank, cx),
        DataType::Bfloat16 => sweep_rank::<R, half::bf16>(rank, cx),
        other => Err(format!("data type {other:?} is not supported by the bench").into()),
    }
}

/// Where the sweep runs, decided before any rank starts.
enum Target {
    Host,
    Cuda(Vec<Arc<CudaContext>>),
}

/// The library and devices for `--backend`; `note` says why auto fell back to the host.
fn resolve(opts: &Options) -> Result<(Arc<Library>, Target, Option<String>)> {
    let try_cuda = || -> Result<(Arc<Library>, Target)> {
        let lib = Library::load()?;
        let count = quiet_cuda(CudaContext::device_count)??;
        if count <= 0 {
            return Err("no CUDA device found".into());
        }
        let want = opts.ranks.unwrap_or(count as usize);
        if want > count as usize {
            return Err(format!(
                "-g {want} asks for more ranks than the {count} GPUs (one rank per GPU)"
            )
            .into());
        }
        let ctxs = (0..want)
            .map(|i| quiet_cuda(|| CudaContext::new(i))?.map_err(BoxError::from))
            .collect::<Result<Vec<_>>>()?;
        for ctx in &ctxs {
            set_event_tracking(ctx, opts.event_tracking);
        }
        Ok((lib, Target::Cuda(ctxs)))
    };
    match opts.backend {
        Backend::Host => Ok((Library::host(), Target::Host, None)),
        Backend::Nccl => {
            let (lib, t) = try_cuda()?;
            Ok((lib, t, None))
        }
        Backend::Auto => match try_cuda() {
            Ok((lib, t)) => Ok((lib, t, None)),
            Err(e) => Ok((Library::host(), Target::Host, Some(e.to_string()))),
        },
    }
}

/// Turns cudarc's event tracking on or off for the buffers `ctx` allocates from now on
/// (`-E`). Called before any stream or buffer of the bench exists.
pub fn set_event_tracking(ctx: &CudaContext, on: bool) {
    if on {
        // SAFETY: no buffer of this context was created with tracking off: this runs
        // before the bench allocates anything.
        unsafe { ctx.enable_event_tracking() };
    } else {
        // SAFETY: cudarc's contract for untracked buffers is that the user orders their
        // uses across streams. Each rank allocates, fills, uses in collectives, reads back
        // and frees every buffer on its one stream, so every use is ordered by that stream
        // and no buffer is touched by two streams.
        unsafe { ctx.disable_event_tracking() };
    }
}

/// The header line that says whether cudarc's event tracking is on.
pub fn event_tracking_line(host: bool, on: bool) -> String {
    match (host, on) {
        (true, _) => "# cudarc event tracking: n/a (host provider: no CUDA buffers)".into(),
        (false, false) => {
            "# cudarc event tracking: off (raw device pointers, as nccl-tests; -E 1 turns it on)"
                .into()
        }
        (false, true) => {
            "# cudarc event tracking: on (-E 1: cudarc records and waits on events around every use of a buffer)"
                .into()
        }
    }
}

/// Runs a cudarc call that may panic when the CUDA driver library is absent, without
/// printing the panic.
pub fn quiet_cuda<R>(f: impl FnOnce() -> R + std::panic::UnwindSafe) -> Result<R> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(f);
    std::panic::set_hook(hook);
    out.map_err(|p| {
        let text = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "CUDA is not available".into());
        BoxError::from(format!("CUDA driver unavailable: {text}"))
    })
}

/// The results of a sweep.
pub struct Outcome {
    /// What it ran on.
    pub info: RunInfo,
    /// Every row, all collectives.
    pub rows: Vec<Row>,
}

/// Runs the sweep of `opts`, printing the header, one table per collective and its footer
/// to `out` as results arrive.
pub fn run(opts: &Options, out: &mut dyn Write) -> Result<Outcome> {
    let (lib, target, note) = resolve(opts)?;
    let ranks = match &target {
        Target::Host => opts.ranks.unwrap_or(4),
        Target::Cuda(c) => c.len(),
    };
    if opts.root >= ranks {
        return Err(format!("-r {} is not a rank of {ranks} ranks", opts.root).into());
    }
    let devices: Vec<String> = match &target {
        Target::Host => vec!["host".to_string(); ranks],
        Target::Cuda(ctxs) => ctxs
            .iter()
            .map(|c| {
                c.name()
                    .unwrap_or_else(|_| format!("CUDA device {}", c.ordinal()))
            })
            .collect(),
    };
    let info = RunInfo {
        backend: match lib.provider() {
            Provider::Host => "host",
            _ => "nccl",
        },
        nccl_version: lib.version().to_string(),
        devices,
        ranks,
        iters: opts.iters,
        warmup_iters: opts.warmup_iters,
    };
    print_header(out, opts, &info, &lib, note.as_deref())?;

    let id = UniqueId::new_with(&lib)?;
    let shared = Shared {
        barrier: Barrier::new(ranks),
        slots: Mutex::new(vec![0.0; ranks]),
        ranks,
    };
    let (tx, rx) = mpsc::channel::<Msg>();
    let mut rows = Vec::new();
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let cx = Ctx {
                    opts,
                    shared: &shared,
                    tx: (r == 0).then(|| tx.clone()),
                };
                let target = &target;
                let lib = &lib;
                scope.spawn(move || -> Result<()> {
                    let result = rank_main(r, &cx, target, lib, &id);
                    if result.is_err() {
                        cx.shared.barrier.abort();
                    }
                    result
                })
            })
            .collect();
        drop(tx);
        let mut table: Vec<Row> = Vec::new();
        for msg in rx {
            let res = match msg {
                Msg::Start(c) => writeln!(
                    out,
                    "#\n# Collective test starting: {}\n#\n{}",
                    c.bench_name(),
                    report::table_header()
                ),
                Msg::Row(row) => {
                    let w = writeln!(out, "{}", report::format_row(&row));
                    table.push(row);
                    w
                }
                Msg::End(c) => {
                    let w = writeln!(
                        out,
                        "{}\n# Collective test concluded: {}",
                        report::table_footer(&table),
                        c.bench_name()
                    );
                    rows.append(&mut table);
                    w
                }
                Msg::Note(text) => writeln!(out, "{text}"),
            };
            let _ = res.and_then(|_| out.flush());
        }
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    let _ = shared.ranks;
    // The first real error (not "another rank failed") is the one to report.
    let mut errors: Vec<BoxError> = results.into_iter().filter_map(|r| r.err()).collect();
    if !errors.is_empty() {
        let pos = errors
            .iter()
            .position(|e| e.to_string() != "another rank failed")
            .unwrap_or(0);
        return Err(errors.swap_remove(pos));
    }
    writeln!(
        out,
        "# All collectives: {} wrong values, average bus bandwidth {} GB/s",
        report::total_wrong(&rows),
        report::format_g(report::average_busbw(&rows))
    )?;
    Ok(Outcome { info, rows })
}

fn rank_main(
    r: usize,
    cx: &Ctx<'_>,
    target: &Target,
    lib: &Arc<Library>,
    id: &UniqueId,
) -> Result<()> {
    let ranks = cx.shared.ranks;
    match target {
        Target::Host => {
            let comm =
                Communicator::init_rank_in(lib, &CommDevice::Host, ranks, r, id, &Config::new())?;
            sweep_alloc(&HostRank { comm }, cx)
        }
        Target::Cuda(ctxs) => {
            let ctx = Arc::clone(&ctxs[r]);
            ctx.bind_to_thread()?;
            let stream = ctx.new_stream()?;
            let device = CommDevice::Cuda(Arc::clone(&ctx));
            let comm = Communicator::init_rank_in(lib, &device, ranks, r, id, &Config::new())?;
            sweep_alloc(&CudaRank { comm, stream, ctx }, cx)
        }
    }
}

fn print_header(
    out: &mut dyn Write,
    o: &Options,
    info: &RunInfo,
    lib: &Library,
    note: Option<&str>,
) -> Result<()> {
    writeln!(out, "# nccl-safe bandwidth bench (nccl-tests layout)")?;
    match lib.provider() {
        Provider::Host => {
            writeln!(
                out,
                "# Backend: host provider (in-process NCCL API on CPU memory, ranks as threads): no GPU is used"
            )?;
            if let Some(why) = note {
                writeln!(out, "# (no GPU run: {why})")?;
            }
        }
        _ => writeln!(
            out,
            "# Backend: NVIDIA NCCL {}",
            lib.path()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        )?,
    }
    writeln!(out, "# NCCL version {}", info.nccl_version)?;
    writeln!(
        out,
        "{}",
        event_tracking_line(lib.provider() == Provider::Host, o.event_tracking)
    )?;
    writeln!(
        out,
        "# nThread 1 nGpus {} minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} agg iters: 1 validation: {} graph: 0 blocking: {}",
        info.ranks,
        o.min_bytes,
        o.max_bytes,
        if o.step_factor > 1 {
            format!("{}(factor)", o.step_factor)
        } else {
            format!("{}(bytes)", o.step_bytes)
        },
        o.warmup_iters,
        o.iters,
        o.check,
        o.blocking as u8
    )?;
    match o.register {
        Register::None => {}
        Register::Local => writeln!(
            out,
            "# Buffers: ncclMemAlloc, registered with ncclCommRegister (-R 1)"
        )?,
        Register::Symmetric => writeln!(
            out,
            "# Buffers: ncclMemAlloc, registered as symmetric windows (-R 2)"
        )?,
    }
    writeln!(out, "#\n# Using devices")?;
    let pid = std::process::id();
    for (r, d) in info.devices.iter().enumerate() {
        writeln!(out, "#  Rank {r:2} Group  0 Pid {pid:6} device {r:2} {d}")?;
    }
    Ok(())
}
