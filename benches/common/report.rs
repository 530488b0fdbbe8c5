//! What nccl-tests prints: per-collective size/count rules, bus-bandwidth factors, the
//! table and its footer, and the same results as JSON.

use std::fmt::Write as _;

pub use nccl_sys::Collective;
use nccl_sys::RankArg;

/// The collectives the bandwidth bench measures, in the order they run by default.
/// [`Collective::Send`] stands for nccl-tests' sendrecv: `ncclSend`/`ncclRecv` in a ring,
/// to rank+1 and from rank-1, in one group.
pub const MEASURED: [Collective; 7] = [
    Collective::AllReduce,
    Collective::AllGather,
    Collective::Broadcast,
    Collective::Reduce,
    Collective::ReduceScatter,
    Collective::AllToAll,
    Collective::Send,
];

/// Element counts of one measurement (nccl-tests' `getCollByteCount`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Elements in each rank's send buffer.
    pub send: usize,
    /// Elements in each rank's receive buffer.
    pub recv: usize,
    /// The count passed to NCCL (and printed in the `count` column).
    pub param: usize,
}

/// The collective named `name` on the command line (nccl-tests' binary names are accepted
/// too), among [`MEASURED`].
pub fn from_name(name: &str) -> Option<Collective> {
    let n = name.trim().trim_end_matches("_perf").replace('-', "_");
    MEASURED
        .into_iter()
        .find(|c| c.bench_name() == n)
        .or(match n.as_str() {
            "alltoall" => Some(Collective::AllToAll),
            "allreduce" => Some(Collective::AllReduce),
            "allgather" => Some(Collective::AllGather),
            "reducescatter" => Some(Collective::ReduceScatter),
            "bcast" => Some(Collective::Broadcast),
            _ => None,
        })
}

/// What the bandwidth bench makes of a collective: its name, its root, its counts and
/// bandwidths as nccl-tests has them. Its buffers' lengths are its row's
/// ([`Collective::extents`]).
pub trait Measured: Copy {
    /// The name used on the command line, in the JSON and in the plot's legend.
    fn bench_name(self) -> &'static str;
    /// Whether it has a root (else the table says `-1`).
    fn has_root(self) -> bool;
    /// Whether its buffers hold `n` blocks (all_gather, reduce_scatter, all_to_all): the
    /// size is then the whole buffer.
    fn is_world(self) -> bool;
    /// Bus bandwidth over algorithm bandwidth for `n` ranks, exactly as nccl-tests:
    /// all_reduce `2(n-1)/n`; all_gather, reduce_scatter, all_to_all `(n-1)/n`;
    /// broadcast, reduce, sendrecv `1`.
    fn bus_factor(self, n: usize) -> f64;
    /// Element counts for a size of `count` elements on `n` ranks. For all_gather,
    /// reduce_scatter and all_to_all the size is the whole buffer, so each rank's block
    /// is `count / n` (rounded down, as nccl-tests does).
    fn counts(self, count: usize, n: usize) -> Counts;
    /// Algorithm and bus bandwidth (GB/s, decimal) for `param` elements of `elem` bytes
    /// moved in `seconds` on `n` ranks (nccl-tests' `getBw`).
    fn bandwidth(self, param: usize, elem: usize, seconds: f64, n: usize) -> (f64, f64);
}

impl Measured for Collective {
    fn bench_name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::Send => "sendrecv",
            Collective::Recv => "recv",
        }
    }

    fn has_root(self) -> bool {
        self.rank_arg() == RankArg::Root
    }

    fn is_world(self) -> bool {
        let (send, recv) = self.extents();
        send.is_world() || recv.is_world()
    }

    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            c if c.is_world() => (n - 1.0) / n,
            _ => 1.0,
        }
    }

    fn counts(self, count: usize, n: usize) -> Counts {
        let param = if self.is_world() { count / n } else { count };
        let (send, recv) = self.extents();
        // Sendrecv receives what its ring's sends send.
        let recv = match self {
            Collective::Send => Collective::Recv.extents().1,
            _ => recv,
        };
        let on_root = |e: nccl_sys::Extent| e.on_root(param, n).expect("a bench size fits");
        Counts {
            send: on_root(send),
            recv: on_root(recv),
            param,
        }
    }

    fn bandwidth(self, param: usize, elem: usize, seconds: f64, n: usize) -> (f64, f64) {
        if seconds <= 0.0 {
            return (0.0, 0.0);
        }
        let blocks = if self.is_world() { n } else { 1 };
        let alg = (param * elem * blocks) as f64 / 1.0e9 / seconds;
        (alg, alg * self.bus_factor(n))
    }
}

/// One timed half of a row: out-of-place or in-place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measure {
    /// Average time per iteration, microseconds.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements found by the check (summed over ranks); `None` when not checked.
    pub wrong: Option<u64>,
}

/// One line of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The collective.
    pub collective: Collective,
    /// Bytes: the larger of the send and receive buffers (nccl-tests' `size`).
    pub size: usize,
    /// Elements passed to NCCL.
    pub count: usize,
    /// Element type name.
    pub dtype: &'static str,
    /// Reduction name, or `none`.
    pub redop: &'static str,
    /// Root, or -1.
    pub root: i64,
    /// Out-of-place result.
    pub out_of_place: Measure,
    /// In-place result.
    pub in_place: Measure,
}

/// The three header lines of the table (nccl-tests' layout).
pub fn table_header() -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       in-place          ",
        "", "", "", "", ""
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}  {:>7}  {:>6}  {:>6} {:>6}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
        "algbw", "busbw", "#wrong"
    );
    let _ = write!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  {:>5}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
        "(GB/s)", ""
    );
    s
}

/// A time the way nccl-tests prints it: fewer decimals as it grows.
pub fn format_time(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:7.0}")
    } else if us >= 100.0 {
        format!("{us:7.1}")
    } else {
        format!("{us:7.2}")
    }
}

fn format_measure(m: &Measure) -> String {
    let wrong = match m.wrong {
        Some(w) => w.to_string(),
        None => "N/A".to_string(),
    };
    format!(
        "  {}  {:6.2}  {:6.2}  {:>5}",
        format_time(m.time_us),
        m.algbw,
        m.busbw,
        wrong
    )
}

/// One data line of the table.
pub fn format_row(r: &Row) -> String {
    format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}{}{}",
        r.size,
        r.count,
        r.dtype,
        r.redop,
        r.root,
        format_measure(&r.out_of_place),
        format_measure(&r.in_place)
    )
}

/// Wrong elements over all rows.
pub fn total_wrong(rows: &[Row]) -> u64 {
    rows.iter()
        .flat_map(|r| [r.out_of_place.wrong, r.in_place.wrong])
        .map(|w| w.unwrap_or(0))
        .sum()
}

/// Mean bus bandwidth over every measurement (out-of-place and in-place), as nccl-tests.
pub fn average_busbw(rows: &[Row]) -> f64 {
    if rows.is_empty() {
        return 0.0;
    }
    let sum: f64 = rows
        .iter()
        .map(|r| r.out_of_place.busbw + r.in_place.busbw)
        .sum();
    sum / (2 * rows.len()) as f64
}

/// nccl-tests' two closing lines for a set of rows.
pub fn table_footer(rows: &[Row]) -> String {
    let wrong = total_wrong(rows);
    format!(
        "# Out of bounds values : {wrong} {}\n# Avg bus bandwidth    : {} \n#",
        if wrong == 0 { "OK" } else { "FAILED" },
        format_g(average_busbw(rows))
    )
}

/// `%g` with six significant digits, as nccl-tests prints the average.
pub fn format_g(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = 6 - 1 - v.abs().log10().floor() as i32;
    let s = format!("{:.*}", digits.max(0) as usize, v);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn measure_json(m: &Measure) -> serde_json::Value {
    serde_json::json!({
        "time_us": m.time_us,
        "algbw": m.algbw,
        "busbw": m.busbw,
        "wrong": m.wrong,
    })
}

/// The results as JSON: the run's context, then one object per row with the table's fields.
pub fn to_json(context: &RunInfo, rows: &[Row]) -> serde_json::Value {
    serde_json::json!({
        "backend": context.backend,
        "nccl_version": context.nccl_version,
        "devices": context.devices,
        "ranks": context.ranks,
        "iters": context.iters,
        "warmup_iters": context.warmup_iters,
        "out_of_bounds": total_wrong(rows),
        "avg_busbw": average_busbw(rows),
        "results": rows.iter().map(|r| serde_json::json!({
            "collective": r.collective.bench_name(),
            "size": r.size,
            "count": r.count,
            "type": r.dtype,
            "redop": r.redop,
            "root": r.root,
            "out_of_place": measure_json(&r.out_of_place),
            "in_place": measure_json(&r.in_place),
        })).collect::<Vec<_>>(),
    })
}

/// What a run ran on: for the header, the JSON and the plot's title.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    /// `"nccl"` or `"host"`.
    pub backend: &'static str,
    /// The loaded NCCL's version (the host provider reports one too).
    pub nccl_version: String,
    /// One name per rank (GPU names, or `host` for the host provider).
    pub devices: Vec<String>,
    /// Number of ranks.
    pub ranks: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Warm-up iterations.
    pub warmup_iters: usize,
}

impl RunInfo {
    /// The device names, each distinct name once with its count (`4 x host`).
    pub fn device_summary(&self) -> String {
        let mut seen: Vec<(String, usize)> = Vec::new();
        for d in &self.devices {
            match seen.iter_mut().find(|(n, _)| n == d) {
                Some((_, k)) => *k += 1,
                None => seen.push((d.clone(), 1)),
            }
        }
        seen.iter()
            .map(|(n, k)| format!("{k} x {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The time per operation of the same sweep with cudarc's event tracking off and on, side
/// by side, as `#` lines (nccl-tests' comment form, so the tables above stay parseable):
/// tracking adds cudarc's event wait and record to every call, which are GPU work too.
/// Rows are matched by collective and size; one without its twin is left out.
pub fn tracking_comparison(off: &[Row], on: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "#\n# Time per operation with cudarc's event tracking off and on (the same sweep, run again with the other -E)"
    );
    let _ = writeln!(
        s,
        "# {:>12}  {:>12}  {:>12}  {:>12}  {:>7}  {:>12}  {:>12}  {:>7}",
        "collective",
        "size (B)",
        "oop off (us)",
        "oop on (us)",
        "on/off",
        "ip off (us)",
        "ip on (us)",
        "on/off"
    );
    let ratio = |on: f64, off: f64| {
        if off > 0.0 {
            format!("{:.2}", on / off)
        } else {
            "n/a".into()
        }
    };
    for a in off {
        let Some(b) = on
            .iter()
            .find(|b| b.collective == a.collective && b.size == a.size)
        else {
            continue;
        };
        let _ = writeln!(
            s,
            "# {:>12}  {:>12}  {:>12.2}  {:>12.2}  {:>7}  {:>12.2}  {:>12.2}  {:>7}",
            a.collective.bench_name(),
            a.size,
            a.out_of_place.time_us,
            b.out_of_place.time_us,
            ratio(b.out_of_place.time_us, a.out_of_place.time_us),
            a.in_place.time_us,
            b.in_place.time_us,
            ratio(b.in_place.time_us, a.in_place.time_us),
        );
    }
    s
}
