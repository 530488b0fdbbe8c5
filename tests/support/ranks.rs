//! Ranks as threads on the host provider, element values that every dtype represents
//! exactly, and teardown accounting.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Duration;

use half::{bf16, f16};
use nccl_safe::host::{stats_for, HostStats};
use nccl_safe::{CommDevice, Communicator, Config, NcclType, UniqueId};

/// An element type whose small integers (|v| <= 127) are exact.
pub trait El: NcclType + PartialEq + std::fmt::Debug + Default {
    /// Whether negative values can be used.
    const SIGNED: bool;
    /// The element for a small integer.
    fn of(v: i64) -> Self;
}

macro_rules! el_int {
    ($($t:ty => $signed:expr),*) => {$(
        impl El for $t {
            const SIGNED: bool = $signed;
            fn of(v: i64) -> Self {
                <$t>::try_from(v).unwrap_or_else(|_| panic!("{v} does not fit {}", stringify!($t)))
            }
        }
    )*};
}
el_int!(i8 => true, u8 => false, i32 => true, u32 => false, i64 => true, u64 => false);

impl El for f16 {
    const SIGNED: bool = true;
    fn of(v: i64) -> Self {
        f16::from_f64(v as f64)
    }
}
impl El for bf16 {
    const SIGNED: bool = true;
    fn of(v: i64) -> Self {
        bf16::from_f64(v as f64)
    }
}
impl El for f32 {
    const SIGNED: bool = true;
    fn of(v: i64) -> Self {
        v as f32
    }
}
impl El for f64 {
    const SIGNED: bool = true;
    fn of(v: i64) -> Self {
        v as f64
    }
}

/// Runs `world` ranks in threads, each with a fresh communicator on one new unique id,
/// calls `f(rank_comm)`, then destroys it. A panicking rank aborts its communicator so
/// the others fail instead of hanging. Checks that every handle was destroyed exactly
/// once and nothing was misused, and returns the id's counters.
pub fn run_ranks<F>(world: usize, f: F) -> HostStats
where
    F: Fn(&Communicator) + Sync,
{
    let id = CommDevice::Host.unique_id().expect("host unique id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    let comm = Communicator::init_rank(
                        &CommDevice::Host,
                        world,
                        rank,
                        &id,
                        &Config::new(),
                    )
                    .expect("init_rank");
                    assert_eq!((comm.rank(), comm.world_size()), (rank, world));
                    if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(&comm))) {
                        let _ = comm.abort();
                        resume_unwind(p);
                    }
                    comm.destroy().map_err(|(_, e)| e).expect("destroy");
                })
            })
            .collect();
        let mut first_panic = None;
        for h in handles {
            if let Err(p) = h.join() {
                first_panic.get_or_insert(p);
            }
        }
        if let Some(p) = first_panic {
            resume_unwind(p);
        }
    });
    assert_balanced(&id)
}

/// Asserts that every handle of `id`'s family was torn down exactly once and that no
/// call reached a dead handle; returns the counters.
/// Aborts the watchdog started, or that a drop handed over, run on abort threads of
/// their own and may finish after the caller moved on: waits (up to 10 s) until no handle
/// of `id`'s family is live before asserting.
#[track_caller]
pub fn assert_balanced(id: &UniqueId) -> HostStats {
    let st = settled_stats(id);
    assert_eq!(st.created, st.destroyed + st.aborted, "{st:?}");
    assert_eq!(st.live, 0, "{st:?}");
    assert_eq!(
        st.misused,
        0,
        "{st:?}; the process's latest misuses: {:#?}",
        nccl_safe::host::recent_misuse()
    );
    st
}

/// `id`'s counters once no handle is live, or after 10 s (background aborts finish).
pub fn settled_stats(id: &UniqueId) -> HostStats {
    let limit = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = stats_for(&id.to_raw());
        if st.live == 0 || std::time::Instant::now() >= limit {
            return st;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
