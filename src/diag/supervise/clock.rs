//! The diagnostics clock: nanoseconds since a process-wide origin, read in one of two ways.
//!
//! * **Coarse** (the default): one relaxed load of a value the watchdog thread advances
//!   every [`TICK`]. Reading it costs about a nanosecond, so the watchdog and the flight
//!   recorder add almost nothing to an operation; times have the tick's resolution (a
//!   duration is a difference of two ticks, so sums over many short operations are right
//!   on average, single short ones read as 0 or one tick).
//! * **Precise** ([`crate::Config::timing`], `NCCL_SAFE_TIMING=1` or `NCCL_SAFE_DEBUG`):
//!   `Instant::now()`, about 20 ns a read and two reads an operation. PyTorch makes the
//!   same trade with `TORCH_NCCL_ENABLE_TIMING`, off by default.
//!
//! Both read the same origin, so their values can be compared and mixed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::teardown::lock;

/// How often the watchdog advances the coarse clock (its poll interval).
pub(crate) const TICK: Duration = Duration::from_millis(10);

/// The coarse clock: nanoseconds since [`origin`] when the watchdog last advanced it.
static COARSE: AtomicU64 = AtomicU64::new(0);

/// The origin of every diagnostics time.
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Nanoseconds since the origin, now.
#[inline]
pub(crate) fn precise() -> u64 {
    origin().elapsed().as_nanos() as u64
}

/// Nanoseconds since the origin as of the last tick (at most [`TICK`] and scheduling delay
/// old once the watchdog runs).
#[inline]
pub(crate) fn coarse() -> u64 {
    COARSE.load(Ordering::Relaxed)
}

/// Advances the coarse clock to now and returns it (called by the watchdog each tick and
/// when a communicator is attached). Never moves it backwards.
pub(crate) fn advance() -> u64 {
    let now = precise();
    let before = COARSE.fetch_max(now, Ordering::Relaxed);
    if before != 0 && now > before {
        let gap = now - before;
        if gap > BIG_GAP {
            note_gap(now, gap);
        }
    }
    now
}

/// A stand-still of the coarse clock longer than this (two ticks) is remembered.
const BIG_GAP: u64 = 2 * TICK.as_nanos() as u64;

/// How many of the latest long stand-stills are remembered one by one.
const KEPT_GAPS: usize = 64;

/// The coarse clock's long stand-stills, newest last: each is (end, length), in
/// nanoseconds since the origin.
#[derive(Debug, Default)]
struct Gaps {
    kept: std::collections::VecDeque<(u64, u64)>,
    /// The latest end and the longest length among the stand-stills no longer kept.
    dropped_end: u64,
    dropped_max: u64,
}

impl Gaps {
    fn note(&mut self, end: u64, gap: u64) {
        if self.kept.len() == KEPT_GAPS {
            if let Some((e, g)) = self.kept.pop_front() {
                self.dropped_end = self.dropped_end.max(e);
                self.dropped_max = self.dropped_max.max(g);
            }
        }
        self.kept.push_back((end, gap));
    }

    /// The longest stand-still that ended after `t` (0 when none).
    fn since(&self, t: u64) -> u64 {
        let kept = self
            .kept
            .iter()
            .filter(|(end, _)| *end > t)
            .map(|(_, g)| *g)
            .max()
            .unwrap_or(0);
        // Conservative once more stand-stills than are kept ended after `t`.
        let dropped = if self.dropped_end > t {
            self.dropped_max
        } else {
            0
        };
        kept.max(dropped)
    }
}

fn gaps() -> std::sync::MutexGuard<'static, Gaps> {
    static GAPS: std::sync::Mutex<Gaps> = std::sync::Mutex::new(Gaps {
        kept: std::collections::VecDeque::new(),
        dropped_end: 0,
        dropped_max: 0,
    });
    lock(&GAPS)
}

/// The end of the latest long stand-still (0: none yet).
static LAST_GAP_END: AtomicU64 = AtomicU64::new(0);

#[cold]
fn note_gap(end: u64, gap: u64) {
    gaps().note(end, gap);
    LAST_GAP_END.fetch_max(end, Ordering::Release);
}

/// How far a coarse time `t` (a value [`coarse`] returned) can lag behind the moment it
/// was read: the longest the clock stood still in a stretch that ended after `t` (a
/// watchdog thread starved of CPU, a machine under load, a tool like valgrind), and never
/// less than a tick.
///
/// The bound decays: a stand-still that ended before `t` was read does not count, so one
/// long pause early in a process does not make every later timeout late. In the common
/// case (no long stand-still since `t`) it is one relaxed load.
pub(crate) fn lag_since(t: u64) -> Duration {
    if LAST_GAP_END.load(Ordering::Relaxed) <= t {
        return TICK;
    }
    Duration::from_nanos(gaps().since(t)).max(TICK)
}

/// The diagnostics time of `i` (nanoseconds since the origin; 0 before it).
pub(crate) fn nanos(i: Instant) -> u64 {
    i.saturating_duration_since(origin()).as_nanos() as u64
}

/// The `Instant` of a diagnostics time.
pub(crate) fn instant(t: u64) -> Instant {
    origin() + Duration::from_nanos(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coarse_follows_advance_and_never_goes_back() {
        let a = advance();
        assert!(coarse() >= a);
        std::thread::sleep(Duration::from_millis(2));
        let b = advance();
        assert!(b >= a + 2_000_000, "{a} {b}");
        assert!(coarse() >= b);
        // An older value never wins.
        COARSE.fetch_max(a, Ordering::Relaxed);
        assert!(coarse() >= b);
        let i = instant(b);
        assert!(i <= Instant::now() && Instant::now() - i < Duration::from_secs(5));
        assert_eq!(nanos(i), b);
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn a_long_stand_still_stops_counting_once_it_is_over() {
        let mut g = Gaps::default();
        // Normal ticks never get here (below two ticks); one 5 s pause ends at 10 s.
        g.note(10_000 * MS, 5_000 * MS);
        // A time read before or during the pause may lag by all of it...
        assert_eq!(g.since(4_000 * MS), 5_000 * MS);
        assert_eq!(g.since(9_999 * MS), 5_000 * MS);
        // ...one read after it by nothing of it.
        assert_eq!(g.since(10_000 * MS), 0);
        assert_eq!(g.since(60_000 * MS), 0);
        // A later, shorter pause counts for times read before its end only.
        g.note(20_000 * MS, 30 * MS);
        assert_eq!(g.since(9_000 * MS), 5_000 * MS);
        assert_eq!(g.since(15_000 * MS), 30 * MS);
        assert_eq!(g.since(20_000 * MS), 0);
    }

    #[test]
    fn forgotten_stand_stills_still_bound_the_times_read_before_them() {
        let mut g = Gaps::default();
        g.note(100 * MS, 900 * MS);
        for i in 0..KEPT_GAPS as u64 {
            g.note((200 + i) * MS, 25 * MS);
        }
        // The long one is no longer kept one by one, but still covers an old time.
        assert_eq!(g.kept.len(), KEPT_GAPS);
        assert_eq!(g.since(50 * MS), 900 * MS);
        assert_eq!(g.since(150 * MS), 25 * MS);
        assert_eq!(g.since(10_000 * MS), 0);
    }

    /// The process-wide path (`note_gap`, as `advance` calls it, then `lag_since`). The
    /// watchdog threads of other tests advance the clock every tick meanwhile, so a real
    /// pause cannot be staged here; the gap is noted directly, small enough not to delay
    /// their timeouts noticeably.
    #[test]
    fn a_noted_stand_still_counts_for_the_times_read_before_it_ended() {
        let read = precise();
        let end = read + 1;
        note_gap(end, 30 * MS);
        assert!(
            lag_since(read) >= Duration::from_millis(30),
            "{:?}",
            lag_since(read)
        );
        assert!(lag_since(read) <= Duration::from_secs(60));
        // Never less than a tick, even for a time read later than any stand-still.
        assert_eq!(lag_since(u64::MAX), TICK);
    }
}
