//! Data parallelism over 4 host-provider ranks (threads): DDP against one rank on the whole
//! batch, ZeRO-1 against DDP, bucket boundaries, gradient accumulation, and bad input.

mod common;

use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{loss, Module, Optimizer, VarMap, SGD};
use common::*;
use nccl_launch::Launcher;
use nccl_safe_candle::{
    all_gather, all_reduce, all_reduce_scalar, broadcast, reduce_scatter, DistError,
    DistErrorKind as K, DistResult, DistributedDataParallel, ReduceOp, Unscaled,
    ZeroRedundancyOptimizer, DEFAULT_BUCKET_CAP,
};

/// What went wrong, when something did.
fn kind<T>(r: DistResult<T>) -> Option<K> {
    r.err().map(DistError::into_kind)
}

const RANKS: usize = 4;
const STEPS: usize = 25;

fn launcher() -> Launcher {
    Launcher::host(RANKS).timeout(Duration::from_secs(60))
}

/// One rank, the whole batch, no communicator.
fn reference<O: Optimizer>(config: O::Config) -> Vec<f32> {
    let map = VarMap::new();
    let model = Mlp::new(&map).unwrap();
    init_fixed(&map).unwrap();
    let (x, y) = batch().unwrap();
    let mut opt = O::new(map.all_vars(), config).unwrap();
    for _ in 0..STEPS {
        let l = loss::mse(&model.forward(&x).unwrap(), &y).unwrap();
        opt.backward_step(&l).unwrap();
    }
    flat_params(&map).unwrap()
}

/// DDP over 4 ranks in threads ([`train_ddp`]).
fn ddp_run(cap: usize) -> Vec<Vec<f32>> {
    launcher()
        .try_run(|rank| train_ddp(rank.comm(), cap, STEPS))
        .unwrap()
}

fn assert_bit_identical(ranks: &[Vec<f32>]) {
    let bits = |p: &[f32]| p.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (r, p) in ranks.iter().enumerate().skip(1) {
        assert_eq!(bits(p), bits(&ranks[0]), "rank {r} differs from rank 0");
    }
}

#[test]
fn ddp_on_four_quarters_matches_one_rank_on_the_whole_batch() {
    let one = reference::<SGD>(0.1);
    let start = {
        let map = VarMap::new();
        Mlp::new(&map).unwrap();
        init_fixed(&map).unwrap();
        flat_params(&map).unwrap()
    };
    // Training moved the parameters: the comparison below is not between two starts.
    assert!(max_rel_diff(&one, &start) > 1e-2);
    // 64-byte buckets (each layer split over several, the 16x8 weight larger than one)
    // and the default (everything in one bucket) must give the same bits.
    let small = ddp_run(64);
    let default = ddp_run(DEFAULT_BUCKET_CAP);
    assert_bit_identical(&small);
    assert_bit_identical(&default);
    assert_eq!(small[0], default[0], "the bucket size changed the result");
    let d = max_rel_diff(&small[0], &one);
    assert!(
        d < 1e-5,
        "DDP differs from one rank on the whole batch by {d}"
    );
}

#[test]
fn zero1_matches_ddp_with_a_quarter_of_the_optimizer_state() {
    let config = (0.05, 0.9);
    let run = |zero: bool| {
        launcher()
            .try_run(|rank| -> DistResult<(Vec<f32>, usize)> {
                let map = VarMap::new();
                let model = Mlp::new(&map)?;
                if rank.rank() == 0 {
                    init_fixed(&map)?;
                }
                let (x, y) = batch()?;
                let n = SAMPLES / RANKS;
                let (x, y) = (
                    x.narrow(0, rank.rank() * n, n)?,
                    y.narrow(0, rank.rank() * n, n)?,
                );
                let state = if zero {
                    let mut opt =
                        ZeroRedundancyOptimizer::<Momentum>::new(rank.comm(), &map, config)?;
                    for _ in 0..STEPS {
                        let l = loss::mse(&model.forward(&x)?, &y)?;
                        opt.backward_step(&l)?;
                    }
                    opt.optimizer().state_bytes()
                } else {
                    let ddp = DistributedDataParallel::new(rank.comm(), &map)?;
                    let mut opt = Momentum::new(map.all_vars(), config)?;
                    for _ in 0..STEPS {
                        let l = loss::mse(&model.forward(&x)?, &y)?;
                        ddp.backward_step(&mut opt, &l)?;
                    }
                    opt.state_bytes()
                };
                Ok((flat_params(&map)?, state))
            })
            .unwrap()
    };
    let ddp = run(false);
    let zero = run(true);
    let params = |r: &[(Vec<f32>, usize)]| r.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_bit_identical(&params(&ddp));
    assert_bit_identical(&params(&zero));
    let one = reference::<Momentum>(config);
    let d = max_rel_diff(&zero[0].0, &ddp[0].0);
    assert!(d < 1e-5, "ZeRO-1 differs from DDP by {d}");
    assert!(max_rel_diff(&ddp[0].0, &one) < 1e-5);
    // Optimizer state per rank: DDP keeps a velocity for every element, ZeRO-1 for its
    // quarter of them (rounded up).
    let elements = one.len();
    for ((_, ddp_bytes), (_, zero_bytes)) in ddp.iter().zip(&zero) {
        assert_eq!(*ddp_bytes, elements * 4);
        assert_eq!(*zero_bytes, elements.div_ceil(RANKS) * 4);
    }
    println!(
        "optimizer state per rank: DDP {} bytes, ZeRO-1 {} bytes ({} parameters' elements, {RANKS} ranks)",
        ddp[0].1, zero[0].1, elements
    );
}

/// Named f32/f64 variables of the given shapes, values `init`.
fn vars(spec: &[(&str, &[usize], DType)]) -> Vec<(String, Var)> {
    spec.iter()
        .map(|(n, s, d)| (n.to_string(), Var::zeros(*s, *d, &Device::Cpu).unwrap()))
        .collect()
}

#[test]
fn buckets_average_every_gradient_and_zero_fill_missing_ones() {
    for cap in [1, 64, DEFAULT_BUCKET_CAP] {
        let out = launcher().try_run(|rank| -> DistResult<()> {
            let r = rank.rank() as f64;
            let params = vars(&[
                ("a", &[3], DType::F32),
                ("b", &[50], DType::F32), // 200 bytes: over the 64-byte cap
                ("c", &[2, 2], DType::F32),
                ("d", &[5], DType::F64),
                ("e", &[7], DType::F32),
            ]);
            let ddp = DistributedDataParallel::from_named(rank.comm(), params.clone(), cap)?;
            let mut grads = GradStore::default();
            // Gradient of parameter k on rank r: (r + 1) * (k + 1) (+ the element index
            // for b); c has none on rank 0, e none anywhere.
            let mut base = None;
            for (k, (name, v)) in params.iter().enumerate() {
                let t = v.as_tensor();
                let g = (Tensor::arange(0f64, t.elem_count() as f64, &Device::Cpu)?
                    .to_dtype(t.dtype())?
                    .reshape(t.shape())?
                    * (if name == "b" { 1.0 } else { 0.0 }))?;
                let g = (g + (r + 1.0) * (k as f64 + 1.0))?;
                match name.as_str() {
                    "c" if rank.rank() == 0 => continue,
                    "e" => continue,
                    // a's gradient shares storage with `base`, which must not change.
                    "a" => {
                        let whole = g.reshape((1, 3))?;
                        base = Some(whole.clone());
                        grads.insert(t, whole.reshape(3)?);
                    }
                    _ => {
                        grads.insert(t, g);
                    }
                }
            }
            ddp.sync_grads(&mut grads)?;
            let got = |n: usize| -> Vec<f64> {
                let t = params[n].1.as_tensor();
                grads
                    .get(t)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            // The average of (r + 1) over 4 ranks is 2.5.
            assert_eq!(got(0), vec![2.5; 3], "a (cap {cap})");
            let b: Vec<f64> = (0..50).map(|i| i as f64 + 5.0).collect();
            assert_eq!(got(1), b, "b (cap {cap})");
            assert_eq!(
                got(2),
                vec![(2.0 + 3.0 + 4.0) * 3.0 / 4.0; 4],
                "c: rank 0's zeros"
            );
            assert_eq!(got(3), vec![10.0; 5], "d (f64)");
            assert_eq!(got(4), vec![0.0; 7], "e: unused everywhere");
            let base = base.unwrap().flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(
                base,
                vec![(r + 1.0) as f32; 3],
                "the caller's tensor changed"
            );
            Ok(())
        });
        out.unwrap();
    }
}

#[test]
fn no_sync_accumulates_scaled_micro_batches_then_reduces_the_sum() {
    launcher()
        .try_run(|rank| -> DistResult<()> {
            let params = vars(&[("w", &[4], DType::F32)]);
            let w = params[0].1.clone();
            let ddp = DistributedDataParallel::from_named(rank.comm(), params, 1024)?;
            let start = w.as_tensor().to_vec1::<f32>()?;
            // Plain SGD with lr 1: the step subtracts the reduced gradient.
            let mut sgd = SGD::new(ddp.vars(), 1.0)?;
            let local = (rank.rank() + 1) as f32;
            let mut acc = ddp.no_sync(2, &mut sgd)?;
            // d(sum(w * c))/dw = c; each micro-batch's loss is scaled by 1/2.
            let c1 = Tensor::full(local, 4, &Device::Cpu)?;
            acc.backward(Unscaled(&(w.as_tensor() * &c1)?.sum_all()?))?;
            let c2 = Tensor::full(10f32, 4, &Device::Cpu)?;
            acc.backward(Unscaled(&(w.as_tensor() * &c2)?.sum_all()?))?;
            // Nothing stepped before the accumulation's step.
            assert_eq!(w.as_tensor().to_vec1::<f32>()?, start);
            acc.step()?;
            // avg over r = 0..4 of (r + 1 + 10) / 2 = 6.25
            let moved: Vec<f32> = w
                .as_tensor()
                .to_vec1::<f32>()?
                .iter()
                .zip(&start)
                .map(|(a, b)| b - a)
                .collect();
            assert!(moved.iter().all(|m| (m - 6.25).abs() < 1e-5), "{moved:?}");
            assert_eq!(ddp.steps(), 1);
            Ok(())
        })
        .unwrap();
}

#[test]
fn tensor_collectives_on_every_float_type() {
    launcher()
        .try_run(|rank| -> DistResult<()> {
            let comm = rank.comm();
            let r = rank.rank() as f64;
            let values = |t: &Tensor| -> Vec<f64> {
                t.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let full = |v: f64, n: usize| {
                    Tensor::full(v, n, &Device::Cpu).and_then(|t| t.to_dtype(dtype))
                };
                for (op, want) in [
                    (ReduceOp::Sum, 10.0),
                    (ReduceOp::Avg, 2.5),
                    (ReduceOp::Min, 1.0),
                    (ReduceOp::Max, 4.0),
                ] {
                    let t = full(r + 1.0, 8)?;
                    all_reduce(comm, &t, op)?;
                    assert_eq!(values(&t), vec![want; 8], "{op:?} {dtype:?}");
                }
                let t = full(r * 3.0, 5)?;
                broadcast(comm, &t, 2)?;
                assert_eq!(values(&t), vec![6.0; 5], "broadcast {dtype:?}");
                let g = all_gather(comm, &full(r, 2)?.reshape((1, 2))?)?;
                assert_eq!(g.dims(), &[4, 2]);
                assert_eq!(
                    values(&g),
                    vec![0., 0., 1., 1., 2., 2., 3., 3.],
                    "all_gather {dtype:?}"
                );
                let s = reduce_scatter(
                    comm,
                    &Tensor::arange(0f64, 8.0, &Device::Cpu)?
                        .to_dtype(dtype)?
                        .reshape((4, 2))?,
                    ReduceOp::Sum,
                )?;
                assert_eq!(s.dims(), &[1, 2]);
                let base = 2.0 * r;
                assert_eq!(
                    values(&s),
                    vec![4.0 * base, 4.0 * (base + 1.0)],
                    "reduce_scatter {dtype:?}"
                );
                // The loss helper: the caller's tensor stays as it was.
                let loss = full(r, 1)?.reshape(())?;
                assert_eq!(all_reduce_scalar(comm, &loss, ReduceOp::Avg)?, 1.5);
                assert_eq!(all_reduce_scalar(comm, &loss, ReduceOp::Max)?, 3.0);
                assert_eq!(values(&loss), vec![r]);
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn bad_input_gets_a_typed_error() {
    launcher()
        .try_run(|rank| -> DistResult<()> {
            let comm = rank.comm();
            let cpu = &Device::Cpu;
            let t = Tensor::zeros((2, 3), DType::F32, cpu)?.t()?;
            assert!(matches!(
                kind(all_reduce(comm, &t, ReduceOp::Sum)),
                Some(K::NotContiguous { .. })
            ));
            let u = Tensor::zeros(4, DType::U32, cpu)?;
            assert!(matches!(
                kind(broadcast(comm, &u, 0)),
                Some(K::UnsupportedDtype {
                    dtype: DType::U32,
                    ..
                })
            ));
            let odd = Tensor::zeros(6, DType::F32, cpu)?;
            assert!(matches!(
                kind(reduce_scatter(comm, &odd, ReduceOp::Sum)),
                Some(K::Shape { .. })
            ));
            assert!(matches!(
                kind(all_reduce_scalar(comm, &odd, ReduceOp::Sum)),
                Some(K::Shape { .. })
            ));
            // A root out of range: nccl-safe's own typed error, and the ranks go on.
            let ok = Tensor::zeros(2, DType::F32, cpu)?;
            assert!(matches!(kind(broadcast(comm, &ok, 9)), Some(K::Nccl(_))));
            let params = vars(&[("w", &[2], DType::F32)]);
            assert!(matches!(
                kind(DistributedDataParallel::from_named(comm, params.clone(), 0)),
                Some(K::InvalidArgument { .. })
            ));
            assert!(matches!(
                kind(DistributedDataParallel::from_named(comm, Vec::new(), 64)),
                Some(K::InvalidArgument { .. })
            ));
            // ZeRO-1 flattens all parameters into one vector: one element type only.
            let mixed = vars(&[("f", &[2], DType::F32), ("g", &[2], DType::F64)]);
            assert!(matches!(
                kind(ZeroRedundancyOptimizer::<SGD>::from_named(comm, mixed, 0.1)),
                Some(K::InvalidArgument { .. })
            ));
            let ddp = DistributedDataParallel::from_named(comm, params, 64)?;
            assert!(matches!(
                kind(ddp.shard_batch(&odd.reshape((3, 2))?)),
                Some(K::Shape { .. })
            ));
            // The communicator still works after all of that.
            all_reduce(comm, &ok, ReduceOp::Sum)?;
            Ok(())
        })
        .unwrap();
}

#[test]
fn ranks_with_different_parameters_all_get_a_typed_error() {
    // Two same-sized parameters with their shapes swapped on rank 1, and a renamed one on
    // rank 3: every rank must refuse, none may train on a mix.
    let errors = launcher()
        .try_run(|rank| -> DistResult<Option<String>> {
            let (a, b): (&[usize], &[usize]) = if rank.rank() == 1 {
                (&[3, 2], &[2, 3])
            } else {
                (&[2, 3], &[3, 2])
            };
            let c = if rank.rank() == 3 { "c2" } else { "c" };
            let params = vars(&[
                ("a", a, DType::F32),
                ("b", b, DType::F32),
                (c, &[4], DType::F32),
            ]);
            Ok(
                match DistributedDataParallel::from_named(rank.comm(), params, 64) {
                    Err(e) if matches!(e.kind(), K::ParameterMismatch { .. }) => {
                        Some(e.to_string())
                    }
                    Err(e) => return Err(e),
                    Ok(_) => None,
                },
            )
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("rank {r} accepted different parameters"));
        assert!(e.contains(&format!("rank {r}:")), "{e}");
    }
}

#[test]
fn a_failed_rank_fails_the_step_on_every_rank() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let timeout = Duration::from_secs(30);
    let failed_steps = AtomicUsize::new(0);
    let started = Instant::now();
    let out = Launcher::host(RANKS)
        .timeout(timeout)
        .try_run(|rank| -> DistResult<()> {
            let params = vars(&[("w", &[16], DType::F32)]);
            let t = params[0].1.as_tensor().clone();
            // Rank 2's parameter broadcast may have been launched (NCCL's launch thread, a
            // non-blocking communicator of 4 ranks) while a peer still waits for its own
            // launch of it: that peer then fails already here, once the clique is aborted.
            let failed = |e: DistError| {
                // The watchdog's report, or the provider's remote error of rank 2's abort.
                let text = e.to_string();
                if text.contains("rank 2 left") || text.contains("rank 2 called ncclCommAbort") {
                    failed_steps.fetch_add(1, Ordering::SeqCst);
                }
                e
            };
            let ddp = DistributedDataParallel::from_named(rank.comm(), params, 64);
            if rank.rank() == 2 {
                return Err(K::InvalidArgument {
                    call: "test",
                    reason: "rank 2 gives up".into(),
                }
                .into());
            }
            let ddp = ddp.map_err(failed)?;
            // The others keep stepping: their all-reduce must fail, not wait for rank 2.
            for _ in 0..1000 {
                let mut g = GradStore::default();
                g.insert(&t, Tensor::ones(16, DType::F32, &Device::Cpu)?);
                ddp.sync_grads(&mut g).map_err(failed)?;
            }
            Ok(())
        });
    let e = out.expect_err("a rank failed, so the run must fail");
    assert!(matches!(e, nccl_launch::Error::RankFailed { .. }), "{e}");
    assert!(e.to_string().contains("rank 2 gives up"), "{e}");
    assert_eq!(
        failed_steps.load(Ordering::SeqCst),
        RANKS - 1,
        "every other rank must fail, naming rank 2"
    );
    assert!(
        started.elapsed() < timeout,
        "the other ranks waited for the timeout"
    );
}

/// A rank that returns early, cleanly (a loop one step shorter on rank 2), while its peers
/// are inside a step's all-reduce (a group of buckets): they fail at once naming rank 2,
/// instead of waiting out the 60 s timeout.
#[test]
fn a_rank_that_returns_early_fails_its_peers_step_at_once() {
    let timeout = Duration::from_secs(60);
    let started = Instant::now();
    let out = Launcher::host(RANKS)
        .timeout(timeout)
        .try_run(|rank| -> DistResult<()> {
            let params = vars(&[("w", &[16], DType::F32), ("b", &[4], DType::F32)]);
            let ts: Vec<Tensor> = params.iter().map(|(_, v)| v.as_tensor().clone()).collect();
            // Two buckets: the step's all-reduce is a group of two.
            let ddp = DistributedDataParallel::from_named(rank.comm(), params, 64)?;
            let steps = if rank.rank() == 2 { 2 } else { 3 };
            for _ in 0..steps {
                let mut g = GradStore::default();
                for t in &ts {
                    g.insert(t, Tensor::ones(t.shape(), DType::F32, &Device::Cpu)?);
                }
                ddp.sync_grads(&mut g)?;
            }
            Ok(())
        });
    let took = started.elapsed();
    let e = out.expect_err("ranks 0, 1 and 3 wait for rank 2");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let text = e.to_string();
    assert!(text.contains("rank 2 left"), "{text}");
}
