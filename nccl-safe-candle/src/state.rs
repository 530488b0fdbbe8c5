//! Optimizer state that can be taken out of one optimizer and put into another, by element
//! range: [`ShardableState`], this crate's [`AdamW`] (candle_nn's, with its moments
//! reachable), and [`CarriedState`] / [`StateCarry`], which carry a
//! [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer)'s or a
//! [`DdpOptimizer`](crate::DdpOptimizer)'s state across a recovery of
//! [`run_elastic`](crate::run_elastic) and re-shard it over the new world.

use std::ops::Range;
use std::sync::Mutex;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW, SGD};
use nccl_safe::{Communicator, ReduceOp};

use crate::accumulate::OptimizerState;
use crate::error::{DistErrorKind as K, DistResult as Result};

/// An optimizer's state as flat tensors: each of [`tensors`](Self::tensors) is 1-D, the
/// optimizer's variables flattened and concatenated in the order it was built with (AdamW:
/// its first and its second moments; SGD: none), and the optimizer's own step count.
#[derive(Debug, Clone)]
pub struct FlatState {
    /// The optimizer's step count (AdamW's `t`, which its bias correction uses).
    pub step: u64,
    /// The per-element state, one 1-D tensor per kind of state.
    pub tensors: Vec<Tensor>,
}

/// How a data-parallel optimizer exports its optimizer's state (`O::export_state`).
pub(crate) type Export<O> = fn(&O) -> candle_core::Result<FlatState>;

/// An optimizer whose per-element state can be exported and imported, so that it can be
/// cut into element ranges and moved between ranks ([`ZeroRedundancyOptimizer::resume`](crate::ZeroRedundancyOptimizer::resume),
/// [`DdpOptimizer::resume`](crate::DdpOptimizer::resume)).
pub trait ShardableState: Optimizer {
    /// The state now. Its tensors must not change when the optimizer steps afterwards
    /// (an optimizer that updates its state in place returns copies): a
    /// [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer) keeps the state from
    /// before a step until the step's all-gather succeeds.
    fn export_state(&self) -> candle_core::Result<FlatState>;

    /// Replaces the state by `state`, of the shape [`export_state`](Self::export_state)
    /// gives (the same number of tensors, each as long as the variables' elements).
    fn import_state(&mut self, state: FlatState) -> candle_core::Result<()>;
}

/// SGD (without momentum) keeps no state: nothing to carry.
impl ShardableState for SGD {
    fn export_state(&self) -> candle_core::Result<FlatState> {
        Ok(FlatState {
            step: 0,
            tensors: Vec::new(),
        })
    }

    fn import_state(&mut self, state: FlatState) -> candle_core::Result<()> {
        if !state.tensors.is_empty() {
            candle_core::bail!("SGD keeps no state, got {} tensors", state.tensors.len())
        }
        Ok(())
    }
}

/// candle_nn's AdamW (the same algorithm, the same [`ParamsAdamW`], the same update bit for
/// bit on the same inputs), whose moments and step count can be exported and imported
/// ([`ShardableState`]): candle_nn's keeps them in private fields. Its moments are tensors
/// replaced at each step rather than variables updated in place, so an export costs no
/// copy when the optimizer has one variable (as in a
/// [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer)).
#[derive(Debug)]
pub struct AdamW {
    vars: Vec<(Var, Tensor, Tensor)>,
    step_t: usize,
    params: ParamsAdamW,
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        let vars = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| {
                let m = Tensor::zeros(var.shape(), var.dtype(), var.device())?;
                let v = Tensor::zeros(var.shape(), var.dtype(), var.device())?;
                Ok((var, m, v))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(AdamW {
            vars,
            step_t: 0,
            params,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        // candle_nn::AdamW::step's arithmetic, operation for operation.
        self.step_t += 1;
        let lr = self.params.lr;
        let lr_lambda = lr * self.params.weight_decay;
        let (beta1, beta2) = (self.params.beta1, self.params.beta2);
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        for (theta, m, v) in self.vars.iter_mut() {
            if let Some(g) = grads.get(theta) {
                let next_m = ((&*m * beta1)? + (g * (1.0 - beta1))?)?;
                let next_v = ((&*v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                let m_hat = (&next_m * scale_m)?;
                let v_hat = (&next_v * scale_v)?;
                let next_theta = (theta.as_tensor() * (1f64 - lr_lambda))?;
                let adjusted_grad = (m_hat / (v_hat.sqrt()? + self.params.eps)?)?;
                let next_theta = (next_theta - (adjusted_grad * lr)?)?;
                *m = next_m;
                *v = next_v;
                theta.set(&next_theta)?;
            }
        }
        Ok(())
    }
}

impl AdamW {
    /// With the default parameters but the learning rate.
    pub fn new_lr(vars: Vec<Var>, learning_rate: f64) -> candle_core::Result<Self> {
        Self::new(
            vars,
            ParamsAdamW {
                lr: learning_rate,
                ..ParamsAdamW::default()
            },
        )
    }

    /// Its parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Changes its parameters.
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }
}

impl OptimizerState for AdamW {
    const COPIES: usize = 2;
}

/// `parts` flattened and concatenated (one part: its flat view, no copy).
fn concat(parts: Vec<Tensor>) -> candle_core::Result<Tensor> {
    if parts.len() == 1 {
        parts[0].flatten_all()
    } else {
        Tensor::cat(
            &parts
                .iter()
                .map(|t| t.flatten_all())
                .collect::<candle_core::Result<Vec<_>>>()?,
            0,
        )
    }
}

impl ShardableState for AdamW {
    fn export_state(&self) -> candle_core::Result<FlatState> {
        let m = concat(self.vars.iter().map(|(_, m, _)| m.clone()).collect())?;
        let v = concat(self.vars.iter().map(|(_, _, v)| v.clone()).collect())?;
        Ok(FlatState {
            step: self.step_t as u64,
            tensors: vec![m, v],
        })
    }

    fn import_state(&mut self, state: FlatState) -> candle_core::Result<()> {
        let total: usize = self.vars.iter().map(|(x, _, _)| x.elem_count()).sum();
        let [m, v] = &state.tensors[..] else {
            candle_core::bail!("AdamW's state is 2 tensors, got {}", state.tensors.len())
        };
        if m.dims() != [total] || v.dims() != [total] {
            candle_core::bail!(
                "AdamW's state over {total} elements, got {:?} and {:?}",
                m.dims(),
                v.dims()
            )
        }
        let mut offset = 0;
        for (x, mx, vx) in self.vars.iter_mut() {
            let n = x.elem_count();
            let dtype = x.dtype();
            *mx = m
                .narrow(0, offset, n)?
                .reshape(x.shape())?
                .to_dtype(dtype)?;
            *vx = v
                .narrow(0, offset, n)?
                .reshape(x.shape())?
                .to_dtype(dtype)?;
            offset += n;
        }
        self.step_t = state.step as usize;
        Ok(())
    }
}

/// The state of a data-parallel optimizer taken out of it ([`ZeroRedundancyOptimizer::into_state`](crate::ZeroRedundancyOptimizer::into_state),
/// [`DdpOptimizer::into_state`](crate::DdpOptimizer::into_state)): the part of the flat
/// parameter vector (the parameters sorted by name, flattened and concatenated) this rank
/// held the state of (ZeRO-1: its range; DDP: all of it) and that state. Put it back on a
/// communicator of any size with `resume`.
#[derive(Debug, Clone)]
pub struct CarriedState {
    pub(crate) start: usize,
    pub(crate) total: usize,
    pub(crate) dtype: DType,
    /// The state after the last step this rank's optimizer took.
    pub(crate) now: FlatState,
    /// ZeRO-1 resumed: the state from before the last step this rank's optimizer took.
    pub(crate) before: Option<FlatState>,
    /// Whether that step failed after the optimizer had stepped (its all-gather failed).
    pub(crate) failed: bool,
}

impl CarriedState {
    pub(crate) fn new(start: usize, total: usize, dtype: DType, now: FlatState) -> Result<Self> {
        for t in &now.tensors {
            if t.rank() != 1 || start + t.elem_count() > total {
                return Err(K::Shape {
                    call: "into_state",
                    reason: format!(
                        "a state tensor of {:?} from element {start} of {total}",
                        t.dims()
                    ),
                }
                .into());
            }
        }
        Ok(CarriedState {
            start,
            total,
            dtype,
            now,
            before: None,
            failed: false,
        })
    }

    /// The elements of the flat parameter vector whose state this holds.
    pub fn range(&self) -> Range<usize> {
        let len = self.now.tensors.first().map_or(0, |t| t.elem_count());
        self.start..self.start + len
    }

    /// The length of the flat parameter vector (without ZeRO-1's padding).
    pub fn total(&self) -> usize {
        self.total
    }

    /// The state (after this rank's optimizer's last step).
    pub fn state(&self) -> &FlatState {
        &self.now
    }
}

/// Where a data-parallel optimizer built with `resume` leaves its state when it is dropped
/// (a step failed, the session ended), for the next one to take: one per rank, made before
/// [`run_elastic`](crate::run_elastic) and given to `resume` in the session.
#[derive(Debug, Default)]
pub struct StateCarry(Mutex<Option<CarriedState>>);

impl StateCarry {
    /// Empty: the first `resume` starts the state afresh.
    pub fn new() -> Self {
        Self::default()
    }

    /// The state left here, if any (leaving it empty).
    pub fn take(&self) -> Option<CarriedState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Leaves `state` here (replacing what was).
    pub fn put(&self, state: CarriedState) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(state);
    }

    /// Whether a state is here.
    pub fn is_empty(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }
}

/// The optimizer state for `want` (a range of the flat parameter vector of `total`
/// elements, of `copies` tensors of `dtype`) on this rank of `comm`, from what every rank
/// carried: each rank contributes the elements of its carried range that no lower rank
/// carries, into a zero buffer of `total` elements, and one sum all-reduce per tensor puts
/// them together (an element nobody carried, a lost rank's, is zero; adding zeros is exact,
/// but a `-0.0` comes back as `0.0`). The step count is rank 0's (the first rank that
/// carried a state, if rank 0 did not). Collective: every rank calls it.
pub(crate) fn reshard(
    comm: &Communicator,
    carried: Option<CarriedState>,
    total: usize,
    dtype: DType,
    copies: usize,
    want: Range<usize>,
    device: &candle_core::Device,
) -> Result<FlatState> {
    let bad = |reason: String| -> crate::DistError {
        K::InvalidArgument {
            call: "resume",
            reason,
        }
        .into()
    };
    // Each rank's [has, start, end, total, copies, step, before_step, dtype, failed]: who
    // carries what. Every rank checks every row, so that all of them return the same error
    // (none is left waiting in a collective the others skipped).
    let code = |d: DType| d as u8 as f64;
    let mine = match &carried {
        None => [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0],
        Some(c) => [
            1.0,
            c.range().start as f64,
            c.range().end as f64,
            c.total as f64,
            c.now.tensors.len() as f64,
            c.now.step as f64,
            c.before.as_ref().map_or(-1.0, |b| b.step as f64),
            code(c.dtype),
            c.failed as u8 as f64,
        ],
    };
    const COLS: usize = 9;
    let table = crate::tensor::all_gather(comm, &Tensor::new(&mine, device)?)?
        .reshape((comm.world_size(), COLS))?
        .to_vec2::<f64>()?;
    let holders: Vec<(usize, &Vec<f64>)> = table
        .iter()
        .enumerate()
        .filter(|(_, r)| r[0] == 1.0)
        .collect();
    let Some((_, first)) = holders.first() else {
        // Nobody carries anything: the state starts afresh everywhere.
        return Ok(FlatState {
            step: 0,
            tensors: (0..copies)
                .map(|_| Tensor::zeros(want.len(), dtype, device))
                .collect::<candle_core::Result<_>>()?,
        });
    };
    // The step count every rank takes (rank 0's; from before its last step, when that step
    // failed after its optimizer had stepped). A rank whose step completed where rank 0's
    // failed (or the other way round) carries both states and takes the one that agrees.
    let step = if first[8] == 1.0 && first[6] >= 0.0 {
        first[6]
    } else {
        first[5]
    };
    let range_of = |r: &Vec<f64>| r[1] as usize..r[2] as usize;
    for (i, (rank, r)) in holders.iter().enumerate() {
        if r[3] != total as f64 || r[4] != copies as f64 || r[7] != code(dtype) {
            return Err(bad(format!(
                "rank {rank} carries a state of {} tensors over {} elements (dtype code {}), the optimizer has {copies} of {dtype:?} over {total}",
                r[4], r[3], r[7]
            )));
        }
        // A state lower ranks carry all of is not used (DDP's beyond the first holder's):
        // a rank whose step failed before its optimizer stepped may carry an older one.
        let lower: Vec<Range<usize>> = holders[..i].iter().map(|(_, l)| range_of(l)).collect();
        if uncovered(range_of(r), lower).is_empty() {
            continue;
        }
        if r[5] != step && r[6] != step {
            return Err(bad(format!(
                "rank {rank}'s state is at step {}, the first holder's at {step}",
                r[5]
            )));
        }
    }
    let now = carried.map(|c| {
        let range = c.range();
        match c.before {
            Some(b) if c.now.step as f64 != step => (range, b),
            _ => (range, c.now),
        }
    });
    // The parts of this rank's range no lower rank carries.
    let own = match &now {
        Some((range, _)) => uncovered(
            range.clone(),
            table[..comm.rank()]
                .iter()
                .filter(|r| r[0] == 1.0)
                .map(range_of)
                .collect(),
        ),
        None => Vec::new(),
    };
    let mut tensors = Vec::with_capacity(copies);
    for k in 0..copies {
        let mut parts = Vec::new();
        let mut at = 0;
        if let Some((range, state)) = &now {
            for o in &own {
                if o.start > at {
                    parts.push(Tensor::zeros(o.start - at, dtype, device)?);
                }
                parts.push(state.tensors[k].narrow(0, o.start - range.start, o.len())?);
                at = o.end;
            }
        }
        if at < total {
            parts.push(Tensor::zeros(total - at, dtype, device)?);
        }
        // A fresh buffer: the all-reduce writes in place.
        let full = if parts.len() == 1 {
            parts[0].copy()?
        } else {
            Tensor::cat(&parts, 0)?
        };
        crate::tensor::all_reduce(comm, &full, ReduceOp::Sum)?;
        let start = want.start.min(total);
        let end = want.end.min(total);
        let mine = full.narrow(0, start, end - start)?;
        // The padding past `total` is zero; a fresh buffer either way (a narrow shares).
        tensors.push(if end - start < want.len() {
            let pad = Tensor::zeros(want.len() - (end - start), dtype, device)?;
            Tensor::cat(&[mine, pad], 0)?
        } else {
            mine.copy()?
        });
    }
    Ok(FlatState {
        step: step as u64,
        tensors,
    })
}

/// The parts of `range` that none of `lower` covers, in order.
fn uncovered(range: Range<usize>, mut lower: Vec<Range<usize>>) -> Vec<Range<usize>> {
    lower.sort_by_key(|r| r.start);
    let mut own = Vec::new();
    let mut at = range.start;
    for l in lower {
        if l.end <= at || l.start >= range.end {
            continue;
        }
        if l.start > at {
            own.push(at..l.start);
        }
        at = at.max(l.end);
    }
    if at < range.end {
        own.push(at..range.end);
    }
    own
}
