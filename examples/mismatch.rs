//! The classic distributed bug: a collective called only on rank 0.
//!
//! Rank 0 all-reduces a metric for logging; every rank then broadcasts the weights. Without
//! diagnostics, rank 0's all-reduce is matched with the others' broadcast and the job hangs
//! (or corrupts data). With the fingerprint check on, every rank stops at once with a table
//! of what each rank called and from which line.
//!
//! `cargo run --example mismatch -- [ranks (2-4, default 3)]` (host provider, ranks as
//! threads; exits non-zero with the report).

use std::time::{Duration, Instant};

use nccl_safe::{CommDevice, Communicator, Config, Error, ReduceOp, Result, Stream};

fn train_step(comm: &Communicator) -> Result<()> {
    let mut loss = vec![comm.rank() as f32; 1];
    if comm.rank() == 0 {
        // The bug: only rank 0 reduces the loss "to log it".
        comm.all_reduce_in_place(&mut loss, ReduceOp::Sum, &Stream::Host)?;
    }
    let mut weights = vec![0.5f32; 1024];
    comm.broadcast_in_place(&mut weights, 0, &Stream::Host)?;
    Ok(())
}

fn run() -> Result<()> {
    let world: usize = match std::env::args().nth(1) {
        Some(a) => a.parse().map_err(|_| Error::InvalidArgument {
            call: "mismatch example",
            reason: format!("{a:?} is not a number of ranks"),
        })?,
        None => 3,
    };
    if !(2..=4).contains(&world) {
        return Err(Error::InvalidArgument {
            call: "mismatch example",
            reason: format!("use 2 to 4 ranks, not {world}"),
        });
    }
    let id = CommDevice::Host.unique_id()?;
    let config = Config::new()
        .check_collectives(true)
        .timeout(Duration::from_secs(5));
    let start = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (id, config) = (&id, &config);
                s.spawn(move || -> Result<()> {
                    let comm = Communicator::init_rank(&CommDevice::Host, world, rank, id, config)?;
                    train_step(&comm)?;
                    comm.destroy().map_err(|(_, e)| e)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::InvalidArgument {
                        call: "mismatch example",
                        reason: "a rank panicked".into(),
                    })
                })
            })
            .collect()
    });
    let elapsed = start.elapsed();
    for (rank, r) in results.iter().enumerate() {
        match r {
            Ok(()) => println!("rank {rank}: ok"),
            Err(e) => println!(
                "rank {rank}: {}",
                e.to_string().lines().next().unwrap_or("")
            ),
        }
    }
    println!("(all ranks returned after {:.3}s)", elapsed.as_secs_f64());
    match results.into_iter().find_map(|r| r.err()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
