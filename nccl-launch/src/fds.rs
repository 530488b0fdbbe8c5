//! Rank 0's descriptor budget: how many sockets its servers (the rendezvous and the desync
//! board) may hold open at once, so that strangers connecting to them can never take the
//! descriptors the process needs for itself (NCCL's init, its own files).
//!
//! When the first server of the process starts, the soft limit on open files
//! (`RLIMIT_NOFILE`, often 1,024) is raised toward the hard limit (to at most [`RAISE_TO`]).
//! Half of the limit (at least [`MIN_RESERVE`]) is then kept back for the process, besides
//! the descriptors it had open at that moment; the rest is the budget every server of the
//! process shares (at least [`MIN_BUDGET`]). A server takes a descriptor of the budget
//! before each `accept` and gives it back only once the socket is closed, so the servers
//! together never hold more than the budget, whatever peers do.

use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The soft limit is raised to the hard limit, but no higher than this.
pub(crate) const RAISE_TO: u64 = 1 << 16;
/// The fewest descriptors kept back for the process.
pub(crate) const MIN_RESERVE: usize = 64;
/// The fewest descriptors the servers get, whatever the limit.
pub(crate) const MIN_BUDGET: usize = 8;

/// The servers' share of the process's descriptors.
#[derive(Debug)]
pub(crate) struct Budget {
    /// How many sockets the servers may hold open at once.
    pub cap: usize,
    /// How many they hold (or are about to accept).
    open: AtomicUsize,
}

/// The process's budget, set up (and the limit raised) on the first call.
pub(crate) fn budget() -> &'static Budget {
    static BUDGET: OnceLock<Budget> = OnceLock::new();
    BUDGET.get_or_init(|| {
        let limit = raise_limit();
        let reserve = (limit / 2).max(MIN_RESERVE);
        let cap = limit.saturating_sub(reserve).saturating_sub(open_now());
        Budget {
            cap: cap.max(MIN_BUDGET),
            open: AtomicUsize::new(0),
        }
    })
}

impl Budget {
    /// One descriptor of the budget, for a socket about to be accepted; `None` when the
    /// servers hold the whole budget.
    pub(crate) fn take(&'static self) -> Option<Held> {
        (self.open)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.cap).then_some(n + 1)
            })
            .ok()
            .map(|_| Held(self))
    }

    /// How many descriptors the servers hold.
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// A descriptor of the [`Budget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Held(&'static Budget);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An accepted socket and the descriptor of the budget it uses, given back only once the
/// socket is closed (the fields drop in order).
#[derive(Debug)]
pub(crate) struct Socket {
    stream: TcpStream,
    _held: Held,
}

impl Socket {
    pub(crate) fn new(stream: TcpStream, held: Held) -> Socket {
        Socket {
            stream,
            _held: held,
        }
    }
}

impl std::ops::Deref for Socket {
    type Target = TcpStream;
    fn deref(&self) -> &TcpStream {
        &self.stream
    }
}

/// The soft limit on open files after raising it toward the hard limit (1,024, the
/// common default, when it cannot be read).
fn raise_limit() -> usize {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return 1024;
    }
    let want = l.rlim_max.min(RAISE_TO as libc::rlim_t);
    if want > l.rlim_cur {
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: l.rlim_max,
        };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            l.rlim_cur = want;
        }
    }
    usize::try_from(l.rlim_cur).unwrap_or(usize::MAX)
}

/// How many descriptors the process has open (64 when `/proc/self/fd` cannot be read).
fn open_now() -> usize {
    match std::fs::read_dir("/proc/self/fd") {
        // The listing's own descriptor is among them.
        Ok(d) => d.count().saturating_sub(1),
        Err(_) => 64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_given_back_once_the_socket_is_closed() {
        let b: &'static Budget = Box::leak(Box::new(Budget {
            cap: 2,
            open: AtomicUsize::new(0),
        }));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = Socket::new(
            TcpStream::connect(l.local_addr().unwrap()).unwrap(),
            b.take().unwrap(),
        );
        let other = b.take().unwrap();
        assert!(b.take().is_none(), "a third descriptor past a budget of 2");
        drop(s);
        assert_eq!(b.open(), 1);
        assert!(b.take().is_some());
        drop(other);
        assert_eq!(b.open(), 0);
        assert!(budget().cap >= MIN_BUDGET);
    }
}
