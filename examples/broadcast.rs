//! Broadcasts a buffer from `--root` to every GPU (or 4 host-provider ranks without a GPU),
//! checks it everywhere, and prints a table.
//!
//! `cargo run --example broadcast -- [--ranks N] [--count N] [--dtype f32] [--root R] [--backend auto|nccl|host]`

mod common;

use std::process::ExitCode;

use common::{device_name, print_table, Args, Buf, Elem, Failure};
use nccl_launch::Rank;
use nccl_safe::Result;

fn rank_body<T: Elem>(rank: &Rank, args: &Args) -> Result<(usize, String, f64, bool)> {
    // Only the root holds 42; the others start with their rank and must end with 42.
    let start = if rank.rank() == args.root {
        42.0
    } else {
        rank.rank() as f64
    };
    let mut buf = Buf::from_host(rank, &vec![T::from_f64(start); args.count])?;
    match &mut buf {
        Buf::Host(v) => rank
            .comm()
            .broadcast_in_place(v, args.root, rank.stream())?,
        Buf::Cuda(b) => rank
            .comm()
            .broadcast_in_place(b, args.root, rank.stream())?,
    }
    let out = buf.to_host(rank)?;
    let ok = out.iter().all(|v| v.to_f64() == 42.0);
    Ok((
        rank.rank(),
        device_name(rank),
        out.first().map_or(f64::NAN, |v| v.to_f64()),
        ok,
    ))
}

fn threads<T: Elem>(
    launcher: &nccl_launch::Launcher,
    args: &Args,
) -> nccl_launch::Result<Vec<(usize, String, f64, bool)>> {
    launcher.run(|rank| rank_body::<T>(rank, args))
}

fn run(args: Args) -> std::result::Result<(), Failure> {
    let (launcher, _, first_line) = args.launcher()?;
    println!("{first_line}");
    println!(
        "broadcast of {} x {} from rank {}",
        args.count, args.dtype, args.root
    );
    let rows = with_dtype!(args.dtype.as_str(), threads(&launcher, &args))?;
    print_table(&rows)
}

fn main() -> ExitCode {
    match Args::parse().and_then(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            common::print_error(&e);
            ExitCode::FAILURE
        }
    }
}
