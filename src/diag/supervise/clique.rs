//! What the ranks of one communicator in this process know about each other: each rank's
//! last operation, the clique's first timeout (the report every rank fails fast with), the
//! rank that left and the ranks lost, the agreements of a recovery, and the fingerprint
//! exchange (for the opt-in check, `observe::fingerprint`).
//!
//! A clique is keyed by a hash of the unique id (plus the split path for children); all
//! ranks of it that live in this process share one [`Clique`]. Ranks in other processes are
//! known from the job's desync board when the clique has one. The words of a failure, the
//! desync report, are the observers' ([`Observers`], given at [`join`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use nccl_sys::EntryPoint;

use super::record::{OpRecord, OpState};
use crate::diag::key::CliqueKey;
use crate::diag::remote::{DesyncPost, RemoteBoard};
use crate::teardown::lock;

/// How many sequence numbers of fingerprints each rank keeps in the exchange. A rank cannot
/// post seq n+1 before every rank posted seq n, so two would do.
pub(crate) const FINGERPRINT_DEPTH: usize = 4;

/// The report of a clique's first timeout: which operation of which rank ran out of time,
/// and the text every rank's error carries. It reads as its text.
#[derive(Debug)]
pub(crate) struct TimeoutReport {
    /// The rank whose operation timed out (`usize::MAX` when no operation is known).
    pub rank: usize,
    /// That operation's NCCL call (`None` when no operation is known).
    pub op: Option<EntryPoint>,
    /// Its collective sequence number.
    pub seq: u64,
    pub text: Box<str>,
    /// The rank whose departure failed the clique (not a timeout), if so.
    pub left: Option<usize>,
    /// After a timeout: the one rank that never reached the collective the others waited
    /// in (the report's only rank behind, or only silent one on the desync board), if
    /// exactly one did.
    pub behind: Option<usize>,
}

impl TimeoutReport {
    /// The report of `rec` on rank `rank`.
    pub(crate) fn of(rank: usize, rec: &OpRecord, report: Report) -> Arc<TimeoutReport> {
        Arc::new(TimeoutReport {
            rank,
            op: Some(rec.op),
            seq: rec.seq,
            text: report.text.into(),
            left: None,
            behind: report.behind,
        })
    }

    /// A report known only by its text.
    pub(crate) fn text(text: &str) -> Arc<TimeoutReport> {
        Arc::new(TimeoutReport {
            rank: usize::MAX,
            op: None,
            seq: u64::MAX,
            text: text.into(),
            left: None,
            behind: None,
        })
    }

    /// Whether it reports operation `op` (sequence number `seq`) of rank `rank`.
    pub(crate) fn is_about(&self, rank: usize, op: EntryPoint, seq: u64) -> bool {
        self.rank == rank && self.op == Some(op) && self.seq == seq
    }
}

impl std::fmt::Display for TimeoutReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::ops::Deref for TimeoutReport {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

/// What one rank was last seen doing.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RankView {
    /// A communicator of this rank is (or was) attached in this process.
    pub present: bool,
    /// It was torn down.
    pub gone: bool,
    /// Collectives issued so far (the next one gets this sequence number).
    pub issued: u64,
    /// The last operation.
    pub last: Option<OpRecord>,
}

/// The shape of a collective that every rank must agree on, and where it was called.
pub(crate) type Fingerprint = OpRecord;

#[derive(Debug)]
pub(crate) struct CliqueState {
    /// Per rank, its last [`FINGERPRINT_DEPTH`] fingerprints (a ring by sequence number): the
    /// fingerprint exchange of [`Clique::exchange`].
    fingerprints: Vec<[Option<Fingerprint>; FINGERPRINT_DEPTH]>,
    /// Set once, by the first timeout: the report every later call returns.
    pub timed_out: Option<Arc<TimeoutReport>>,
}

/// A rank of a clique: its live communicator's diagnostics, and its recorded view.
type Member = (Option<Weak<dyn LiveRank>>, RankView);

#[derive(Debug)]
pub(crate) struct Clique {
    pub key: CliqueKey,
    pub world_size: usize,
    state: Mutex<CliqueState>,
    /// Per rank: its live communicator's diagnostics, read when a report is built (the
    /// per-operation path writes nothing here), and what was recorded when it was torn
    /// down (or set directly).
    ranks: Vec<Mutex<Member>>,
    cv: Condvar,
    /// Mirrors `CliqueState::timed_out.is_some()`, so the per-operation check takes no lock.
    any_timeout: AtomicBool,
    /// The job's desync board in another process, read and posted to by [`Clique::report`]
    /// and by departures.
    board: OnceLock<Arc<dyn RemoteBoard>>,
    /// What the observers say about a failure of this clique (its desync report).
    observers: &'static Observers,
    /// The first rank that left (its communicator torn down, or its launcher closure
    /// returned) while the clique was healthy.
    departed: OnceLock<Departure>,
    /// Per rank of this process: the ranks it found gone when it began its recovery
    /// ([`Clique::agree_lost`]).
    recovering: Mutex<BTreeMap<usize, Vec<usize>>>,
    /// Per rank of this process: the exclude list of each of its shrinks of this clique's
    /// communicator, in call order ([`Clique::agree_exclude`]).
    shrinks: Mutex<BTreeMap<usize, Vec<Vec<usize>>>>,
    /// A worker of the watchdog handles a timeout of this clique right now (its report,
    /// claims, revokes): the watchdog hands it no second one meanwhile
    /// (`watchdog::sweep`), so each communicator has one claimer at a time.
    pub(crate) expiring: AtomicBool,
}

/// A rank that left its clique: no collective of sequence number `issued` or later will
/// ever come from it.
#[derive(Debug, Clone)]
pub(crate) struct Departure {
    pub rank: usize,
    /// Collectives it issued before it left.
    pub issued: u64,
    /// How it left, and its last call.
    pub how: String,
    /// Its last collectives (sequence number, NCCL call), oldest first, as far as its
    /// flight record still held them; empty for a rank of another process.
    pub recent: Vec<(u64, EntryPoint)>,
}

impl Departure {
    /// Whether the departed rank never issued `rec`, a collective of a peer: `rec` comes
    /// at or after the last sequence number it issued, or the departed rank's collective
    /// of that number was another call (a window it deregistered as it left, or one only
    /// it registered, took the number the peer's collective has: the peer waits for a
    /// call that will never come all the same).
    fn never_issued(&self, rec: &OpRecord) -> bool {
        rec.seq >= self.issued
            || self
                .recent
                .iter()
                .any(|&(seq, op)| seq == rec.seq && op != rec.op)
    }
}

/// How long no further rank must be found lost before a recovery across processes shrinks
/// ([`Clique::settled`]).
pub(crate) const SETTLE: Duration = Duration::from_millis(50);

/// Every clique of this process, by key.
static REGISTRY: Mutex<BTreeMap<CliqueKey, Weak<Clique>>> = Mutex::new(BTreeMap::new());

/// The clique `key` of `world_size` ranks, shared by every rank of it in this process.
/// `observers` build its reports (`diag::observe` gives them, through the hooks).
pub(crate) fn join(
    key: CliqueKey,
    world_size: usize,
    observers: &'static Observers,
) -> Arc<Clique> {
    let mut r = lock(&REGISTRY);
    r.retain(|_, w| w.strong_count() > 0);
    if let Some(c) = r.get(&key).and_then(Weak::upgrade) {
        if c.world_size == world_size {
            return c;
        }
    }
    let c = Arc::new(Clique {
        key,
        world_size,
        state: Mutex::new(CliqueState {
            fingerprints: vec![[None; FINGERPRINT_DEPTH]; world_size],
            timed_out: None,
        }),
        ranks: (0..world_size).map(|_| Mutex::default()).collect(),
        cv: Condvar::new(),
        any_timeout: AtomicBool::new(false),
        board: OnceLock::new(),
        observers,
        departed: OnceLock::new(),
        recovering: Mutex::new(BTreeMap::new()),
        shrinks: Mutex::new(BTreeMap::new()),
        expiring: AtomicBool::new(false),
    });
    r.insert(key, Arc::downgrade(&c));
    c
}

/// How the comparison of a shrink's exclude list ended ([`Clique::agree_exclude`]).
pub(crate) enum ExcludeAgreement {
    /// Every other rank of this process that stays shrinks with the same list.
    Agree,
    /// Two ranks listed different ranks: every list posted for this shrink, by rank.
    Mismatch(Vec<(usize, Vec<usize>)>),
    /// These ranks of this process, staying by this rank's list, never called their
    /// shrink before the deadline.
    Missing(Vec<usize>),
}

/// A rank's live diagnostics, as the clique sees them: what it is doing now. Implemented by
/// the communicator's shared diagnostics state, which holds the clique (so the clique holds
/// it weakly, and only through this view).
pub(crate) trait LiveRank: Send + Sync {
    /// What the rank is doing now.
    fn view(&self) -> RankView;
}

/// What the observers (`diag::observe`) say about a failure, which supervision asks for
/// on its cold paths only (a timeout, the watchdog's notice): the one edge from
/// supervision up to the observers, inverted. The hooks give every clique the observers'
/// table when they join it ([`join`]); nothing on an operation's path calls through it.
#[derive(Debug)]
pub(crate) struct Observers {
    /// The desync report ([`Clique::report`], with its arguments).
    pub report: ReportFn,
    /// Posts this process's ranks' last operations to the board ([`Clique::post_waiting`]).
    pub post_waiting: fn(&Clique),
}

/// Builds a clique's desync report: [`Clique::report`]'s arguments, the clique first.
pub(crate) type ReportFn =
    fn(&Clique, usize, &OpRecord, Duration, &str, bool, Option<&[usize]>) -> Report;

/// How a fingerprint exchange ended ([`Clique::exchange`]).
pub(crate) enum Exchanged<R> {
    /// Every rank posted its fingerprint: what the comparison made of them.
    Posted(R),
    /// The clique timed out (the report), or our wait ran out (`None`: build the report).
    TimedOut(Option<Arc<TimeoutReport>>),
}

impl Clique {
    /// Rank `rank`'s view: its live communicator's, else the one recorded last.
    pub(crate) fn view(&self, rank: usize) -> RankView {
        let Some(m) = self.ranks.get(rank) else {
            return RankView::default();
        };
        let (live, last) = {
            let m = lock(m);
            (m.0.as_ref().and_then(Weak::upgrade), m.1)
        };
        live.map_or(last, |s| s.view())
    }

    /// The ranks in this process whose communicator is not torn down, with their views.
    pub(crate) fn here(&self) -> impl Iterator<Item = (usize, RankView)> + '_ {
        (0..self.world_size)
            .map(|r| (r, self.view(r)))
            .filter(|(_, v)| v.present && !v.gone)
    }

    /// The ranks in this process, not torn down, that have not issued collective `seq`.
    pub(crate) fn behind_here(&self, seq: u64) -> Vec<usize> {
        (self.here().filter(|(_, v)| v.issued <= seq))
            .map(|(r, _)| r)
            .collect()
    }

    /// How many ranks of the clique have had a communicator in this process.
    pub(crate) fn local_ranks(&self) -> usize {
        self.ranks.iter().filter(|m| lock(m).1.present).count()
    }

    /// Rank `rank`'s communicator joined with its diagnostics `s`.
    pub(crate) fn attach(&self, rank: usize, s: Weak<dyn LiveRank>) {
        if let Some(m) = self.ranks.get(rank) {
            let mut m = lock(m);
            m.0 = Some(s);
            m.1.present = true;
        }
    }

    /// Rank `rank`'s communicator is torn down; `last` is what it was last seen doing.
    pub(crate) fn detach(&self, rank: usize, last: RankView) {
        if let Some(m) = self.ranks.get(rank) {
            *lock(m) = (None, last);
        }
    }

    /// Rank `rank` leaves (`how`: its communicator was torn down, or its launcher closure
    /// returned) having issued what `view` says. The first departure is kept. When a rank
    /// still here has already issued a collective beyond the departed rank's last, it waits
    /// for a collective that will never come: the clique fails at once with a report
    /// naming the departed rank (the watchdog then aborts the ranks in flight). Returns
    /// that report.
    ///
    /// `broken`: it left by an abort. Then no collective of the clique can complete again,
    /// so the clique fails at once, waiting ranks or not (every rank's `is_failed()`).
    ///
    /// `recent`: the rank's last collectives (sequence number, call), oldest first, so that
    /// a peer whose collective of a number the rank issued as another call also counts as
    /// waiting for it.
    pub(crate) fn depart(
        &self,
        rank: usize,
        view: RankView,
        recent: Vec<(u64, EntryPoint)>,
        how: &str,
        broken: bool,
    ) -> Option<Arc<TimeoutReport>> {
        if self.any_timeout() || self.world_size < 2 {
            return None;
        }
        let last = match &view.last {
            Some(l) => format!(
                "its last call was {} seq {} at {}",
                l.signature(),
                l.seq,
                l.at()
            ),
            None => "it made no call".to_string(),
        };
        let mut first = false;
        let mine = Departure {
            rank,
            issued: view.issued,
            how: format!("{how} after {} collective(s); {last}", view.issued),
            recent,
        };
        let mut mine = Some(mine);
        let d = self.departed.get_or_init(|| {
            first = true;
            mine.take().expect("taken once")
        });
        if d.rank != rank {
            // Another rank left first (say by `destroy()`, or an `abort()` that broke no
            // peer's wait): an abort of this one still leaves no collective that can
            // complete.
            return match (broken, mine) {
                (true, Some(mine)) => Some(self.fail_for_departure(&mine, None, None)),
                _ => None,
            };
        }
        if first {
            self.post_departure(d);
        }
        if broken {
            return Some(self.fail_for_departure(d, None, None));
        }
        // A rank of this process already in such a collective (the watchdog finds the
        // others, and later ones, within a tick).
        let (waiting, rec) = self.here().find_map(|(r, v)| {
            let l = v.last.filter(|l| l.state == OpState::Enqueued)?;
            (r != rank && self.waits_for_departed(r, &l).is_some()).then_some((r, l))
        })?;
        Some(self.fail_for_departure(d, Some(waiting), Some(&rec)))
    }

    /// Rank `rank` begins its recovery having found `lost` gone (`lost_now`, read again
    /// while it waits): it waits until every other rank of this process in the clique also
    /// began its recovery or tore its communicator down (until `deadline` at most), and
    /// returns the union of what they found, with the ranks torn down meanwhile. The ranks
    /// of this process that recover together thus exclude the same ranks, however their
    /// losses were staggered; ranks of other processes are not waited for.
    pub(crate) fn agree_lost(
        &self,
        rank: usize,
        mut lost_now: impl FnMut() -> Vec<usize>,
        deadline: Instant,
    ) -> Vec<usize> {
        let post = |mine: Vec<usize>| {
            let mut posts = lock(&self.recovering);
            let v = posts.entry(rank).or_default();
            v.extend(mine);
            v.sort_unstable();
            v.dedup();
        };
        post(lost_now());
        loop {
            let torn = self.torn_down();
            let union = {
                let posts = lock(&self.recovering);
                let mut u: Vec<usize> = posts.values().flatten().copied().collect();
                u.extend(&torn);
                u.retain(|&r| r != rank);
                u.sort_unstable();
                u.dedup();
                // A rank named lost (stuck, say) is not waited for.
                let waiting = self.here().any(|(r, _)| {
                    r != rank && !posts.contains_key(&r) && u.binary_search(&r).is_err()
                });
                (!waiting).then_some(u)
            };
            if let Some(u) = union {
                return self.settled(rank, u, &mut lost_now, deadline);
            }
            if Instant::now() >= deadline {
                post(lost_now());
                let mut u: Vec<usize> =
                    lock(&self.recovering).values().flatten().copied().collect();
                u.extend(self.torn_down());
                u.retain(|&r| r != rank);
                u.sort_unstable();
                u.dedup();
                return u;
            }
            std::thread::sleep(Duration::from_millis(1));
            post(lost_now());
        }
    }

    /// `lost` once no further rank has been found lost for [`SETTLE`], when the clique has
    /// ranks in other processes (until `deadline` at most): nothing tells them which ranks
    /// this one excludes, and ranks lost within moments of each other (two processes
    /// killed at once, a rank dying as the recovery begins) are seen a few milliseconds
    /// apart. A shrink must name them all the first time: NCCL sets the parent's error
    /// when a shrink fails (group.cc:700-701 of 2.29.7), and a communicator is revoked at
    /// most once (init.cc:2655-2657), so a failed shrink cannot be tried again.
    fn settled(
        &self,
        rank: usize,
        mut lost: Vec<usize>,
        lost_now: &mut impl FnMut() -> Vec<usize>,
        deadline: Instant,
    ) -> Vec<usize> {
        let present = (0..self.world_size)
            .filter(|&r| self.view(r).present)
            .count();
        if present == self.world_size {
            return lost;
        }
        let mut quiet_since = Instant::now();
        loop {
            let now = Instant::now();
            if now.duration_since(quiet_since) >= SETTLE || now >= deadline {
                return lost;
            }
            std::thread::sleep(Duration::from_millis(2));
            let mut more = lost_now();
            more.extend(self.torn_down());
            more.retain(|&r| r != rank && lost.binary_search(&r).is_err());
            if !more.is_empty() {
                lost.extend(more);
                lost.sort_unstable();
                lost.dedup();
                quiet_since = Instant::now();
            }
        }
    }

    /// Rank `rank` shrinks this clique's communicator excluding `exclude` (sorted): it
    /// posts the list as its next shrink's and compares it with the lists that the ranks
    /// of this process staying by its list (not excluded, not torn down) posted for their
    /// shrink of the same number, until each of them has posted (or `deadline`). Two
    /// ranks that would build one child thus both see a mismatch, or both agree. NCCL
    /// compares nothing (init.cc:2758, 1609-1622 of v2.29.7-1: each rank's job builds its
    /// child from its own list), so ranks that disagree would wait in the child's
    /// bootstrap until a timeout; here each of them sees the other's list first. Ranks of
    /// other processes are not compared, nor ranks whose init has not returned yet (not
    /// attached: they may be in another process).
    pub(crate) fn agree_exclude(
        &self,
        rank: usize,
        exclude: &[usize],
        deadline: Instant,
    ) -> ExcludeAgreement {
        let n = {
            let mut posts = lock(&self.shrinks);
            let mine = posts.entry(rank).or_default();
            mine.push(exclude.to_vec());
            mine.len() - 1
        };
        let stays = |r: usize| r != rank && exclude.binary_search(&r).is_err();
        loop {
            {
                let posts = lock(&self.shrinks);
                let posted = || posts.iter().filter_map(|(&r, v)| Some((r, v.get(n)?)));
                // Only the lists of the ranks this one's child would hold matter: a rank
                // this one excludes builds no child with it (and, listing this rank among
                // those that stay, sees the mismatch itself).
                if posted().any(|(r, l)| stays(r) && l.as_slice() != exclude) {
                    return ExcludeAgreement::Mismatch(
                        posted().map(|(r, l)| (r, l.clone())).collect(),
                    );
                }
                let missing: Vec<usize> = (self.here().map(|(r, _)| r))
                    .filter(|&r| stays(r))
                    .filter(|r| posts.get(r).is_none_or(|v| v.len() <= n))
                    .collect();
                if missing.is_empty() {
                    return ExcludeAgreement::Agree;
                }
                if Instant::now() >= deadline {
                    return ExcludeAgreement::Missing(missing);
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// After [`agree_exclude`](Self::agree_exclude) agreed among the ranks of this process:
    /// compares `exclude` (sorted; this rank's `n`-th shrink of the clique, `n` from its
    /// count of posted lists) with the lists of the ranks of other processes that it keeps,
    /// through the job's desync board. Each rank posts its list as a post of its own
    /// (another key than the clique's reports, so the reports, departures and waits never
    /// read it) and reads the board until every kept rank of another process posted its
    /// list for the same shrink, bounded by `deadline` and [`EXCLUDE_WAIT`]. `Mismatch`
    /// (this rank's list and every list read) when a kept rank lists others, or already
    /// posted a later shrink's list (it left this one, and will not join it); `Agree` when
    /// all agree, and also without a board, when it cannot be read, or when a kept rank
    /// posted nothing in time: then NCCL's shrink decides, bounded by the timeout.
    pub(crate) fn agree_exclude_remote(
        &self,
        rank: usize,
        exclude: &[usize],
        deadline: Instant,
    ) -> ExcludeAgreement {
        let Some(board) = self.board.get() else {
            return ExcludeAgreement::Agree;
        };
        let n = lock(&self.shrinks)
            .get(&rank)
            .map_or(0, |v| v.len().saturating_sub(1)) as u64;
        let kept: Vec<usize> = (0..self.world_size)
            .filter(|&r| r != rank && exclude.binary_search(&r).is_err())
            .filter(|&r| !self.view(r).present)
            .collect();
        if kept.is_empty() {
            return ExcludeAgreement::Agree;
        }
        let key = exclude_key(self.key);
        // The list's hash decides (a post's text is cut at 1000 bytes); the list follows
        // it for the error's text.
        let text = |l: &[usize]| {
            let v: Vec<String> = l.iter().map(|r| r.to_string()).collect();
            format!("exclude {:016x} {}", list_hash(l), v.join(","))
        };
        let until = deadline.min(Instant::now() + EXCLUDE_WAIT);
        if board
            .post(rank, &DesyncPost::new(key, n, &text(exclude)), until)
            .is_err()
        {
            return ExcludeAgreement::Agree;
        }
        loop {
            let Ok(posts) = board.fetch(until) else {
                return ExcludeAgreement::Agree;
            };
            // A rank's list for this shrink, or for a later one of its own: a rank that
            // posted a later shrink's list left this one (its lists disagreed with another
            // rank's, or its call failed) and will not join this rank's child, so it
            // counts as a disagreement at once rather than as a rank yet to post.
            let list_of = |r: usize| -> Option<(u64, Vec<usize>, bool)> {
                let p = posts.get(r)?.as_ref()?;
                if p.clique != key || p.issued < n || p.left {
                    return None;
                }
                let (hash, l) = p.text.strip_prefix("exclude ")?.split_once(' ')?;
                let l = l.split(',').filter_map(|x| x.trim().parse().ok()).collect();
                Some((u64::from_str_radix(hash, 16).ok()?, l, p.issued > n))
            };
            let lists: Vec<(usize, u64, Vec<usize>, bool)> = (0..self.world_size)
                .filter(|&r| r != rank)
                .filter_map(|r| {
                    let (h, l, later) = list_of(r)?;
                    Some((r, h, l, later))
                })
                .collect();
            let mine = list_hash(exclude);
            if (lists.iter()).any(|(r, h, _, later)| kept.contains(r) && (*h != mine || *later)) {
                let mut all: Vec<(usize, Vec<usize>)> =
                    lists.into_iter().map(|(r, _, l, _)| (r, l)).collect();
                all.push((rank, exclude.to_vec()));
                all.sort_unstable();
                return ExcludeAgreement::Mismatch(all);
            }
            let missing = kept.iter().any(|r| !lists.iter().any(|(q, ..)| q == r));
            if !missing || Instant::now() >= until {
                return ExcludeAgreement::Agree;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The ranks of this process whose communicator of this clique was torn down.
    pub(crate) fn torn_down(&self) -> Vec<usize> {
        (0..self.world_size)
            .filter(|&r| {
                let v = self.view(r);
                v.present && v.gone
            })
            .collect()
    }

    /// The ranks of other processes that posted their departure from this clique on the
    /// job's desync board, read once (bounded); empty without a board.
    pub(crate) fn departed_on_board(&self) -> Vec<usize> {
        let Some(board) = self.board.get() else {
            return Vec::new();
        };
        let Ok(posts) = board.fetch(Instant::now() + BOARD_IO) else {
            return Vec::new();
        };
        (posts.into_iter().enumerate())
            .filter(|(r, p)| {
                *r < self.world_size
                    && !self.view(*r).present
                    && p.as_ref().is_some_and(|p| p.left && p.clique == self.key)
            })
            .map(|(r, _)| r)
            .collect()
    }

    /// The rank that left this clique first, other than `rank`, if any.
    pub(crate) fn departed_other_than(&self, rank: usize) -> Option<&Departure> {
        self.departed.get().filter(|d| d.rank != rank)
    }

    /// The departure that rank `r`'s operation `rec` waits for, if any: the operation is a
    /// collective the departed rank never issued.
    pub(crate) fn waits_for_departed(&self, rank: usize, rec: &OpRecord) -> Option<&Departure> {
        let d = self.departed.get()?;
        // Only the calls that need every rank: not point-to-point (only its peer), a
        // shrink (only the ranks it keeps: the excluded ones may well be gone), or local
        // calls.
        let every_rank = match rec.op.collective() {
            Some(c) => c.every_rank(),
            None => matches!(
                rec.op,
                EntryPoint::ncclCommSplit
                    | EntryPoint::ncclCommWindowRegister
                    | EntryPoint::ncclCommWindowDeregister
            ),
        };
        (d.rank != rank && every_rank && d.never_issued(rec)).then_some(d)
    }

    /// Fails the clique because rank `waiting` (in `rec`) waits for departed `d`.
    pub(crate) fn fail_for_departure(
        &self,
        d: &Departure,
        waiting: Option<usize>,
        rec: Option<&OpRecord>,
    ) -> Arc<TimeoutReport> {
        let op = match rec {
            Some(r) => format!("{} seq {} (called at {})", r.signature(), r.seq, r.at()),
            None => "a collective".to_string(),
        };
        let text = match waiting {
            Some(w) => format!(
                "rank {} left: {}. Rank {w} waits in {op}, a collective rank {} will never call: the clique's communicators are aborted",
                d.rank, d.how, d.rank
            ),
            None => format!(
                "rank {} left: {}: no collective of this clique can complete any more",
                d.rank, d.how
            ),
        };
        let report = Arc::new(TimeoutReport {
            rank: waiting.unwrap_or(usize::MAX),
            op: rec.map(|r| r.op),
            seq: rec.map_or(u64::MAX, |r| r.seq),
            text: text.into(),
            left: Some(d.rank),
            behind: None,
        });
        self.set_timed_out(&report)
    }

    /// Whether a rank of the clique left (one load).
    #[inline]
    pub(crate) fn has_departure(&self) -> bool {
        self.departed.get().is_some()
    }

    /// Whether a rank of another process posted to the board that it waits in collective
    /// `seq` or later (at its timeout, or at the watchdog's notice): then a remote error in
    /// `seq` is most likely that rank's watchdog aborting the clique. Read once, bounded;
    /// false without a board.
    pub(crate) fn remote_waiting(&self, seq: u64) -> bool {
        let Some(board) = self.board.get() else {
            return false;
        };
        let Ok(posts) = board.fetch(Instant::now() + BOARD_IO) else {
            return false;
        };
        (posts.iter().enumerate()).any(|(r, p)| {
            p.as_ref().is_some_and(|p| {
                !p.left && p.clique == self.key && p.issued > seq && !self.view(r).present
            })
        })
    }

    /// Whether the clique timed out (one load).
    #[inline]
    pub(crate) fn any_timeout(&self) -> bool {
        self.any_timeout.load(Ordering::Acquire)
    }

    /// Updates rank `rank`'s recorded view (the tests' stand-in for a rank's communicator).
    #[cfg(test)]
    pub(crate) fn update(&self, rank: usize, f: impl FnOnce(&mut RankView)) {
        if let Some(m) = self.ranks.get(rank) {
            f(&mut lock(m).1);
        }
    }

    /// Gives the clique its remote desync board (the first one given stays), and starts
    /// reading it for ranks of other processes that leave ([`watch_departures`]).
    pub(crate) fn set_board(self: &Arc<Self>, board: &Arc<dyn RemoteBoard>) {
        if self.board.set(Arc::clone(board)).is_ok() && self.world_size > 1 {
            let clique = Arc::downgrade(self);
            // A thread that cannot start leaves departures in other processes to the
            // timeout, as without a board.
            let _ = std::thread::Builder::new()
                .name("nccl-safe-departures".into())
                .spawn(move || watch_departures(clique));
        }
    }

    /// Tells the ranks of other processes, through the board, that `d` (a rank of this
    /// process) left: in the background, so a teardown keeps its bound; the process's exit
    /// waits for the post until its deadline.
    fn post_departure(&self, d: &Departure) {
        let post = DesyncPost::departure(self.key, d.issued, &d.how);
        // Wait a little for it, so that it is on the board before the teardown that follows
        // wakes the peers through the provider: they then read why this rank left
        // ([`Clique::remote_departure`]) rather than the provider's words. Not posted (no
        // thread): the peers fall back to their timeout.
        if let Some(done) = self.post_in_background(vec![(d.rank, post)]) {
            let _ = done.recv_timeout(DEPARTURE_POST_WAIT);
        }
    }

    /// Posts `posts` (rank, post) to the board on a thread of its own, each bounded by
    /// [`BOARD_IO`] (the process's exit waits for them until then). `None` (nothing posted)
    /// without a board, while the process exits, or when no thread starts; else the
    /// receiver hears when they are done.
    pub(crate) fn post_in_background(
        &self,
        posts: Vec<(usize, DesyncPost)>,
    ) -> Option<std::sync::mpsc::Receiver<()>> {
        let board = Arc::clone(self.board.get()?);
        let deadline = Instant::now() + BOARD_IO;
        let posting = crate::teardown::exit::posting(deadline)?;
        let (posted, done) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("nccl-safe-post".into())
            .spawn(move || {
                let _posting = posting;
                for (rank, post) in &posts {
                    let _ = board.post(*rank, post, deadline);
                }
                let _ = posted.send(());
            })
            .ok()?;
        Some(done)
    }

    /// The departure of a rank in another process that the job's desync board holds, read
    /// once (bounded), for a collective that the provider failed with a peer's remote error:
    /// the first one found becomes the clique's departure, so that the error names the rank
    /// that left and how (it panicked, its communicator was dropped, ...) and its last call,
    /// rather than the provider's words ("called ncclCommAbort", "destroyed its
    /// communicator"). `None` without a board, or when no rank of another process posted a
    /// departure.
    pub(crate) fn remote_departure(&self, rank: usize) -> Option<&Departure> {
        let board = self.board.get()?;
        if self.departed.get().is_none() && !self.any_timeout() {
            self.read_departures(board.fetch(Instant::now() + BOARD_IO).ok()?);
        }
        self.departed_other_than(rank)
            .filter(|d| !self.view(d.rank).present)
    }

    /// The first departure posted in `posts` (the board's, as fetched) by a rank of another
    /// process becomes the clique's, unless it timed out or has one: the watchdog then
    /// fails, at its next tick, every rank of this process that waits in a collective that
    /// rank never issued.
    fn read_departures(&self, posts: Vec<Option<DesyncPost>>) {
        let left = (posts.into_iter().enumerate()).find_map(|(r, p)| {
            let mine = |p: &DesyncPost| p.left && p.clique == self.key && r < self.world_size;
            p.filter(|p| mine(p) && !self.view(r).present)
                .map(|p| (r, p))
        });
        if let Some((rank, p)) = left.filter(|_| !self.any_timeout()) {
            let how = format!("{} (another process, from the desync board)", p.text);
            self.depart_elsewhere(rank, p.issued, how);
        }
    }

    /// Rank `rank` of another process left (its post on the board) or died (the provider
    /// saw its process gone) in or before collective `issued`: the clique's departure,
    /// unless one is known already (the first is kept, and returned).
    pub(crate) fn depart_elsewhere(&self, rank: usize, issued: u64, how: String) -> &Departure {
        self.departed.get_or_init(|| Departure {
            rank,
            issued,
            how,
            recent: Vec::new(),
        })
    }

    /// Whether a rank of this process has waited in an operation for at least `age`.
    fn waiting_for(&self, age: Duration) -> bool {
        self.here().any(|(_, v)| {
            v.last
                .is_some_and(|l| l.state == OpState::Enqueued && l.enqueued.elapsed() >= age)
        })
    }

    pub(crate) fn timed_out(&self) -> Option<Arc<TimeoutReport>> {
        if !self.any_timeout.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.state).timed_out.clone()
    }

    /// The job's desync board, if the clique was given one.
    pub(crate) fn board(&self) -> Option<&Arc<dyn RemoteBoard>> {
        self.board.get()
    }

    /// The clique's first departure, if a rank left.
    pub(crate) fn departure(&self) -> Option<&Departure> {
        self.departed.get()
    }

    /// The desync report for rank `rank` stuck in `stuck` (its operation `stuck.seq`),
    /// ending with why this clique was aborted: by this rank's watchdog (`ours`), or by a
    /// rank of another process. `host`: the ranks of other processes the host provider
    /// says have not reached the collective, when it knows. The observers build it
    /// ([`Observers::report`]).
    #[cold]
    pub(crate) fn report(
        &self,
        rank: usize,
        stuck: &OpRecord,
        timeout: Duration,
        what: &str,
        ours: bool,
        host: Option<&[usize]>,
    ) -> Report {
        (self.observers.report)(self, rank, stuck, timeout, what, ours, host)
    }

    /// Posts this process's ranks' last operations to the board, when one of them has
    /// waited long in an operation (the watchdog's notice); the observers do it
    /// ([`Observers::post_waiting`]).
    #[cold]
    pub(crate) fn post_waiting(&self) {
        (self.observers.post_waiting)(self)
    }

    /// Records the clique's first timeout and wakes everyone waiting in the fingerprint exchange.
    pub(crate) fn set_timed_out(&self, report: &Arc<TimeoutReport>) -> Arc<TimeoutReport> {
        let mut s = lock(&self.state);
        let r = s
            .timed_out
            .get_or_insert_with(|| Arc::clone(report))
            .clone();
        self.any_timeout.store(true, Ordering::Release);
        drop(s);
        self.cv.notify_all();
        r
    }

    /// Posts `fp` for rank `rank` and waits (until `deadline`) for every rank's fingerprint
    /// of the same sequence number (the fingerprint exchange); then `compare` reads them,
    /// every rank's last ones and the slot of this sequence number, under the exchange's
    /// lock.
    pub(crate) fn exchange<R>(
        &self,
        rank: usize,
        fp: Fingerprint,
        deadline: Instant,
        compare: impl FnOnce(&[[Option<Fingerprint>; FINGERPRINT_DEPTH]], usize) -> R,
    ) -> Exchanged<R> {
        let slot = (fp.seq % FINGERPRINT_DEPTH as u64) as usize;
        let mut s = lock(&self.state);
        if let Some(b) = s.fingerprints.get_mut(rank) {
            b[slot] = Some(fp);
        }
        self.cv.notify_all();
        // Every rank's fingerprint of this sequence number has been posted.
        let posted = |s: &CliqueState| {
            (s.fingerprints.iter()).all(|b| b[slot].is_some_and(|p| p.seq == fp.seq))
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let waited = self
            .cv
            .wait_timeout_while(s, left, |s| s.timed_out.is_none() && !posted(s));
        let s = waited.unwrap_or_else(|e| e.into_inner()).0;
        if let Some(r) = &s.timed_out {
            Exchanged::TimedOut(Some(Arc::clone(r)))
        } else if !posted(&s) {
            Exchanged::TimedOut(None)
        } else {
            Exchanged::Posted(compare(&s.fingerprints, slot))
        }
    }
}

/// A desync report: its text, and the one rank it finds behind, if exactly one is.
#[derive(Debug)]
pub(crate) struct Report {
    pub text: String,
    pub behind: Option<usize>,
}

/// How long a rank of this process waits in an operation before the clique reads the
/// board for departures, and then how often: a departure reaches a waiting peer in another
/// process within about a second, and a healthy job, whose operations end sooner, never
/// reads the board.
const DEPARTURE_AFTER: Duration = Duration::from_millis(300);
const DEPARTURE_POLL: Duration = Duration::from_millis(200);
/// The longest a shrink waits for the exclude lists of the ranks of other processes it
/// keeps, on the desync board ([`Clique::agree_exclude_remote`]).
pub(crate) const EXCLUDE_WAIT: Duration = Duration::from_secs(2);

/// The key of the exclude lists' posts of the clique `key` on the board: not the clique's
/// own, so no report, departure or wait reads them.
fn exclude_key(key: CliqueKey) -> u64 {
    key.rotate_left(29) ^ 0x5348_524b_4558_434c // "SHRKEXCL"
}

/// FNV-1a over a sorted exclude list (the same in every process, whatever its build).
fn list_hash(l: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for r in l {
        for b in (*r as u64).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Bound on one post to, or read of, the board by the departure path.
const BOARD_IO: Duration = Duration::from_secs(1);
/// How long a departing rank's teardown waits for its post to the board (a loopback or LAN
/// round trip takes milliseconds); a slower post goes on in the background.
const DEPARTURE_POST_WAIT: Duration = Duration::from_millis(500);

/// The clique's departure reader (one thread per clique with a board, ended with the
/// clique or its first departure or timeout): while a rank of this process waits in an
/// operation, reads the board for ranks of other processes that posted a departure
/// ([`DesyncPost::left`]), and records the first as the clique's departure.
fn watch_departures(clique: Weak<Clique>) {
    loop {
        std::thread::sleep(DEPARTURE_POLL);
        let Some(c) = clique.upgrade() else {
            return;
        };
        if c.any_timeout() || c.departed.get().is_some() {
            return;
        }
        if !c.waiting_for(DEPARTURE_AFTER) {
            continue;
        }
        let Some(board) = c.board.get().cloned() else {
            continue;
        };
        if let Ok(posts) = board.fetch(Instant::now() + BOARD_IO) {
            c.read_departures(posts);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::diag::key::fresh_key;
    use crate::diag::remote;

    /// Observers for the tests of the clique's state, which build no report.
    static NO_REPORTS: Observers = Observers {
        report: |_, _, _, _, _, _, _| unreachable!("these tests build no desync report"),
        post_waiting: |_| {},
    };

    /// The clique `key` of `n` ranks, without observers.
    fn join(key: CliqueKey, n: usize) -> Arc<Clique> {
        super::join(key, n, &NO_REPORTS)
    }

    /// A desync board in memory, as the crate nccl-launch's board (over TCP, tested there)
    /// is to a report: rank-indexed latest posts.
    #[derive(Debug, Clone)]
    pub(crate) struct MemBoard(Arc<std::sync::Mutex<Vec<Option<DesyncPost>>>>);

    impl MemBoard {
        pub(crate) fn new(world_size: usize) -> MemBoard {
            MemBoard(Arc::new(std::sync::Mutex::new(vec![None; world_size])))
        }

        pub(crate) fn post(&self, rank: usize, post: &DesyncPost) -> remote::BoardResult<()> {
            let mut b = crate::teardown::lock(&self.0);
            let slot = b.get_mut(rank).ok_or("rank out of range")?;
            *slot = Some(post.clone());
            Ok(())
        }

        pub(crate) fn fetch(&self) -> remote::BoardResult<Vec<Option<DesyncPost>>> {
            Ok(crate::teardown::lock(&self.0).clone())
        }
    }

    impl RemoteBoard for MemBoard {
        fn post(&self, rank: usize, post: &DesyncPost, _: Instant) -> remote::BoardResult<()> {
            MemBoard::post(self, rank, post)
        }

        fn fetch(&self, _: Instant) -> remote::BoardResult<Vec<Option<DesyncPost>>> {
            MemBoard::fetch(self)
        }
    }

    /// A rank's view: attached, `issued` collectives, last doing `last`.
    pub(crate) fn seen(issued: u64, last: Option<OpRecord>) -> RankView {
        RankView {
            present: true,
            gone: false,
            issued,
            last,
        }
    }

    /// An all-reduce of 4 `f32` at `seq`, enqueued `age` ago and not yet started.
    #[track_caller]
    pub(crate) fn enqueued_all_reduce(seq: u64, age: Duration) -> OpRecord {
        OpRecord {
            seq,
            op: EntryPoint::ncclAllReduce,
            dtype: Some(crate::types::DataType::Float32),
            count: 4,
            root: None,
            caller: std::panic::Location::caller(),
            enqueued: Instant::now() - age,
            took: None,
            state: OpState::Enqueued,
        }
    }

    /// Rank 0 of "this process" shrinks excluding rank 2 (its first shrink) while rank 1
    /// of "another process" already posted the list of its second shrink: rank 1 left
    /// this shrink, so rank 0 sees a disagreement at once instead of waiting 2 s for a
    /// post of rank 1's first shrink that never comes and then entering NCCL's call,
    /// where rank 1 never joins it.
    #[test]
    fn a_rank_that_moved_on_to_a_later_shrink_is_a_disagreement() {
        let client = MemBoard::new(3);
        let c = join(fresh_key(), 3);
        c.set_board(&(Arc::new(client.clone()) as Arc<dyn RemoteBoard>));
        let text = format!("exclude {:016x} 2", list_hash(&[2]));
        client
            .post(1, &DesyncPost::new(exclude_key(c.key), 1, &text))
            .unwrap();
        let t = Instant::now();
        let agreed = c.agree_exclude_remote(0, &[2], t + Duration::from_secs(10));
        match agreed {
            ExcludeAgreement::Mismatch(lists) => {
                assert_eq!(lists, vec![(0, vec![2]), (1, vec![2])]);
            }
            ExcludeAgreement::Agree => panic!("expected a mismatch, got an agreement"),
            ExcludeAgreement::Missing(r) => panic!("expected a mismatch, got {r:?} missing"),
        }
        assert!(t.elapsed() < EXCLUDE_WAIT, "{:?}", t.elapsed());
    }

    /// A rank of "this process" that leaves posts its departure to the board, and a rank
    /// of "this process" that waits in a collective learns from the board that a rank of
    /// "another process" left (the clique records that departure, which the watchdog then
    /// turns into `RankLeft` for the waiting rank).
    #[test]
    fn departures_travel_through_the_board_both_ways() {
        let client = MemBoard::new(3);
        let as_board = || Arc::new(client.clone()) as Arc<dyn RemoteBoard>;

        // Posting: rank 2 here leaves after 5 collectives.
        let here = join(fresh_key(), 3);
        here.set_board(&as_board());
        here.update(2, |v| *v = seen(5, None));
        let last = OpRecord {
            state: OpState::Completed,
            ..enqueued_all_reduce(4, Duration::ZERO)
        };
        let view = seen(5, Some(last));
        assert!(here
            .depart(2, view, Vec::new(), "its launcher closure returned", false)
            .is_none());
        let t = Instant::now();
        let posted = loop {
            if let Some(p) = client.fetch().unwrap()[2].clone() {
                break p;
            }
            assert!(t.elapsed() < Duration::from_secs(3), "never posted");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(posted.left, "{posted:?}");
        assert_eq!((posted.clique, posted.issued), (here.key, 5));
        assert!(
            posted.text.starts_with("its launcher closure returned after 5 collective(s); its last call was ncclAllReduce"),
            "{posted:?}"
        );

        // Reading: rank 0 here waits in seq 3 (for longer than the reader's threshold);
        // rank 1 of another process posts that it left after 3 collectives.
        let there = join(fresh_key(), 3);
        there.update(0, |v| {
            *v = seen(4, Some(enqueued_all_reduce(3, Duration::from_secs(1))));
        });
        client
            .post(
                1,
                &DesyncPost::departure(there.key, 3, "its communicator was dropped"),
            )
            .unwrap();
        // A departure of another clique is not this one's.
        client
            .post(2, &DesyncPost::departure(there.key ^ 1, 0, "elsewhere"))
            .unwrap();
        there.set_board(&as_board());
        let t = Instant::now();
        let d = loop {
            if let Some(d) = there.departed.get() {
                break d.clone();
            }
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "the departure was not read"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!((d.rank, d.issued), (1, 3));
        assert!(
            d.how
                .contains("its communicator was dropped (another process"),
            "{d:?}"
        );
        assert!(there
            .waits_for_departed(0, &enqueued_all_reduce(3, Duration::ZERO))
            .is_some());
        assert!(there
            .waits_for_departed(0, &enqueued_all_reduce(2, Duration::ZERO))
            .is_none());
    }

    /// A peer waits for a departed rank in a collective of a number the rank issued as
    /// another call (here a window it registered and deregistered as it left, which the
    /// peer never did): chaos seeds 919, 1941 and 2243, where the peers' collective failed
    /// by the rank's abort and the clique was never failed for an idle rank to see.
    #[test]
    fn a_collective_numbered_as_another_call_of_the_departed_rank_waits_for_it() {
        let c = join(fresh_key(), 3);
        let view = seen(2, None);
        let recent = vec![
            (0, EntryPoint::ncclCommWindowRegister),
            (1, EntryPoint::ncclCommWindowDeregister),
        ];
        assert!(c
            .depart(1, view, recent, "it aborted its communicator", false)
            .is_none());
        let bcast = |seq| OpRecord {
            op: EntryPoint::ncclBroadcast,
            root: Some(0),
            ..enqueued_all_reduce(seq, Duration::ZERO)
        };
        // Below `issued`, yet numbered as the rank's window calls.
        assert!(c.waits_for_departed(0, &bcast(0)).is_some());
        assert!(c.waits_for_departed(2, &bcast(1)).is_some());
        assert!(c.waits_for_departed(0, &bcast(2)).is_some());
        // The same call of the same number: the rank issued it.
        let dereg = OpRecord {
            op: EntryPoint::ncclCommWindowDeregister,
            ..enqueued_all_reduce(1, Duration::ZERO)
        };
        assert!(c.waits_for_departed(0, &dereg).is_none());
        // Beyond what the departure recorded: the number alone decides, as before.
        let c = join(fresh_key(), 2);
        let view = seen(5, None);
        c.depart(
            1,
            view,
            vec![(4, EntryPoint::ncclAllReduce)],
            "it left",
            false,
        );
        assert!(c
            .waits_for_departed(0, &enqueued_all_reduce(3, Duration::ZERO))
            .is_none());
        assert!(c.waits_for_departed(0, &bcast(3)).is_none());
        assert!(c.waits_for_departed(0, &bcast(4)).is_some());
        assert!(c
            .waits_for_departed(0, &enqueued_all_reduce(4, Duration::ZERO))
            .is_none());
    }

    /// A rank that leaves broken (a panic, a failed init) after another left cleanly still
    /// fails the clique: chaos seed 1941, where a rank's init failed by the abort of a
    /// rank that had left first, and the idle rank never saw `is_failed()`.
    #[test]
    fn a_broken_departure_after_another_fails_the_clique() {
        let c = join(fresh_key(), 3);
        let view = seen(2, None);
        assert!(c
            .depart(1, view, Vec::new(), "it aborted its communicator", false)
            .is_none());
        assert!(!c.any_timeout());
        // A clean departure of another rank changes nothing.
        assert!(c
            .depart(2, RankView::default(), Vec::new(), "it destroyed it", false)
            .is_none());
        assert!(!c.any_timeout());
        let r = c
            .depart(0, RankView::default(), Vec::new(), "its init failed", true)
            .expect("the clique fails");
        assert!(c.any_timeout());
        assert_eq!(r.left, Some(0));
        assert!(
            r.text.contains("rank 0 left: its init failed"),
            "{}",
            r.text
        );
    }
}
