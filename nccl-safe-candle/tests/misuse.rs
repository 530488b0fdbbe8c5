//! The mistakes of issue 35, each impossible or a typed error on the first step: a plain
//! `loss.backward()` inside an accumulation, a data-parallel step inside it, a plain
//! optimizer step instead of the data-parallel one; drift detection on a planted
//! divergence; and errors that name the caller's file and line and the step.

mod common;

use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::{loss, AdamW, Module, Optimizer, ParamsAdamW, VarMap, SGD};
use common::*;
use nccl_safe_candle::{
    DdpOptimizer, DistError, DistErrorKind as K, DistResult, DistributedDataParallel, Launcher,
    ReduceOp, Unscaled, ZeroRedundancyOptimizer,
};

const RANKS: usize = 4;

fn launcher() -> Launcher {
    Launcher::host(RANKS).timeout(Duration::from_secs(60))
}

/// This rank's quarter of the batch.
fn my_batch(rank: usize) -> DistResult<(Tensor, Tensor)> {
    let (x, y) = batch()?;
    let n = SAMPLES / RANKS;
    Ok((x.narrow(0, rank * n, n)?, y.narrow(0, rank * n, n)?))
}

/// The model on rank 0's fixed parameters (the others' are candle's random ones until the
/// data-parallel object broadcasts rank 0's).
fn model(map: &VarMap, rank: usize) -> DistResult<Mlp> {
    let m = Mlp::new(map)?;
    if rank == 0 {
        init_fixed(map)?;
    }
    Ok(m)
}

fn bits(p: &[f32]) -> Vec<u32> {
    p.iter().map(|v| v.to_bits()).collect()
}

/// Mistake 1: only `loss.backward()` inside the accumulation (as with PyTorch's
/// `no_sync`). Its gradients never reach the guard: the guard's step refuses, typed, and
/// nothing is stepped (before, 3/4 of the gradients were dropped silently).
#[test]
fn mistake_1_plain_backward_inside_no_sync_is_a_typed_error_on_the_first_step() {
    launcher()
        .try_run(|rank| -> DistResult<()> {
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let (x, y) = my_batch(rank.rank())?;
            let mut opt = DdpOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?;
            let before = flat_params(&map)?;
            let acc = opt.no_sync(2)?;
            for half in [0, 4] {
                let l = loss::mse(&m.forward(&x.narrow(0, half, 4)?)?, &y.narrow(0, half, 4)?)?;
                l.backward()?; // the mistake
            }
            let e = acc
                .step()
                .expect_err("a plain backward must not reach the step");
            assert!(
                matches!(
                    e.kind(),
                    K::MicroBatchCount {
                        micro_batches: 2,
                        done: 0,
                        ..
                    }
                ),
                "{e}"
            );
            assert_eq!(e.step(), Some(1), "{e}");
            assert_eq!(flat_params(&map)?, before, "nothing may be stepped");
            // The same with a DistributedDataParallel and an optimizer of one's own.
            let ddp = opt.ddp();
            let mut sgd = SGD::new(ddp.vars(), 0.1)?;
            let acc = ddp.no_sync(2, &mut sgd)?;
            loss::mse(&m.forward(&x)?, &y)?.backward()?;
            let e = acc
                .step()
                .expect_err("a plain backward must not reach the step");
            assert!(
                matches!(e.kind(), K::MicroBatchCount { done: 0, .. }),
                "{e}"
            );
            Ok(())
        })
        .unwrap();
}

/// Mistake 2: a data-parallel step inside the accumulation, which stepped on local
/// gradients. With the optimizer the accumulation holds it does not compile (see the
/// `compile_fail` example of `DistributedDataParallel::no_sync`); with any other way
/// in (`sync_grads`, `backward_step` with a second optimizer) it is a typed error.
#[test]
fn mistake_2_a_step_inside_no_sync_is_a_typed_error() {
    launcher()
        .try_run(|rank| -> DistResult<()> {
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let (x, y) = my_batch(rank.rank())?;
            let ddp = DistributedDataParallel::new(rank.comm(), &map)?;
            let mut sgd = SGD::new(ddp.vars(), 0.1)?;
            let mut other = SGD::new(ddp.vars(), 0.1)?;
            let before = flat_params(&map)?;
            let mut acc = ddp.no_sync(2, &mut sgd)?;
            acc.backward(Unscaled(&loss::mse(&m.forward(&x)?, &y)?))?;
            let e = ddp
                .backward_step(&mut other, &loss::mse(&m.forward(&x)?, &y)?)
                .expect_err("a step inside an accumulation");
            assert!(
                matches!(
                    e.kind(),
                    K::AccumulationOpen {
                        micro_batches: 2,
                        done: 1,
                        ..
                    }
                ),
                "{e}"
            );
            let mut g = loss::mse(&m.forward(&x)?, &y)?.backward()?;
            let e = ddp
                .sync_grads(&mut g)
                .expect_err("a sync inside an accumulation");
            assert!(matches!(e.kind(), K::AccumulationOpen { .. }), "{e}");
            assert_eq!(flat_params(&map)?, before, "nothing may be stepped");
            // The accumulation itself still ends normally.
            acc.backward(Unscaled(&loss::mse(&m.forward(&x)?, &y)?))?;
            acc.step()?;
            assert_eq!(ddp.steps(), 1);
            ddp.check_drift()?;
            Ok(())
        })
        .unwrap();
}

/// A guard dropped without its step (its gradients lost) fails the next step once.
#[test]
fn an_accumulation_dropped_without_its_step_fails_the_next_step() {
    launcher()
        .try_run(|rank| -> DistResult<()> {
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let (x, y) = my_batch(rank.rank())?;
            let mut opt = ZeroRedundancyOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?;
            {
                let mut acc = opt.no_sync(3)?;
                acc.backward(Unscaled(&loss::mse(&m.forward(&x)?, &y)?))?;
            }
            let e = opt
                .backward_step(&loss::mse(&m.forward(&x)?, &y)?)
                .expect_err("the lost accumulation must be reported");
            assert!(
                matches!(
                    e.kind(),
                    K::AccumulationAbandoned {
                        micro_batches: 3,
                        done: 1,
                        ..
                    }
                ),
                "{e}"
            );
            // Reported once: training goes on.
            opt.backward_step(&loss::mse(&m.forward(&x)?, &y)?)?;
            assert_eq!(opt.steps(), 1);
            Ok(())
        })
        .unwrap();
}

/// Mistake 3: a plain optimizer step. With `DdpOptimizer` (and ZeRO-1) the optimizer you
/// hold is the data-parallel one, so `opt.backward_step(&loss)` (here through code
/// generic over `candle_nn::Optimizer`) keeps the ranks bit-identical. With a
/// `DistributedDataParallel` and an optimizer of one's own, the drift check catches it
/// after the first step, naming the step and the ranks.
#[test]
fn mistake_3_a_plain_optimizer_step_keeps_ranks_equal_or_is_caught_by_the_drift_check() {
    fn train<O: Optimizer>(
        opt: &mut O,
        m: &Mlp,
        x: &Tensor,
        y: &Tensor,
    ) -> candle_core::Result<()> {
        for _ in 0..3 {
            opt.backward_step(&loss::mse(&m.forward(x)?, y)?)?;
        }
        Ok(())
    }
    let out = launcher()
        .try_run(|rank| -> DistResult<(Vec<f32>, Vec<f32>, String)> {
            let (x, y) = my_batch(rank.rank())?;
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let mut opt = DdpOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?;
            train(&mut opt, &m, &x, &y)?;
            opt.check_drift()?;
            let ddp_params = flat_params(&map)?;
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let mut zero = ZeroRedundancyOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?;
            train(&mut zero, &m, &x, &y)?;
            zero.check_drift()?;
            let zero_params = flat_params(&map)?;
            // The mistake, with a DistributedDataParallel and a plain SGD.
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let ddp = DistributedDataParallel::new(rank.comm(), &map)?;
            let mut sgd = SGD::new(ddp.vars(), 0.1)?;
            sgd.backward_step(&loss::mse(&m.forward(&x)?, &y)?)?; // the mistake
            let e = ddp.check_drift().expect_err("the ranks stepped apart");
            Ok((ddp_params, zero_params, e.to_string()))
        })
        .unwrap();
    for (r, (ddp, zero, _)) in out.iter().enumerate() {
        assert_eq!(bits(ddp), bits(&out[0].0), "DdpOptimizer: rank {r} drifted");
        assert_eq!(bits(zero), bits(&out[0].1), "ZeRO-1: rank {r} drifted");
        assert!(max_rel_diff(ddp, zero) < 1e-5);
    }
    for (_, _, e) in &out {
        // Every rank saw a different quarter: four groups of one, rank 0's kept.
        assert!(e.contains("rank(s) [1, 2, 3]"), "{e}");
        assert!(
            e.contains("drift before the first data-parallel step"),
            "{e}"
        );
    }
}

/// A divergence planted on rank 2 after step 3, with the check every 2 steps: the step
/// that completes step 4 fails on every rank, naming step 4, the last good step (2) and
/// rank 2, at the line of the step in this file.
#[test]
fn drift_check_names_the_step_and_the_rank_of_a_planted_divergence() {
    let errors = launcher()
        .try_run(|rank| -> DistResult<String> {
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let (x, y) = my_batch(rank.rank())?;
            let mut opt = DdpOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?.with_drift_check(2);
            for step in 1..=6u64 {
                let l = loss::mse(&m.forward(&x)?, &y)?;
                let line = line!() + 1;
                match opt.backward_step(&l) {
                    Ok(()) => {}
                    Err(e) => {
                        assert_eq!(step, 4, "{e}");
                        assert_eq!(e.step(), Some(4), "{e}");
                        assert!(e.caller().file().ends_with("misuse.rs"), "{e}");
                        assert_eq!(e.caller().line(), line, "{e}");
                        let K::Drift {
                            differing,
                            after_step,
                            last_good_step,
                            ..
                        } = e.kind()
                        else {
                            panic!("not a drift error: {e}");
                        };
                        assert_eq!(
                            (differing.as_slice(), *after_step, *last_good_step),
                            (&[2][..], 4, 2)
                        );
                        return Ok(e.to_string());
                    }
                }
                if step == 3 && rank.rank() == 2 {
                    let (_, v) = &opt.ddp().params()[0];
                    v.set(&v.as_tensor().affine(1.0, 1e-3)?)?; // the planted divergence
                }
            }
            panic!("rank {}: the drift was not detected", rank.rank());
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        assert!(
            e.contains("parameter drift after step 4: rank(s) [2]"),
            "{e}"
        );
        assert!(e.contains(&format!("this rank ({r})")), "{e}");
        assert!(e.contains("misuse.rs:"), "{e}");
    }
}

/// Errors carry the caller's file and line (not the crate's), and the step when the
/// data-parallel object knows it, also through `?` into candle's error.
#[test]
fn errors_carry_the_callers_file_and_line_and_the_step() {
    launcher()
        .try_run(|rank| -> DistResult<()> {
            let comm = rank.comm();
            let here = |e: &DistError, line: u32| {
                assert!(e.caller().file().ends_with("misuse.rs"), "{e}");
                assert_eq!(e.caller().line(), line, "{e}");
                assert!(e.to_string().contains(&format!("misuse.rs:{line}")), "{e}");
            };
            let odd = Tensor::zeros(6, DType::F32, &Device::Cpu)?;
            let e = nccl_safe_candle::reduce_scatter(comm, &odd, ReduceOp::Sum).unwrap_err();
            here(&e, line!() - 1);
            // nccl-safe's own check (a root out of range): its "called at" names this line
            // too, not the crate's storage hook.
            let e = nccl_safe_candle::broadcast(comm, &odd, 9).unwrap_err();
            here(&e, line!() - 1);
            assert!(!e.to_string().contains("src/tensor.rs"), "{e}");
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let mut opt = DdpOptimizer::<SGD>::new(comm, &map, 0.1)?;
            let e = opt.shard_batch(&odd.reshape((3, 2))?).unwrap_err();
            here(&e, line!() - 1);
            let (x, y) = my_batch(rank.rank())?;
            opt.backward_step(&loss::mse(&m.forward(&x)?, &y)?)?;
            let step_line = line!() - 1;
            // The core crate's own record of the step's all-reduce (what its desync report
            // and mismatch table print) names this line too, not the crate's storage hook.
            let rec = comm.flight_record();
            let last = rec
                .entries
                .last()
                .expect("the step's all-reduce is recorded");
            assert!(
                last.caller.file().ends_with("misuse.rs") && last.caller.line() == step_line,
                "the flight record names {}",
                last.caller
            );
            // A gradient of the wrong shape in step 2.
            let mut g = GradStore::default();
            let (_, v) = &opt.ddp().params()[0];
            g.insert(v.as_tensor(), Tensor::zeros(1, DType::F32, &Device::Cpu)?);
            let e = opt.step(&g).unwrap_err();
            here(&e, line!() - 1);
            assert_eq!(e.step(), Some(2), "{e}");
            assert!(e.to_string().contains("step 2"), "{e}");
            // Through candle's Optimizer trait and `?` into candle's error.
            let candle = |opt: &mut DdpOptimizer<SGD>| -> candle_core::Result<()> {
                Optimizer::step(opt, &g)?;
                Ok(())
            };
            let e = candle(&mut opt).unwrap_err().to_string();
            assert!(e.contains("misuse.rs:"), "{e}");
            Ok(())
        })
        .unwrap();
}

/// DDP's and ZeRO-1's parameters, their optimizer-state bytes, ZeRO-1's shard bytes.
type Zero1Run = (Vec<f32>, Vec<f32>, usize, usize, usize);

/// ZeRO-1 has DDP's shape: accumulation gives what DDP's gives, and the optimizer state
/// is reported as such (AdamW: two moments, over a quarter of the parameters).
#[test]
fn zero1_accumulates_like_ddp_and_reports_its_optimizer_state() {
    let out = launcher()
        .try_run(|rank| -> DistResult<Zero1Run> {
            let (x, y) = my_batch(rank.rank())?;
            let run = |zero: bool| -> DistResult<(Vec<f32>, usize, usize)> {
                let map = VarMap::new();
                let m = model(&map, rank.rank())?;
                let cfg = ParamsAdamW {
                    lr: 0.01,
                    ..Default::default()
                };
                let accumulate = |acc: &mut dyn FnMut(&Tensor) -> DistResult<()>| {
                    for half in [0, 4] {
                        let (xh, yh) = (x.narrow(0, half, 4)?, y.narrow(0, half, 4)?);
                        acc(&loss::mse(&m.forward(&xh)?, &yh)?)?;
                    }
                    Ok::<(), DistError>(())
                };
                if zero {
                    let mut opt = ZeroRedundancyOptimizer::<AdamW>::new(rank.comm(), &map, cfg)?;
                    for _ in 0..3 {
                        let mut acc = opt.no_sync(2)?;
                        accumulate(&mut |l| acc.backward(Unscaled(l)))?;
                        acc.step()?;
                    }
                    Ok((
                        flat_params(&map)?,
                        opt.optimizer_state_bytes(),
                        opt.param_shard_bytes(),
                    ))
                } else {
                    let mut opt = DdpOptimizer::<AdamW>::new(rank.comm(), &map, cfg)?;
                    for _ in 0..3 {
                        let mut acc = opt.no_sync(2)?;
                        accumulate(&mut |l| acc.backward(Unscaled(l)))?;
                        acc.step()?;
                    }
                    Ok((flat_params(&map)?, opt.optimizer_state_bytes(), 0))
                }
            };
            let (ddp, ddp_state, _) = run(false)?;
            let (zero, zero_state, zero_shard) = run(true)?;
            Ok((ddp, zero, ddp_state, zero_state, zero_shard))
        })
        .unwrap();
    let elements = out[0].0.len();
    for (ddp, zero, ddp_state, zero_state, zero_shard) in &out {
        assert_eq!(bits(ddp), bits(&out[0].0));
        assert_eq!(bits(zero), bits(&out[0].1));
        let d = max_rel_diff(ddp, zero);
        assert!(d < 1e-5, "ZeRO-1 accumulation differs from DDP's by {d}");
        assert_eq!(*ddp_state, 2 * elements * 4);
        assert_eq!(*zero_shard, elements.div_ceil(RANKS) * 4);
        assert_eq!(*zero_state, 2 * zero_shard);
    }
}

/// A DDP step that times out (rank 1 stuck for 2.5 s, the timeout 1 s): rank 0's error
/// names the line of the step in this file and rank 1 as the one behind (before, the
/// buckets' NCCL group timed out naming nccl-safe's src/group.rs and no rank).
#[test]
fn a_ddp_steps_timeout_names_the_callers_line_and_the_rank_behind() {
    use nccl_safe::{CommDevice, Communicator, Config};
    let id = CommDevice::Host.unique_id().unwrap();
    let config = Config::new().timeout(Duration::from_secs(1));
    let errors: Vec<(String, u32)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let config = config.clone();
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &config).unwrap();
                    let map = VarMap::new();
                    let m = model(&map, rank).unwrap();
                    // Buckets of 64 bytes: several all-reduces in the step.
                    let mut opt =
                        DdpOptimizer::<SGD>::with_bucket_cap(&comm, &map, 64, 0.1).unwrap();
                    let (x, y) = my_batch(rank).unwrap();
                    let l = loss::mse(&m.forward(&x).unwrap(), &y).unwrap();
                    if rank == 1 {
                        std::thread::sleep(Duration::from_millis(2500));
                    }
                    let e = opt.backward_step(&l).unwrap_err();
                    (e.to_string(), line!() - 1)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (e, line) = &errors[0];
    assert!(e.contains(&format!("misuse.rs:{line}")), "{e}");
    assert!(!e.contains("group.rs"), "{e}");
    assert!(e.contains("rank(s) [1] are behind"), "{e}");
}

/// Issue 53 item 8: raw DDP with the drift check on, stepped by the plain optimizer
/// (`sgd.backward_step`: its gradients never reduced, so the ranks drift apart). The drift
/// check runs inside the DDP's steps, and this step is not one of them: it never ran, and
/// the ranks ended 8.9e-2 apart. The next batch's `shard_batch` now finds the parameters
/// moved with no DDP step and fails on every rank, naming the caller's line; steps through
/// the DDP (x and y sharded apart, as loops do) are not mistaken for it.
#[test]
fn a_step_outside_the_ddp_fails_loudly_with_the_drift_check_on() {
    launcher()
        .try_run(|rank| -> DistResult<()> {
            let map = VarMap::new();
            let m = model(&map, rank.rank())?;
            let (x, y) = batch()?;
            let ddp = DistributedDataParallel::new(rank.comm(), &map)?.with_drift_check(10);
            let mut sgd = SGD::new(ddp.vars(), 0.1)?;
            for _ in 0..3 {
                let (xs, ys) = (ddp.shard_batch(&x)?, ddp.shard_batch(&y)?);
                ddp.backward_step(&mut sgd, &loss::mse(&m.forward(&xs)?, &ys)?)?;
            }
            let (xs, ys) = (ddp.shard_batch(&x)?, ddp.shard_batch(&y)?);
            sgd.backward_step(&loss::mse(&m.forward(&xs)?, &ys)?)?; // the mistake
            let e = ddp
                .shard_batch(&x)
                .expect_err("a step outside the DDP with the drift check on");
            assert!(
                matches!(e.kind(), K::SteppedOutside { steps: 3, .. }),
                "{e}"
            );
            assert!(e.to_string().contains("misuse.rs"), "{e}");
            Ok(())
        })
        .unwrap();
}
