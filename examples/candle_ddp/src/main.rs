//! Data-parallel training of a small candle model with `nccl-safe-candle`.
//!
//! Every rank (a thread, from `nccl_launch::Launcher`) builds the same MLP;
//! `DistributedDataParallel` gives every rank rank 0's parameters (after checking that all
//! ranks hold the same ones) and, each step, averages the gradients over the ranks in
//! buckets, so every rank applies the same SGD update to its own shard of a synthetic
//! regression set. Every 25 steps the drift check compares a fingerprint of every rank's
//! parameters (a step that fails it names the step and the ranks). At the end the example
//! checks that the global loss fell and that every rank holds bit-identical parameters,
//! and exits non-zero otherwise.
//!
//! On CPU tensors the collectives run on the host provider; with the `cuda` feature on
//! candle's `CudaStorage`, with no copy to the host: the gradient buckets on a
//! communication stream of their own, ordered against candle's stream by events.
//!
//!     cargo run --release                      # 4 ranks on the host provider, CPU tensors
//!     cargo run --release -- --ranks 2 --steps 300
//!     cargo run --release --features cuda     # one rank per GPU, CUDA tensors
//!     cargo run --release -- --accumulate 4    # 4 micro-batches per step (no_sync)
//!     cargo run --release -- --no-allreduce    # a plain SGD step: the drift check fails
use std::process::ExitCode;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::{linear, Linear, Module, Optimizer, VarBuilder, VarMap, SGD};
use nccl_safe_candle::{DdpOptimizer, DistributedDataParallel, Launcher, Rank, ReduceOp, Unscaled};

const INPUTS: usize = 8;
const HIDDEN: usize = 32;
const SAMPLES: usize = 1024;
const LEARNING_RATE: f64 = 0.05;
/// Buckets of 1 KiB: this small model's gradients (about 5.5 KiB) take five, so that on
/// CUDA packing one overlaps with reducing the one before (25 MiB would make one bucket).
const BUCKET_CAP: usize = 1024;
/// The drift check runs after every this many steps.
const DRIFT_EVERY: u64 = 25;

/// The model: three linear layers with ReLUs.
struct Mlp {
    layers: [Linear; 3],
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Mlp> {
        Ok(Mlp {
            layers: [
                linear(INPUTS, HIDDEN, vb.pp("l1"))?,
                linear(HIDDEN, HIDDEN, vb.pp("l2"))?,
                linear(HIDDEN, 1, vb.pp("l3"))?,
            ],
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = self.layers[0].forward(x)?.relu()?;
        let x = self.layers[1].forward(&x)?.relu()?;
        self.layers[2].forward(&x)
    }
}

/// A fixed sequence of numbers in [-1, 1) (xorshift64*), so that runs are reproducible.
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed | 1;
    move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// A deterministic synthetic regression set (the same on every rank): inputs in [-1, 1)
/// and a smooth nonlinear target. Returns this rank's shard (every `world`-th sample).
fn shard(rank: usize, world: usize) -> (Vec<f32>, Vec<f32>, usize) {
    let mut next = uniform(0x9E37_79B9_7F4A_7C15);
    let (mut xs, mut ys, mut n) = (Vec::new(), Vec::new(), 0);
    for i in 0..SAMPLES {
        let x: Vec<f32> = (0..INPUTS).map(|_| next()).collect();
        let linear: f32 = x
            .iter()
            .enumerate()
            .map(|(j, v)| v * (j as f32 - 3.5) / 4.0)
            .sum();
        let y = linear.sin() + 0.5 * x[0] * x[1];
        if i % world == rank {
            xs.extend_from_slice(&x);
            ys.push(y);
            n += 1;
        }
    }
    (xs, ys, n)
}

struct Opts {
    ranks: usize,
    steps: usize,
    all_reduce: bool,
    accumulate: usize,
}

/// What a rank reports: the global loss before and after training, and its parameters.
struct Outcome {
    losses: Vec<(usize, f32)>,
    params: Vec<f32>,
}

fn train(rank: &Rank, device: &Device, opts: &Opts) -> candle_core::Result<Outcome> {
    let map = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&map, DType::F32, device))?;
    let ddp = DistributedDataParallel::with_bucket_cap(rank.comm(), &map, BUCKET_CAP)?
        .with_drift_check(DRIFT_EVERY);
    // Rank 0 draws its parameters from a fixed sequence (uniform in +-1/sqrt(fan-in), as
    // candle-nn's default), so that runs are reproducible, and every rank takes them.
    if rank.rank() == 0 {
        let mut next = uniform(0x5EED);
        for (_, v) in ddp.params() {
            let dims = v.as_tensor().dims().to_vec();
            let fan_in = if dims.len() == 2 { dims[1] } else { HIDDEN };
            let scale = 1.0 / (fan_in as f32).sqrt();
            let values: Vec<f32> = (0..v.as_tensor().elem_count())
                .map(|_| next() * scale)
                .collect();
            v.set(&Tensor::from_vec(values, dims, device)?)?;
        }
    }
    ddp.broadcast_params()?;
    let (xs, ys, n) = shard(rank.rank(), rank.world_size());
    let x = Tensor::from_vec(xs, (n, INPUTS), device)?;
    let y = Tensor::from_vec(ys, (n, 1), device)?;
    let mut losses = Vec::new();
    let mut log = |step: usize, loss: &Tensor, ddp: &DistributedDataParallel| {
        if step.is_multiple_of(50) || step + 1 == opts.steps {
            let mean = ddp.all_reduce_scalar(loss, ReduceOp::Avg)?;
            losses.push((step, mean as f32));
        }
        candle_core::Result::Ok(())
    };
    if !opts.all_reduce {
        // The mistake the drift check is for: a plain optimizer beside the
        // DistributedDataParallel, stepped on its own (local) gradients.
        let mut sgd = SGD::new(ddp.vars(), LEARNING_RATE)?;
        for step in 0..opts.steps {
            let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
            log(step, &loss, &ddp)?;
            sgd.backward_step(&loss)?;
            if (step as u64 + 1).is_multiple_of(DRIFT_EVERY) {
                ddp.check_drift()?;
            }
        }
    } else {
        // The optimizer inside the data-parallel object: its backward_step is the
        // data-parallel step (the drift check runs in it every DRIFT_EVERY steps).
        let mut opt = DdpOptimizer::<SGD>::from_ddp(ddp, LEARNING_RATE)?;
        let micro = n / opts.accumulate;
        for step in 0..opts.steps {
            let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
            log(step, &loss, opt.ddp())?;
            if opts.accumulate == 1 {
                opt.backward_step(&loss)?;
            } else {
                // Each micro-batch's loss goes through the guard, which scales it by
                // 1/accumulate; one all-reduce and one step at the end.
                let mut acc = opt.no_sync(opts.accumulate)?;
                for k in 0..opts.accumulate {
                    let (xk, yk) = (
                        x.narrow(0, k * micro, micro)?,
                        y.narrow(0, k * micro, micro)?,
                    );
                    acc.backward(Unscaled(&candle_nn::loss::mse(&model.forward(&xk)?, &yk)?))?;
                }
                acc.step()?;
            }
        }
        opt.check_drift()?;
        return outcome(opt.ddp().params(), losses);
    }
    outcome(ddp.params(), losses)
}

fn outcome(
    named: &[(String, candle_core::Var)],
    losses: Vec<(usize, f32)>,
) -> candle_core::Result<Outcome> {
    let mut params = Vec::new();
    for (_, v) in named {
        params.extend(v.as_tensor().flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(Outcome { losses, params })
}

fn parse() -> Result<Opts, String> {
    let mut opts = Opts {
        ranks: 4,
        steps: 200,
        all_reduce: true,
        accumulate: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .filter(|&v| v > 0)
                .ok_or_else(|| format!("{name} needs a positive number"))
        };
        match a.as_str() {
            "--ranks" => opts.ranks = number("--ranks")?,
            "--steps" => opts.steps = number("--steps")?,
            "--accumulate" => opts.accumulate = number("--accumulate")?,
            "--no-allreduce" => opts.all_reduce = false,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(opts)
}

fn main() -> ExitCode {
    let opts = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!(
                "candle-ddp: {e}\nusage: candle-ddp [--ranks N] [--steps N] [--accumulate N] [--no-allreduce]"
            );
            return ExitCode::from(2);
        }
    };
    #[cfg(not(feature = "cuda"))]
    let (launcher, backend) = (Launcher::host(opts.ranks), "the host provider, CPU tensors");
    #[cfg(feature = "cuda")]
    let (launcher, backend) = match Launcher::all_devices() {
        Ok(l) => (l, "NVIDIA's NCCL, CUDA tensors"),
        Err(e) => {
            eprintln!("candle-ddp: no CUDA devices: {e}");
            return ExitCode::FAILURE;
        }
    };
    let launcher = launcher.timeout(Duration::from_secs(60));
    let params = INPUTS * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN + 1;
    println!(
        "candle-ddp: {} ranks on {backend}; MLP {INPUTS}-{HIDDEN}-{HIDDEN}-1 ({params} parameters), {SAMPLES} samples, {} steps of SGD (lr {LEARNING_RATE}){}",
        launcher.world_size(),
        opts.steps,
        if !opts.all_reduce {
            ", a plain SGD step (gradients NOT all-reduced)".to_string()
        } else if opts.accumulate > 1 {
            format!(", {} micro-batches per step", opts.accumulate)
        } else {
            String::new()
        }
    );
    let start = Instant::now();
    let results = launcher.run(|rank| {
        #[cfg(not(feature = "cuda"))]
        let device = Device::Cpu;
        #[cfg(feature = "cuda")]
        let device = match nccl_safe_candle::candle_device(rank) {
            Ok(d) => d,
            Err(e) => return Ok(Err(e.to_string())),
        };
        // A rank whose training fails returns early; the launcher then aborts the others.
        Ok(train(rank, &device, &opts).map_err(|e| format!("rank {}: {e}", rank.rank())))
    });
    let outcomes = match results {
        Ok(r) => match r.into_iter().collect::<Result<Vec<_>, _>>() {
            Ok(o) => o,
            Err(e) => {
                eprintln!("candle-ddp: {e}");
                return ExitCode::FAILURE;
            }
        },
        Err(e) => {
            eprintln!("candle-ddp: {e}");
            return ExitCode::FAILURE;
        }
    };
    let took = start.elapsed();
    let first = &outcomes[0];
    for (step, loss) in &first.losses {
        println!("step {step:>5}  loss {loss:.6}");
    }
    let mut ok = true;
    let (l0, l1) = (first.losses[0].1, first.losses[first.losses.len() - 1].1);
    if l1.is_finite() && l1 < l0 / 4.0 {
        println!(
            "loss fell from {l0:.6} to {l1:.6} ({:.1}x) in {:.2?}",
            l0 / l1,
            took
        );
    } else {
        println!("FAILED: the loss did not fall enough: {l0:.6} -> {l1:.6}");
        ok = false;
    }
    let bits = |p: &[f32]| p.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let reference = bits(&first.params);
    let differing: Vec<(usize, usize)> = outcomes
        .iter()
        .enumerate()
        .skip(1)
        .map(|(r, o)| {
            let b = bits(&o.params);
            let n = if b.len() == reference.len() {
                b.iter().zip(&reference).filter(|(a, b)| a != b).count()
            } else {
                reference.len().max(b.len())
            };
            (r, n)
        })
        .filter(|&(_, n)| n > 0)
        .collect();
    if reference.len() != params {
        println!("FAILED: {} parameters, expected {params}", reference.len());
        ok = false;
    } else if differing.is_empty() {
        println!(
            "parameters: bit-identical on all {} ranks ({params} values)",
            outcomes.len()
        );
    } else {
        for (r, n) in differing {
            println!("FAILED: rank {r} differs from rank 0 in {n} of {params} parameters");
        }
        ok = false;
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
