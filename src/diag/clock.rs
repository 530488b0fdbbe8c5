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
    if before != 0 {
        MAX_LAG.fetch_max(now.saturating_sub(before), Ordering::Relaxed);
    }
    now
}

/// The longest the coarse clock has stood still between two advances (a watchdog thread
/// starved of CPU, a machine under load or a tool like valgrind): how far a time read
/// from it can lag behind. Never less than a tick.
pub(crate) fn max_lag() -> Duration {
    Duration::from_nanos(MAX_LAG.load(Ordering::Relaxed)).max(TICK)
}

static MAX_LAG: AtomicU64 = AtomicU64::new(0);

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
    }
}
