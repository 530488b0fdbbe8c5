//! ZeRO-1's copy of each rank's optimizer state on the rank before it
//! (`StateCarry::with_replica`, on by default): after a lost rank the survivors rebuild its
//! state, so training ends where a run that lost nothing ends.
//!
//! 4 host-provider ranks as threads, an f64 model and this crate's AdamW, 30 steps, each
//! step's global batch of 24 samples the same whatever the world (split 6 x 4 or 8 x 3,
//! each rank's mean loss averaged: the same gradient up to rounding):
//! - rank 3 lost at step 10, the 3 left go on: the parameters end within 1e-5 of 4 ranks
//!   that lost nothing (measured: 1.1e-16 largest difference, f64's rounding of the 3-way
//!   against the 4-way average);
//! - the same without the replica (the only behaviour before it: the lost rank's range of
//!   AdamW's moments restarts from zero) ends 3.9e-2 away, which the test also checks, so
//!   the first check cannot pass without the replica doing its work;
//! - ranks that disagree on `with_replica` are refused on every rank, none left waiting;
//! - `candle_nn::AdamW` does not compile where the state must be carried, and the error
//!   names the drop-in (`resume`'s `compile_fail` doc test).

mod common;

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_nn::{linear, loss, Linear, Module, ParamsAdamW, VarBuilder, VarMap};
use common::uniform;
use nccl_safe::{CommDevice, Communicator, Config};
use nccl_safe_candle::state::AdamW;
use nccl_safe_candle::{run_elastic, DistResult, StateCarry, ZeroRedundancyOptimizer};

const RANKS: usize = 4;
const STEPS: u64 = 30;
const LOST_AT: u64 = 10;
/// Each step's global batch: divides by 4 and by 3.
const BATCH: usize = 24;
const INPUTS: usize = 6;

struct Net {
    l1: Linear,
    l2: Linear,
}

impl Net {
    fn new(map: &VarMap) -> candle_core::Result<Net> {
        let vb = VarBuilder::from_varmap(map, DType::F64, &Device::Cpu);
        Ok(Net {
            l1: linear(INPUTS, 12, vb.pp("l1"))?,
            l2: linear(12, 1, vb.pp("l2"))?,
        })
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.tanh()?)
    }
}

/// Every parameter from a fixed sequence (rank 0's: the optimizer broadcasts them).
fn init(map: &VarMap) -> candle_core::Result<()> {
    let mut next = uniform(0x5EED);
    let mut vars: Vec<_> = map.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, v) in vars {
        let t = v.as_tensor();
        let values: Vec<f64> = (0..t.elem_count()).map(|_| next() as f64 * 0.5).collect();
        v.set(&Tensor::from_vec(values, t.shape(), &Device::Cpu)?)?;
    }
    Ok(())
}

fn flat(map: &VarMap) -> Vec<f64> {
    let mut vars: Vec<_> = map.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars.iter()
        .flat_map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        })
        .collect()
}

/// Step `step`'s global batch (the same on every rank and in every run).
fn batch(step: u64) -> candle_core::Result<(Tensor, Tensor)> {
    let mut next = uniform(0x9E37_79B9 ^ ((step + 1) * 0x1000_0001));
    let xs: Vec<f64> = (0..BATCH * INPUTS).map(|_| next() as f64).collect();
    let ys: Vec<f64> = xs
        .chunks(INPUTS)
        .map(|x| (x[0] - 0.5 * x[3]).sin() + 0.25 * x[1] * x[2] - x[5])
        .collect();
    Ok((
        Tensor::from_vec(xs, (BATCH, INPUTS), &Device::Cpu)?,
        Tensor::from_vec(ys, (BATCH, 1), &Device::Cpu)?,
    ))
}

fn params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.01,
        ..ParamsAdamW::default()
    }
}

/// One rank's run: its final parameters and world, or its error.
fn rank(
    rank: usize,
    id: &nccl_safe::UniqueId,
    lose_at: Option<u64>,
    replica: bool,
) -> DistResult<(Vec<f64>, usize)> {
    let config = Config::new().elastic(true).timeout(Duration::from_secs(30));
    let comm = Communicator::init_rank(&CommDevice::Host, RANKS, rank, id, &config)?;
    let map = VarMap::new();
    let net = Net::new(&map)?;
    init(&map)?;
    let carry = StateCarry::new().with_replica(replica);
    let run = run_elastic(comm, 0, |comm, step| {
        let mut opt = ZeroRedundancyOptimizer::<AdamW>::resume(comm, &map, params(), &carry)?;
        while *step < STEPS {
            if lose_at == Some(*step) {
                return Err(candle_core::Error::Msg("rank 3 is lost".into()).into());
            }
            let (x, y) = batch(*step)?;
            let (x, y) = (opt.shard_batch(&x)?, opt.shard_batch(&y)?);
            opt.backward_step(&loss::mse(&net.forward(&x)?, &y)?)?;
            *step += 1;
        }
        Ok(())
    })?;
    assert_eq!(run.step, STEPS);
    Ok((flat(&map), run.comm.world_size()))
}

/// Rank 0's final parameters, after checking that the survivors agree.
fn four_ranks(lose: bool, replica: bool) -> Vec<f64> {
    let id = CommDevice::Host.unique_id().unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RANKS)
            .map(|r| {
                let id = &id;
                let lose_at = (lose && r == 3).then_some(LOST_AT);
                s.spawn(move || rank(r, id, lose_at, replica))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let survivors = if lose { 3 } else { 4 };
    let mut results = results.into_iter();
    let kept: Vec<(Vec<f64>, usize)> = results
        .by_ref()
        .take(survivors)
        .map(|r| r.unwrap())
        .collect();
    for r in results {
        assert!(matches!(&r, Err(e) if e.to_string().contains("rank 3 is lost")));
    }
    for (r, (p, world)) in kept.iter().enumerate() {
        assert_eq!(*world, survivors, "rank {r}");
        assert_eq!(p, &kept[0].0, "rank {r}'s parameters");
    }
    kept.into_iter().next().unwrap().0
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn zero1_after_a_lost_rank_ends_within_1e_5_of_a_run_that_lost_nothing() {
    let nothing_lost = four_ranks(false, true);
    let with_replica = four_ranks(true, true);
    let without = four_ranks(true, false);
    let (d_with, d_without) = (
        max_diff(&with_replica, &nothing_lost),
        max_diff(&without, &nothing_lost),
    );
    eprintln!("largest difference from the run that lost nothing: {d_with:e} with the replica, {d_without:e} without");
    assert!(
        d_with < 1e-5,
        "{d_with} from the run that lost nothing, with the replica"
    );
    // Without it the lost range's moments restart: the test above could not pass so.
    assert!(
        d_without > 1e-4,
        "{d_without}: without the replica the run should differ"
    );
}

/// One rank's `StateCarry` says `with_replica(false)`, the others `true`: every rank's
/// `resume` fails with the same error naming the setting (none waits in a collective).
#[test]
fn ranks_that_disagree_on_the_replica_are_refused_on_every_rank() {
    let results = nccl_safe_candle::Launcher::host(3)
        .timeout(Duration::from_secs(60))
        .try_run(|rank| -> DistResult<String> {
            let map = VarMap::new();
            Net::new(&map)?;
            let carry = StateCarry::new().with_replica(rank.comm().rank() != 1);
            let e = ZeroRedundancyOptimizer::<AdamW>::resume(rank.comm(), &map, params(), &carry)
                .map(|_| ())
                .unwrap_err();
            Ok(e.to_string())
        })
        .unwrap();
    for e in results {
        assert!(
            e.contains("rank 1's StateCarry says with_replica(false), rank 0's with_replica(true)"),
            "{e}"
        );
    }
}

/// The replica costs one optimizer state of the shard: AdamW's, twice the parameter
/// shard's bytes; none without it, and none with one rank.
#[test]
fn the_replica_holds_one_shard_of_state() {
    let sizes = nccl_safe_candle::Launcher::host(RANKS)
        .try_run(|rank| -> DistResult<[usize; 4]> {
            let map = VarMap::new();
            Net::new(&map)?;
            let with = StateCarry::new();
            let without = StateCarry::new().with_replica(false);
            let a = ZeroRedundancyOptimizer::<AdamW>::resume(rank.comm(), &map, params(), &with)?;
            let b =
                ZeroRedundancyOptimizer::<AdamW>::resume(rank.comm(), &map, params(), &without)?;
            Ok([
                a.state_replica_bytes(),
                a.optimizer_state_bytes(),
                a.param_shard_bytes(),
                b.state_replica_bytes(),
            ])
        })
        .unwrap();
    // 6 x 12 + 12 + 12 + 1 = 97 elements over 4 ranks: 25 each (padded), f64.
    for s in sizes {
        assert_eq!(s, [2 * 25 * 8, 2 * 25 * 8, 25 * 8, 0]);
    }
}
