//! What ZeRO-1's copy of the next rank's optimizer state (`StateCarry::with_replica`, on by
//! default) costs, on 4 host-provider ranks (threads): step time and bytes, against ZeRO-1
//! without the copy.
//!
//! `cargo bench --bench zero_replica [-- --elems N --steps N --rounds N]`
//!
//! The model is one f32 parameter of `--elems` elements (default 4 Mi: 16 MiB), stepped by
//! this crate's AdamW through `ZeroRedundancyOptimizer::resume` with a fixed gradient (so
//! the step is the optimizer's alone: reduce-scatter, AdamW on this rank's quarter, the
//! copy's exchange, all-gather). The two variants take turns, round after round, `--steps`
//! steps each (default 10), in one run; the figures are medians over the rounds (default
//! 7) and the ratio is with / without. Then the bytes per rank: the parameter shard, the
//! optimizer state of the shard, and the copy.

use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::{ParamsAdamW, VarBuilder, VarMap};
use nccl_launch::Launcher;
use nccl_safe_candle::state::AdamW;
use nccl_safe_candle::{DistResult, StateCarry, ZeroRedundancyOptimizer};

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
    let (elems, steps, rounds) = (
        arg("--elems", 4 << 20),
        arg("--steps", 10),
        arg("--rounds", 7),
    );
    let out = Launcher::host(RANKS).try_run(|rank| -> DistResult<_> {
        let comm = rank.comm();
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let w = vb.get_with_hints(elems, "w", candle_nn::Init::Const(0.5))?;
        let g = (Tensor::ones(elems, DType::F32, &Device::Cpu)? * 0.01)?;
        let mut grads = GradStore::default();
        grads.insert(&w, g);
        let carries = [StateCarry::new().with_replica(false), StateCarry::new()];
        let mut times: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
        let mut bytes = [0usize; 4];
        for round in 0..rounds {
            for k in 0..2 {
                let v = (round + k) % 2;
                let mut opt = ZeroRedundancyOptimizer::<AdamW>::resume(
                    comm,
                    &map,
                    ParamsAdamW::default(),
                    &carries[v],
                )?;
                opt.step(&grads)?; // warm
                let t0 = Instant::now();
                for _ in 0..steps {
                    opt.step(&grads)?;
                }
                times[v].push(t0.elapsed() / steps as u32);
                if v == 1 {
                    bytes = [
                        opt.param_shard_bytes(),
                        opt.optimizer_state_bytes(),
                        opt.state_replica_bytes(),
                        elems * 4,
                    ];
                }
            }
        }
        Ok((median(times[0].clone()), median(times[1].clone()), bytes))
    })?;
    let (without, with, bytes) = out[0];
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "{RANKS} ranks, {elems} f32 parameters ({:.1} MiB), AdamW, {steps} steps x {rounds} rounds",
        mib(bytes[3])
    );
    println!(
        "  step without the copy: {:>8.2} ms",
        without.as_secs_f64() * 1e3
    );
    println!(
        "  step with the copy:    {:>8.2} ms  ({:.2}x)",
        with.as_secs_f64() * 1e3,
        with.as_secs_f64() / without.as_secs_f64()
    );
    println!(
        "  per rank: parameter shard {:.2} MiB, its AdamW state {:.2} MiB, the copy {:.2} MiB \
         (+{:.0}% of ZeRO-1's optimizer state; during a step also a {:.2} MiB exchange buffer \
         and the copy received)",
        mib(bytes[0]),
        mib(bytes[1]),
        mib(bytes[2]),
        100.0 * bytes[2] as f64 / bytes[1] as f64,
        mib(bytes[1] * RANKS)
    );
    Ok(())
}
