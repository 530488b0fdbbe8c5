//! One-sided communication on windows: every rank writes a block of its data straight into
//! the next rank's window (`ncclPutSignal`), with no receive on the other side, then waits
//! for the signal of the rank before it (`ncclWaitSignal`) and checks the block that
//! arrived. Without a GPU (or with `--backend host`) the same program runs on the host
//! provider with 4 ranks, and its first line says so.
//!
//! `cargo run --example one_sided -- [--ranks N] [--count N] [--backend auto|nccl|host]`

mod common;

use std::process::ExitCode;

use common::{device_name, print_table, Args, Failure};
use nccl_launch::Rank;
use nccl_safe::{NcclMemory, Result, Signal, SignalWait, WindowFlags};

/// One rank's work: rank r's source holds `1000 r + i`; it puts its whole source into the
/// next rank's window at block r, waits for the rank before it, and checks that block.
fn rank_body(rank: &Rank, count: usize) -> Result<(usize, String, f64, bool)> {
    let (comm, s) = (rank.comm(), rank.stream());
    let (me, n) = (rank.rank(), rank.world_size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let value = |r: usize, i: usize| (1000 * r + i) as f32;
    // Symmetric windows: every rank registers the same sizes, in the same order.
    let mut src = NcclMemory::<f32>::alloc_zeros(comm, count, s.clone())?;
    src.copy_from_host(&(0..count).map(|i| value(me, i)).collect::<Vec<_>>(), s)?;
    let mut dst = NcclMemory::<f32>::alloc_zeros(comm, count * n, s.clone())?;
    let src = comm.register_window(&mut src, WindowFlags::COLL_SYMMETRIC)?;
    let mut dst = comm.register_window(&mut dst, WindowFlags::COLL_SYMMETRIC)?;

    dst.put_signal(&src, 0..count, next, me * count, Signal::DEFAULT, s)?;
    dst.wait_signal(&[SignalWait::new(prev, 1)], s)?;

    let got = dst.buffer().to_vec(s)?;
    let block = &got[prev * count..(prev + 1) * count];
    let ok = block.iter().enumerate().all(|(i, v)| *v == value(prev, i));
    let first = block.first().map_or(f64::NAN, |v| *v as f64);
    Ok((me, device_name(rank), first, ok))
}

fn run(args: Args) -> std::result::Result<(), Failure> {
    let (launcher, _backend, first_line) = args.launcher()?;
    println!("{first_line}");
    println!(
        "put_signal of {} x f32 from each rank into the next rank's window, then wait_signal",
        args.count
    );
    let count = args.count.max(1);
    let rows = launcher.run(|rank| rank_body(rank, count))?;
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
