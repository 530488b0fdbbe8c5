//! Bus bandwidth of every collective, measured and printed the way nccl-tests does.
//!
//! `cargo bench --bench bandwidth -- -b 8 -e 16M -f 4 [--op all_reduce] [--plot bw.svg]`;
//! `-h` lists the options. Without a GPU it runs on the host provider and says so.
//!
//! On a GPU it then runs the same sweep again with cudarc's event tracking the other way
//! (`-E`), its tables not printed, and prints the time per operation with tracking off next
//! to tracking on: what a user of cudarc's default pays per call beyond NCCL.

mod common;

use std::process::ExitCode;

use common::options::{self, Command, USAGE};
use common::{plot, report, sweep};

fn main() -> ExitCode {
    let opts = match options::parse(std::env::args().skip(1)) {
        Ok(Command::Run(o)) => o,
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut stdout = std::io::stdout().lock();
    let outcome = match sweep::run(&opts, &mut stdout) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if outcome.info.backend == "nccl" {
        let mut other = opts.clone();
        other.event_tracking = !opts.event_tracking;
        other.json = None;
        other.plot = None;
        match sweep::run(&other, &mut std::io::sink()) {
            Ok(twin) => {
                let (off, on) = if opts.event_tracking {
                    (&twin.rows, &outcome.rows)
                } else {
                    (&outcome.rows, &twin.rows)
                };
                print!("{}", report::tracking_comparison(off, on));
            }
            Err(e) => {
                eprintln!("error: the sweep with cudarc's event tracking the other way: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        println!("# Time per operation with cudarc's event tracking on and off: n/a (host provider: no CUDA buffers)");
    }
    if let Some(path) = &opts.json {
        let text = report::to_json(&outcome.info, &outcome.rows).to_string();
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("error: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("# Results written to {}", path.display());
    }
    if let Some(path) = &opts.plot {
        if let Err(e) = plot::draw(path, &outcome.info, &outcome.rows) {
            eprintln!("error: drawing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("# Plot written to {}", path.display());
    }
    if report::total_wrong(&outcome.rows) != 0 {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
