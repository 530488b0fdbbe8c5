//! An elastic training job: 4 ranks and a standby. ZeRO-1 with AdamW, each step's
//! samples from a DistributedSampler; a lost rank is survived, the standby taken back.
//!
//!   cargo run --example elastic_job                      (threads: nothing is lost)
//!   mpirun -np 5 --enable-recovery target/debug/examples/elastic_job
//!   srun -n 5 --kill-on-bad-exit=0 target/debug/examples/elastic_job
//!
//! In processes set NCCL_SAFE_RENDEZVOUS_TOKEN (one secret for the job), MASTER_ADDR and
//! MASTER_PORT (the job uses that port and the 3 after it).
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_nn::{linear, loss, Module, ParamsAdamW, VarBuilder, VarMap};
use nccl_safe_candle::state::AdamW;
use nccl_safe_candle::{
    BatchSplit, Config, DistResult, DistributedSampler, ElasticJob, ElasticRank, GrowPolicy,
    StateCarry, ZeroRedundancyOptimizer,
};

const STEPS: u64 = 200;
const SAMPLES: usize = 1000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let job = ElasticJob::from_env_or_host(4)? // mpirun, srun, torchrun; else 4 threads
        .host_provider() // ranks on the CPU; leave this out for a GPU each
        .standbys(1) // the launcher's last rank waits to replace a lost one
        .config(Config::new().timeout(Duration::from_secs(20)))
        .grow_policy(GrowPolicy::WhenStandbyWaits { every: 10 });
    for result in job.run(train) {
        result?;
    }
    Ok(())
}

fn train(rank: ElasticRank) -> DistResult<()> {
    let dev = Device::Cpu;
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let (l1, l2) = (linear(8, 32, vb.pp("l1"))?, linear(32, 1, vb.pp("l2"))?);
    let model = |x: &Tensor| l2.forward(&l1.forward(x)?.tanh()?);
    // The data, the same on every rank: a smooth function of 8 inputs.
    let x = (Tensor::arange(0u32, (SAMPLES * 8) as u32, &dev)?.to_dtype(DType::F32)? * 0.37)?
        .sin()?
        .reshape((SAMPLES, 8))?;
    let y = ((x.narrow(1, 0, 1)? * 2.0)? - x.narrow(1, 1, 1)?)?.sin()?;
    // Each step's 100 samples, split over whatever the world's size is then.
    let sampler = DistributedSampler::new(SAMPLES, 100)?
        .shuffle(7)
        .split(BatchSplit::Uneven);
    let carry = StateCarry::new(); // AdamW's moments, kept across a change of world
    let run = rank.train(STEPS, |comm, step, stop| {
        // Built again on every new world: rank 0's parameters, the carried state.
        let mut opt =
            ZeroRedundancyOptimizer::<AdamW>::resume(comm, &map, ParamsAdamW::default(), &carry)?;
        while *step < stop {
            let part = sampler.part_for(comm, *step)?;
            let l = loss::mse(&model(&part.select(&x)?)?, &part.select(&y)?)?;
            opt.backward_step(&(l * part.weight)?)?;
            *step += 1;
            if *step % 10 == 0 {
                let (r, w, pid) = (comm.rank(), comm.world_size(), std::process::id());
                println!("rank {r} of {w} (pid {pid}): step {step}");
            }
            std::thread::sleep(Duration::from_millis(20)); // a real model's step takes longer
        }
        Ok(())
    })?;
    match run {
        Some(run) => println!(
            "done: rank {} of {} at step {}, {} recoveries, loss {:.9}",
            run.comm.rank(),
            run.comm.world_size(),
            run.step,
            run.recoveries.len(),
            loss::mse(&model(&x)?, &y)?.to_scalar::<f32>()?
        ),
        None => println!("done: a standby that was not needed"),
    }
    Ok(())
}
