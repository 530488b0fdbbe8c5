//! The elastic loop over 4 host-provider ranks (threads, `Config::elastic`): rank 3 is
//! lost in the middle of step 10 (it returns an error and drops its communicator, or it
//! panics), ranks 0-2 recover and carry on from step 10 on 3 ranks. Checked: one
//! recovery, naming rank 3, at step 10; every survivor ends at step 30 with bit-identical
//! parameters; the loss falls before and after the loss of the rank; the parameters match
//! one process training on the whole batch for 30 steps (so no step was skipped or
//! applied twice); every communicator is torn down once. And a replacement rank 3 that
//! rejoins through `grow` at step 20, a standby that dies before it joins (the grow hands
//! the communicator back and training carries on), and two ranks lost one after the other.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use candle_nn::{loss, Module, Optimizer, VarMap, SGD};
use common::*;
use nccl_safe::{CommDevice, Communicator, Config, UniqueId};
use nccl_safe_candle::{run_elastic, DdpOptimizer, DistResult, Recovery, ZeroRedundancyOptimizer};

const RANKS: usize = 4;
const STEPS: u64 = 30;
const LOST_AT: u64 = 10;
/// Divides by 4 and by 3.
const ROWS: usize = 24;
const LR: f64 = 0.05;

fn data() -> (Tensor, Tensor) {
    let (x, y) = batch().unwrap();
    (x.narrow(0, 0, ROWS).unwrap(), y.narrow(0, 0, ROWS).unwrap())
}

/// One process, the whole batch.
fn reference() -> Vec<f32> {
    let map = VarMap::new();
    let model = Mlp::new(&map).unwrap();
    init_fixed(&map).unwrap();
    let (x, y) = data();
    let mut opt = SGD::new(map.all_vars(), LR).unwrap();
    for _ in 0..STEPS {
        opt.backward_step(&loss::mse(&model.forward(&x).unwrap(), &y).unwrap())
            .unwrap();
    }
    flat_params(&map).unwrap()
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Loss {
    /// Rank 3's session returns an error: its communicator is dropped (destroyed) while
    /// the others wait in the step's reduce-scatter.
    Returns,
    /// Rank 3 panics in the middle of the step: its communicator is aborted.
    Panics,
    /// Rank 3 is stuck (alive, calling nothing) for 3 s, three times the 1 s timeout,
    /// then tries its step: the watchdog's timeout finds it the one rank behind.
    Stuck,
}

/// The data-parallel optimizer a session steps.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Dp {
    /// ZeRO-1 (a reduce-scatter and an all-gather per step).
    Zero,
    /// DDP (its buckets' all-reduces as one NCCL group on the host provider).
    Ddp,
}

/// How a session steps it.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Via {
    /// The optimizer's own `backward_step` (a `DistResult`).
    Inherent,
    /// Code generic over `candle_nn::Optimizer` (a `candle_core::Result`), `?` into a
    /// `DistResult`.
    Trait,
}

/// Either optimizer, stepped either way.
enum AnyOpt<'c> {
    Zero(ZeroRedundancyOptimizer<'c, SGD>),
    Ddp(DdpOptimizer<'c, SGD>),
}

/// A step through candle's trait, as code generic over any optimizer writes it.
fn generic_step<O: Optimizer>(opt: &mut O, l: &Tensor) -> candle_core::Result<()> {
    opt.backward_step(l)
}

impl<'c> AnyOpt<'c> {
    fn new(dp: Dp, comm: &'c Communicator, map: &VarMap) -> DistResult<AnyOpt<'c>> {
        Ok(match dp {
            Dp::Zero => AnyOpt::Zero(ZeroRedundancyOptimizer::new(comm, map, LR)?),
            // Buckets of 64 bytes: several all-reduces in the step's group.
            Dp::Ddp => AnyOpt::Ddp(DdpOptimizer::with_bucket_cap(comm, map, 64, LR)?),
        })
    }

    fn shard_batch(&self, t: &Tensor) -> DistResult<Tensor> {
        match self {
            AnyOpt::Zero(o) => o.shard_batch(t),
            AnyOpt::Ddp(o) => o.shard_batch(t),
        }
    }

    fn step(&mut self, l: &Tensor, via: Via) -> DistResult<()> {
        match (self, via) {
            (AnyOpt::Zero(o), Via::Inherent) => o.backward_step(l),
            (AnyOpt::Ddp(o), Via::Inherent) => o.backward_step(l),
            (AnyOpt::Zero(o), Via::Trait) => Ok(generic_step(o, l)?),
            (AnyOpt::Ddp(o), Via::Trait) => Ok(generic_step(o, l)?),
        }
    }
}

struct Survivor {
    params: Vec<f32>,
    losses: Vec<f32>,
    step: u64,
    world: usize,
    recoveries: Vec<Recovery>,
    /// When the first step on the smaller world completed.
    first_small_step: Option<Instant>,
}

fn train(
    rank: usize,
    id: UniqueId,
    (how, dp, via): (Loss, Dp, Via),
    config: Config,
    lost_at: &Mutex<Option<Instant>>,
) -> DistResult<Survivor> {
    let comm = Communicator::init_rank(&CommDevice::Host, RANKS, rank, &id, &config)?;
    let map = VarMap::new();
    let model = Mlp::new(&map)?;
    init_fixed(&map)?;
    let (x, y) = data();
    let mut losses = Vec::new();
    let mut first_small_step = None;
    let run = run_elastic(comm, 0, |comm, step| {
        // The three lines of an elastic loop: the optimizer (re)built on the communicator
        // it is given, the batch sharded over its world, `step` counted here.
        let mut opt = AnyOpt::new(dp, comm, &map)?;
        catch_up(&mut losses, *step, || {
            Ok(loss::mse(&model.forward(&x)?, &y)?.to_scalar::<f32>()?)
        })?;
        let (xs, ys) = (opt.shard_batch(&x)?, opt.shard_batch(&y)?);
        while *step < STEPS {
            let l = loss::mse(&model.forward(&xs)?, &ys)?;
            if rank == 3 && *step == LOST_AT {
                *lost_at.lock().unwrap() = Some(Instant::now());
                match how {
                    Loss::Returns => {
                        return Err(candle_core::Error::Msg("rank 3 is lost".into()).into())
                    }
                    Loss::Panics => panic!("rank 3 is lost"),
                    Loss::Stuck => {
                        std::thread::sleep(Duration::from_secs(3));
                        opt.step(&l, via)?;
                        return Err(candle_core::Error::Msg("rank 3 stepped again".into()).into());
                    }
                }
            }
            opt.step(&l, via)?;
            *step += 1;
            if comm.world_size() < RANKS && first_small_step.is_none() {
                first_small_step = Some(Instant::now());
            }
            let whole = loss::mse(&model.forward(&x)?, &y)?.to_scalar::<f32>()?;
            losses.push(whole);
        }
        Ok(())
    })?;
    Ok(Survivor {
        params: flat_params(&map)?,
        losses,
        step: run.step,
        world: run.comm.world_size(),
        recoveries: run.recoveries,
        first_small_step,
    })
}

fn lose_a_rank(how: Loss, dp: Dp, via: Via) {
    let t0 = Instant::now();
    let id = CommDevice::Host.unique_id().unwrap();
    let timeout = Duration::from_secs(if how == Loss::Stuck { 1 } else { 30 });
    let config = Config::new().elastic(true).timeout(timeout);
    let lost_at = Mutex::new(None);
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RANKS)
            .map(|rank| {
                let (config, lost_at) = (config.clone(), &lost_at);
                s.spawn(move || train(rank, id, (how, dp, via), config, lost_at))
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    for (r, res) in results.iter().enumerate() {
        if let Ok(Err(e)) = res {
            eprintln!("rank {r}: {e}");
        }
    }
    let mut results = results.into_iter();
    let survivors: Vec<Survivor> = results
        .by_ref()
        .take(3)
        .map(|r| {
            r.expect("no survivor panics")
                .expect("every survivor recovers")
        })
        .collect();
    match (how, results.next().unwrap()) {
        (Loss::Returns, Ok(Err(e))) => assert!(e.to_string().contains("rank 3 is lost"), "{e}"),
        (Loss::Panics, Err(_)) => {}
        // When it wakes, its step fails and every other rank is gone from its view: the
        // quorum rule refuses its recovery into a world of one (before, it recovered alone
        // and ended on its second try at step 10 with "rank 3 stepped again").
        (Loss::Stuck, Ok(Err(e))) => assert!(
            matches!(
                e.kind(),
                nccl_safe_candle::DistErrorKind::NoQuorum { left: 1, .. }
            ),
            "the stuck rank 3: {e}"
        ),
        (_, other) => panic!("rank 3 should be lost, got {:?}", other.map(|r| r.is_ok())),
    }
    let lost_at = lost_at.lock().unwrap().expect("rank 3 was lost");
    let reference = reference();
    for (r, s) in survivors.iter().enumerate() {
        assert_eq!((s.step, s.world), (STEPS, 3), "rank {r}");
        assert_eq!(s.recoveries.len(), 1, "rank {r}");
        let rec = &s.recoveries[0];
        assert_eq!(
            (rec.lost, rec.step, rec.world_sizes, rec.ranks),
            (3, survivors[0].recoveries[0].step, (4, 3), (r, r)),
            "rank {r}"
        );
        assert!(resumes_at(rec.step, LOST_AT), "rank {r}: {rec:?}");
        assert_eq!(
            s.params, survivors[0].params,
            "rank {r}'s parameters differ from rank 0's"
        );
        assert_eq!(s.losses, survivors[0].losses, "rank {r}");
        assert_eq!(
            s.losses.len(),
            STEPS as usize,
            "one loss per step, none twice"
        );
        let l = &s.losses;
        assert!(
            l[LOST_AT as usize - 1] < l[0] && l[STEPS as usize - 1] < l[LOST_AT as usize],
            "the loss falls before and after: {l:?}"
        );
        let worst = s
            .params
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-5,
            "rank {r}: {worst} from one process's 30 steps"
        );
    }
    let first = survivors
        .iter()
        .filter_map(|s| s.first_small_step)
        .max()
        .unwrap();
    if how == Loss::Stuck {
        // Within a few timeouts, not at the stuck rank's return.
        let first = survivors.iter().filter_map(|s| s.first_small_step).max();
        eprintln!(
            "{dp:?}, stuck: from the start to the first step on 3 ranks {:?}",
            first.map(|f| f - t0)
        );
        return;
    }
    eprintln!(
        "{dp:?} via {via:?}, {:?}: lost at step {LOST_AT}; recover() took {:?} (rank 0); from the loss to the first step on 3 ranks (every survivor): {:?}",
        how,
        survivors[0].recoveries[0].took,
        first.duration_since(lost_at)
    );
    let limit = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = nccl_safe::host::stats_for(&id.to_raw());
        if st.live == 0 || Instant::now() >= limit {
            break st;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    // 4 inits and 3 shrinks' children, each torn down once.
    assert_eq!(st.created, 7, "{st:?}");
    assert_eq!(st.created, st.destroyed + st.aborted, "{st:?}");
    assert_eq!((st.live, st.misused), (0, 0), "{st:?}");
}

#[test]
fn three_ranks_carry_on_after_one_returns_an_error() {
    lose_a_rank(Loss::Returns, Dp::Zero, Via::Inherent);
}

#[test]
fn three_ranks_carry_on_after_one_panics() {
    lose_a_rank(Loss::Panics, Dp::Zero, Via::Inherent);
}

#[test]
fn ddp_three_ranks_carry_on_after_one_returns_an_error() {
    lose_a_rank(Loss::Returns, Dp::Ddp, Via::Inherent);
}

#[test]
fn ddp_three_ranks_carry_on_after_one_panics() {
    lose_a_rank(Loss::Panics, Dp::Ddp, Via::Inherent);
}

#[test]
fn three_ranks_carry_on_after_one_is_stuck() {
    lose_a_rank(Loss::Stuck, Dp::Zero, Via::Inherent);
}

/// A DDP step waits in its buckets' all-reduces for a rank that is stuck: the watchdog's
/// timeout names it and `run_elastic` recovers without it, as with ZeRO-1 (before, the
/// buckets' NCCL group timed out with no rank named and `run_elastic` returned the error).
#[test]
fn ddp_three_ranks_carry_on_after_one_is_stuck() {
    lose_a_rank(Loss::Stuck, Dp::Ddp, Via::Inherent);
}

/// Stepped through code generic over `candle_nn::Optimizer`: the rank loss comes back
/// as a `candle_core::Error` and `?` turns it into a `DistError` again; `run_elastic`
/// still recovers (before, it returned `candle: rank 3 left: ...`).
#[test]
fn zero_stepped_through_candles_optimizer_trait_recovers() {
    lose_a_rank(Loss::Returns, Dp::Zero, Via::Trait);
}

#[test]
fn ddp_stepped_through_candles_optimizer_trait_recovers() {
    lose_a_rank(Loss::Panics, Dp::Ddp, Via::Trait);
}

/// One rank's steps up to `end` with a ZeRO-1 SGD built on `comm`; `lose_at`: this rank
/// is lost (by an error) at that step. The whole batch's loss after each step goes to
/// `losses`, which began at step `from`.
fn steps(
    comm: &Communicator,
    (step, from): (&mut u64, u64),
    end: u64,
    map: &VarMap,
    lose_at: Option<u64>,
    losses: &mut Vec<f32>,
) -> DistResult<()> {
    let model = Mlp::new(map)?; // the same variables: the map already holds them
    let (x, y) = data();
    let mut opt = ZeroRedundancyOptimizer::<SGD>::new(comm, map, LR)?;
    catch_up(losses, *step - from, || {
        Ok(loss::mse(&model.forward(&x)?, &y)?.to_scalar::<f32>()?)
    })?;
    let (xs, ys) = (opt.shard_batch(&x)?, opt.shard_batch(&y)?);
    while *step < end {
        let l = loss::mse(&model.forward(&xs)?, &ys)?;
        if lose_at == Some(*step) {
            return Err(candle_core::Error::Msg("rank 3 is lost".into()).into());
        }
        opt.backward_step(&l)?;
        *step += 1;
        losses.push(loss::mse(&model.forward(&x)?, &y)?.to_scalar::<f32>()?);
    }
    Ok(())
}

const REJOIN_AT: u64 = 20;

/// Three ranks train to step 20, then grow to 4, but the standby rank 0 would hand the id
/// to died before it joined. `grow` fails within the timeout (1 s) and hands each rank its
/// communicator back, untouched and healthy, with the step as it was; the 3 train on it
/// to step 30, and end with bit-identical parameters, equal to one process's 30 steps,
/// the loss falling. Each handle (3 inits, 3 grown ones aborted) is torn down once, the
/// grown ones before their parents. Before, `grow` consumed the communicator on error
/// (and the grow's timeout failed it besides): nothing was left to train on.
#[test]
fn a_standby_that_dies_before_it_joins_costs_the_grow_only() {
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().elastic(true).timeout(Duration::from_secs(1));
    type Out = (Vec<f32>, Vec<f32>, u64, usize);
    let results: Vec<DistResult<Out>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let config = config.clone();
                s.spawn(move || {
                    let comm = Communicator::init_rank(&CommDevice::Host, 3, rank, &id, &config)?;
                    let map = VarMap::new();
                    Mlp::new(&map)?;
                    init_fixed(&map)?;
                    let mut losses = Vec::new();
                    let run = run_elastic(comm, 0, |comm, step| {
                        steps(comm, (step, 0), REJOIN_AT, &map, None, &mut losses)
                    })?;
                    let mut step = run.step;
                    // The standby the id was for died: nobody joins.
                    let grow_id = (rank == 0).then(|| run.comm.grow_id()).transpose()?;
                    let Err((comm, e)) =
                        nccl_safe_candle::grow(run.comm, 4, grow_id.as_ref(), &mut step)
                    else {
                        panic!("nobody joined the grow, yet it succeeded");
                    };
                    assert!(e.to_string().contains("stays usable"), "{e}");
                    assert!(!comm.is_failed(), "{e}");
                    assert_eq!((comm.rank(), comm.world_size(), step), (rank, 3, REJOIN_AT));
                    let run = run_elastic(comm, step, |comm, step| {
                        steps(comm, (step, 0), STEPS, &map, None, &mut losses)
                    })?;
                    assert!(run.recoveries.is_empty());
                    Ok((flat_params(&map)?, losses, run.step, run.comm.world_size()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let reference = reference();
    let outs: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    for (r, (params, losses, step, world)) in outs.iter().enumerate() {
        assert_eq!((*step, *world), (STEPS, 3), "rank {r}");
        assert_eq!(
            params, &outs[0].0,
            "rank {r}'s parameters differ from rank 0's"
        );
        assert_eq!(
            losses.len(),
            STEPS as usize,
            "one loss per step, none twice"
        );
        let k = REJOIN_AT as usize;
        assert!(losses[k - 1] < losses[0] && losses[STEPS as usize - 1] < losses[k - 1]);
        let worst = (params.iter().zip(&reference))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-5,
            "rank {r}: {worst} from one process's 30 steps"
        );
    }
    let limit = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = nccl_safe::host::stats_for(&id.to_raw());
        if st.live == 0 || Instant::now() >= limit {
            break st;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!((st.created, st.destroyed, st.aborted), (6, 3, 3), "{st:?}");
    assert_eq!((st.live, st.misused), (0, 0), "{st:?}");
}

/// Rank 3 of 4 is lost at step 10; the 3 left carry on to step 20, then take a new rank 3
/// back through `grow` (rank 0 hands it the id) and all 4 train to step 30. The new rank
/// starts at step 20 with rank 0's parameters (its own initialization differs); at the end
/// the 4 hold bit-identical parameters, equal to one process's 30 steps; 11 handles (4
/// inits, 3 shrunk, 4 grown) are each torn down once.
#[test]
fn a_replacement_rank_rejoins_through_grow() {
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().elastic(true).timeout(Duration::from_secs(30));
    let (tx, rx) = std::sync::mpsc::channel::<(UniqueId, Instant)>();
    let first_big_step = Mutex::new(Vec::new());
    type Out = (Vec<f32>, Vec<f32>, u64, usize);
    let (old, new): (Vec<std::thread::Result<DistResult<Out>>>, DistResult<Out>) =
        std::thread::scope(|s| {
            let newcomer = {
                let (config, first_big_step) = (config.clone(), &first_big_step);
                s.spawn(move || -> DistResult<Out> {
                    let (grow_id, sent) = rx.recv().unwrap();
                    let (comm, start) =
                        nccl_safe_candle::join(&CommDevice::Host, RANKS, 3, &grow_id, &config)?;
                    assert_eq!(start, REJOIN_AT);
                    let map = VarMap::new();
                    Mlp::new(&map)?; // its own initialization: rank 0's replaces it
                    let mut losses = Vec::new();
                    let mut first = None;
                    let run = run_elastic(comm, start, |comm, step| {
                        steps(
                            comm,
                            (step, REJOIN_AT),
                            REJOIN_AT + 1,
                            &map,
                            None,
                            &mut losses,
                        )?;
                        first.get_or_insert(Instant::now());
                        steps(comm, (step, REJOIN_AT), STEPS, &map, None, &mut losses)
                    })?;
                    first_big_step.lock().unwrap().push(first.unwrap() - sent);
                    Ok((flat_params(&map)?, losses, run.step, run.comm.world_size()))
                })
            };
            let handles: Vec<_> = (0..RANKS)
                .map(|rank| {
                    let (config, tx, first_big_step) =
                        (config.clone(), tx.clone(), &first_big_step);
                    s.spawn(move || -> DistResult<Out> {
                        let comm =
                            Communicator::init_rank(&CommDevice::Host, RANKS, rank, &id, &config)?;
                        let map = VarMap::new();
                        Mlp::new(&map)?;
                        init_fixed(&map)?;
                        let mut losses = Vec::new();
                        let run = run_elastic(comm, 0, |comm, step| {
                            steps(
                                comm,
                                (step, 0),
                                REJOIN_AT,
                                &map,
                                (rank == 3).then_some(LOST_AT),
                                &mut losses,
                            )
                        })?;
                        assert_eq!((run.step, run.comm.world_size()), (REJOIN_AT, 3));
                        let mut step = run.step;
                        let sent = Instant::now();
                        let big = if run.comm.rank() == 0 {
                            let grow_id = run.comm.grow_id()?;
                            tx.send((grow_id, sent)).unwrap();
                            nccl_safe_candle::grow(run.comm, RANKS, Some(&grow_id), &mut step)
                                .map_err(|(_, e)| e)?
                        } else {
                            nccl_safe_candle::grow(run.comm, RANKS, None, &mut step)
                                .map_err(|(_, e)| e)?
                        };
                        assert_eq!(
                            (big.rank(), big.world_size(), step),
                            (rank, RANKS, REJOIN_AT)
                        );
                        let mut first = None;
                        let run = run_elastic(big, step, |comm, step| {
                            steps(comm, (step, 0), REJOIN_AT + 1, &map, None, &mut losses)?;
                            first.get_or_insert(Instant::now());
                            steps(comm, (step, 0), STEPS, &map, None, &mut losses)
                        })?;
                        if rank == 0 {
                            first_big_step.lock().unwrap().push(first.unwrap() - sent);
                        }
                        Ok((flat_params(&map)?, losses, run.step, run.comm.world_size()))
                    })
                })
                .collect();
            drop(tx);
            let old = handles.into_iter().map(|h| h.join()).collect();
            (old, newcomer.join().unwrap())
        });
    let mut old = old.into_iter();
    let survivors: Vec<Out> = old.by_ref().take(3).map(|r| r.unwrap().unwrap()).collect();
    let lost = old.next().unwrap().unwrap();
    assert!(lost.unwrap_err().to_string().contains("rank 3 is lost"));
    let new = new.unwrap();
    let reference = reference();
    for (r, (params, losses, step, world)) in survivors.iter().chain([&new]).enumerate() {
        assert_eq!((*step, *world), (STEPS, RANKS), "rank {r}");
        assert_eq!(
            params, &survivors[0].0,
            "rank {r}'s parameters differ from rank 0's"
        );
        let worst = params
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-5,
            "rank {r}: {worst} from one process's 30 steps"
        );
        let expected = if r < 3 { STEPS } else { STEPS - REJOIN_AT };
        assert_eq!(losses.len(), expected as usize, "rank {r}");
        assert!(losses.last() < losses.first(), "rank {r}: {losses:?}");
    }
    assert_eq!(new.1[..], survivors[0].1[REJOIN_AT as usize..]);
    eprintln!(
        "rejoin: from the id sent to the first step on 4 ranks: {:?}",
        first_big_step.lock().unwrap()
    );
    let limit = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = nccl_safe::host::stats_for(&id.to_raw());
        if st.live == 0 || Instant::now() >= limit {
            break st;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(st.created, 11, "{st:?}");
    assert_eq!(st.created, st.destroyed + st.aborted, "{st:?}");
    assert_eq!((st.live, st.misused), (0, 0), "{st:?}");
}

/// Two losses in one run: rank 3 at step 10, then rank 2 (of the 3 left) at step 20; ranks
/// 0 and 1 end at step 30 on 2 ranks, with two recoveries, bit-identical parameters equal
/// to one process's 30 steps, and 9 handles (4 inits, 3 and 2 shrunk) each torn down once.
#[test]
fn two_ranks_lost_one_after_the_other() {
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().elastic(true).timeout(Duration::from_secs(30));
    type Out = (Vec<f32>, usize, Vec<Recovery>);
    let results: Vec<DistResult<Out>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RANKS)
            .map(|rank| {
                let config = config.clone();
                s.spawn(move || -> DistResult<Out> {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, RANKS, rank, &id, &config)?;
                    let map = VarMap::new();
                    Mlp::new(&map)?;
                    init_fixed(&map)?;
                    let lose_at = match rank {
                        3 => Some(LOST_AT),
                        2 => Some(20),
                        _ => None,
                    };
                    let mut losses = Vec::new();
                    let run = run_elastic(comm, 0, |comm, step| {
                        steps(comm, (step, 0), STEPS, &map, lose_at, &mut losses)
                    })?;
                    assert_eq!(run.step, STEPS);
                    assert!(losses.last() < losses.first(), "{losses:?}");
                    Ok((flat_params(&map)?, run.comm.world_size(), run.recoveries))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let reference = reference();
    let (p0, _, _) = results[0].as_ref().unwrap();
    for (r, res) in results.iter().enumerate() {
        match (r, res) {
            (0 | 1, Ok((params, world, recoveries))) => {
                assert_eq!(*world, 2, "rank {r}");
                let seen: Vec<_> = recoveries
                    .iter()
                    .map(|x| (x.lost, x.step, x.world_sizes))
                    .collect();
                let (p, q) = (seen[0].1, seen.get(1).map_or(0, |x| x.1));
                assert_eq!(seen, vec![(3, p, (4, 3)), (2, q, (3, 2))], "rank {r}");
                assert!(
                    resumes_at(p, LOST_AT) && resumes_at(q, 20),
                    "rank {r}: {seen:?}"
                );
                assert_eq!(params, p0, "rank {r}'s parameters differ from rank 0's");
                let worst = params
                    .iter()
                    .zip(&reference)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 1e-5, "rank {r}: {worst}");
            }
            (2 | 3, Err(e)) => assert!(e.to_string().contains("is lost"), "{e}"),
            (_, other) => panic!("rank {r}: {:?}", other.as_ref().map(|o| o.1)),
        }
    }
    let limit = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = nccl_safe::host::stats_for(&id.to_raw());
        if st.live == 0 || Instant::now() >= limit {
            break st;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(st.created, 9, "{st:?}");
    assert_eq!(st.created, st.destroyed + st.aborted, "{st:?}");
    assert_eq!((st.live, st.misused), (0, 0), "{st:?}");
}

/// How the second of two ranks is lost.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Second {
    /// Ranks 1 and 2 return an error at the same moment of step 10.
    AtOnce,
    /// Rank 1 returns an error at step 10; rank 2 takes part in the step (it fails with the
    /// loss of rank 1, as the survivors' does) and is lost 10 ms later, while the survivors
    /// recover.
    DuringRecovery,
}

/// Four ranks lose ranks 1 and 2 at step 10 (`second`); ranks 0 and 3 end at step 30 on 2
/// ranks, with one recovery that excluded both, bit-identical parameters equal to one
/// process's 30 steps, and every handle torn down once. Bounded: a 2 s timeout, the whole
/// run within 30 s.
fn lose_two(second: Second) {
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().elastic(true).timeout(Duration::from_secs(2));
    let both = std::sync::Barrier::new(2);
    type Out = (Vec<f32>, Vec<f32>, usize, Vec<Recovery>);
    let t0 = Instant::now();
    let results: Vec<DistResult<Out>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RANKS)
            .map(|rank| {
                let (config, both) = (config.clone(), &both);
                s.spawn(move || -> DistResult<Out> {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, RANKS, rank, &id, &config)?;
                    let map = VarMap::new();
                    let model = Mlp::new(&map)?;
                    init_fixed(&map)?;
                    let (x, y) = data();
                    let mut losses = Vec::new();
                    let run = run_elastic(comm, 0, |comm, step| {
                        let mut opt = ZeroRedundancyOptimizer::<SGD>::new(comm, &map, LR)?;
                        catch_up(&mut losses, *step, || {
                            Ok(loss::mse(&model.forward(&x)?, &y)?.to_scalar::<f32>()?)
                        })?;
                        let (xs, ys) = (opt.shard_batch(&x)?, opt.shard_batch(&y)?);
                        while *step < STEPS {
                            let l = loss::mse(&model.forward(&xs)?, &ys)?;
                            let lost = |r: usize| {
                                candle_core::Error::Msg(format!("rank {r} is lost")).into()
                            };
                            if *step == LOST_AT && comm.world_size() == RANKS {
                                match (rank, second) {
                                    (1, Second::DuringRecovery) => return Err(lost(1)),
                                    (1 | 2, Second::AtOnce) => {
                                        both.wait();
                                        return Err(lost(rank));
                                    }
                                    _ => {}
                                }
                            }
                            let stepped = opt.backward_step(&l);
                            // Rank 2 fails with the loss of rank 1 (at step 10, or at 9
                            // while it still waited for NCCL's launch of it).
                            if (rank, second, comm.world_size())
                                == (2, Second::DuringRecovery, RANKS)
                            {
                                if let Err(e) = &stepped {
                                    assert!(comm.is_failed(), "{e}");
                                    std::thread::sleep(Duration::from_millis(10));
                                    return Err(lost(2));
                                }
                            }
                            stepped?;
                            *step += 1;
                            losses.push(loss::mse(&model.forward(&x)?, &y)?.to_scalar::<f32>()?);
                        }
                        Ok(())
                    })?;
                    assert_eq!(run.step, STEPS);
                    Ok((
                        flat_params(&map)?,
                        losses,
                        run.comm.world_size(),
                        run.recoveries,
                    ))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.iter().enumerate() {
        if let Err(e) = res {
            eprintln!("{second:?}: rank {r}: {e}");
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    let reference = reference();
    let p0 = &results[0].as_ref().expect("rank 0 carries on").0;
    for (r, res) in results.iter().enumerate() {
        match (r, res) {
            (0 | 3, Ok((params, losses, world, recoveries))) => {
                assert_eq!(*world, 2, "rank {r}");
                let seen: Vec<_> = recoveries
                    .iter()
                    .map(|x| (x.lost_ranks.clone(), x.step, x.world_sizes, x.ranks))
                    .collect();
                let new_rank = if r == 0 { 0 } else { 1 };
                let at = seen[0].1;
                assert_eq!(
                    seen,
                    vec![(vec![1, 2], at, (4, 2), (r, new_rank))],
                    "rank {r}"
                );
                assert!(resumes_at(at, LOST_AT), "rank {r}: {seen:?}");
                assert_eq!(params, p0, "rank {r}'s parameters differ from rank 0's");
                let worst = params
                    .iter()
                    .zip(&reference)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 1e-5, "rank {r}: {worst}");
                assert_eq!(losses.len(), STEPS as usize, "rank {r}");
                assert!(losses.last() < losses.first(), "rank {r}: {losses:?}");
            }
            (1 | 2, Err(e)) => assert!(e.to_string().contains(&format!("rank {r} is lost")), "{e}"),
            (_, other) => panic!("rank {r}: {:?}", other.as_ref().map(|o| o.2)),
        }
    }
    let limit = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = nccl_safe::host::stats_for(&id.to_raw());
        if st.live == 0 || Instant::now() >= limit {
            break st;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(st.created, st.destroyed + st.aborted, "{st:?}");
    assert_eq!((st.live, st.misused), (0, 0), "{st:?}");
}

#[test]
fn two_ranks_lost_at_once() {
    lose_two(Second::AtOnce);
}

#[test]
fn a_rank_lost_during_the_recovery() {
    lose_two(Second::DuringRecovery);
}

/// Without `Config::elastic(true)`, rank 3 lost at step 10: every rank left gets
/// `NotElastic`, naming the setting, the lost rank (and any rank left that already
/// returned this error), and the step's error, for DDP and
/// ZeRO-1 alike (before, DDP recovered on the host provider, hiding the mistake, and
/// ZeRO-1 returned the step's error with no hint).
fn without_elastic(dp: Dp) {
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().timeout(Duration::from_secs(30));
    let results: Vec<DistResult<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RANKS)
            .map(|rank| {
                let config = config.clone();
                s.spawn(move || -> DistResult<u64> {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, RANKS, rank, &id, &config)?;
                    let map = VarMap::new();
                    let model = Mlp::new(&map)?;
                    init_fixed(&map)?;
                    let (x, y) = data();
                    let run = run_elastic(comm, 0, |comm, step| {
                        let mut opt = AnyOpt::new(dp, comm, &map)?;
                        let (xs, ys) = (opt.shard_batch(&x)?, opt.shard_batch(&y)?);
                        while *step < STEPS {
                            if rank == 3 && *step == LOST_AT {
                                return Err(candle_core::Error::Msg("rank 3 is lost".into()).into());
                            }
                            opt.step(&loss::mse(&model.forward(&xs)?, &ys)?, Via::Inherent)?;
                            *step += 1;
                        }
                        Ok(())
                    })?;
                    Ok(run.step)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.iter().enumerate().take(3) {
        let e = res
            .as_ref()
            .expect_err("no recovery without Config::elastic");
        assert!(
            matches!(e.kind(), nccl_safe_candle::DistErrorKind::NotElastic { lost, .. } if lost.contains(&3)),
            "{dp:?}: rank {r}: {e}"
        );
        let text = e.to_string();
        assert!(
            text.contains("Config::elastic(true)") && text.contains("rank 3 left"),
            "{dp:?}: rank {r}: {text}"
        );
        assert!(
            e.step().is_some_and(|s| resumes_at(s, LOST_AT)),
            "{dp:?}: rank {r}: {text}"
        );
    }
}

#[test]
fn zero_without_elastic_is_refused_naming_the_setting() {
    without_elastic(Dp::Zero);
}

#[test]
fn ddp_without_elastic_is_refused_naming_the_setting() {
    without_elastic(Dp::Ddp);
}

/// The sampler in an elastic loop: 26 samples, global batches of 10 (10, 10, 6 per
/// epoch), shuffled, split unevenly with each rank's loss weighted (`BatchPart::weight`):
/// 10 over 4 ranks is 3, 3, 2, 2; after rank 3 is lost at step 10, over 3 ranks 4, 3, 3.
/// The survivors end bit-identical, within 1e-5 of one process stepping on each global
/// batch whole: no sample skipped or taken twice across the recovery. (`shard_batch`
/// refuses these batches: 10 rows do not split into 4 or 3 equal parts.)
#[test]
fn ddp_with_the_sampler_recovers_on_batches_that_do_not_divide() {
    use nccl_safe_candle::{BatchSplit, DistributedSampler};
    const LEN: usize = 26;
    let sampler = DistributedSampler::new(LEN, 10)
        .unwrap()
        .shuffle(7)
        .split(BatchSplit::Uneven);
    let (x, y) = batch().unwrap();
    let (x, y) = (x.narrow(0, 0, LEN).unwrap(), y.narrow(0, 0, LEN).unwrap());
    let reference = {
        let map = VarMap::new();
        let model = Mlp::new(&map).unwrap();
        init_fixed(&map).unwrap();
        let mut opt = SGD::new(map.all_vars(), LR).unwrap();
        let whole = DistributedSampler::new(LEN, 10).unwrap().shuffle(7);
        for step in 0..STEPS {
            let part = whole.part(step, 0, 1).unwrap();
            let (xs, ys) = (part.select(&x).unwrap(), part.select(&y).unwrap());
            opt.backward_step(&loss::mse(&model.forward(&xs).unwrap(), &ys).unwrap())
                .unwrap();
        }
        flat_params(&map).unwrap()
    };
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().elastic(true).timeout(Duration::from_secs(30));
    type Out = (Vec<f32>, usize, Vec<Recovery>);
    let results: Vec<DistResult<Out>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RANKS)
            .map(|rank| {
                let (config, sampler, x, y) = (config.clone(), &sampler, &x, &y);
                s.spawn(move || -> DistResult<Out> {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, RANKS, rank, &id, &config)?;
                    let map = VarMap::new();
                    let model = Mlp::new(&map)?;
                    init_fixed(&map)?;
                    let run = run_elastic(comm, 0, |comm, step| {
                        let mut opt = DdpOptimizer::<SGD>::new(comm, &map, LR)?;
                        while *step < STEPS {
                            if rank == 3 && *step == LOST_AT {
                                return Err(candle_core::Error::Msg("rank 3 is lost".into()).into());
                            }
                            let part = sampler.part_for(comm, *step)?;
                            let (xs, ys) = (part.select(x)?, part.select(y)?);
                            let l = (loss::mse(&model.forward(&xs)?, &ys)? * part.weight)?;
                            opt.backward_step(&l)?;
                            *step += 1;
                        }
                        Ok(())
                    })?;
                    Ok((flat_params(&map)?, run.comm.world_size(), run.recoveries))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let p0 = results[0].as_ref().expect("rank 0 carries on").0.clone();
    for (r, res) in results.iter().enumerate().take(3) {
        let (params, world, recoveries) = res.as_ref().expect("every survivor recovers");
        assert_eq!(*world, 3, "rank {r}");
        assert_eq!(recoveries.len(), 1, "rank {r}");
        let at = results[0].as_ref().unwrap().2[0].step;
        assert_eq!(recoveries[0].step, at, "rank {r}");
        assert!(resumes_at(at, LOST_AT), "rank {r}: {at}");
        assert_eq!(params, &p0, "rank {r}'s parameters differ from rank 0's");
        let worst = params
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "rank {r}: {worst} from one process");
    }
}

/// What the stuck rank of [`a_stuck_rank_that_wakes_after_the_recovery_does_not_train_alone`]
/// ended with: its world and step, or its error.
fn stalled_rank(rank: usize, id: UniqueId, config: Config) -> DistResult<(usize, u64)> {
    let comm = Communicator::init_rank(&CommDevice::Host, RANKS, rank, &id, &config)?;
    let map = VarMap::new();
    let model = Mlp::new(&map)?;
    init_fixed(&map)?;
    let (x, y) = data();
    let mut stalled = false;
    let run = run_elastic(comm, 0, |comm, step| {
        let mut opt = ZeroRedundancyOptimizer::<SGD>::new(comm, &map, LR)?;
        let (xs, ys) = (opt.shard_batch(&x)?, opt.shard_batch(&y)?);
        while *step < STEPS {
            let l = loss::mse(&model.forward(&xs)?, &ys)?;
            if rank == 3 && *step == LOST_AT && !stalled {
                // Stuck (as a SIGSTOPped process or a long stall) for three timeouts;
                // then it wakes and carries on with its loop as if nothing happened.
                stalled = true;
                std::thread::sleep(Duration::from_secs(3));
            }
            opt.backward_step(&l)?;
            *step += 1;
        }
        Ok(())
    })?;
    Ok((run.comm.world_size(), run.step))
}

/// Rank 3 stalls past the timeout at step 10; ranks 0-2 time out, name it, shrink without
/// it and train on to step 30 on 3 ranks. When rank 3 wakes, its communicator has failed
/// and every other rank is gone from its view: a recovery would leave it in a world of 1
/// (split brain: a second, divergent model). The quorum rule refuses that recovery with
/// `DistErrorKind::NoQuorum`, naming the rule and the setting, so the woken rank ends with
/// an error. Before, it recovered into a world of one and trained alone to step 30.
#[test]
fn a_stuck_rank_that_wakes_after_the_recovery_does_not_train_alone() {
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().elastic(true).timeout(Duration::from_secs(1));
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RANKS)
            .map(|rank| {
                let config = config.clone();
                s.spawn(move || stalled_rank(rank, id, config))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.iter().take(3).enumerate() {
        assert_eq!(res.as_ref().ok(), Some(&(3, STEPS)), "rank {r}: {res:?}");
    }
    let woken = results[3]
        .as_ref()
        .expect_err("the woken rank trained alone");
    assert!(
        matches!(
            woken.kind(),
            nccl_safe_candle::DistErrorKind::NoQuorum { .. }
        ),
        "{woken}"
    );
    let text = woken.to_string();
    eprintln!("the woken rank 3: {text}");
    assert!(text.contains("min_ranks"), "names the setting: {text}");
    assert!(text.contains("MinRanks::Half"), "names the rule: {text}");
}
