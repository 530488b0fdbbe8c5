//! The flight recorder: a preallocated ring of the last operations of one communicator.
//!
//! Entries are `Copy` (calls are [`EntryPoint`]s, call sites `&'static Location`), the ring
//! is allocated once when the communicator is attached, so recording an operation never
//! allocates.

use std::fmt::{self, Write as _};
use std::panic::Location;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

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

/// A copy of one communicator's flight recorder, oldest operation first.
#[derive(Debug, Clone)]
pub struct FlightRecord {
    /// The communicator's rank.
    pub rank: usize,
    /// Its size.
    pub world_size: usize,
    /// The process-wide key of its clique (the ranks sharing it), as used in reports.
    pub clique: u64,
    /// The last operations, oldest first.
    pub entries: Vec<OpRecord>,
    /// When the copy was taken.
    pub taken: Instant,
}

impl FlightRecord {
    /// The record as JSON (one object; `entries` oldest first; times in microseconds
    /// before the dump).
    pub fn to_json(&self) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            "{{\"rank\":{},\"world_size\":{},\"clique\":\"{:016x}\",\"pid\":{},\"unix_time_s\":{},\"entries\":[",
            self.rank,
            self.world_size,
            self.clique,
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        );
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(
                s,
                "{{\"seq\":{},\"op\":\"{}\",\"dtype\":{},\"count\":{},\"root\":{},\"file\":\"{}\",\"line\":{},\"enqueued_us_ago\":{},\"took_us\":{},\"state\":\"{}\"}}",
                e.seq,
                e.op,
                e.dtype.map_or("null".to_string(), |d| format!("\"{}\"", d.name())),
                e.count,
                e.root.map_or("null".to_string(), |r| r.to_string()),
                json_escape(e.caller.file()),
                e.caller.line(),
                self.taken.saturating_duration_since(e.enqueued).as_micros(),
                e.took.map_or("null".to_string(), |d| d.as_micros().to_string()),
                e.state.name()
            );
        }
        s.push_str("]}");
        s
    }

    /// Writes [`to_json`](Self::to_json) to
    /// `dir/nccl-safe-flight-<pid>-<clique>-rank<rank>.json` and returns the path.
    pub fn write_json(&self, dir: &Path) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!(
            "nccl-safe-flight-{}-{:016x}-rank{}.json",
            std::process::id(),
            self.clique,
            self.rank
        ));
        std::fs::write(&path, self.to_json())?;
        Ok(path)
    }
}

fn json_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o
}

impl fmt::Display for FlightRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "flight record of rank {}/{} (clique {:016x}), last {} operation(s):",
            self.rank,
            self.world_size,
            self.clique,
            self.entries.len()
        )?;
        for e in &self.entries {
            let ago = self.taken.saturating_duration_since(e.enqueued);
            write!(
                f,
                "  seq {:>4}  {:<40} at {:<30} {:>9}  issued {:.3}s ago",
                e.seq,
                e.signature(),
                e.at(),
                e.state.name(),
                ago.as_secs_f64()
            )?;
            if let Some(t) = e.took {
                write!(f, ", took {:.3}s", t.as_secs_f64())?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
