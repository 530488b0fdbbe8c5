//! The process-wide registry of the host provider: handles, cliques, rendezvous and
//! posted operations, all behind one mutex and one condition variable (how an operation is
//! posted and run: the crate docs). A rank's buffers are only touched while that rank
//! still waits for the op: once a clique is aborted no new execution starts, and a waiter
//! whose op is executing waits for it to finish even when the clique was aborted.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::c_int;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use nccl_sys::bindings::*;

pub(crate) use super::defs::{wait_limit, CollPost, Collective, Fail, IdBytes};
use super::HostStats;

/// The opaque value behind an `ncclComm_t`.
pub(crate) type Handle = usize;
/// Index of a root unique id in [`Global::roots`].
pub(crate) type RootIdx = usize;

/// Handles are `HANDLE_BASE + 16 * n`, n = 1, 2, ...: never null, never reused.
const HANDLE_BASE: usize = 0x4e43_0000;

/// What a communicator handle currently is.
#[derive(Debug, Clone)]
pub(crate) enum CommState {
    /// Waiting for its init / split / shrink rendezvous.
    Pending,
    /// A member of a clique.
    Ready { clique: u64, rank: i32 },
    /// Its rendezvous failed (it still has to be destroyed or aborted).
    Failed(Fail),
}

/// NCCL's async job on a communicator (`ncclAsyncJob`: a split, shrink or window
/// registration on a non-blocking communicator: NCCL 2.28's `ncclAsyncLaunch` /
/// `ncclGroupEndInternal` return ncclSuccess to the caller and finish the work on a thread
/// of their own), or its state.
#[derive(Debug, Clone, Default)]
pub(crate) enum AsyncJob {
    /// Nothing in flight.
    #[default]
    Idle,
    /// In flight: `ncclCommGetAsyncError` says ncclInProgress and every other call is
    /// refused (`ncclCommEnsureReady`: ncclInvalidArgument). `child` is the split/shrink
    /// child the job waits for (an abort fails it, so the job ends).
    Busy { child: Option<Handle> },
    /// Ended with an error: sticky, as NCCL's `asyncResult`.
    Failed(Fail),
    /// Collectives of a non-blocking communicator of two or more ranks were run, and NCCL
    /// would now launch them from its group's thread (`groupLaunchNonBlocking`, group.cc:
    /// 705-738 of 2.28.9): the call returned ncclInProgress, and until the caller's next
    /// `ncclCommGetAsyncError` (which "joins" the thread: it reads ncclSuccess and clears
    /// this) every call that checks readiness is refused, as while NCCL's thread still runs.
    /// Of NCCL's possible schedules, the strictest: the thread ends only when asked.
    Launching,
}

/// What a pending handle waits on (so a timeout can fail the whole rendezvous).
#[derive(Debug, Clone)]
pub(crate) enum PendingOn {
    Init(IdBytes),
    Rdv { clique: u64, seq: u64 },
    Nothing,
}

/// A registered PreMulSum reduction.
#[derive(Debug, Clone)]
pub(crate) struct PreMul {
    pub dtype: ncclDataType_t,
    /// Host-immediate scalar bytes, or the address to read at op time.
    pub scalar: Result<Vec<u8>, usize>,
}

/// A live communicator handle.
#[derive(Debug)]
pub(crate) struct Comm {
    pub state: CommState,
    pub root: RootIdx,
    pub device: c_int,
    pub nonblocking: bool,
    pub finalized: bool,
    pub coll_seq: u64,
    /// Shrinks in `NCCL_SHRINK_ABORT` mode made of this communicator: their rendezvous
    /// numbers, apart from the collectives' (the ranks left may differ in what they
    /// issued before the failure).
    pub abort_shrinks: u64,
    /// The next send/recv sequence number per (is it a send, peer).
    pub p2p_seq: HashMap<(bool, i32), u64>,
    pub redops: HashMap<ncclRedOp_t, PreMul>,
    pub next_redop: ncclRedOp_t,
    pub pending_on: PendingOn,
    pub deadline: Instant,
    /// Asynchronous work in flight on this communicator, or its sticky failure.
    pub async_job: AsyncJob,
    /// The config's `commName` pointer (0: none), kept, not copied, as NCCL keeps it
    /// (init.cc:1251, read by the profiler plugin after the call; a split or shrink child
    /// without a config of its own inherits its parent's).
    pub name: usize,
    /// `ncclCommRevoke` was called (NCCL's `revokedFlag`, init.cc:2663 of 2.29.7): its
    /// collectives are refused with ncclInvalidUsage (enqueue.cc:2983-2986).
    pub revoked: bool,
    /// The revoke's job ended: as NCCL's `commRevokeAsync` stores its own result into the
    /// communicator's `asyncResult` (init.cc:2635), an error seen before (a failed clique)
    /// no longer shows in `ncclCommGetAsyncError`, and a shrink may go on.
    pub error_cleared: bool,
    /// Grows this rank took part in (NCCL's `childCount`, bumped by `ncclCommGrow`,
    /// init.cc:2909): the next grow's id is derived from it, as NCCL derives the grow
    /// handle's magic (`hashCombine(comm->magic, comm->childCount)`).
    pub grows: u64,
    /// The communicator this one grows (an existing rank's `ncclCommGrow`): NCCL's grow
    /// job keeps using it until the job ends (its bootstrap sends through the parent's,
    /// bootstrap.cc:777-779, and it clears the parent's `childAbortFlag` at its end,
    /// init.cc:1716 of v2.29.7-1), and the parent's abort neither stops nor joins that job
    /// (it is linked to the new communicator). A teardown of the parent while this one is
    /// still pending is a use after free in NCCL: counted as misuse here.
    pub grow_parent: Option<Handle>,
    /// While it joins a shared segment (`join_shared`): the join's cancel flag and the
    /// segment's path, so that a teardown during the join ends it and leaves nothing in
    /// `/dev/shm`, even when the process exits right after.
    pub shared_join: Option<(std::sync::Arc<std::sync::atomic::AtomicBool>, String)>,
    /// `ncclCommDestroy` was called on it (NCCL's `destroyFlag`, set before the readiness
    /// check that may refuse the destroy, init.cc:2379 of 2.28.9, and never cleared): a
    /// revoke is refused from then on (:2457).
    pub destroy_called: bool,
    /// NCCL's `comm->groupJob`: the group job a non-blocking group end linked to it
    /// (group.cc:802-818 of v2.29.7-1), until an `ncclCommGetAsyncError` that reads
    /// ncclSuccess completes and unlinks it (init.cc:3105-3110). A revoke aborts it and
    /// leaves it linked (init.cc:2664 -> 404), deleted once no communicator holds it
    /// (group.cc:873-884): see [`Global::complete_group_job`].
    pub group_job: Option<u64>,
    /// Window registrations queued in a group that failed, or left behind by one that
    /// failed at the group's end: NCCL keeps their tasks queued on the communicator
    /// (`groupCleanup`, group.cc:340-397 of 2.28.9) and runs them, writing through their
    /// stale out-pointers, at the next group end that registers a window there. The
    /// provider refuses that next registration instead.
    pub stale_windows: usize,
    /// `ncclCommSuspend(NCCL_SUSPEND_MEM)` completed and no `ncclCommResume` since: NCCL's
    /// `memManager->released` (mem_manager.cc:505 and :890 of 2.30.7).
    pub suspended: bool,
}

#[derive(Debug, Clone)]
pub(crate) enum OpState {
    Waiting,
    Executing,
    Done(Result<(), Fail>),
}

/// What a posted operation is found by in its clique: a collective by its sequence number,
/// a send/recv pair by (source, destination, the pair's sequence number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum OpKey {
    Coll(u64),
    P2p(i32, i32, u64),
}

/// A posted operation: the posts (a collective's one per rank, a send/recv pair's send
/// then receive), its state, and how many waits have yet to take its result (the last one
/// removes it).
#[derive(Debug)]
pub(crate) struct PostedOp {
    pub posts: Vec<Option<CollPost>>,
    pub state: OpState,
    pub waiters: usize,
    /// Per post: the rank revoked its communicator while it waited here. Its wait ends
    /// with an error, and the op never runs (its buffers may be gone): the other ranks
    /// wait on, until their own revoke, an abort or their deadline.
    pub withdrawn: Vec<bool>,
}

/// A split or shrink rendezvous over a parent clique.
#[derive(Debug)]
pub(crate) struct SplitRdv {
    /// `None` for split; the sorted excluded ranks for shrink.
    pub shrink: Option<Vec<i32>>,
    pub expected: usize,
    /// (parent rank, color, key, handle to fill: None for NOCOLOR)
    pub posts: Vec<(i32, c_int, c_int, Option<Handle>)>,
}

/// The ranks that share one communicator (one init, split or shrink result).
#[derive(Debug, Default)]
pub(crate) struct CommWorld {
    pub nranks: i32,
    pub root: RootIdx,
    pub members: usize,
    pub aborted: Option<Fail>,
    pub ops: HashMap<OpKey, PostedOp>,
    pub rdv: HashMap<u64, SplitRdv>,
    /// For a communicator across processes: this rank's view of the shared segment (the
    /// clique then holds this one rank of the communicator).
    pub shared: Option<std::sync::Arc<super::shm::Segment>>,
}

impl CommWorld {
    fn executing(&self) -> bool {
        (self.ops.values()).any(|s| matches!(s.state, OpState::Executing))
    }
}

/// An init rendezvous on one unique id.
#[derive(Debug)]
pub(crate) struct PendingInit {
    pub nranks: i32,
    pub posts: Vec<(i32, Handle)>,
}

/// Everything, behind [`lock`].
#[derive(Debug, Default)]
pub(crate) struct Global {
    next_handle: usize,
    next_clique: u64,
    pub comms: HashMap<Handle, Comm>,
    pub dead: HashMap<Handle, RootIdx>,
    pub cliques: HashMap<u64, CommWorld>,
    pub inits: HashMap<IdBytes, PendingInit>,
    pub failed_ids: HashMap<IdBytes, Fail>,
    roots: HashMap<IdBytes, RootIdx>,
    pub root_stats: Vec<HostStats>,
    pub total: HostStats,
    pub misuse_log: VecDeque<String>,
    pub mem: HashMap<usize, std::alloc::Layout>,
    /// Grow ids sent by `ncclCommGetUniqueId` to the boundary ranks (0 and n-1) of a
    /// clique, keyed by (clique, rank): NCCL's `bcastGrowHandle` (bootstrap.cc:470-486),
    /// received by those ranks' `ncclCommGrow`.
    pub grow_mail: HashMap<(u64, i32), VecDeque<IdBytes>>,
    /// Handles whose `ncclCommGrow` waits for the grow id in its call (a boundary rank,
    /// init.cc:2913-2924 of v2.29.7-1): NCCL's abort frees the communicator that call
    /// still uses, so a teardown meanwhile is counted as misuse.
    pub blocked_in_grow: HashSet<Handle>,
    /// NCCL's group jobs not yet deleted, with the number of communicators linked to each
    /// (`groupRefCount`, group.cc:784-818 of v2.29.7-1).
    pub group_jobs: HashMap<u64, usize>,
    next_group_job: u64,
}

static GLOBAL: OnceLock<(Mutex<Global>, Condvar)> = OnceLock::new();

fn global() -> &'static (Mutex<Global>, Condvar) {
    GLOBAL.get_or_init(|| (Mutex::new(Global::default()), Condvar::new()))
}

/// Locks the registry (a poisoned lock is recovered: the state stays usable).
pub(crate) fn lock() -> MutexGuard<'static, Global> {
    global().0.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wakes every waiter.
pub(crate) fn notify() {
    global().1.notify_all();
}

/// Waits for a change (or `until`), returning the re-acquired lock.
pub(crate) fn wait(g: MutexGuard<'static, Global>, until: Instant) -> MutexGuard<'static, Global> {
    let d = until
        .saturating_duration_since(Instant::now())
        .min(Duration::from_millis(200));
    match global().1.wait_timeout(g, d) {
        Ok((g, _)) => g,
        Err(e) => e.into_inner().0,
    }
}

/// Waits, asking `done` again after every change, until it gives a value, or for at most
/// the provider's wait limit (then `None`); returns the re-acquired lock.
pub(crate) fn wait_until<R>(
    mut g: MutexGuard<'static, Global>,
    mut done: impl FnMut(&mut Global) -> Option<R>,
) -> (MutexGuard<'static, Global>, Option<R>) {
    let deadline = Instant::now() + wait_limit();
    loop {
        if let Some(r) = done(&mut g) {
            return (g, Some(r));
        }
        if Instant::now() >= deadline {
            return (g, None);
        }
        g = wait(g, deadline);
    }
}

impl Global {
    /// The stats index of a root unique id (interned on first use).
    pub(crate) fn root_of(&mut self, id: &IdBytes) -> RootIdx {
        if let Some(&r) = self.roots.get(id) {
            return r;
        }
        let r = self.root_stats.len();
        self.root_stats.push(HostStats::default());
        self.roots.insert(*id, r);
        r
    }

    /// Counts the communicators of `id` with root `r` (a grow id: its new ranks are
    /// counted with the communicator they grow), unless `id` has a root already.
    pub(crate) fn alias_root(&mut self, id: &IdBytes, r: RootIdx) {
        self.roots.entry(*id).or_insert(r);
    }

    /// The stats index of a root id, if it was ever used.
    pub(crate) fn find_root(&self, id: &IdBytes) -> Option<RootIdx> {
        self.roots.get(id).copied()
    }

    /// The unique id interned as `r`.
    pub(crate) fn root_id(&self, r: RootIdx) -> Option<ncclUniqueId> {
        let id = self.roots.iter().find(|(_, &v)| v == r)?.0;
        Some(super::defs::unique_id_of(*id))
    }

    /// Applies `f` to the process totals and to `root`'s stats.
    pub(crate) fn count(&mut self, root: Option<RootIdx>, f: impl Fn(&mut HostStats)) {
        f(&mut self.total);
        if let Some(s) = root.and_then(|r| self.root_stats.get_mut(r)) {
            f(s);
        }
    }

    /// Records a misuse of entry point `what` and returns the failure to report: `code`
    /// (ncclInvalidArgument or ncclInvalidUsage) and "invalid argument: {what}: {m}" (or
    /// "invalid usage: ...").
    pub(crate) fn misuse(
        &mut self,
        root: Option<RootIdx>,
        code: ncclResult_t,
        what: &str,
        m: impl std::fmt::Display,
    ) -> Fail {
        let f = Fail::new(code, format!("{what}: {m}"));
        self.count(root, |s| s.misused += 1);
        if self.misuse_log.len() >= 64 {
            self.misuse_log.pop_front();
        }
        self.misuse_log.push_back(f.msg.clone());
        f
    }

    /// A non-blocking group end of `handles`: links its job to each that has none
    /// (group.cc:802-818 of v2.29.7-1).
    pub(crate) fn link_group_job(&mut self, handles: &[Handle]) {
        self.next_group_job += 1;
        let id = self.next_group_job;
        let mut refs = 0;
        for h in handles {
            if let Some(c) = self
                .comms
                .get_mut(h)
                .filter(|c| c.nonblocking && c.group_job.is_none())
            {
                c.group_job = Some(id);
                refs += 1;
            }
        }
        if refs > 0 {
            self.group_jobs.insert(id, refs);
        }
    }

    /// Drops a reference to `h`'s linked job (`take`: and unlinks it), deleting the job
    /// at zero; a job already deleted is a use after free in NCCL: counted as misuse.
    fn unref_group_job(&mut self, h: Handle, what: &str, take: bool) {
        let Some(c) = self.comms.get_mut(&h) else {
            return;
        };
        let root = c.root;
        let Some(id) = (if take {
            c.group_job.take()
        } else {
            c.group_job
        }) else {
            return;
        };
        match self.group_jobs.get_mut(&id) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.group_jobs.remove(&id);
            }
            None => {
                let m = "the communicator's group job was deleted by an earlier ncclCommRevoke, which left it linked (ncclCommEnsureReady -> ncclGroupJobAbort, init.cc:2664 -> 404 and group.cc:873-884 of v2.29.7-1): a use after free in NCCL; revoke only a communicator whose last ncclCommGetAsyncError read ncclSuccess, abort the others";
                self.misuse(Some(root), ncclInvalidUsage, what, m);
            }
        }
    }

    /// An `ncclCommGetAsyncError` (or `ncclCommEnsureReady`) that read ncclSuccess on `h`:
    /// completes and unlinks its job (init.cc:3105-3110 of v2.29.7-1).
    pub(crate) fn complete_group_job(&mut self, h: Handle, what: &str) {
        self.unref_group_job(h, what, true);
    }

    /// `ncclCommEnsureReady` under the abort flags (a revoke's, an abort's): aborts `h`'s
    /// job (init.cc:403-404 of v2.29.7-1) and leaves it linked, deleted or not (`gone`:
    /// the communicator is freed right after, as an abort's is).
    pub(crate) fn abort_group_job(&mut self, h: Handle, what: &str, gone: bool) {
        self.unref_group_job(h, what, gone);
    }

    /// [`Global::misuse`] with ncclInvalidArgument.
    pub(crate) fn invalid(
        &mut self,
        root: Option<RootIdx>,
        what: &str,
        m: impl std::fmt::Display,
    ) -> Fail {
        self.misuse(root, ncclInvalidArgument, what, m)
    }

    /// A new handle in state `Pending`, not yet counted as created, keeping `commName`
    /// pointer `name`.
    pub(crate) fn new_handle(
        &mut self,
        root: RootIdx,
        device: c_int,
        nonblocking: bool,
        name: usize,
    ) -> Handle {
        self.next_handle += 1;
        let h = HANDLE_BASE + 16 * self.next_handle;
        self.comms.insert(
            h,
            Comm {
                state: CommState::Pending,
                root,
                device,
                nonblocking,
                finalized: false,
                coll_seq: 0,
                abort_shrinks: 0,
                p2p_seq: HashMap::new(),
                redops: HashMap::new(),
                next_redop: ncclNumOps,
                pending_on: PendingOn::Nothing,
                deadline: Instant::now() + wait_limit(),
                async_job: AsyncJob::Idle,
                name,
                revoked: false,
                error_cleared: false,
                grows: 0,
                grow_parent: None,
                shared_join: None,
                destroy_called: false,
                group_job: None,
                stale_windows: 0,
                suspended: false,
            },
        );
        h
    }

    /// Counts `h` as handed to the user.
    pub(crate) fn count_created(&mut self, h: Handle) {
        let root = self.comms.get(&h).map(|c| c.root);
        self.count(root, |s| s.created += 1);
    }

    /// Drops a handle that was never handed to the user (a failed blocking init).
    pub(crate) fn forget_handle(&mut self, h: Handle) {
        if let Some(c) = self.comms.remove(&h) {
            self.dead.insert(h, c.root);
            if let CommState::Ready { clique, .. } = c.state {
                self.leave_clique(clique);
            }
        }
    }

    /// A new clique with `handles[i]` as rank i (all set `Ready`).
    pub(crate) fn new_clique(&mut self, root: RootIdx, handles: &[Handle]) {
        let n = handles.len();
        let world = CommWorld {
            nranks: n as i32,
            root,
            members: n,
            ..Default::default()
        };
        self.add_clique(world, handles.iter().copied().zip(0..))
    }

    /// A clique for handle `h`, rank `rank` of a communicator across processes.
    pub(crate) fn new_shared_clique(
        &mut self,
        root: RootIdx,
        h: Handle,
        seg: std::sync::Arc<super::shm::Segment>,
        nranks: i32,
    ) {
        let rank = seg.rank() as i32;
        let world = CommWorld {
            nranks,
            root,
            members: 1,
            shared: Some(seg),
            ..Default::default()
        };
        self.add_clique(world, [(h, rank)])
    }

    /// Adds clique `world` and sets each of its `(handle, rank)` members `Ready`.
    fn add_clique(&mut self, world: CommWorld, members: impl IntoIterator<Item = (Handle, i32)>) {
        self.next_clique += 1;
        let clique = self.next_clique;
        self.cliques.insert(clique, world);
        for (h, rank) in members {
            if let Some(c) = self.comms.get_mut(&h) {
                c.state = CommState::Ready { clique, rank };
                c.pending_on = PendingOn::Nothing;
            }
        }
    }

    /// One member handle of `clique` is gone; drop the clique when it has none and no
    /// execution is in flight.
    pub(crate) fn leave_clique(&mut self, clique: u64) {
        if let Some(c) = self.cliques.get_mut(&clique) {
            c.members = c.members.saturating_sub(1);
            if c.members == 0 && !c.executing() {
                self.cliques.remove(&clique);
            }
        }
    }

    /// Marks a clique aborted (waking its waiters); the first reason wins.
    pub(crate) fn abort_clique(&mut self, clique: u64, why: Fail) {
        if let Some(c) = self.cliques.get_mut(&clique) {
            if c.aborted.is_none() {
                c.aborted = Some(why);
            }
        }
        notify();
    }

    /// Fails every handle of the rendezvous that `h` waits on.
    pub(crate) fn fail_pending(&mut self, on: PendingOn, why: Fail) {
        let handles: Vec<Handle> = match on {
            PendingOn::Init(id) => match self.inits.remove(&id) {
                Some(p) => {
                    self.failed_ids.insert(id, why.clone());
                    p.posts.iter().map(|&(_, h)| h).collect()
                }
                None => Vec::new(),
            },
            PendingOn::Rdv { clique, seq } => self
                .cliques
                .get_mut(&clique)
                .and_then(|c| c.rdv.remove(&seq))
                .map(|s| s.posts.iter().filter_map(|p| p.3).collect())
                .unwrap_or_default(),
            PendingOn::Nothing => Vec::new(),
        };
        for h in handles {
            if let Some(c) = self.comms.get_mut(&h) {
                if matches!(c.state, CommState::Pending) {
                    c.state = CommState::Failed(why.clone());
                    c.pending_on = PendingOn::Nothing;
                }
            }
        }
        notify();
    }

    /// Fails `h`'s rendezvous with `ncclTimeout` when its deadline has passed.
    pub(crate) fn check_pending_deadline(&mut self, h: Handle) {
        let Some(c) = self.comms.get(&h) else { return };
        if matches!(c.state, CommState::Pending) && Instant::now() >= c.deadline {
            let msg = format!(
                "communicator initialization did not complete within {:?} (NCCL_SAFE_HOST_TIMEOUT_MS)",
                wait_limit()
            );
            self.fail_handle(h, Fail::new(ncclTimeout, msg));
        }
    }

    /// Fails the rendezvous the pending handle `h` waits on, and `h` itself (when it is
    /// still pending), with `why`.
    pub(crate) fn fail_handle(&mut self, h: Handle, why: Fail) {
        let Some(on) = self.comms.get(&h).map(|c| c.pending_on.clone()) else {
            return;
        };
        self.fail_pending(on, why.clone());
        if let Some(c) = self.comms.get_mut(&h) {
            if matches!(c.state, CommState::Pending) {
                c.state = CommState::Failed(why);
            }
        }
    }

    /// Posts rank `rank`'s part of an init on `id`.
    pub(crate) fn post_init(&mut self, id: IdBytes, nranks: i32, rank: i32, h: Handle) {
        if let Some(f) = self.failed_ids.get(&id).cloned() {
            if let Some(c) = self.comms.get_mut(&h) {
                c.state = CommState::Failed(f);
            }
            return;
        }
        if let Some(c) = self.comms.get_mut(&h) {
            c.pending_on = PendingOn::Init(id);
        }
        let p = self.inits.entry(id).or_insert(PendingInit {
            nranks,
            posts: Vec::new(),
        });
        let clash = if p.nranks != nranks {
            let theirs = p.nranks;
            Some(format!(
                "ranks disagree on nranks for one unique id ({theirs} vs {nranks})"
            ))
        } else if p.posts.iter().any(|&(r, _)| r == rank) {
            Some(format!("rank {rank} joined the same unique id twice"))
        } else {
            None
        };
        p.posts.push((rank, h));
        if let Some(msg) = clash {
            self.fail_pending(PendingOn::Init(id), Fail::new(ncclInvalidArgument, msg));
            return;
        }
        if p.posts.len() == nranks as usize {
            let mut posts = match self.inits.remove(&id) {
                Some(p) => p.posts,
                None => return,
            };
            posts.sort_by_key(|&(r, _)| r);
            let handles: Vec<Handle> = posts.iter().map(|&(_, h)| h).collect();
            let root = self.root_of(&id);
            self.new_clique(root, &handles);
            notify();
        }
    }

    /// Posts a split/shrink part into `clique`'s rendezvous `seq`.
    pub(crate) fn post_rdv(
        &mut self,
        clique: u64,
        seq: u64,
        shrink: Option<Vec<i32>>,
        post: (i32, c_int, c_int, Option<Handle>),
    ) -> Result<(), Fail> {
        let Some(cl) = self.cliques.get_mut(&clique) else {
            return Err(Fail::new(ncclInvalidUsage, "communicator's clique is gone"));
        };
        if let Some(c) = post.3.and_then(|h| self.comms.get_mut(&h)) {
            c.pending_on = PendingOn::Rdv { clique, seq };
        }
        let expected = cl.nranks as usize - shrink.as_ref().map_or(0, |e| e.len());
        let rdv = cl.rdv.entry(seq).or_insert(SplitRdv {
            shrink: shrink.clone(),
            expected,
            posts: Vec::new(),
        });
        rdv.posts.push(post);
        if rdv.shrink != shrink {
            let msg =
                "ranks disagree on the split/shrink (different exclude lists or split vs shrink)";
            self.fail_pending(
                PendingOn::Rdv { clique, seq },
                Fail::new(ncclInvalidArgument, msg),
            );
            return Ok(());
        }
        if rdv.posts.len() < rdv.expected {
            return Ok(());
        }
        let root = cl.root;
        let Some(mut rdv) = cl.rdv.remove(&seq) else {
            return Ok(());
        };
        // One child per color (NOCOLOR makes none), its ranks ordered by (key, parent rank).
        rdv.posts.sort_by_key(|p| (p.1, p.2, p.0));
        for members in rdv.posts.chunk_by(|a, b| a.1 == b.1) {
            if members[0].1 != NCCL_SPLIT_NOCOLOR {
                let handles: Vec<Handle> = members.iter().filter_map(|p| p.3).collect();
                self.new_clique(root, &handles);
            }
        }
        notify();
        Ok(())
    }
}
