//! Gradient synchronization of a model with many small parameters, on 4 host-provider
//! ranks (threads): one all-reduce per parameter, against DDP's buckets.
//!
//! `cargo bench --bench buckets [-- --params N --elems N --rounds N]`
//!
//! The model has `--params` tensors (default 100) of `--elems` f32 each (default 16384:
//! 64 KiB, 6.25 MiB in all). Each step averages every gradient over the ranks and applies
//! SGD; the gradients are built once. The variants:
//!
//! - `per-parameter`: what a loop without buckets does (burn's way): every gradient copied
//!   and all-reduced on its own with [`nccl_safe_candle::all_reduce`], then averaged.
//! - `ddp, 1-byte buckets`: DDP with a bucket per parameter (packing, no batching).
//! - `ddp, 1 MiB buckets`, `ddp, one bucket`, `ddp, default (25 MiB)`.
//!
//! The variants take turns, round after round (each round starting with the next), in one
//! run; the figures are medians over the rounds, and the ratios are to the default (time /
//! default's time). Two variants with the same plan (one bucket and the default, for a
//! model under 25 MiB) show the noise.
//!
//! Then the optimizer state per rank of the same model, counted as the bytes of the state
//! tensors of a momentum SGD (one velocity per element): over all parameters, as with DDP,
//! and over this rank's part, as with ZeRO-1.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use nccl_launch::Launcher;
use nccl_safe_candle::{
    all_reduce, DistributedDataParallel, ReduceOp, ZeroRedundancyOptimizer, DEFAULT_BUCKET_CAP,
};

const RANKS: usize = 4;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (params, elems, rounds) = (
        arg("--params", 100),
        arg("--elems", 16384),
        arg("--rounds", 7),
    );
    let variants: [(&str, Option<usize>); 5] = [
        ("per-parameter all-reduce", None),
        ("ddp, 1-byte buckets", Some(1)),
        ("ddp, 1 MiB buckets", Some(1 << 20)),
        ("ddp, one bucket", Some(usize::MAX)),
        ("ddp, default (25 MiB)", Some(DEFAULT_BUCKET_CAP)),
    ];
    let times = Launcher::host(RANKS).try_run(
        |rank| -> nccl_safe_candle::DistResult<(Vec<Vec<Duration>>, usize, usize)> {
            let comm = rank.comm();
            let named: Vec<(String, Var)> = (0..params)
                .map(|i| {
                    Ok((
                        format!("p{i:03}"),
                        Var::zeros(elems, DType::F32, &Device::Cpu)?,
                    ))
                })
                .collect::<candle_core::Result<_>>()?;
            let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
            let grads: Vec<Tensor> = (0..params)
                .map(|i| Tensor::full((rank.rank() + i) as f32, elems, &Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            let store = || {
                let mut g = GradStore::default();
                for (v, t) in vars.iter().zip(&grads) {
                    g.insert(v.as_tensor(), t.clone());
                }
                g
            };
            let ddps = variants
                .iter()
                .map(|(_, cap)| {
                    cap.map(|c| DistributedDataParallel::from_named(comm, named.clone(), c))
                        .transpose()
                })
                .collect::<nccl_safe_candle::DistResult<Vec<_>>>()?;
            let mut sgd = SGD::new(vars.clone(), 1e-6)?;
            let world = comm.world_size() as f64;
            let mut times = vec![Vec::new(); variants.len()];
            let barrier = Tensor::zeros(1, DType::F32, &Device::Cpu)?;
            for round in 0..=rounds {
                // Each round starts with another variant: no variant always runs first.
                for j in 0..ddps.len() {
                    let k = (j + round) % ddps.len();
                    let ddp = &ddps[k];
                    all_reduce(comm, &barrier, ReduceOp::Sum)?;
                    let start = Instant::now();
                    let mut g = store();
                    match ddp {
                        Some(ddp) => ddp.sync_grads(&mut g)?,
                        None => {
                            for v in &vars {
                                let t = g.get(v.as_tensor()).expect("built above").copy()?;
                                all_reduce(comm, &t, ReduceOp::Sum)?;
                                g.insert(v.as_tensor(), (t / world)?);
                            }
                        }
                    }
                    sgd.step(&g)?;
                    // Round 0 warms up.
                    if round > 0 {
                        times[k].push(start.elapsed());
                    }
                }
            }
            // Optimizer state per rank: DDP's optimizer holds all parameters, ZeRO-1's its part.
            let ddp_state = common::Momentum::new(vars.clone(), (1e-6, 0.9))?.state_bytes();
            let zero = ZeroRedundancyOptimizer::<common::Momentum>::from_named(
                comm,
                named.clone(),
                (1e-6, 0.9),
            )?;
            Ok((times, ddp_state, zero.optimizer().state_bytes()))
        },
    )?;
    let state: Vec<(usize, usize)> = times.iter().map(|t| (t.1, t.2)).collect();
    let times: Vec<Vec<Vec<Duration>>> = times.into_iter().map(|t| t.0).collect();
    let rank0 = times.into_iter().next().expect("4 ranks");
    let medians: Vec<Duration> = rank0.into_iter().map(median).collect();
    let default = medians[variants.len() - 1].as_secs_f64();
    println!(
        "gradient sync + SGD step: {params} f32 parameters of {elems} elements ({:.2} MiB), {RANKS} host ranks, median of {rounds} rounds",
        (params * elems * 4) as f64 / (1 << 20) as f64
    );
    println!(
        "{:<28} {:>12} {:>16}",
        "variant", "ms / step", "time / default"
    );
    for ((name, _), m) in variants.iter().zip(&medians) {
        println!(
            "{name:<28} {:>12.2} {:>16.2}",
            m.as_secs_f64() * 1e3,
            m.as_secs_f64() / default
        );
    }
    for (r, (ddp, zero)) in state.iter().enumerate() {
        println!(
            "optimizer state, rank {r}: DDP {:.3} MiB, ZeRO-1 {:.3} MiB ({:.3} of DDP's)",
            *ddp as f64 / (1 << 20) as f64,
            *zero as f64 / (1 << 20) as f64,
            *zero as f64 / *ddp as f64
        );
    }
    Ok(())
}
