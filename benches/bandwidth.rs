//! Bus bandwidth of every collective, measured and printed the way nccl-tests does.
//!
//! `cargo bench --bench bandwidth -- -b 8 -e 16M -f 4 [--op all_reduce] [--plot bw.svg]`;
//! `-h` lists the options. Without a GPU it runs on the host provider and says so.

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
