//! All-reduces a buffer across every GPU of the machine, checks the result on every rank,
//! and prints a table. Without a GPU (or with `--backend host`) the same program runs on
//! the host provider with 4 ranks, and its first line says so.
//!
//! `cargo run --example allreduce -- [--ranks N] [--count N] [--dtype f32] [--op sum]
//!  [--backend auto|nccl|host] [--launcher threads|env]`

mod common;

use std::process::ExitCode;

use common::{device_name, print_table, Args, Buf, Elem, Failure};
use nccl_launch::{Launcher, Rank};
use nccl_safe::{ReduceOp, Result};

/// The average of the inputs 1, 2, ..., n as NCCL computes it: integer types divide the
/// sum, truncating; floating-point types add up each input times `1/n` rounded to the type
/// (`float(1.0/n)`, and `1.0/n` for f64), each step rounded to the type.
fn nccl_avg<T: Elem>(n: f64) -> f64 {
    let round = |x: f64| T::from_f64(x).to_f64();
    if round(0.5) == 0.0 {
        return round(n * (n + 1.0) / 2.0) / n; // then truncated by the caller's rounding
    }
    let f64_type = std::mem::size_of::<T>() == 8;
    let scale = round(if f64_type {
        1.0 / n
    } else {
        (1.0 / n) as f32 as f64
    });
    (1..=n as usize).fold(0.0, |acc, x| round(acc + round(x as f64 * scale)))
}

/// One rank's work: fill, all-reduce in place, copy back, compare with the exact answer.
fn rank_body<T: Elem>(rank: &Rank, args: &Args) -> Result<(usize, String, f64, bool)> {
    let (n, r) = (rank.world_size() as f64, rank.rank() as f64);
    let (input, expected) = match args.op {
        ReduceOp::Sum => (r + 1.0, n * (n + 1.0) / 2.0),
        ReduceOp::Prod => (if r < 3.0 { 2.0 } else { 1.0 }, 2f64.powf(n.min(3.0))),
        ReduceOp::Max => (r + 1.0, n),
        ReduceOp::Min => (r + 1.0, 1.0),
        ReduceOp::Avg => (r + 1.0, nccl_avg::<T>(n)),
    };
    let expected = T::from_f64(expected).to_f64();
    let mut buf = Buf::from_host(rank, &vec![T::from_f64(input); args.count])?;
    match &mut buf {
        Buf::Host(v) => rank.comm().all_reduce_in_place(v, args.op, rank.stream())?,
        Buf::Cuda(b) => rank.comm().all_reduce_in_place(b, args.op, rank.stream())?,
    }
    let out = buf.to_host(rank)?;
    let ok = out.len() == args.count && out.iter().all(|v| v.to_f64() == expected);
    Ok((
        rank.rank(),
        device_name(rank),
        out.first().map_or(f64::NAN, |v| v.to_f64()),
        ok,
    ))
}

fn threads<T: Elem>(
    launcher: &Launcher,
    args: &Args,
) -> nccl_launch::Result<Vec<(usize, String, f64, bool)>> {
    launcher.run(|rank| rank_body::<T>(rank, args))
}

fn one_process<T: Elem>(rank: &Rank, args: &Args) -> Result<Vec<(usize, String, f64, bool)>> {
    rank_body::<T>(rank, args).map(|row| vec![row])
}

fn run(args: Args) -> std::result::Result<(), Failure> {
    let rows = if args.launcher == "env" {
        let rank = args.process_rank()?;
        println!(
            "rank {} of {} (from the launcher's environment)",
            rank.rank(),
            rank.world_size()
        );
        with_dtype!(args.dtype.as_str(), one_process(&rank, &args))?
    } else {
        let (launcher, _backend, first_line) = args.launcher()?;
        println!("{first_line}");
        println!(
            "all_reduce ({:?}) of {} x {} per rank",
            args.op, args.count, args.dtype
        );
        with_dtype!(args.dtype.as_str(), threads(&launcher, &args))?
    };
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
