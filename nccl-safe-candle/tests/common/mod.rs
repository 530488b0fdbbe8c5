//! What the tests share: a small model, its data, a fixed initialization, and a momentum
//! SGD whose state can be counted.
#![allow(dead_code)]

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{linear, Linear, Module, Optimizer, VarBuilder, VarMap};

pub const INPUTS: usize = 8;
pub const HIDDEN: usize = 16;
pub const SAMPLES: usize = 32;

/// Two linear layers; `unused.w` takes part in no forward (its gradient is always missing).
pub struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    pub fn new(map: &VarMap) -> Result<Mlp> {
        let vb = VarBuilder::from_varmap(map, DType::F32, &Device::Cpu);
        vb.pp("unused")
            .get_with_hints((3, 5), "w", candle_nn::Init::Const(0.5))?;
        Ok(Mlp {
            l1: linear(INPUTS, HIDDEN, vb.pp("l1"))?,
            l2: linear(HIDDEN, 1, vb.pp("l2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.tanh()?)
    }
}

/// xorshift64*: numbers in [-1, 1), the same on every run.
pub fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed | 1;
    move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// The variables sorted by name.
pub fn sorted(map: &VarMap) -> Vec<(String, Var)> {
    let data = map.data().lock().unwrap();
    let mut v: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Sets every parameter from a fixed sequence.
pub fn init_fixed(map: &VarMap) -> Result<()> {
    let mut next = uniform(0x5EED);
    for (_, v) in sorted(map) {
        let t = v.as_tensor();
        let values: Vec<f32> = (0..t.elem_count()).map(|_| next() * 0.5).collect();
        v.set(&Tensor::from_vec(values, t.shape(), &Device::Cpu)?)?;
    }
    Ok(())
}

/// Every parameter, flattened in name order.
pub fn flat_params(map: &VarMap) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for (_, v) in sorted(map) {
        out.extend(v.as_tensor().flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// The whole batch: inputs and a smooth target.
pub fn batch() -> Result<(Tensor, Tensor)> {
    let mut next = uniform(0x9E37_79B9_7F4A_7C15);
    let xs: Vec<f32> = (0..SAMPLES * INPUTS).map(|_| next()).collect();
    let ys: Vec<f32> = xs
        .chunks(INPUTS)
        .map(|x| (x[0] - 0.5 * x[3]).sin() + 0.25 * x[1] * x[2])
        .collect();
    Ok((
        Tensor::from_vec(xs, (SAMPLES, INPUTS), &Device::Cpu)?,
        Tensor::from_vec(ys, (SAMPLES, 1), &Device::Cpu)?,
    ))
}

/// SGD with momentum; its velocity tensors are its state.
pub struct Momentum {
    vars: Vec<Var>,
    velocity: Vec<Tensor>,
    lr: f64,
    mu: f64,
}

impl Momentum {
    /// The bytes of the optimizer's state tensors.
    pub fn state_bytes(&self) -> usize {
        self.velocity
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

impl Optimizer for Momentum {
    type Config = (f64, f64);

    fn new(vars: Vec<Var>, (lr, mu): (f64, f64)) -> Result<Self> {
        let velocity = vars
            .iter()
            .map(|v| v.as_tensor().zeros_like())
            .collect::<Result<Vec<_>>>()?;
        Ok(Momentum {
            vars,
            velocity,
            lr,
            mu,
        })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        for (v, vel) in self.vars.iter().zip(self.velocity.iter_mut()) {
            if let Some(g) = grads.get(v.as_tensor()) {
                *vel = ((&*vel * self.mu)? + g)?;
                v.set(&(v.as_tensor() - (&*vel * self.lr)?)?)?;
            }
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }
}

/// The largest difference relative to the values' scale.
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + x.abs().max(y.abs())))
        .fold(0.0, f32::max)
}

/// DDP training on this rank's quarter of the batch with buckets of `cap` bytes; rank 0
/// alone starts from the fixed parameters (the others from candle's random ones: the
/// broadcast must fix that). Returns the parameters, flattened in name order.
pub fn train_ddp(
    comm: &nccl_safe::Communicator,
    cap: usize,
    steps: usize,
) -> nccl_safe_candle::DistResult<Vec<f32>> {
    use candle_nn::{loss, SGD};
    let map = VarMap::new();
    let model = Mlp::new(&map)?;
    if comm.rank() == 0 {
        init_fixed(&map)?;
    }
    let ddp = nccl_safe_candle::DistributedDataParallel::with_bucket_cap(comm, &map, cap)?;
    let mut sgd = SGD::new(map.all_vars(), 0.1)?;
    let (x, y) = batch()?;
    let (x, y) = (ddp.shard_batch(&x)?, ddp.shard_batch(&y)?);
    for _ in 0..steps {
        let l = loss::mse(&model.forward(&x)?, &y)?;
        ddp.backward_step(&mut sgd, &l)?;
    }
    Ok(flat_params(&map)?)
}

/// Whether a recovery from a rank lost at step `lost` resumed at `step`: at `lost`, or at
/// `lost - 1` when a survivor was still waiting for NCCL's launch of the last step every
/// rank took (a non-blocking communicator of two or more ranks launches from NCCL's own
/// thread) as the clique was aborted. That step then failed on that survivor only, and
/// every survivor resumes at rank 0's step (and carries the state at that step).
pub fn resumes_at(step: u64, lost: u64) -> bool {
    step == lost || step + 1 == lost
}

/// `losses` once a session resumed at `done` steps since the losses began (rank 0's
/// count): a rank whose last step failed while rank 0's completed records that step's
/// loss now, from rank 0's parameters (`whole`); one whose last step completed while rank
/// 0's failed drops that step's loss, as the step is taken again.
pub fn catch_up(
    losses: &mut Vec<f32>,
    done: u64,
    whole: impl FnOnce() -> nccl_safe_candle::DistResult<f32>,
) -> nccl_safe_candle::DistResult<()> {
    let done = done as usize;
    losses.truncate(done);
    if losses.len() + 1 == done {
        losses.push(whole()?);
    }
    assert_eq!(losses.len(), done, "a rank is at most one step off rank 0");
    Ok(())
}
