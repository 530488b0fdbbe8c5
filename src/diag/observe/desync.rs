//! The desync report: who is behind, and what each rank of a clique was last doing and
//! from which line, built when supervision fails the clique (`Observers::report`); ranks of
//! other processes come from the job's desync board, which the report posts this process's
//! ranks to and reads (only then, and at the watchdog's notice: nothing is sent per
//! operation).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::diag::remote::{BoardError, DesyncPost, RemoteBoard};
use crate::diag::supervise::clique::{Clique, RankView, Report};
use crate::diag::supervise::record::{OpRecord, OpState};

/// The desync report for rank `rank` stuck in `stuck` (its operation `stuck.seq`),
/// ending with why this clique was aborted: by this rank's watchdog (`ours`), or by a
/// rank of another process. `host`: the ranks of other processes the host provider
/// says have not reached the collective, when it knows (used for a rank the desync
/// board has no post of: there is no board, or it cannot be read).
pub(crate) fn report(
    c: &Clique,
    rank: usize,
    stuck: &OpRecord,
    timeout: Duration,
    what: &str,
    ours: bool,
    host: Option<&[usize]>,
) -> Report {
    let now = Instant::now();
    let mut out = format!(
        "{} (seq {}) on rank {rank}, called at {}, {what}.\nDesync report (clique {:016x}, {} ranks):\n",
        stuck.signature(),
        stuck.seq,
        stuck.at(),
        c.key,
        c.world_size,
    );
    let mut behind = Vec::new();
    let views: Vec<RankView> = (0..c.world_size).map(|r| c.view(r)).collect();
    // Cross-process: post our ranks' last operations, read the others' (bounded).
    let remote = c.board().map(|b| {
        // A rank of ours that left keeps its departure on the board.
        let left = c
            .departure()
            .filter(|d| views.get(d.rank).is_some_and(|v| v.present));
        let ours: Vec<(usize, DesyncPost)> = (views.iter().enumerate())
            .filter(|(_, v)| v.present)
            .map(|(r, v)| match left {
                Some(d) if d.rank == r => (r, DesyncPost::departure(c.key, d.issued, &d.how)),
                _ => (r, DesyncPost::new(c.key, v.issued, &describe(v, now))),
            })
            .collect();
        let wanted: Vec<usize> = (0..views.len()).filter(|&r| !views[r].present).collect();
        exchange(&**b, c.key, &ours, &wanted, timeout, host.is_some())
    });
    let mut silent = Vec::new();
    for (r, v) in views.iter().enumerate() {
        let _ = write!(out, "  rank {r}: ");
        let (issued, last, gone) = if v.present {
            let gone = if v.gone {
                "; communicator torn down"
            } else {
                ""
            };
            (v.issued, describe(v, now), gone)
        } else if let Some(p) = remote.as_ref().and_then(|x| x.posts.get(r)?.as_ref()) {
            (
                p.issued,
                p.text.clone(),
                " (another process, from the desync board)",
            )
        } else if let Some(h) = host {
            // The host provider's shared memory knows who reached the collective.
            if h.contains(&r) {
                behind.push(r);
                let _ = writeln!(
                    out,
                    "BEHIND: never reached seq {} (another process; the host provider's shared memory says so)",
                    stuck.seq
                );
            } else {
                let _ = writeln!(
                    out,
                    "reached seq {} (another process; the host provider's shared memory says so)",
                    stuck.seq
                );
            }
            continue;
        } else {
            match &remote {
                None => {
                    let _ = writeln!(out, "no record (not in this process, or not attached yet)");
                }
                Some(x) => {
                    silent.push(r);
                    let _ = match &x.error {
                        Some(e) => writeln!(out, "no record (another process; the desync board could not be read: {e})"),
                        None => writeln!(out, "no post on the desync board within {:.1}s (another process that has not timed out: it is not waiting in this clique's collectives, or entered later)", x.waited.as_secs_f64()),
                    };
                }
            }
            continue;
        };
        if issued <= stuck.seq {
            behind.push(r);
            let _ = writeln!(
                out,
                "BEHIND: has issued {issued} collective(s), never seq {}; last: {last}{gone}",
                stuck.seq
            );
        } else if issued == stuck.seq + 1 {
            let _ = writeln!(out, "at seq {}: {last}{gone}", stuck.seq);
        } else {
            let _ = writeln!(out, "ahead ({issued} issued); last: {last}{gone}");
        }
    }
    if !silent.is_empty() {
        let _ = writeln!(
            out,
            "=> rank(s) {silent:?} in other processes posted nothing: probably behind (or hung outside this clique's collectives)"
        );
    }
    if behind.is_empty() && silent.is_empty() {
        let _ = writeln!(
            out,
            "=> no rank in this process is behind: a rank in another process, or the work itself, is stuck"
        );
    } else if !behind.is_empty() {
        let _ = writeln!(
            out,
            "=> rank(s) {behind:?} are behind: they never called seq {} ({} at {}) that the others wait in",
            stuck.seq,
            stuck.signature(),
            stuck.at()
        );
    }
    if ours {
        let _ = write!(
            out,
            "=> the watchdog aborted this clique's communicators (timeout {timeout:?}: Config::timeout or NCCL_SAFE_TIMEOUT_MS) because {} seq {} on rank {rank} (called at {})",
            stuck.op,
            stuck.seq,
            stuck.at()
        );
    } else {
        let _ = write!(
            out,
            "=> a rank of another process aborted this clique first (its own timeout, say), and NCCL failed {} seq {} on rank {rank} with its remote error",
            stuck.op,
            stuck.seq,
        );
    }
    behind.extend(silent);
    Report {
        text: out,
        behind: match behind[..] {
            [r] if r != rank => Some(r),
            _ => None,
        },
    }
}

/// Posts this process's ranks' last operations to the board (in the background, bounded
/// like a departure's post), when one of them has waited long in an operation (the
/// watchdog's notice): so that the first rank of another process to time out finds
/// every rank that waits with it on the board, and only the rank behind silent. Ranks
/// otherwise post only at their own timeout, which the first to time out never sees.
/// (When nothing could be posted, the report says these ranks posted nothing.)
pub(crate) fn post_waiting(c: &Clique) {
    if c.board().is_none() {
        return;
    }
    let now = Instant::now();
    let posts: Vec<(usize, DesyncPost)> = (c.here())
        .map(|(r, v)| (r, DesyncPost::new(c.key, v.issued, &describe(&v, now))))
        .collect();
    let _ = c.post_in_background(posts);
}

/// What a rank was last doing, one line: `ncclAllReduce(f32 x 4) seq 1 at x.rs:9 (in
/// progress for 1.002s)`.
fn describe(v: &RankView, now: Instant) -> String {
    let Some(l) = v.last else {
        return "nothing".to_string();
    };
    let state = match l.state {
        OpState::Enqueued => {
            let age = now.saturating_duration_since(l.enqueued).as_secs_f64();
            format!("in progress for {age:.3}s")
        }
        s => s.name().to_string(),
    };
    format!("{} seq {} at {} ({state})", l.signature(), l.seq, l.at())
}

/// What the board said, for the ranks not in this process.
#[derive(Debug, Default)]
pub(crate) struct Remote {
    pub posts: Vec<Option<DesyncPost>>,
    /// Why the board could not be read (or posted to), if so.
    pub error: Option<BoardError>,
    pub waited: Duration,
}

/// Posts `ours` (rank, post) and fetches the board until every rank in `wanted` has a post
/// of `clique` or the grace period ends (half the timeout, at most 2 s: the other processes
/// post when their own watchdog fires, which is about when ours did). Every wait is bounded:
/// a board client tries again until the deadline it is given (its server may not answer
/// at all, rank 0's process gone, say), so the posts and the fetches share one deadline,
/// 2 s from the start. `quick` (the host provider already says who is behind): one post
/// and one fetch, within 200 ms, so that a board that does not answer (rank 0's process
/// stopped) does not hold the report and the abort behind it.
pub(crate) fn exchange(
    board: &dyn RemoteBoard,
    clique: u64,
    ours: &[(usize, DesyncPost)],
    wanted: &[usize],
    timeout: Duration,
    quick: bool,
) -> Remote {
    let start = Instant::now();
    let io = if quick {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(2)
    };
    let mut remote = Remote::default();
    for (rank, post) in ours {
        if let Err(e) = board.post(*rank, post, start + io) {
            remote.error = Some(e);
        }
    }
    let until = start + (timeout / 2).min(Duration::from_secs(2));
    loop {
        match board.fetch(start + io) {
            Ok(posts) => {
                remote.posts = posts
                    .into_iter()
                    .map(|p| p.filter(|p| p.clique == clique))
                    .collect();
                remote.error = None;
            }
            Err(e) => remote.error = Some(e),
        }
        let all = remote.error.is_none()
            && wanted
                .iter()
                .all(|&r| remote.posts.get(r).is_some_and(Option::is_some));
        if all || quick || Instant::now() >= until {
            break;
        }
        std::thread::sleep(Duration::from_millis(100).min(until - Instant::now()));
    }
    remote.waited = start.elapsed();
    remote
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::diag::key::fresh_key;
    use crate::diag::observe::OBSERVERS;
    use crate::diag::supervise::clique::join;
    use crate::diag::supervise::clique::tests::{enqueued_all_reduce, seen, MemBoard};
    use nccl_sys::EntryPoint;

    /// A report built in "this process" (rank 0) shows what rank 2 of "another process"
    /// posted to a board, and names rank 1 (which posted nothing).
    #[test]
    fn report_shows_remote_ranks_from_the_board() {
        let client = MemBoard::new(3);
        let c = join(fresh_key(), 3, &OBSERVERS);
        let remote_line = "ncclAllReduce(f32 x 4) seq 0 at remote.rs:7 (completed)";
        client
            .post(2, &DesyncPost::new(c.key, 1, remote_line))
            .unwrap();
        // A post of another clique is not used.
        client
            .post(1, &DesyncPost::new(c.key ^ 1, 9, "elsewhere"))
            .unwrap();
        let stuck = enqueued_all_reduce(1, Duration::ZERO);
        c.update(0, |v| *v = seen(2, Some(stuck)));
        c.set_board(&(Arc::new(client.clone()) as Arc<dyn RemoteBoard>));
        let t = Instant::now();
        let report = report(
            &c,
            0,
            &stuck,
            Duration::from_millis(400),
            "did not complete in time",
            true,
            None,
        );
        let r = &report.text;
        eprintln!("{r}");
        // Two ranks missing (one behind, one silent): neither is named the one behind.
        assert_eq!(report.behind, None);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(
            r.contains("  rank 0: at seq 1: ncclAllReduce(float x 4) seq 1 at "),
            "{r}"
        );
        assert!(
            r.contains(&format!("  rank 2: BEHIND: has issued 1 collective(s), never seq 1; last: {remote_line} (another process, from the desync board)")),
            "{r}"
        );
        assert!(r.contains("  rank 1: no post on the desync board"), "{r}");
        assert!(r.contains("rank(s) [2] are behind"), "{r}");
        assert!(
            r.contains("rank(s) [1] in other processes posted nothing"),
            "{r}"
        );
        // And rank 0's own line went to the board for the other processes.
        let posts = client.fetch().unwrap();
        let ours = posts[0].as_ref().expect("rank 0 posted");
        assert_eq!((ours.clique, ours.issued), (c.key, 2));
        assert!(
            ours.text.starts_with("ncclAllReduce(float x 4) seq 1 at "),
            "{ours:?}"
        );
    }

    /// Without a board the report is as before: other ranks are "no record".
    #[test]
    fn report_without_a_board_says_no_record() {
        let c = join(fresh_key(), 2, &OBSERVERS);
        let stuck = OpRecord {
            op: EntryPoint::ncclBroadcast,
            dtype: None,
            count: 0,
            root: Some(0),
            ..enqueued_all_reduce(0, Duration::ZERO)
        };
        c.update(0, |v| *v = seen(1, Some(stuck)));
        let r = report(&c, 0, &stuck, Duration::from_secs(1), "x", true, None).text;
        assert!(
            r.contains("  rank 1: no record (not in this process"),
            "{r}"
        );
    }
}
