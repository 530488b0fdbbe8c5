//! One dependency, no clashes: what a trainer needs comes from nccl-safe-candle, and its
//! names do not clash with candle's under glob imports (`Result` and `Error` below are
//! candle's; an ambiguous name would not compile). `?` goes from this crate's error into
//! candle's and anyhow's.

use candle_core::*;
use candle_nn::*;
use nccl_safe_candle::*;

fn candle_loop(rank: &Rank) -> Result<f64> {
    let map = VarMap::new();
    let model = linear(
        4,
        1,
        VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu),
    )?;
    let mut opt = DdpOptimizer::<SGD>::new(rank.comm(), &map, 0.1)?;
    let x = opt.shard_batch(&Tensor::ones((4, 4), DType::F32, &Device::Cpu)?)?;
    let y = Tensor::zeros((x.dim(0)?, 1), DType::F32, &Device::Cpu)?;
    let l = loss::mse(&model.forward(&x)?, &y)?;
    opt.backward_step(&l)?;
    let comm: &Communicator = rank.comm();
    Ok(all_reduce_scalar(comm, &l, ReduceOp::Avg)?)
}

fn anyhow_loop(rank: &Rank) -> anyhow::Result<()> {
    let odd = Tensor::zeros(3, DType::F32, &Device::Cpu)?;
    shard_batch(rank.comm(), &odd)?;
    Ok(())
}

#[test]
fn names_do_not_clash_with_candles_under_glob_imports_and_question_mark_converts() {
    let _config: Option<Config> = None;
    let losses = Launcher::host(2).try_run(candle_loop).unwrap();
    assert_eq!(losses[0], losses[1]);
    let e: Error = Launcher::host(2)
        .try_run(anyhow_loop)
        .map_err(Error::wrap)
        .unwrap_err();
    assert!(e.to_string().contains("glob_imports.rs:"), "{e}");
}
