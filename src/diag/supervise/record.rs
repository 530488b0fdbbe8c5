//! The record of one operation, as the journal keeps it (`supervise::journal`: a
//! preallocated ring of a communicator's last operations, which the watchdog reads and the
//! flight record copies, `observe::flight`).
//!
//! Records are `Copy` (calls are [`EntryPoint`]s, call sites `&'static Location`), the ring
//! is allocated once when the communicator is attached, so recording an operation never
//! allocates.

use std::fmt::Write as _;
use std::panic::Location;
use std::time::{Duration, Instant};

pub use nccl_sys::EntryPoint;

use crate::types::DataType;

/// Where an operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpState {
    /// Handed to NCCL (or waiting for the fingerprint check); not known to be complete.
    Enqueued,
    /// Complete (host provider: the call returned; CUDA: its end event completed).
    Completed,
    /// Failed (an NCCL error, a mismatch or a timeout).
    Failed,
}

impl OpState {
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpState::Enqueued => "enqueued",
            OpState::Completed => "completed",
            OpState::Failed => "failed",
        }
    }
}

/// One recorded operation.
#[derive(Debug, Clone, Copy)]
pub struct OpRecord {
    /// The collective's sequence number on its communicator (point-to-point operations and
    /// shrink carry the number of the last collective before them).
    pub seq: u64,
    /// The NCCL call, e.g. `ncclAllReduce`: it compares with a name (`rec.op ==
    /// "ncclAllReduce"`), displays as one, and [`EntryPoint::name`] gives the `&'static str`.
    pub op: EntryPoint,
    /// The element type, when the operation moves data.
    pub dtype: Option<DataType>,
    /// The element count NCCL received.
    pub count: usize,
    /// The root (rooted collectives) or peer (send/recv).
    pub root: Option<usize>,
    /// The user's line that issued it.
    pub caller: &'static Location<'static>,
    /// When it was issued.
    pub enqueued: Instant,
    /// How long it took (until completion or failure); `None` while enqueued.
    pub took: Option<Duration>,
    /// Its state.
    pub state: OpState,
}

impl OpRecord {
    /// `ncclAllReduce(f32 x 4, root 0)`.
    pub(crate) fn signature(&self) -> String {
        let mut s = format!("{}(", self.op);
        if let Some(d) = self.dtype {
            let _ = write!(s, "{} x {}", d.name(), self.count);
        }
        if let Some(r) = self.root {
            let _ = write!(
                s,
                "{}{} {r}",
                if self.dtype.is_some() { ", " } else { "" },
                if self.op.collective().is_some_and(|c| !c.every_rank()) {
                    "peer"
                } else {
                    "root"
                }
            );
        }
        s.push(')');
        s
    }

    pub(crate) fn at(&self) -> String {
        format!("{}:{}", self.caller.file(), self.caller.line())
    }
}
