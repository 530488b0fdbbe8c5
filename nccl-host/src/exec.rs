//! Posting, executing and waiting for operations (collectives, send/recv, rendezvous).

use std::sync::Arc;
use std::time::Instant;

use nccl_sys::bindings::*;
use nccl_sys::{Block, BlockSource, Extent, Sender};

use super::dtype::{self, RedKind};
use super::shm::{P2pWork, Segment};
use super::state::{
    lock, notify, wait, wait_limit, CollPost, Collective, CommState, CommWorld, Fail, Global,
    Handle, OpKey, OpState, PostedOp,
};

/// An operation queued by a thread (inside a group, or the single op of a plain call).
#[derive(Debug, Clone)]
pub(crate) enum Item {
    /// A collective, or one side of a send/recv pair, posted under `key` by handle `h`,
    /// rank `rank` of `clique`.
    Op {
        h: Handle,
        clique: u64,
        rank: i32,
        key: OpKey,
        post: CollPost,
    },
    /// A handle whose init/split/shrink rendezvous must complete before group end returns.
    Handle(Handle),
}

/// What a posted item waits on.
#[derive(Debug, Clone)]
enum Wait {
    /// A collective's posted op, and this rank's post in it.
    Op(u64, OpKey, usize),
    Handle(Handle),
}

fn aborted_fail(g: &Global, clique: u64) -> Option<Fail> {
    match g.cliques.get(&clique) {
        None => Some(Fail::new(
            ncclRemoteError,
            "every rank of this communicator was destroyed or aborted",
        )),
        Some(c) => c.aborted.clone(),
    }
}

/// Whether the posts of a complete op agree: a collective's on the call, a send/recv
/// pair's on its count and data type.
fn consistent(key: OpKey, posts: &[CollPost]) -> Result<(), Fail> {
    let a = &posts[0];
    if let OpKey::P2p(src, dst, _) = key {
        let b = &posts[1];
        if a.count == b.count && a.dtype == b.dtype {
            return Ok(());
        }
        let side = |p: &CollPost| format!("count={}, {}", p.count, dtype::name(p.dtype));
        let (sent, received) = (side(a), side(b));
        let m = format!(
            "ncclSend from rank {src} ({sent}) does not match ncclRecv on rank {dst} ({received})"
        );
        return Err(Fail::new(ncclInvalidUsage, m));
    }
    let call = |p: &CollPost| {
        let dt = dtype::name(p.dtype);
        format!("{:?}(count={}, {dt}, root={})", p.kind, p.count, p.root)
    };
    for (r, p) in posts.iter().enumerate() {
        if p.kind != a.kind || p.count != a.count || p.dtype != a.dtype || p.root != a.root {
            let (first, this) = (call(a), call(p));
            let m = format!(
                "ranks disagree on a collective: rank 0 called {first} but rank {r} called {this}"
            );
            return Err(Fail::new(ncclInvalidUsage, m));
        }
        // (A PreMulSum's scalar may differ per rank: the kind alone must agree.)
        if a.kind.reduces() && p.red != a.red {
            let m = format!(
                "ranks disagree on the reduction ({:?} vs {:?})",
                a.red, p.red
            );
            return Err(Fail::new(ncclInvalidUsage, m));
        }
    }
    Ok(())
}

/// The clique an item posts to; an aborted one fails the post.
fn open_clique(g: &mut Global, clique: u64) -> Result<&mut CommWorld, Fail> {
    if let Some(f) = aborted_fail(g, clique) {
        return Err(f);
    }
    g.cliques
        .get_mut(&clique)
        .ok_or_else(|| Fail::new(ncclInternalError, "clique vanished"))
}

/// Posts `item`; the posts of the op it completes are the work this thread then runs.
fn post(g: &mut Global, item: Item) -> Result<(Wait, Option<Vec<CollPost>>), Fail> {
    let (clique, rank, key, post) = match item {
        Item::Handle(h) => return Ok((Wait::Handle(h), None)),
        Item::Op {
            clique,
            rank,
            key,
            post,
            ..
        } => (clique, rank, key, post),
    };
    let cl = open_clique(g, clique)?;
    // A collective's posts by rank; a pair's send, then its receive.
    let (n, at) = match key {
        OpKey::Coll(_) => (cl.nranks as usize, rank as usize),
        OpKey::P2p(..) => (2, usize::from(post.kind == Collective::Recv)),
    };
    let op = cl.ops.entry(key).or_insert_with(|| PostedOp {
        posts: vec![None; n],
        state: OpState::Waiting,
        waiters: n,
        withdrawn: vec![false; n],
    });
    if op.posts.get(at).is_none_or(|p| p.is_some()) {
        return Err(Fail::new(ncclInternalError, "rank posted twice"));
    }
    op.posts[at] = Some(post);
    let w = Wait::Op(clique, key, at);
    // A rank that withdrew (its revoke) never completes the collective.
    if op.posts.iter().any(Option::is_none) || op.withdrawn.iter().any(|&w| w) {
        return Ok((w, None));
    }
    let posts: Vec<CollPost> = op.posts.iter().flatten().cloned().collect();
    if let Err(f) = consistent(key, &posts) {
        op.state = OpState::Done(Err(f));
        notify();
        return Ok((w, None));
    }
    op.state = OpState::Executing;
    Ok((w, Some(posts)))
}

/// Output bytes reduced per step: the partial result stays in L1 while every rank's
/// input for it streams through once.
const REDUCE_CHUNK: usize = 32 << 10;
/// Bytes copied per step when one source feeds several destinations, so the source is
/// read from memory once and from cache for the other destinations.
const COPY_CHUNK: usize = 256 << 10;
/// Collectives that touch at least this many bytes per rank are split across threads.
const PARALLEL_MIN: usize = 4 << 20;

/// A byte range of host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    addr: usize,
    len: usize,
}

impl Span {
    fn new(addr: usize, len: usize) -> Span {
        Span { addr, len }
    }

    fn end(self) -> usize {
        self.addr.saturating_add(self.len)
    }

    /// The `len` bytes starting `off` bytes in.
    fn at(self, off: usize, len: usize) -> Span {
        Span::new(self.addr.wrapping_add(off), len)
    }

    fn overlaps(self, o: Span) -> bool {
        self.len > 0 && o.len > 0 && self.addr < o.end() && o.addr < self.end()
    }
}

/// The bytes of `s`.
///
/// # Safety
/// `s` lies in a buffer posted by a rank that is still waiting for this operation (or in
/// memory this module owns), and nothing writes to it while the slice is alive.
unsafe fn bytes<'a>(s: Span) -> &'a [u8] {
    if s.len == 0 {
        return &[];
    }
    // SAFETY: by this function's contract `s` is readable and not written meanwhile;
    // `s.len > 0` so `s.addr` is a posted, non-null pointer.
    unsafe { core::slice::from_raw_parts(s.addr as *const u8, s.len) }
}

/// Copies `src` to address `dst`.
///
/// # Safety
/// `dst` starts `src.len()` writable bytes of a buffer posted by a rank that is still
/// waiting for this operation; they do not overlap `src` and nothing else reads or writes
/// them meanwhile.
unsafe fn write(dst: usize, src: &[u8]) {
    if !src.is_empty() {
        // SAFETY: by this function's contract the destination is writable, exclusively
        // ours, and disjoint from `src`.
        unsafe { core::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
    }
}

/// How many threads share a collective that touches `bytes` bytes per rank: one below
/// [`PARALLEL_MIN`], else up to the machine's parallelism with at least half of
/// `PARALLEL_MIN` each.
fn threads_for(bytes: usize) -> usize {
    static PARALLELISM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if bytes < PARALLEL_MIN {
        return 1;
    }
    let avail =
        *PARALLELISM.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    avail.min(bytes / (PARALLEL_MIN / 2)).max(1)
}

/// The failure of an operation whose execution panicked (a bug).
fn panicked() -> Fail {
    Fail::new(ncclInternalError, "panic while executing an operation")
}

/// Runs `f` over a partition of `0..len` into ranges that start at multiples of `align`:
/// on this thread alone for small `len * unit` bytes, else spread over scoped threads
/// (this one included). A thread that cannot be started leaves its range to this thread.
/// Returns the first error.
fn for_parts(
    len: usize,
    unit: usize,
    align: usize,
    f: impl Fn(core::ops::Range<usize>) -> Result<(), Fail> + Sync,
) -> Result<(), Fail> {
    let t = threads_for(len.saturating_mul(unit));
    let align = align.max(1);
    let per = len.div_ceil(align).div_ceil(t.max(1)) * align;
    if t <= 1 || per >= len {
        return f(0..len);
    }
    let parts: Vec<core::ops::Range<usize>> = (0..t)
        .map(|i| (i * per).min(len)..((i + 1) * per).min(len))
        .filter(|r| !r.is_empty())
        .collect();
    let f = &f;
    std::thread::scope(|s| {
        let spawn = |p: &core::ops::Range<usize>| {
            let p = p.clone();
            std::thread::Builder::new().spawn_scoped(s, move || f(p))
        };
        let threads: Vec<_> = parts[1..].iter().map(spawn).collect();
        let mut res = f(parts[0].clone());
        for (p, thread) in parts[1..].iter().zip(threads) {
            res = res.and(match thread {
                Ok(h) => h.join().unwrap_or_else(|_| Err(panicked())),
                Err(_) => f(p.clone()),
            });
        }
        res
    })
}

/// A reduction over `elems` elements of every rank's input, with each output holding a
/// contiguous part of the result.
struct Reduction<'a> {
    dt: ncclDataType_t,
    kind: RedKind,
    es: usize,
    elems: usize,
    /// One `elems * es`-byte span per rank, in rank order.
    inputs: Vec<Span>,
    /// Destination and the index of the first result element it holds, in rank order.
    outputs: Vec<(Span, usize)>,
    scalars: &'a [Vec<u8>],
}

fn bad_reduce() -> Fail {
    Fail::new(
        ncclInternalError,
        "malformed reduction (short input or PreMulSum scalar)",
    )
}

impl Reduction<'_> {
    /// Whether reducing chunk by chunk straight from the posted inputs into the posted
    /// outputs gives the same bytes as reading every input before writing any output:
    /// outputs are pairwise disjoint, and an output overlaps an input only where both
    /// hold the same element index (in-place forms), so each byte is read and written
    /// within one chunk, reads first.
    fn direct_ok(&self) -> bool {
        let es = self.es;
        for (i, &(o, first)) in self.outputs.iter().enumerate() {
            if self.outputs[..i].iter().any(|&(p, _)| p.overlaps(o)) {
                return false;
            }
            for &inp in &self.inputs {
                if inp.overlaps(o) && inp.addr.checked_add(first * es) != Some(o.addr) {
                    return false;
                }
            }
        }
        true
    }

    /// Writes result elements `lo..lo + acc.len() / es` (in `acc`) to every output that
    /// holds some of them.
    ///
    /// # Safety
    /// The outputs are posted buffers of waiting ranks, pairwise disjoint and disjoint
    /// from `acc`; no one else reads or writes the written bytes meanwhile.
    unsafe fn write_out(&self, lo: usize, acc: &[u8]) {
        let es = self.es;
        let hi = lo + acc.len() / es;
        for &(o, first) in &self.outputs {
            let (a, b) = (lo.max(first), hi.min(first + o.len / es));
            if a < b {
                // SAFETY: forwarded to the caller; `a..b` lies inside output `o`.
                unsafe {
                    write(
                        o.addr + (a - first) * es,
                        &acc[(a - lo) * es..(b - lo) * es],
                    )
                };
            }
        }
    }

    /// Reduces result elements `range` chunk by chunk from the posted inputs straight to
    /// the outputs.
    ///
    /// # Safety
    /// [`Reduction::direct_ok`] holds, the spans are posted buffers of waiting ranks, and
    /// no other thread touches the bytes of `range` (in any input or output) meanwhile.
    unsafe fn run_direct(&self, range: core::ops::Range<usize>) -> Result<(), Fail> {
        let es = self.es;
        let chunk = (REDUCE_CHUNK / es).max(1);
        let mut acc = vec![0u8; chunk.min(range.len()) * es];
        let mut lo = range.start;
        while lo < range.end {
            let hi = (lo + chunk).min(range.end);
            let out = &mut acc[..(hi - lo) * es];
            {
                let ins: smallvec::SmallVec<[&[u8]; 8]> = self
                    .inputs
                    .iter()
                    // SAFETY: the caller guarantees the inputs are readable and that
                    // nothing writes this chunk while the slices live (outputs of this
                    // chunk are written below, after they are dropped).
                    .map(|s| unsafe { bytes(s.at(lo * es, (hi - lo) * es)) })
                    .collect();
                if !dtype::reduce(self.dt, self.kind, &ins, self.scalars, out) {
                    return Err(bad_reduce());
                }
            }
            // SAFETY: every input byte of this chunk has been read; by `direct_ok` the
            // outputs overlap inputs only at this chunk's own elements, and `acc` is ours.
            unsafe { self.write_out(lo, out) };
            lo = hi;
        }
        Ok(())
    }

    /// Runs the reduction: directly (split across threads when large) when the buffers
    /// allow it, else from copies of the inputs into a full result written rank by rank.
    fn run(&self) -> Result<(), Fail> {
        let es = self.es;
        if self.elems == 0 || es == 0 || self.inputs.is_empty() {
            return Ok(());
        }
        if self.direct_ok() {
            let chunk = (REDUCE_CHUNK / es).max(1);
            // SAFETY: `direct_ok` holds; every rank waits for this op, so its buffers are
            // alive; the parts are disjoint element ranges, and by `direct_ok` the bytes
            // of one element range (inputs and outputs) are disjoint from any other's.
            return for_parts(self.elems, es, chunk, |r| unsafe { self.run_direct(r) });
        }
        // SAFETY: the inputs are posted by waiting ranks; nothing is written yet.
        let copies: Vec<Vec<u8>> = self
            .inputs
            .iter()
            .map(|&s| unsafe { bytes(s) }.to_vec())
            .collect();
        let ins: Vec<&[u8]> = copies.iter().map(Vec::as_slice).collect();
        let mut result = vec![0u8; self.elems * es];
        if !dtype::reduce(self.dt, self.kind, &ins, self.scalars, &mut result) {
            return Err(bad_reduce());
        }
        for &(o, first) in &self.outputs {
            let from = first * es;
            // SAFETY: `o` is a posted output of a waiting rank and `result` is ours;
            // outputs are written in rank order, like the all-at-once form.
            unsafe { write(o.addr, &result[from..from + o.len]) };
        }
        Ok(())
    }
}

/// One copy of a collective: `src` (inside `sources[src_buf]`) to `dst`, of equal length.
#[derive(Debug, Clone, Copy)]
struct Move {
    src: Span,
    dst: usize,
}

/// Whether performing `moves` straight from the posted sources, in any order, gives the
/// same bytes as reading every source before writing anything: each destination either
/// is its own source (nothing to do) or is disjoint from every source and from every
/// other destination.
fn moves_direct_ok(sources: &[Span], moves: &[Move]) -> bool {
    let mut spans: Vec<(Span, bool)> = sources
        .iter()
        .filter(|s| s.len > 0)
        .map(|&s| (s, false))
        .collect();
    spans.extend(
        moves
            .iter()
            .filter(|m| m.src.len > 0 && m.dst != m.src.addr)
            .map(|m| (Span::new(m.dst, m.src.len), true)),
    );
    spans.sort_unstable_by_key(|(s, _)| s.addr);
    // Sweep by start address: a span overlaps an earlier one exactly when it starts
    // before the furthest end seen so far of that kind.
    let (mut src_end, mut dst_end) = (0usize, 0usize);
    for (s, is_dst) in spans {
        if s.addr < dst_end || (is_dst && s.addr < src_end) {
            return false;
        }
        if is_dst {
            dst_end = dst_end.max(s.end());
        } else {
            src_end = src_end.max(s.end());
        }
    }
    true
}

/// Performs `moves` (listed in rank order of their destinations) with the semantics of
/// reading every source in `sources` before writing any destination.
fn run_moves(sources: &[Span], mut moves: Vec<Move>) {
    if moves_direct_ok(sources, &moves) {
        // Any order gives the same bytes: group the destinations of each source so a
        // source chunk is read from memory once for all of them.
        moves.retain(|m| m.src.len > 0 && m.dst != m.src.addr);
        moves.sort_by_key(|m| (m.src.addr, m.src.len));
        for run in moves.chunk_by(|a, b| a.src == b.src) {
            let src = run[0].src;
            let step = if run.len() > 1 { COPY_CHUNK } else { src.len };
            let mut off = 0;
            while off < src.len {
                let n = step.min(src.len - off);
                // SAFETY: `src` lies in a posted source of a waiting rank and, by
                // `moves_direct_ok`, no destination overlaps any source.
                let data = unsafe { bytes(src.at(off, n)) };
                for m in run {
                    // SAFETY: `m.dst` starts `src.len` bytes of a posted destination of a
                    // waiting rank, disjoint from every source and every other destination.
                    unsafe { write(m.dst + off, data) };
                }
                off += n;
            }
        }
        return;
    }
    // SAFETY: the sources are posted by waiting ranks; nothing is written yet.
    let copies: Vec<Vec<u8>> = sources
        .iter()
        .map(|&s| unsafe { bytes(s) }.to_vec())
        .collect();
    for m in moves {
        let Some((buf, base)) = sources
            .iter()
            .zip(&copies)
            .find(|(s, _)| m.src.addr >= s.addr && m.src.end() <= s.end())
            .map(|(s, c)| (c, m.src.addr - s.addr))
        else {
            continue;
        };
        // SAFETY: `m.dst` starts `m.src.len` bytes of a posted destination of a waiting
        // rank; the data comes from our own copy.
        unsafe { write(m.dst, &buf[base..base + m.src.len]) };
    }
}

/// What a collective does, as buffer spans.
enum Plan<'a> {
    Reduce(Reduction<'a>),
    /// Whole source buffers, and the copies in rank order of their destinations.
    Moves(Vec<Span>, Vec<Move>),
    /// In-place all-to-all over pairwise disjoint buffers (one per rank, `n` blocks of
    /// `block` bytes each): block q of rank r trades places with block r of rank q.
    SwapBlocks(Vec<usize>, usize),
}

/// The plan of a collective whose posts agree (see `consistent`), from its data movement
/// ([`Collective::source`]); `None` for an unknown data type or a point-to-point call.
/// `scalars[r]` is rank r's PreMulSum scalar.
fn plan<'a>(posts: &[CollPost], scalars: &'a [Vec<u8>]) -> Option<Plan<'a>> {
    let n = posts.len();
    let a = posts.first()?;
    let es = dtype::size_of(a.dtype)?;
    let bytes = a.count * es;
    let root = a.root as usize;
    let (send, recv) = a.kind.extents();
    let blocks = |ext: Extent, r: usize| ext.elements(1, n, r == root).unwrap_or(0);
    let sends: Vec<Span> = (posts.iter().enumerate())
        .map(|(q, p)| Span::new(p.send, blocks(send, q) * bytes))
        .collect();
    let (mut outputs, mut moves) = (Vec::new(), Vec::new());
    for (r, p) in posts.iter().enumerate() {
        for j in 0..blocks(recv, r) {
            let dst = p.recv.wrapping_add(j * bytes);
            match a.kind.source(r, j, root)? {
                BlockSource { rank: None, block } => {
                    outputs.push((Span::new(dst, bytes), block * a.count))
                }
                BlockSource {
                    rank: Some(q),
                    block,
                } => moves.push(Move {
                    src: sends.get(q)?.at(block * bytes, bytes),
                    dst,
                }),
            }
        }
    }
    if a.kind.reduces() {
        return Some(Plan::Reduce(Reduction {
            dt: a.dtype,
            kind: a.red,
            es,
            elems: sends.first()?.len / es.max(1),
            inputs: sends,
            outputs,
            scalars,
        }));
    }
    let sources: Vec<Span> = sends.into_iter().filter(|s| s.len > 0).collect();
    // In place, block q of rank r and block r of rank q trade places.
    let transpose = a.kind.movement() == (Sender::RankOfBlock, Block::Receiver);
    if transpose && posts.iter().all(|p| p.recv == p.send) && pairwise_disjoint(&sources) {
        return Some(Plan::SwapBlocks(
            posts.iter().map(|p| p.send).collect(),
            bytes,
        ));
    }
    Some(Plan::Moves(sources, moves))
}

/// Runs a collective for every rank with the semantics of reading all inputs before
/// writing any output, so in-place and aliasing buffers get the same result as separate
/// ones (directly from the posted buffers where the layout allows it, else through
/// copies).
fn run_coll(posts: &[CollPost]) -> Result<(), Fail> {
    let scalars: Vec<Vec<u8>> = posts.iter().map(|p| p.scalar.clone()).collect();
    match plan(posts, &scalars) {
        None => Ok(()),
        Some(Plan::Reduce(red)) => red.run(),
        Some(Plan::Moves(sources, moves)) => {
            run_moves(&sources, moves);
            Ok(())
        }
        Some(Plan::SwapBlocks(bufs, block)) => {
            for (r, &a) in bufs.iter().enumerate() {
                for (q, &b) in bufs.iter().enumerate().skip(r + 1) {
                    if block > 0 {
                        // SAFETY: `a` and `b` are the posted in-place buffers of ranks r
                        // and q, both waiting for this op, each `n * block` bytes and
                        // disjoint from each other (checked by `plan`); block q of one
                        // and block r of the other lie inside them. Each block is in
                        // exactly one swap, so this equals reading everything first.
                        unsafe {
                            core::ptr::swap_nonoverlapping(
                                (a + q * block) as *mut u8,
                                (b + r * block) as *mut u8,
                                block,
                            )
                        };
                    }
                }
            }
            Ok(())
        }
    }
}

/// Whether no two of `spans` share a byte.
fn pairwise_disjoint(spans: &[Span]) -> bool {
    let mut v: Vec<Span> = spans.iter().copied().filter(|s| s.len > 0).collect();
    v.sort_unstable_by_key(|s| s.addr);
    v.windows(2).all(|w| w[0].end() <= w[1].addr)
}

/// Runs `job`, then marks the op that `w` waits on done with its result.
fn run_job(w: &Wait, posts: Vec<CollPost>) {
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &posts[..] {
        [s, r] if s.kind == Collective::Send => {
            let n = s.count * dtype::size_of(s.dtype).unwrap_or(0);
            if n > 0 && s.send != r.recv {
                // SAFETY: both ranks wait for this op, so both buffers are alive and, by
                // NCCL's contract, hold `n` bytes; `copy` handles overlap like reading the
                // whole source before writing.
                unsafe { core::ptr::copy(s.send as *const u8, r.recv as *mut u8, n) };
            }
            Ok(())
        }
        _ => run_coll(&posts),
    }));
    let res = res.unwrap_or_else(|_| Err(panicked()));
    let mut g = lock();
    let state = match w {
        Wait::Op(clique, key, _) => (g.cliques.get_mut(clique))
            .and_then(|c| c.ops.get_mut(key))
            .map(|s| &mut s.state),
        Wait::Handle(_) => None,
    };
    if let Some(state) = state {
        *state = OpState::Done(res);
    }
    drop(g);
    notify();
}

/// The state of one wait: `None` while it must go on.
fn poll(g: &mut Global, w: &Wait, deadline: Instant) -> Option<Result<(), Fail>> {
    match w {
        Wait::Handle(h) => {
            g.check_pending_deadline(*h);
            match g.comms.get(h).map(|c| &c.state) {
                None => Some(Err(Fail::new(
                    ncclInvalidUsage,
                    "communicator was destroyed or aborted while it was initializing",
                ))),
                Some(CommState::Pending) => None,
                Some(CommState::Ready { .. }) => Some(Ok(())),
                Some(CommState::Failed(f)) => Some(Err(f.clone())),
            }
        }
        Wait::Op(clique, key, at) => {
            if let Some(f) = withdrawn(g, *clique, key, *at) {
                return Some(Err(f));
            }
            let state = (g.cliques.get_mut(clique)).and_then(|c| take_done(&mut c.ops, key));
            wait_op(g, *clique, state, deadline)
        }
    }
}

/// This rank's post `at` in the op at `key` was withdrawn by its revoke: its wait ends
/// with this error (the op stays for the others, and goes when its last waiter left).
fn withdrawn(g: &mut Global, clique: u64, key: &OpKey, at: usize) -> Option<Fail> {
    let ops = &mut g.cliques.get_mut(&clique)?.ops;
    let op = ops.get_mut(key)?;
    if !matches!(op.state, OpState::Waiting) || !op.withdrawn.get(at).copied()? {
        return None;
    }
    op.waiters -= 1;
    if op.waiters == 0 {
        ops.remove(key);
    }
    Some(Fail::new(
        ncclRemoteError,
        "this rank revoked its communicator while this collective waited for a peer (its abort flags end its own wait; its peers' go on)",
    ))
}

/// The state of the op at `key` (`None`: no such op). A done op's result is taken
/// for one waiter; the last waiter removes the op.
fn take_done(ops: &mut std::collections::HashMap<OpKey, PostedOp>, key: &OpKey) -> Option<OpState> {
    let op = ops.get_mut(key)?;
    let state = op.state.clone();
    if let OpState::Done(_) = state {
        op.waiters -= 1;
        if op.waiters == 0 {
            ops.remove(key);
        }
    }
    Some(state)
}

/// One poll of a wait on an op of `clique` found in `state`: a waiting one fails when
/// the clique is aborted, and at `deadline` aborts it with a timeout. An op that
/// vanished (`None`: its clique was dropped) can no longer touch the waiter's buffers.
fn wait_op(
    g: &mut Global,
    clique: u64,
    state: Option<OpState>,
    deadline: Instant,
) -> Option<Result<(), Fail>> {
    let Some(state) = state else {
        let m = "communicator torn down during the operation";
        return Some(Err(Fail::new(ncclRemoteError, m)));
    };
    match state {
        OpState::Executing => None,
        OpState::Done(r) => Some(r),
        OpState::Waiting => match aborted_fail(g, clique) {
            Some(f) => Some(Err(f)),
            None if Instant::now() >= deadline => {
                let f = Fail::new(
                    ncclTimeout,
                    format!(
                        "an operation did not complete by its deadline (the caller's timeout, at most {:?}: NCCL_SAFE_HOST_TIMEOUT_MS); the communicator was aborted",
                        wait_limit()
                    ),
                );
                g.abort_clique(clique, f.clone());
                Some(Err(f))
            }
            None => None,
        },
    }
}

/// Runs `items`: those of communicators in this process as in [`run_local`], then those
/// of communicators across processes, in order, through their shared segments. Returns
/// the first error. Consumes the lock.
pub(crate) fn run_items(
    g: std::sync::MutexGuard<'static, Global>,
    items: Vec<Item>,
) -> Result<(), Fail> {
    let mut local = Vec::new();
    let mut shared = Vec::new();
    for it in items {
        let seg = match &it {
            Item::Op { clique, .. } => g.cliques.get(clique).and_then(|c| c.shared.clone()),
            Item::Handle(_) => None,
        };
        match (seg, it) {
            (
                Some(seg),
                Item::Op {
                    clique, key, post, ..
                },
            ) => shared.push((seg, clique, key, post)),
            (_, it) => local.push(it),
        }
    }
    let mut res = run_local(g, local);
    // A failure fails the communicator on every rank: later calls fail at once. Not this
    // rank's own revoke, which ended its wait only: its peers' waits go on (NCCL's revoke
    // sets only this rank's abort flags).
    let mut check = |clique, seg: &Segment, r: Result<(), Fail>| {
        if let Err(f) = r {
            if !seg.is_revoked_here() {
                lock().abort_clique(clique, f.clone());
            }
            res = res.clone().and(Err(f));
        }
    };
    // Collectives in order, then every send and receive together (per communicator), the
    // same on every rank.
    let mut p2p: Vec<(u64, Arc<Segment>, Vec<P2pWork>)> = Vec::new();
    for (seg, clique, key, post) in shared {
        match key {
            OpKey::Coll(seq) => check(clique, &seg, seg.run_coll(seq, &post)),
            OpKey::P2p(src, dst, _) => {
                let is_send = post.kind == Collective::Send;
                let w = P2pWork {
                    peer: if is_send { dst } else { src } as usize,
                    is_send,
                    ptr: if is_send { post.send } else { post.recv },
                    bytes: post.count * dtype::size_of(post.dtype).unwrap_or(0),
                    dtype: post.dtype,
                };
                match p2p.iter_mut().find(|(c, ..)| *c == clique) {
                    Some((.., ws)) => ws.push(w),
                    None => p2p.push((clique, seg, vec![w])),
                }
            }
        }
    }
    for (clique, seg, work) in p2p {
        check(clique, &seg, seg.run_p2p(&work));
    }
    res
}

/// Posts `items` in order, runs the work this thread completed, then waits until every
/// item is done (or failed). Returns the first error. Consumes the lock.
fn run_local(mut g: std::sync::MutexGuard<'static, Global>, items: Vec<Item>) -> Result<(), Fail> {
    let mut first: Option<Fail> = None;
    let mut waits = Vec::new();
    let mut jobs = Vec::new();
    for it in items {
        match post(&mut g, it) {
            Ok((w, job)) => {
                jobs.extend(job.map(|posts| (w.clone(), posts)));
                waits.push(w);
            }
            Err(f) => {
                first.get_or_insert(f);
            }
        }
    }
    if !jobs.is_empty() {
        drop(g);
        for (w, j) in jobs {
            run_job(&w, j);
        }
        g = lock();
    }
    let mut deadline = super::defs::call_deadline();
    let cancellable = super::defs::call_cancellable();
    loop {
        let mut i = 0;
        while i < waits.len() {
            match poll(&mut g, &waits[i], deadline) {
                Some(r) => {
                    if let Err(f) = r {
                        first.get_or_insert(f);
                    }
                    waits.swap_remove(i);
                }
                None => i += 1,
            }
        }
        if waits.is_empty() {
            break;
        }
        if cancellable {
            // The caller's check reads its own state, never the provider's: poll it
            // without the lock. Once it says the call can never complete, the deadline is
            // now (the clique is aborted as at the deadline, so no peer touches our
            // buffers afterwards). Each wait lasts a poll interval (or until notified),
            // also past the deadline while an op is still executing, so this never spins.
            g = wait(g, Instant::now() + super::defs::CANCEL_POLL);
            drop(g);
            let cancelled = super::defs::call_cancelled();
            g = lock();
            if cancelled {
                deadline = deadline.min(Instant::now());
            }
        } else {
            g = wait(
                g,
                deadline.max(Instant::now() + std::time::Duration::from_millis(10)),
            );
        }
    }
    match first {
        Some(f) => Err(f),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::dtype::{noise, one_nan, reference_reduce, ALL_DTYPES};
    use super::super::state::Collective;
    use super::*;

    /// The all-reads-then-all-writes form: every input copied out, the result computed
    /// element by element, then written rank by rank.
    fn reference(posts: &[CollPost]) {
        let n = posts.len();
        let a = &posts[0];
        let es = dtype::size_of(a.dtype).unwrap();
        let bytes = a.count * es;
        let root = a.root as usize;
        // SAFETY: the tests post buffers they own, alive and sized for `len` bytes, and run
        // one collective at a time.
        let read = |p: usize, len: usize| unsafe { super::bytes(Span::new(p, len)) }.to_vec();
        // SAFETY: as above, for writes of `src.len()` bytes.
        let put = |p: usize, src: &[u8]| unsafe { write(p, src) };
        let scalars: Vec<Vec<u8>> = posts.iter().map(|p| p.scalar.clone()).collect();
        let reduce = |len: usize| {
            let inputs: Vec<Vec<u8>> = posts.iter().map(|p| read(p.send, len)).collect();
            let ins: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
            let mut out = vec![0u8; len];
            reference_reduce(a.dtype, a.red, &ins, &scalars, &mut out);
            out
        };
        match a.kind {
            Collective::AllReduce | Collective::Reduce => {
                let out = reduce(bytes);
                for (r, p) in posts.iter().enumerate() {
                    if a.kind == Collective::AllReduce || r == root {
                        put(p.recv, &out);
                    }
                }
            }
            Collective::ReduceScatter => {
                let out = reduce(n * bytes);
                for (r, p) in posts.iter().enumerate() {
                    put(p.recv, &out[r * bytes..(r + 1) * bytes]);
                }
            }
            Collective::Broadcast => {
                let data = read(posts[root].send, bytes);
                for p in posts {
                    put(p.recv, &data);
                }
            }
            Collective::AllGather | Collective::Gather => {
                let mut out = Vec::new();
                for p in posts {
                    out.extend_from_slice(&read(p.send, bytes));
                }
                for (r, p) in posts.iter().enumerate() {
                    if a.kind == Collective::AllGather || r == root {
                        put(p.recv, &out);
                    }
                }
            }
            Collective::Scatter => {
                let data = read(posts[root].send, n * bytes);
                for (r, p) in posts.iter().enumerate() {
                    put(p.recv, &data[r * bytes..(r + 1) * bytes]);
                }
            }
            Collective::AllToAll => {
                let inputs: Vec<Vec<u8>> = posts.iter().map(|p| read(p.send, n * bytes)).collect();
                for (r, p) in posts.iter().enumerate() {
                    let mut out = Vec::new();
                    for input in &inputs {
                        out.extend_from_slice(&input[r * bytes..(r + 1) * bytes]);
                    }
                    put(p.recv, &out);
                }
            }
            Collective::Send | Collective::Recv => unreachable!("point-to-point is not planned"),
        }
    }

    /// Every collective that every rank takes part in (point-to-point is not planned).
    fn kinds() -> impl Iterator<Item = Collective> {
        Collective::ALL.iter().copied().filter(|c| c.every_rank())
    }

    /// Where each rank's buffers lie (byte offsets into one arena).
    #[derive(Debug, Clone, Copy)]
    enum Layout {
        /// Every buffer on its own, at odd offsets.
        Separate,
        /// NCCL's in-place form of the collective.
        InPlace,
        /// Each rank's receive buffer starts this many bytes after its send buffer.
        Shifted(isize),
        /// Rank r receives into rank r+1's send buffer.
        Ring,
        /// Every rank receives into the same buffer.
        SharedRecv,
        /// Every rank sends from the same buffer.
        SharedSend,
        /// Every rank sends and receives in the same buffer.
        SharedInPlace,
    }

    const LAYOUTS: [Layout; 14] = [
        Layout::Separate,
        Layout::InPlace,
        Layout::Shifted(1),
        Layout::Shifted(-1),
        Layout::Shifted(8),
        Layout::Shifted(-8),
        Layout::Shifted(REDUCE_CHUNK as isize + 8),
        Layout::Shifted(-(REDUCE_CHUNK as isize) - 8),
        Layout::Shifted(COPY_CHUNK as isize + 3),
        Layout::Shifted(-(COPY_CHUNK as isize) - 3),
        Layout::Ring,
        Layout::SharedRecv,
        Layout::SharedSend,
        Layout::SharedInPlace,
    ];

    /// (send offset, recv offset) per rank; `None` where a buffer is not posted.
    fn offsets(
        layout: Layout,
        kind: Collective,
        n: usize,
        bytes: usize,
        root: usize,
    ) -> Vec<(Option<isize>, Option<isize>)> {
        // Send and receive bytes of each rank (as the API sizes them).
        let ext: Vec<(usize, usize)> = (0..n)
            .map(|r| {
                kind.elements(bytes, n, r == root)
                    .expect("small test sizes")
            })
            .collect();
        let shift = match layout {
            Layout::Shifted(d) => d.unsigned_abs(),
            _ => 0,
        };
        // A multiple of 8, so every send buffer starts at the same offset modulo the
        // element size (7, unaligned for every type wider than a byte).
        let room = (n * bytes + shift + 64).next_multiple_of(8) as isize;
        let base = |r: usize, j: usize| ((2 * r + j) as isize) * room + 7;
        let some = |len: usize, off: isize| (len > 0).then_some(off);
        (0..n)
            .map(|r| {
                let (ns, nr) = ext[r];
                let (s, d) = match layout {
                    Layout::Separate => (base(r, 0), base(r, 1)),
                    Layout::InPlace => {
                        let b = base(r, 0);
                        let rb = (r * bytes) as isize;
                        match kind {
                            Collective::ReduceScatter | Collective::Scatter => (b, b + rb),
                            Collective::AllGather | Collective::Gather => (b + rb, b),
                            _ => (b, b),
                        }
                    }
                    Layout::Shifted(d) => (base(r, 0), base(r, 0) + d),
                    Layout::Ring => (base(r, 0), base((r + 1) % n, 0)),
                    Layout::SharedRecv => (base(r, 0), base(n, 0)),
                    Layout::SharedSend => (base(n, 0), base(r, 1)),
                    Layout::SharedInPlace => (base(n, 0), base(n, 0)),
                };
                (some(ns, s), some(nr, d))
            })
            .collect()
    }

    /// Runs `kind` over `layout` with the fast path and with [`reference`] on the same
    /// random arena, and compares every byte of the arena. Returns whether the fast path
    /// ran straight from the posted buffers.
    fn check(
        kind: Collective,
        dt: ncclDataType_t,
        red: RedKind,
        n: usize,
        count: usize,
        root: usize,
        layout: Layout,
    ) -> bool {
        let es = dtype::size_of(dt).unwrap();
        let bytes = count * es;
        let offs = offsets(layout, kind, n, bytes, root);
        let all: Vec<isize> = offs.iter().flat_map(|&(s, d)| [s, d]).flatten().collect();
        let lo = all.iter().fold(0, |m, &o| m.min(o)).div_euclid(8) * 8;
        let size = all.iter().fold(0, |m, &o| m.max(o)) - lo + (n * bytes) as isize + 64;
        let seed = (kind as u64) << 48 ^ (dt as u64) << 40 ^ (n as u64) << 32 ^ count as u64;
        let mut arena = noise(seed, size as usize);
        one_nan(dt, &mut arena[7 % es..]);
        let mut want = arena.clone();
        let scalars: Vec<Vec<u8>> = (0..n)
            .map(|r| {
                if red == RedKind::PreMulSum {
                    noise(seed ^ r as u64, es)
                } else {
                    Vec::new()
                }
            })
            .collect();
        let posts = |mem: &mut Vec<u8>| -> Vec<CollPost> {
            let base = mem.as_mut_ptr() as usize;
            let at = |o: Option<isize>| o.map_or(0, |o| base + (o - lo) as usize);
            offs.iter()
                .zip(&scalars)
                .map(|(&(s, d), sc)| CollPost {
                    kind,
                    send: at(s),
                    recv: at(d),
                    count,
                    dtype: dt,
                    red,
                    scalar: sc.clone(),
                    caller: None,
                    root: root as i32,
                })
                .collect()
        };
        let fast = posts(&mut arena);
        let direct = match plan(&fast, &scalars).unwrap() {
            Plan::Reduce(r) => r.direct_ok(),
            Plan::Moves(s, m) => moves_direct_ok(&s, &m),
            Plan::SwapBlocks(..) => true,
        };
        run_coll(&fast).unwrap();
        reference(&posts(&mut want));
        if arena != want {
            let i = arena.iter().zip(&want).position(|(a, b)| a != b).unwrap();
            panic!(
                "{kind:?} dt={dt} {red:?} n={n} count={count} root={root} {layout:?}: first difference at arena byte {i} (of {})",
                arena.len()
            );
        }
        direct
    }

    /// A shift larger than a chunk (the same as [`Layout::Separate`] for small counts).
    fn is_far(l: &Layout) -> bool {
        matches!(l, Layout::Shifted(d) if d.unsigned_abs() > 8)
    }

    /// A shift of more than a copy chunk (the same as a smaller one for reductions).
    fn is_copy_far(l: &Layout) -> bool {
        matches!(l, Layout::Shifted(d) if d.unsigned_abs() > COPY_CHUNK)
    }

    #[test]
    fn every_collective_matches_the_read_everything_first_form_on_every_layout() {
        for kind in kinds() {
            for &dt in ALL_DTYPES {
                let kinds: &[RedKind] = if kind.reduces() {
                    &RedKind::ALL
                } else {
                    &[RedKind::Sum]
                };
                for &red in kinds {
                    for n in [1usize, 2, 3, 4] {
                        for layout in LAYOUTS.into_iter().filter(|l| !is_far(l)) {
                            for count in [0usize, 5] {
                                check(kind, dt, red, n, count, n / 2, layout);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn reductions_over_several_chunks_match_on_every_layout() {
        for kind in kinds().filter(|k| k.reduces()) {
            for dt in [ncclInt32, ncclBfloat16, ncclFloat64] {
                let count = REDUCE_CHUNK / dtype::size_of(dt).unwrap() + 3;
                for red in [RedKind::Sum, RedKind::Min, RedKind::PreMulSum] {
                    for layout in LAYOUTS.into_iter().filter(|l| !is_copy_far(l)) {
                        check(kind, dt, red, 3, count, 2, layout);
                    }
                }
            }
        }
    }

    #[test]
    fn copies_larger_than_a_chunk_match_on_every_layout() {
        for kind in kinds().filter(|k| !k.reduces()) {
            for n in [1usize, 3] {
                for layout in LAYOUTS {
                    let (count, root) = (COPY_CHUNK + 5, n - 1);
                    check(kind, ncclInt8, RedKind::Sum, n, count, root, layout);
                }
            }
        }
    }

    #[test]
    fn separate_and_in_place_buffers_take_the_direct_path() {
        // (kind, ranks, root, layout, direct): outputs read later than they are written,
        // or written twice, are not direct.
        let cases = kinds()
            .flat_map(|k| {
                [
                    (k, 4, 1, Layout::Separate, true),
                    (k, 4, 1, Layout::InPlace, true),
                ]
            })
            .chain([
                (Collective::AllReduce, 3, 0, Layout::Shifted(-4), false),
                (Collective::AllReduce, 3, 0, Layout::SharedRecv, false),
                (Collective::AllGather, 3, 0, Layout::Ring, false),
                (Collective::Broadcast, 3, 0, Layout::SharedSend, true),
            ]);
        for (kind, n, root, layout, direct) in cases {
            let got = check(kind, ncclFloat32, RedKind::Sum, n, 100, root, layout);
            assert_eq!(got, direct, "{kind:?} {layout:?} n={n}: direct path");
        }
    }

    #[test]
    fn large_reductions_split_across_threads_match() {
        // Over PARALLEL_MIN per rank, so the element range is split where the machine
        // has more than one core.
        use Collective::{AllReduce, Reduce, ReduceScatter};
        use RedKind::{Avg, PreMulSum, Sum};
        let c = PARALLEL_MIN / 4 + REDUCE_CHUNK / 4 + 3;
        for layout in [Layout::Separate, Layout::InPlace] {
            check(AllReduce, ncclFloat32, Sum, 3, c, 0, layout);
        }
        check(ReduceScatter, ncclFloat16, Avg, 2, c, 0, Layout::InPlace);
        check(Reduce, ncclInt8, PreMulSum, 2, 4 * c, 1, Layout::InPlace);
    }

    #[test]
    fn a_short_premulsum_scalar_is_an_error_not_a_panic() {
        let mut a = vec![1u8; 64];
        let p = CollPost {
            kind: Collective::AllReduce,
            send: a.as_mut_ptr() as usize,
            recv: a.as_mut_ptr() as usize,
            count: 16,
            dtype: ncclFloat32,
            red: RedKind::PreMulSum,
            scalar: vec![0; 2],
            root: 0,
            caller: None,
        };
        assert!(run_coll(&[p.clone(), p]).is_err());
    }
}
