//! The flight record: a copy of a communicator's ledger of recent operations (the
//! supervision's journal, `supervise::journal`), printed and written as JSON on a failure.

use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use crate::diag::supervise::record::OpRecord;
use crate::diag::supervise::shared::Shared;

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

/// The flight record of communicator `s`: its journal's shown entries, with completion of
/// tracked work applied.
pub(crate) fn of(s: &Shared) -> FlightRecord {
    FlightRecord {
        rank: s.rank,
        world_size: s.world_size,
        clique: s.clique.key,
        entries: s.journal.shown().filter_map(|p| s.record(p)).collect(),
        taken: Instant::now(),
    }
}

/// Prints and/or writes the flight record of `s`, as configured.
#[cold]
pub(crate) fn dump(s: &Shared) {
    if !s.settings.dump_stderr && s.settings.dump_dir.is_none() {
        return;
    }
    let fr = of(s);
    if s.settings.dump_stderr {
        eprintln!("nccl-safe: {fr}");
    }
    if let Some(dir) = &s.settings.dump_dir {
        match fr.write_json(dir) {
            Ok(p) if s.settings.dump_stderr => {
                eprintln!("nccl-safe: flight record written to {}", p.display())
            }
            Ok(_) => {}
            Err(e) => eprintln!(
                "nccl-safe: cannot write the flight record to {}: {e}",
                dir.display()
            ),
        }
    }
}
