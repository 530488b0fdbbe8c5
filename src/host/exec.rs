//! Posting, executing and waiting for operations (collectives, send/recv, rendezvous).

use std::time::Instant;

use nccl_sys::bindings::*;

use super::dtype::{self, RedKind};
use super::state::{
    lock, notify, wait, wait_limit, CollKind, CollPost, CollSlot, CommState, Fail, Global, Handle,
    P2pPost, P2pSlot, SlotState,
};

/// An operation queued by a thread (inside a group, or the single op of a plain call).
#[derive(Debug, Clone)]
pub(crate) enum Item {
    Coll {
        clique: u64,
        rank: i32,
        seq: u64,
        post: CollPost,
    },
    P2p {
        clique: u64,
        src: i32,
        dst: i32,
        seq: u64,
        is_send: bool,
        post: P2pPost,
    },
    /// A handle whose init/split/shrink rendezvous must complete before group end returns.
    Handle(Handle),
}

/// What a posted item waits on.
#[derive(Debug, Clone)]
enum Wait {
    Coll(u64, u64),
    P2p(u64, (i32, i32, u64)),
    Handle(Handle),
}

/// Work that the completing poster runs outside the lock.
enum Job {
    Coll(u64, u64, Vec<CollPost>),
    P2p(u64, (i32, i32, u64), P2pPost, P2pPost),
}

fn aborted_fail(g: &Global, clique: u64) -> Option<Fail> {
    match g.cliques.get(&clique) {
        None => Some(Fail::new(
            ncclRemoteError,
            "remote error: every rank of this communicator was destroyed or aborted",
        )),
        Some(c) => c.aborted.clone(),
    }
}

fn consistent(posts: &[CollPost]) -> Result<(), Fail> {
    let a = &posts[0];
    for (r, p) in posts.iter().enumerate() {
        if p.kind != a.kind || p.count != a.count || p.dtype != a.dtype || p.root != a.root {
            return Err(Fail::new(
                ncclInvalidUsage,
                format!(
                    "invalid usage: ranks disagree on a collective: rank 0 called {:?}(count={}, dtype={}, root={}) but rank {r} called {:?}(count={}, dtype={}, root={})",
                    a.kind, a.count, a.dtype, a.root, p.kind, p.count, p.dtype, p.root
                ),
            ));
        }
        let reduces = matches!(
            a.kind,
            CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter
        );
        if reduces && (p.red == RedKind::PreMulSum) != (a.red == RedKind::PreMulSum)
            || reduces && p.red != RedKind::PreMulSum && p.red != a.red
        {
            return Err(Fail::new(
                ncclInvalidUsage,
                format!(
                    "invalid usage: ranks disagree on the reduction ({:?} vs {:?})",
                    a.red, p.red
                ),
            ));
        }
    }
    Ok(())
}

fn post(g: &mut Global, item: Item) -> Result<(Wait, Option<Job>), Fail> {
    match item {
        Item::Handle(h) => Ok((Wait::Handle(h), None)),
        Item::Coll {
            clique,
            rank,
            seq,
            post,
        } => {
            if let Some(f) = aborted_fail(g, clique) {
                return Err(f);
            }
            let Some(cl) = g.cliques.get_mut(&clique) else {
                return Err(Fail::new(
                    ncclInternalError,
                    "internal error: clique vanished",
                ));
            };
            let n = cl.nranks as usize;
            let slot = cl.colls.entry(seq).or_insert_with(|| CollSlot {
                posts: vec![None; n],
                nposted: 0,
                state: SlotState::Waiting,
                waiters: n,
            });
            let r = rank as usize;
            if slot.posts.get(r).is_none_or(|p| p.is_some()) {
                return Err(Fail::new(
                    ncclInternalError,
                    "internal error: rank posted twice",
                ));
            }
            slot.posts[r] = Some(post);
            slot.nposted += 1;
            let w = Wait::Coll(clique, seq);
            if slot.nposted < n {
                return Ok((w, None));
            }
            let posts: Vec<CollPost> = slot.posts.iter().flatten().cloned().collect();
            if let Err(f) = consistent(&posts) {
                slot.state = SlotState::Done(Err(f));
                notify();
                return Ok((w, None));
            }
            slot.state = SlotState::Executing;
            Ok((w, Some(Job::Coll(clique, seq, posts))))
        }
        Item::P2p {
            clique,
            src,
            dst,
            seq,
            is_send,
            post,
        } => {
            if let Some(f) = aborted_fail(g, clique) {
                return Err(f);
            }
            let Some(cl) = g.cliques.get_mut(&clique) else {
                return Err(Fail::new(
                    ncclInternalError,
                    "internal error: clique vanished",
                ));
            };
            let key = (src, dst, seq);
            let slot = cl.p2p.entry(key).or_insert_with(|| P2pSlot {
                send: None,
                recv: None,
                state: SlotState::Waiting,
                waiters: 2,
            });
            let side = if is_send {
                &mut slot.send
            } else {
                &mut slot.recv
            };
            if side.is_some() {
                return Err(Fail::new(
                    ncclInternalError,
                    "internal error: p2p posted twice",
                ));
            }
            *side = Some(post);
            let w = Wait::P2p(clique, key);
            match (&slot.send, &slot.recv) {
                (Some(s), Some(r)) => {
                    if s.count != r.count || s.dtype != r.dtype {
                        slot.state = SlotState::Done(Err(Fail::new(
                            ncclInvalidUsage,
                            format!(
                                "invalid usage: ncclSend from rank {src} (count={}, dtype={}) does not match ncclRecv on rank {dst} (count={}, dtype={})",
                                s.count, s.dtype, r.count, r.dtype
                            ),
                        )));
                        notify();
                        return Ok((w, None));
                    }
                    let job = Job::P2p(clique, key, s.clone(), r.clone());
                    slot.state = SlotState::Executing;
                    Ok((w, Some(job)))
                }
                _ => Ok((w, None)),
            }
        }
    }
}

/// Copies `n` bytes from `p` into a new vector (empty for `n == 0`).
fn read(p: usize, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    if n > 0 {
        // SAFETY: `p` was posted by a rank that is still waiting for this op (so the buffer
        // is alive) and, by NCCL's contract, it holds at least `n` readable bytes. The
        // destination is a fresh vector of `n` bytes, so the ranges cannot overlap.
        unsafe { core::ptr::copy_nonoverlapping(p as *const u8, v.as_mut_ptr(), n) };
    }
    v
}

/// Copies `src` to address `p`.
fn write(p: usize, src: &[u8]) {
    if !src.is_empty() {
        // SAFETY: `p` was posted by a rank that is still waiting for this op and, by NCCL's
        // contract, it holds at least `src.len()` writable bytes; `src` is our own vector.
        unsafe { core::ptr::copy_nonoverlapping(src.as_ptr(), p as *mut u8, src.len()) };
    }
}

/// Runs a collective for every rank: all reads happen before any write, so in-place and
/// aliasing buffers get the same result as separate ones.
fn run_coll(posts: &[CollPost]) -> Result<(), Fail> {
    let n = posts.len();
    let a = &posts[0];
    let Some(es) = dtype::size_of(a.dtype) else {
        return Ok(());
    };
    let scalars: Vec<Vec<u8>> = posts.iter().map(|p| p.scalar.clone()).collect();
    let reduce = |inputs: &[Vec<u8>], out: &mut [u8]| {
        let ins: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
        if dtype::reduce(a.dtype, a.red, &ins, &scalars, out) {
            Ok(())
        } else {
            Err(Fail::new(
                ncclInternalError,
                "internal error: malformed reduction (short input or PreMulSum scalar)",
            ))
        }
    };
    let bytes = a.count * es;
    let root = a.root as usize;
    match a.kind {
        CollKind::AllReduce | CollKind::Reduce => {
            let inputs: Vec<Vec<u8>> = posts.iter().map(|p| read(p.send, bytes)).collect();
            let mut out = vec![0u8; bytes];
            reduce(&inputs, &mut out)?;
            for (r, p) in posts.iter().enumerate() {
                if a.kind == CollKind::AllReduce || r == root {
                    write(p.recv, &out);
                }
            }
        }
        CollKind::ReduceScatter => {
            let inputs: Vec<Vec<u8>> = posts.iter().map(|p| read(p.send, n * bytes)).collect();
            let mut out = vec![0u8; n * bytes];
            reduce(&inputs, &mut out)?;
            for (r, p) in posts.iter().enumerate() {
                write(p.recv, &out[r * bytes..(r + 1) * bytes]);
            }
        }
        CollKind::Broadcast => {
            let data = read(posts[root].send, bytes);
            for p in posts {
                write(p.recv, &data);
            }
        }
        CollKind::AllGather | CollKind::Gather => {
            let mut out = Vec::with_capacity(n * bytes);
            for p in posts {
                out.extend_from_slice(&read(p.send, bytes));
            }
            for (r, p) in posts.iter().enumerate() {
                if a.kind == CollKind::AllGather || r == root {
                    write(p.recv, &out);
                }
            }
        }
        CollKind::Scatter => {
            let data = read(posts[root].send, n * bytes);
            for (r, p) in posts.iter().enumerate() {
                write(p.recv, &data[r * bytes..(r + 1) * bytes]);
            }
        }
        CollKind::AlltoAll => {
            let inputs: Vec<Vec<u8>> = posts.iter().map(|p| read(p.send, n * bytes)).collect();
            for (r, p) in posts.iter().enumerate() {
                let mut out = Vec::with_capacity(n * bytes);
                for input in &inputs {
                    out.extend_from_slice(&input[r * bytes..(r + 1) * bytes]);
                }
                write(p.recv, &out);
            }
        }
    }
    Ok(())
}

fn run_job(job: Job) {
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &job {
        Job::Coll(_, _, posts) => run_coll(posts),
        Job::P2p(_, _, s, r) => {
            let n = s.count * dtype::size_of(s.dtype).unwrap_or(0);
            let data = read(s.ptr, n);
            write(r.ptr, &data);
            Ok(())
        }
    }));
    let res = res
        .map_err(|_| {
            Fail::new(
                ncclInternalError,
                "internal error: panic while executing an operation",
            )
        })
        .and_then(|r| r);
    let mut g = lock();
    match job {
        Job::Coll(clique, seq, _) => {
            if let Some(s) = g
                .cliques
                .get_mut(&clique)
                .and_then(|c| c.colls.get_mut(&seq))
            {
                s.state = SlotState::Done(res);
            }
        }
        Job::P2p(clique, key, _, _) => {
            if let Some(s) = g.cliques.get_mut(&clique).and_then(|c| c.p2p.get_mut(&key)) {
                s.state = SlotState::Done(res);
            }
        }
    }
    drop(g);
    notify();
}

/// The state of one wait: `None` while it must go on.
fn poll(g: &mut Global, w: &Wait, deadline: Instant) -> Option<Result<(), Fail>> {
    let timeout = || {
        Fail::new(
            ncclTimeout,
            format!(
                "NCCL timeout: an operation did not complete within {:?} (NCCL_SAFE_HOST_TIMEOUT_MS); the communicator was aborted",
                wait_limit()
            ),
        )
    };
    match w {
        Wait::Handle(h) => {
            g.check_pending_deadline(*h);
            match g.comms.get(h).map(|c| &c.state) {
                None => Some(Err(Fail::new(
                    ncclInvalidUsage,
                    "invalid usage: communicator was destroyed or aborted while it was initializing",
                ))),
                Some(CommState::Pending) => None,
                Some(CommState::Ready { .. }) => Some(Ok(())),
                Some(CommState::Failed(f)) => Some(Err(f.clone())),
            }
        }
        Wait::Coll(clique, seq) => {
            let aborted = aborted_fail(g, *clique);
            let cl = g.cliques.get_mut(clique)?;
            let slot = cl.colls.get_mut(seq)?;
            match &slot.state {
                SlotState::Executing => None,
                SlotState::Done(r) => {
                    let r = r.clone();
                    slot.waiters -= 1;
                    if slot.waiters == 0 {
                        cl.colls.remove(seq);
                    }
                    Some(r)
                }
                SlotState::Waiting => match aborted {
                    Some(f) => Some(Err(f)),
                    None if Instant::now() >= deadline => {
                        let f = timeout();
                        g.abort_clique(*clique, f.clone());
                        Some(Err(f))
                    }
                    None => None,
                },
            }
        }
        Wait::P2p(clique, key) => {
            let aborted = aborted_fail(g, *clique);
            let cl = g.cliques.get_mut(clique)?;
            let slot = cl.p2p.get_mut(key)?;
            match &slot.state {
                SlotState::Executing => None,
                SlotState::Done(r) => {
                    let r = r.clone();
                    slot.waiters -= 1;
                    if slot.waiters == 0 {
                        cl.p2p.remove(key);
                    }
                    Some(r)
                }
                SlotState::Waiting => match aborted {
                    Some(f) => Some(Err(f)),
                    None if Instant::now() >= deadline => {
                        let f = timeout();
                        g.abort_clique(*clique, f.clone());
                        Some(Err(f))
                    }
                    None => None,
                },
            }
        }
    }
}

/// Posts `items` in order, runs the work this thread completed, then waits until every
/// item is done (or failed). Returns the first error. Consumes the lock.
pub(crate) fn run_items(
    mut g: std::sync::MutexGuard<'static, Global>,
    items: Vec<Item>,
) -> Result<(), Fail> {
    let mut first: Option<Fail> = None;
    let mut waits = Vec::new();
    let mut jobs = Vec::new();
    for it in items {
        match post(&mut g, it) {
            Ok((w, job)) => {
                waits.push(w);
                jobs.extend(job);
            }
            Err(f) => {
                first.get_or_insert(f);
            }
        }
    }
    if !jobs.is_empty() {
        drop(g);
        for j in jobs {
            run_job(j);
        }
        g = lock();
    }
    let deadline = Instant::now() + wait_limit();
    loop {
        let mut i = 0;
        while i < waits.len() {
            // A slot that vanished (clique dropped) can no longer touch our buffers.
            let r = poll(&mut g, &waits[i], deadline).or_else(|| match &waits[i] {
                Wait::Coll(c, s) if g.cliques.get(c).is_none_or(|cl| !cl.colls.contains_key(s)) => {
                    Some(Err(Fail::new(
                        ncclRemoteError,
                        "remote error: communicator torn down during the operation",
                    )))
                }
                Wait::P2p(c, k) if g.cliques.get(c).is_none_or(|cl| !cl.p2p.contains_key(k)) => {
                    Some(Err(Fail::new(
                        ncclRemoteError,
                        "remote error: communicator torn down during the operation",
                    )))
                }
                _ => None,
            });
            match r {
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
        g = wait(
            g,
            deadline.max(Instant::now() + std::time::Duration::from_millis(10)),
        );
    }
    match first {
        Some(f) => Err(f),
        None => Ok(()),
    }
}
