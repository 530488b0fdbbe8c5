//! All-gathers one block per rank across every GPU (or 4 host-provider ranks without a GPU),
//! checks that every rank holds every block, and prints a table.
//!
//! `cargo run --example allgather -- [--ranks N] [--count N] [--dtype f32] [--backend auto|nccl|host]`

mod common;

use std::process::ExitCode;

use common::{device_name, print_table, Args, Buf, Elem, Failure};
use nccl_launch::Rank;
use nccl_safe::Result;

fn rank_body<T: Elem>(rank: &Rank, args: &Args) -> Result<(usize, String, f64, bool)> {
    let n = rank.world_size();
    // Rank r contributes the value r + 1; block i of the result must hold i + 1.
    let send = Buf::from_host(
        rank,
        &vec![T::from_f64(rank.rank() as f64 + 1.0); args.count],
    )?;
    let mut recv = Buf::from_host(rank, &vec![T::default(); args.count * n])?;
    match (&send, &mut recv) {
        (Buf::Host(s), Buf::Host(r)) => rank.comm().all_gather(s, r, rank.stream())?,
        (Buf::Cuda(s), Buf::Cuda(r)) => rank.comm().all_gather(s, r, rank.stream())?,
        _ => unreachable!("both buffers live where the rank runs"),
    }
    let out = recv.to_host(rank)?;
    let ok = out.chunks(args.count.max(1)).enumerate().all(|(i, block)| {
        block
            .iter()
            .all(|v| v.to_f64() == T::from_f64(i as f64 + 1.0).to_f64())
    });
    let sum: f64 = out.iter().map(|v| v.to_f64()).sum();
    Ok((rank.rank(), device_name(rank), sum, ok))
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
        "all_gather of {} x {} per rank (value = sum of the gathered buffer)",
        args.count, args.dtype
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
