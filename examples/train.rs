//! Data-parallel training as a Rust trainer would write it: each rank fits a linear model
//! `y = w . x + b` by SGD on its own shard, all-reduces (averages) the gradients every step,
//! and applies the same update. The ranks' parameters stay identical and the loss falls.
//!
//! `cargo run --example train -- [--ranks N] [--backend auto|nccl|host] [--launcher threads|env]`
//!
//! With `--launcher env` each process is one rank of a job started by torchrun, srun or
//! mpirun (`--backend host` runs it on the CPU).

mod common;

use std::process::ExitCode;

use common::{Args, Buf, Failure};
use nccl_launch::Rank;
use nccl_safe::{ReduceOp, Result};

const FEATURES: usize = 8;
const SAMPLES_PER_RANK: usize = 256;
const STEPS: usize = 200;
const LEARNING_RATE: f32 = 0.1;

/// A small deterministic generator (xorshift), so every run and rank is reproducible.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// This rank's shard of `y = true_w . x + true_b + noise`.
fn shard(rank: usize) -> (Vec<[f32; FEATURES]>, Vec<f32>) {
    let true_w: [f32; FEATURES] = [0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 1.0];
    let true_b = 0.3;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((rank as u64 + 1) * 0x1000_0001));
    (0..SAMPLES_PER_RANK)
        .map(|_| {
            let x: [f32; FEATURES] = std::array::from_fn(|_| rng.next());
            let y =
                x.iter().zip(true_w).map(|(a, w)| a * w).sum::<f32>() + true_b + 0.01 * rng.next();
            (x, y)
        })
        .unzip()
}

/// Mean squared error and its gradient over the shard; `params = [w..., b]`.
fn loss_and_grad(params: &[f32], xs: &[[f32; FEATURES]], ys: &[f32]) -> (f32, Vec<f32>) {
    let mut grad = vec![0.0f32; FEATURES + 1];
    let mut loss = 0.0;
    for (x, y) in xs.iter().zip(ys) {
        let pred = x.iter().zip(params).map(|(a, w)| a * w).sum::<f32>() + params[FEATURES];
        let err = pred - y;
        loss += err * err;
        for (g, a) in grad.iter_mut().zip(x) {
            *g += 2.0 * err * a;
        }
        grad[FEATURES] += 2.0 * err;
    }
    let n = xs.len() as f32;
    grad.iter_mut().for_each(|g| *g /= n);
    (loss / n, grad)
}

/// Averages `values` over all ranks (all-reduce with `Avg`), on the rank's device.
fn average(rank: &Rank, values: &[f32]) -> Result<Vec<f32>> {
    let mut buf = Buf::from_host(rank, values)?;
    match &mut buf {
        Buf::Host(v) => rank
            .comm()
            .all_reduce_in_place(v, ReduceOp::Avg, rank.stream())?,
        Buf::Cuda(b) => rank
            .comm()
            .all_reduce_in_place(b, ReduceOp::Avg, rank.stream())?,
    }
    buf.to_host(rank)
}

fn train(rank: &Rank) -> Result<(Vec<f32>, Vec<f32>)> {
    let (xs, ys) = shard(rank.rank());
    let mut params = vec![0.0f32; FEATURES + 1];
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (loss, grad) = loss_and_grad(&params, &xs, &ys);
        // One all-reduce carries the gradient and the loss (for logging).
        let mut packed = grad;
        packed.push(loss);
        let avg = average(rank, &packed)?;
        for (p, g) in params.iter_mut().zip(&avg[..FEATURES + 1]) {
            *p -= LEARNING_RATE * g;
        }
        if step % 40 == 0 || step == STEPS - 1 {
            losses.push(avg[FEATURES + 1]);
        }
    }
    Ok((params, losses))
}

/// One rank of a job started by torchrun, srun or mpirun: trains, then gathers every
/// rank's parameters to check they are identical.
fn one_process(args: &Args) -> std::result::Result<(), Failure> {
    let rank = args.process_rank()?;
    println!(
        "rank {} of {} (from the launcher's environment): linear regression by data-parallel SGD, {STEPS} steps",
        rank.rank(),
        rank.world_size()
    );
    let (params, losses) = train(&rank)?;
    let mut all = vec![0.0f32; params.len() * rank.world_size()];
    rank.comm().all_gather(&params, &mut all, rank.stream())?;
    let identical = all.chunks(params.len()).all(|p| {
        p.iter()
            .zip(&params)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    });
    let fell = losses.last().copied().unwrap_or(f32::NAN) < losses[0] / 100.0;
    println!(
        "rank {}: loss {:.4} -> {:.6}, parameters identical on every rank: {}",
        rank.rank(),
        losses[0],
        losses[losses.len() - 1],
        if identical { "yes" } else { "NO" }
    );
    if !identical || !fell {
        return Err(Failure::Wrong(format!(
            "training failed on rank {}: identical = {identical}, loss fell 100x = {fell}",
            rank.rank()
        )));
    }
    Ok(())
}

fn run(args: Args) -> std::result::Result<(), Failure> {
    if args.launcher == "env" {
        return one_process(&args);
    }
    let (launcher, _, first_line) = args.launcher()?;
    println!("{first_line}");
    println!(
        "linear regression by data-parallel SGD: {} ranks x {SAMPLES_PER_RANK} samples, {STEPS} steps",
        launcher.world_size()
    );
    let results = launcher.run(train)?;
    let (params0, losses) = &results[0];
    for (i, loss) in losses.iter().enumerate() {
        println!("  step {:>4}: mean loss {loss:.6}", (i * 40).min(STEPS - 1));
    }
    let identical = results.iter().all(|(p, _)| {
        p.iter()
            .zip(params0)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    });
    let fell = losses.last().copied().unwrap_or(f32::NAN) < losses[0] / 100.0;
    println!(
        "parameters identical on every rank: {}",
        if identical { "yes" } else { "NO" }
    );
    println!(
        "w = {:?}, b = {:.3}",
        params0[..FEATURES]
            .iter()
            .map(|w| (w * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        params0[FEATURES]
    );
    if !identical || !fell {
        return Err(Failure::Wrong(format!(
            "training failed: identical = {identical}, loss fell 100x = {fell}"
        )));
    }
    println!(
        "loss fell from {:.4} to {:.6}",
        losses[0],
        losses[losses.len() - 1]
    );
    Ok(())
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
