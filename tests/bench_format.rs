//! The bandwidth bench's output shape, without running `cargo bench`: busbw factors,
//! size/count rules, option parsing, the table's header and rows, and a tiny sweep on
//! two host ranks through the same function that prints the table.

#[path = "../benches/common/mod.rs"]
mod common;

use common::options::{self, Backend, Command, Options, Register};
use common::report::{self, Collective, Measured, MEASURED};

fn opts(args: &[&str]) -> Options {
    match options::parse(args.iter().copied()) {
        Ok(Command::Run(o)) => o,
        other => panic!("{args:?}: {other:?}"),
    }
}

#[test]
fn bus_factors_are_nccl_tests() {
    for n in [1usize, 2, 4, 8] {
        let f = n as f64;
        assert_eq!(Collective::AllReduce.bus_factor(n), 2.0 * (f - 1.0) / f);
        for c in [
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
        ] {
            assert_eq!(c.bus_factor(n), (f - 1.0) / f, "{c:?}");
        }
        for c in [Collective::Broadcast, Collective::Reduce, Collective::Send] {
            assert_eq!(c.bus_factor(n), 1.0, "{c:?}");
        }
    }
    // 1 GB of all_reduce in 1 s on 4 ranks: algbw 1 GB/s, busbw 1.5 GB/s.
    let (alg, bus) = Collective::AllReduce.bandwidth(250_000_000, 4, 1.0, 4);
    assert_eq!((alg, bus), (1.0, 1.5));
    // all_gather's count is per rank; its bandwidth counts the whole buffer.
    let (alg, _) = Collective::AllGather.bandwidth(62_500_000, 4, 1.0, 4);
    assert_eq!(alg, 1.0);
}

#[test]
fn sizes_are_whole_buffers() {
    let c = Collective::AllGather.counts(1024, 4);
    assert_eq!((c.send, c.recv, c.param), (256, 1024, 256));
    let c = Collective::ReduceScatter.counts(1024, 4);
    assert_eq!((c.send, c.recv, c.param), (1024, 256, 256));
    let c = Collective::AllToAll.counts(1024, 4);
    assert_eq!((c.send, c.recv, c.param), (1024, 1024, 256));
    let c = Collective::AllReduce.counts(1024, 4);
    assert_eq!((c.send, c.recv, c.param), (1024, 1024, 1024));
}

#[test]
fn options_follow_nccl_tests() {
    let o = opts(&["--bench"]);
    assert_eq!(
        (o.min_bytes, o.max_bytes, o.iters, o.warmup_iters),
        (32 << 20, 32 << 20, 20, 5)
    );
    assert_eq!(o.collectives, MEASURED.to_vec());
    let o = opts(&[
        "-b",
        "8",
        "-e",
        "16M",
        "-f",
        "4",
        "--bench",
        "--backend",
        "host",
        "-o",
        "max",
    ]);
    assert_eq!((o.min_bytes, o.max_bytes, o.step_factor), (8, 16 << 20, 4));
    assert_eq!(o.backend, Backend::Host);
    assert_eq!(o.sizes().len(), 11); // 8, 32, ..., 8M
    assert_eq!(o.register, Register::None);
    assert_eq!(opts(&["-R", "1"]).register, Register::Local);
    assert_eq!(opts(&["--local_register=2"]).register, Register::Symmetric);
    assert_eq!(opts(&["-R0"]).register, Register::None);
    // cudarc's event tracking: off unless asked for (nccl-tests passes raw pointers).
    assert!(!opts(&[]).event_tracking);
    assert!(opts(&["-E", "1"]).event_tracking);
    assert!(opts(&["--event_tracking=1"]).event_tracking);
    assert!(!opts(&["-E1", "-E", "0"]).event_tracking);
    assert!(options::USAGE.contains("--event_tracking"));
    assert_eq!(options::parse_size("1G"), Some(1 << 30));
    assert_eq!(options::parse_size("2k"), Some(2048));
    assert_eq!(
        opts(&["-b1K", "-e", "4K", "-i", "1K"]).sizes(),
        vec![1024, 2048, 3072, 4096]
    );
    let o = opts(&["--op", "all_reduce,broadcast", "-t", "sendrecv", "alltoall"]);
    assert_eq!(
        o.collectives,
        vec![
            Collective::AllReduce,
            Collective::Broadcast,
            Collective::Send,
            Collective::AllToAll
        ]
    );
    for bad in [
        &["-b"][..],
        &["-b", "x"],
        &["-e", "3Q"],
        &["-b", "2M", "-e", "1M"],
        &["-d", "float7"],
        &["-o", "xor"],
        &["--op", "all_shuffle"],
        &["--backend", "tpu"],
        &["-n", "0"],
        &["-g", "2", "-r", "2"],
        &["--frobnicate"],
        &["-R", "3"],
        &["-R"],
        &["-E", "2"],
        &["--event_tracking"],
    ] {
        assert!(
            options::parse(bad.iter().copied()).is_err(),
            "{bad:?} must be refused"
        );
    }
}

#[test]
fn the_event_tracking_line_says_on_off_or_not_applicable() {
    let line = common::sweep::event_tracking_line;
    assert!(line(false, false).starts_with("# cudarc event tracking: off"));
    assert!(line(false, true).starts_with("# cudarc event tracking: on"));
    assert!(line(true, true).starts_with("# cudarc event tracking: n/a"));
    assert!(line(true, false).starts_with("# cudarc event tracking: n/a"));
}

#[test]
fn table_shape_matches_nccl_tests() {
    let header = report::table_header();
    let lines: Vec<&str> = header.lines().collect();
    assert_eq!(lines.len(), 3);
    assert!(lines[0].contains("out-of-place") && lines[0].contains("in-place"));
    let names: Vec<&str> = lines[1]
        .trim_start_matches('#')
        .split_whitespace()
        .collect();
    assert_eq!(
        names,
        [
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
            "algbw", "busbw", "#wrong"
        ]
    );
    assert!(lines[2].contains("(B)") && lines[2].contains("(GB/s)"));
    assert_eq!(report::format_time(12.345), "  12.35");
    assert_eq!(report::format_time(123.45), "  123.5");
    assert_eq!(report::format_time(12345.6), "  12346");
    assert_eq!(report::format_g(67.92171), "67.9217");
}

#[test]
fn tiny_host_sweep_prints_a_full_table_with_no_wrong_values() {
    let o = opts(&[
        "-b",
        "8",
        "-e",
        "64",
        "-f",
        "2",
        "-n",
        "2",
        "-w",
        "1",
        "-g",
        "2",
        "--backend",
        "host",
    ]);
    let mut out = Vec::new();
    let outcome = common::sweep::run(&o, &mut out).expect("the sweep runs");
    let text = String::from_utf8(out).expect("utf-8");
    assert!(text.contains("host provider"), "{text}");
    // The header says whether cudarc's event tracking is on, once, before the devices.
    let tracking: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("# cudarc event tracking: "))
        .collect();
    assert_eq!(
        tracking,
        vec![common::sweep::event_tracking_line(true, false).as_str()],
        "{text}"
    );
    assert!(
        text.find("# cudarc event tracking: ") < text.find("# Using devices"),
        "{text}"
    );
    let sizes = o.sizes().len();
    assert_eq!(sizes, 4);
    assert_eq!(outcome.rows.len(), sizes * MEASURED.len(), "{text}");
    assert_eq!(report::total_wrong(&outcome.rows), 0, "{text}");
    let data_rows: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    assert_eq!(data_rows.len(), outcome.rows.len(), "{text}");
    for row in &data_rows {
        assert_eq!(row.split_whitespace().count(), 13, "{row}");
    }
    assert_eq!(
        text.matches("# Out of bounds values : 0 OK").count(),
        MEASURED.len()
    );
    assert_eq!(
        text.matches("# Avg bus bandwidth    : ").count(),
        MEASURED.len()
    );
    let json = report::to_json(&outcome.info, &outcome.rows);
    assert_eq!(
        json["results"].as_array().map(Vec::len),
        Some(outcome.rows.len())
    );
    assert_eq!(json["backend"], "host");
}

#[test]
fn registered_host_sweeps_allocate_with_ncclmemalloc_and_register_every_buffer() {
    for (flag, line) in [
        (
            "1",
            "# Buffers: ncclMemAlloc, registered with ncclCommRegister (-R 1)",
        ),
        (
            "2",
            "# Buffers: ncclMemAlloc, registered as symmetric windows (-R 2)",
        ),
    ] {
        let before = nccl_safe::host::stats();
        let o = opts(&[
            "-b",
            "0",
            "-e",
            "64",
            "-f",
            "4",
            "-n",
            "2",
            "-w",
            "1",
            "-g",
            "2",
            "--backend",
            "host",
            "-R",
            flag,
        ]);
        let mut out = Vec::new();
        let outcome = common::sweep::run(&o, &mut out).expect("the sweep runs");
        let text = String::from_utf8(out).expect("utf-8");
        assert!(text.contains(line), "{text}");
        assert_eq!(
            outcome.rows.len(),
            o.sizes().len() * MEASURED.len(),
            "{text}"
        );
        assert_eq!(report::total_wrong(&outcome.rows), 0, "{text}");
        let after = nccl_safe::host::stats();
        // Every buffer came from ncclMemAlloc and went back to ncclMemFree. (Process-wide
        // counters: other tests of this binary allocate none.)
        let allocated = after.mem_allocated - before.mem_allocated;
        assert!(allocated > 0, "{text}");
        assert_eq!(after.mem_freed - before.mem_freed, allocated);
        // Every registration (or window) was deregistered, nothing was misused.
        let (reg, dereg) = match flag {
            "1" => (
                after.registered - before.registered,
                after.deregistered - before.deregistered,
            ),
            _ => (
                after.windows_registered - before.windows_registered,
                after.windows_deregistered - before.windows_deregistered,
            ),
        };
        assert!(
            reg > 0 && reg == dereg,
            "{reg} registered, {dereg} deregistered"
        );
        assert_eq!(after.misused, before.misused);
        assert_eq!(after.live_at_teardown, before.live_at_teardown);
    }
}
