//! The job's desync board, the cross-process transport of both diagnostics layers: what a
//! rank posts to it (hosted by rank 0, see the crate nccl-launch's `desync`) and reads back.
//! Supervision posts and reads departures and a shrink's exclude lists (`supervise::clique`);
//! the observers post a rank's last operation when its clique times out or waits long, and
//! read the other processes' posts into the desync report (`observe::desync`).
//!
//! Nothing here runs per operation: a rank posts only at a timeout, a long wait, a
//! departure or a shrink.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most bytes of [`DesyncPost::text`] that travel (longer text is cut at a character
/// boundary); a whole encoded post is at most 1 KiB.
pub const MAX_POST_TEXT: usize = 1000;

/// What one rank was last doing, as posted to a desync board.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesyncPost {
    /// The communicator's clique key (as in [`crate::diag::FlightRecord::clique`]); posts of
    /// another clique are not used by a report.
    pub clique: u64,
    /// Collectives the rank had issued (its next collective's sequence number).
    pub issued: u64,
    /// One line: the last operation, its sequence number, the caller's file:line, its state
    /// and age; for a departure, how the rank left.
    pub text: String,
    /// The rank left its clique (its communicator was torn down, or its launcher closure
    /// returned): no collective numbered `issued` or later will come from it. Peers in
    /// other processes that wait in one fail at once ([`crate::Error::RankLeft`]).
    pub left: bool,
}

/// The top bit of `issued` on the wire: the post is a departure.
const LEFT_BIT: u64 = 1 << 63;

impl DesyncPost {
    /// A post; `text` is cut to [`MAX_POST_TEXT`] bytes and line breaks become spaces.
    pub fn new(clique: u64, issued: u64, text: &str) -> DesyncPost {
        let mut end = text.len().min(MAX_POST_TEXT);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        DesyncPost {
            clique,
            issued,
            text: text[..end].replace(['\n', '\r'], " "),
            left: false,
        }
    }

    /// The post of a rank that left, having issued `issued` collectives; `how` says how
    /// (and where its last call was).
    pub fn departure(clique: u64, issued: u64, how: &str) -> DesyncPost {
        DesyncPost {
            left: true,
            ..DesyncPost::new(clique, issued, how)
        }
    }

    /// The wire form: clique and issued (big-endian `u64`s; issued's top bit set for a
    /// departure), then the UTF-8 text.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let p = DesyncPost::new(self.clique, self.issued, &self.text);
        let issued = (p.issued & !LEFT_BIT) | if self.left { LEFT_BIT } else { 0 };
        let mut v = Vec::with_capacity(16 + p.text.len());
        v.extend_from_slice(&p.clique.to_be_bytes());
        v.extend_from_slice(&issued.to_be_bytes());
        v.extend_from_slice(p.text.as_bytes());
        v
    }

    /// The post of a wire form; `None` when it is not one.
    pub(crate) fn decode(b: &[u8]) -> Option<DesyncPost> {
        if b.len() < 16 || b.len() > 16 + MAX_POST_TEXT {
            return None;
        }
        let (head, text) = b.split_at(16);
        let clique = u64::from_be_bytes(head[..8].try_into().ok()?);
        let issued = u64::from_be_bytes(head[8..].try_into().ok()?);
        let text = std::str::from_utf8(text).ok()?;
        Some(DesyncPost {
            left: issued & LEFT_BIT != 0,
            ..DesyncPost::new(clique, issued & !LEFT_BIT, text)
        })
    }
}

/// Why a desync board could not be posted to or read: any error (a report shows its
/// message; only the report is affected, it leaves out the ranks of other processes).
pub type BoardError = Box<dyn std::error::Error + Send + Sync>;

/// `Result` of a [`RemoteBoard`] call.
pub type BoardResult<T> = std::result::Result<T, BoardError>;

/// A job's desync board, as a timeout report uses it: where each rank posts what it was
/// last doing, so a report can show ranks in other processes. Implemented by the crate
/// nccl-launch (`desync::BoardClient`, the board rank 0 hosts, and the torchrun store's
/// board); give one to a communicator with [`crate::Config::desync_board`]. A board of your
/// own fails with any error; a report shows its message.
pub trait RemoteBoard: Send + Sync + fmt::Debug {
    /// Posts `post` as rank `rank`'s latest, giving up at `deadline`.
    fn post(&self, rank: usize, post: &DesyncPost, deadline: Instant) -> BoardResult<()>;
    /// Every rank's latest post, rank-indexed, giving up at `deadline`.
    fn fetch(&self, deadline: Instant) -> BoardResult<Vec<Option<DesyncPost>>>;
}

/// A board that failed to answer is not asked again for [`BOARD_DOWN_FOR`], and one that
/// has left a call unanswered for [`BOARD_SLOW`] is not asked meanwhile: each read of a
/// board whose server does not answer (rank 0's process stopped, say) costs its whole
/// bound, and a recovery reads it several times, from several threads (the departure
/// reader, the timeout report, the error of a call a peer's revoke ended, `lost_ranks`,
/// the settling of `agree_lost_ranks`), so a stopped board would make every survivor's
/// recovery seconds longer. Such calls fail at once with the reason; the host provider's
/// shared memory names the ranks behind instead. Wraps the board a [`crate::Config`] is
/// given, so every communicator made with it shares the marks.
#[derive(Debug)]
pub(crate) struct Guarded {
    inner: Arc<dyn RemoteBoard>,
    state: Mutex<GuardState>,
}

#[derive(Debug, Default)]
struct GuardState {
    /// When and why the last call failed (cleared by one that succeeds).
    down: Option<(Instant, String)>,
    /// The calls in progress: their number and when each began.
    calls: std::collections::BTreeMap<u64, Instant>,
    next: u64,
}

/// How long a board that failed to answer is not asked again.
pub(crate) const BOARD_DOWN_FOR: Duration = Duration::from_secs(30);
/// A call unanswered this long marks the board slow: other calls fail at once meanwhile
/// (a loopback or LAN round trip takes milliseconds).
pub(crate) const BOARD_SLOW: Duration = Duration::from_millis(200);

impl Guarded {
    pub(crate) fn new(inner: Arc<dyn RemoteBoard>) -> Guarded {
        Guarded {
            inner,
            state: Mutex::new(GuardState::default()),
        }
    }

    fn guard<T>(&self, f: impl FnOnce() -> BoardResult<T>) -> BoardResult<T> {
        let id = {
            let mut st = crate::teardown::lock(&self.state);
            if let Some((since, why)) = &st.down {
                if since.elapsed() < BOARD_DOWN_FOR {
                    return Err(format!(
                        "not asked: it failed {:.1}s ago ({why}), and is not asked again for {}s",
                        since.elapsed().as_secs_f64(),
                        BOARD_DOWN_FOR.as_secs()
                    )
                    .into());
                }
            }
            if let Some(t) = st
                .calls
                .values()
                .min()
                .filter(|t| t.elapsed() >= BOARD_SLOW)
            {
                return Err(format!(
                    "not asked: it has not answered a call for {:.1}s",
                    t.elapsed().as_secs_f64()
                )
                .into());
            }
            st.next += 1;
            let id = st.next;
            st.calls.insert(id, Instant::now());
            id
        };
        let r = f();
        let mut st = crate::teardown::lock(&self.state);
        st.calls.remove(&id);
        st.down = match &r {
            Ok(_) => None,
            Err(e) => Some((Instant::now(), e.to_string())),
        };
        r
    }
}

impl RemoteBoard for Guarded {
    fn post(&self, rank: usize, post: &DesyncPost, deadline: Instant) -> BoardResult<()> {
        self.guard(|| self.inner.post(rank, post, deadline))
    }

    fn fetch(&self, deadline: Instant) -> BoardResult<Vec<Option<DesyncPost>>> {
        self.guard(|| self.inner.fetch(deadline))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posts_round_trip_and_are_bounded() {
        let p = DesyncPost::new(7, 3, "ncclAllReduce seq 2\nat x.rs:1");
        assert_eq!(p.text, "ncclAllReduce seq 2 at x.rs:1");
        assert_eq!(DesyncPost::decode(&p.encode()), Some(p.clone()));
        let left = DesyncPost::departure(7, 3, "its communicator was dropped");
        assert!(left.left && !p.left);
        assert_eq!(DesyncPost::decode(&left.encode()), Some(left));
        let long = DesyncPost::new(1, 1, &"é".repeat(1000));
        assert!(long.text.len() <= MAX_POST_TEXT && long.encode().len() <= 1024);
        assert_eq!(DesyncPost::decode(&[0; 15]), None);
        assert_eq!(DesyncPost::decode(&[0xff; 16 + 2]), None, "not UTF-8");
        assert_eq!(
            DesyncPost::decode(&vec![b'a'; 16 + MAX_POST_TEXT + 1]),
            None
        );
    }
}
