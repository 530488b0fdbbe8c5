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
///
/// candle_nn's `AdamW` keeps its moments in private fields, so it cannot implement this:
/// use this crate's [`AdamW`], a drop-in (the same `ParamsAdamW`, the same updates bit for
/// bit). candle_nn's `SGD` implements it (no state). An optimizer of your own (an enum over
/// several, say) implements it by exporting its per-element state as flat tensors.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot carry its optimizer state across a recovery: it does not implement `ShardableState`",
    label = "its state cannot be exported and re-sharded",
    note = "for candle_nn::AdamW (whose moments are private) use its drop-in `nccl_safe_candle::state::AdamW`: the same `ParamsAdamW`, the same updates bit for bit",
    note = "an optimizer of your own implements `nccl_safe_candle::ShardableState` (`export_state`, `import_state`); or build with `new`, whose state starts afresh after a recovery"
)]
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
/// held the state of (ZeRO-1: its range; DDP: all of it) and that state, and for ZeRO-1
/// with its replica the copy this rank kept of the next rank's state
/// ([`replica_range`](Self::replica_range)). Put it back on a communicator of any size
/// with `resume`.
#[derive(Debug, Clone)]
pub struct CarriedState {
    pub(crate) start: usize,
    pub(crate) total: usize,
    pub(crate) dtype: DType,
    /// The state after the last step this rank's optimizer took.
    pub(crate) now: FlatState,
    /// ZeRO-1 resumed: the state from before the last step this rank's optimizer took.
    pub(crate) before: Option<FlatState>,
    /// Whether that step failed after the optimizer had stepped (its exchange or
    /// all-gather failed).
    pub(crate) failed: bool,
    /// ZeRO-1 with the replica: the copy of the next rank's state.
    pub(crate) replica: Option<Replica>,
}

/// The copy a ZeRO-1 rank keeps of the next rank's (`rank + 1` modulo the world) state, as
/// [`CarriedState`] keeps its own: from `start`, the last one whose exchange reached this
/// rank (`now`), and the one received before it.
#[derive(Debug, Clone)]
pub(crate) struct Replica {
    pub(crate) start: usize,
    pub(crate) now: FlatState,
    pub(crate) before: Option<FlatState>,
}

impl Replica {
    fn range(&self) -> Range<usize> {
        let len = self.now.tensors.first().map_or(0, |t| t.elem_count());
        self.start..self.start + len
    }
}

impl CarriedState {
    pub(crate) fn new(start: usize, total: usize, dtype: DType, now: FlatState) -> Result<Self> {
        check_piece(start, total, &now)?;
        Ok(CarriedState {
            start,
            total,
            dtype,
            now,
            before: None,
            failed: false,
            replica: None,
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

    /// ZeRO-1 with its replica ([`StateCarry::with_replica`]): the elements of the flat
    /// parameter vector of the next rank's state, whose copy this rank kept.
    pub fn replica_range(&self) -> Option<Range<usize>> {
        self.replica.as_ref().map(Replica::range)
    }

    /// ZeRO-1 with its replica: the copy of the next rank's state (after the last step
    /// whose exchange reached this rank).
    pub fn replica_state(&self) -> Option<&FlatState> {
        self.replica.as_ref().map(|r| &r.now)
    }
}

fn check_piece(start: usize, total: usize, state: &FlatState) -> Result<()> {
    for t in &state.tensors {
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
    Ok(())
}

/// Where a data-parallel optimizer built with `resume` leaves its state when it is dropped
/// (a step failed, the session ended), for the next one to take: one per rank, made before
/// [`run_elastic`](crate::run_elastic) and given to `resume` in the session. It also says
/// whether a [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer) resumed from it
/// keeps a copy of the next rank's state ([`with_replica`](Self::with_replica), on by
/// default), so that the state of a lost rank is rebuilt on the survivors.
#[derive(Debug)]
pub struct StateCarry {
    state: Mutex<Option<CarriedState>>,
    replica: bool,
}

impl Default for StateCarry {
    fn default() -> Self {
        Self::new()
    }
}

impl StateCarry {
    /// Empty: the first `resume` starts the state afresh. With the replica
    /// ([`with_replica`](Self::with_replica)).
    pub fn new() -> Self {
        StateCarry {
            state: Mutex::new(None),
            replica: true,
        }
    }

    /// Whether a [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer) resumed from
    /// this carry keeps a copy of the next rank's (`rank + 1` modulo the world) optimizer
    /// state, refreshed at every step (`true`, the default): after the loss of a rank the
    /// rank before it holds its state, and the survivors rebuild it, bit for bit. It costs
    /// each rank one more optimizer state of its shard's size (AdamW: twice its parameter
    /// shard, as much again as ZeRO-1's own state) and, per step, a send and a receive of
    /// that state after the optimizer's step (see the README for measurements). Without it
    /// (`false`) the state of a lost rank's range starts again from zero. Every rank of a
    /// `resume` must say the same (a disagreement is an error on every rank). Ignored by
    /// [`DdpOptimizer`](crate::DdpOptimizer), whose state is whole on every rank.
    pub fn with_replica(mut self, on: bool) -> Self {
        self.replica = on;
        self
    }

    /// Whether ZeRO-1 keeps the replica ([`with_replica`](Self::with_replica)).
    pub fn replica(&self) -> bool {
        self.replica
    }

    /// The state left here, if any (leaving it empty).
    pub fn take(&self) -> Option<CarriedState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Leaves `state` here (replacing what was).
    pub fn put(&self, state: CarriedState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = Some(state);
    }

    /// Whether a state is here.
    pub fn is_empty(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }
}

/// The optimizer state for `want` on this rank of `comm` (see [`reshard_pieces`]), for an
/// optimizer without a replica (DDP).
pub(crate) fn reshard(
    comm: &Communicator,
    carried: Option<CarriedState>,
    total: usize,
    dtype: DType,
    copies: usize,
    want: Range<usize>,
    device: &candle_core::Device,
) -> Result<FlatState> {
    let mut v = reshard_pieces(comm, carried, total, dtype, copies, &[want], false, device)?;
    Ok(v.remove(0))
}

/// One piece of state a rank carries, as a row of the table every rank sees:
/// `[has, start, end, step, before_step]`.
const PIECE: usize = 5;

fn piece_row(p: Option<(Range<usize>, u64, Option<u64>)>) -> [f64; PIECE] {
    match p {
        None => [0.0, 0.0, 0.0, 0.0, -1.0],
        Some((r, now, before)) => [
            1.0,
            r.start as f64,
            r.end as f64,
            now as f64,
            before.map_or(-1.0, |b| b as f64),
        ],
    }
}

/// The optimizer state for each of `want` (ranges of the flat parameter vector of `total`
/// elements, of `copies` tensors of `dtype`; past `total`, zeros) on this rank of `comm`,
/// from what every rank carried: first the ranks' own states, then the replicas (ZeRO-1's
/// copies of the next rank's state), each contributing the elements of its carried range
/// that no piece before it carries (its own, lower ranks' own, lower ranks' replicas),
/// into a zero buffer of `total` elements; one sum all-reduce per tensor puts them
/// together. So an element comes from its holder when it survived, else from the copy the
/// rank before it kept; an element nobody carried (two neighbouring ranks lost at once, or
/// no replica) is zero. Adding zeros is exact, but a `-0.0` comes back as `0.0`. Each piece
/// takes the version (after its last step, or from before a step whose all-gather failed)
/// at the step count of rank 0 (the first rank that carried a state, if rank 0 did not); an
/// own state at neither is an error, a replica at neither is left out. Every rank must pass
/// the same `replica` (whether the new optimizer keeps one). Collective: every rank calls
/// it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reshard_pieces(
    comm: &Communicator,
    carried: Option<CarriedState>,
    total: usize,
    dtype: DType,
    copies: usize,
    want: &[Range<usize>],
    replica: bool,
    device: &candle_core::Device,
) -> Result<Vec<FlatState>> {
    let bad = |reason: String| -> crate::DistError {
        K::InvalidArgument {
            call: "resume",
            reason,
        }
        .into()
    };
    // Each rank's [total, copies, dtype, replica, failed, own piece, replica piece]: who
    // carries what. Every rank checks every row, so that all of them return the same error
    // (none is left waiting in a collective the others skipped).
    const HEAD: usize = 5;
    fn own_of(r: &[f64]) -> &[f64] {
        &r[HEAD..HEAD + PIECE]
    }
    fn replica_of(r: &[f64]) -> &[f64] {
        &r[HEAD + PIECE..]
    }
    let code = |d: DType| d as u8 as f64;
    let mut mine = vec![0.0; HEAD];
    mine[3] = replica as u8 as f64;
    if let Some(c) = &carried {
        mine[..3].copy_from_slice(&[c.total as f64, c.now.tensors.len() as f64, code(c.dtype)]);
        mine[4] = c.failed as u8 as f64;
    }
    mine.extend(piece_row(carried.as_ref().map(|c| {
        (c.range(), c.now.step, c.before.as_ref().map(|b| b.step))
    })));
    mine.extend(piece_row(carried.as_ref().and_then(|c| {
        c.replica
            .as_ref()
            .map(|r| (r.range(), r.now.step, r.before.as_ref().map(|b| b.step)))
    })));
    const COLS: usize = HEAD + 2 * PIECE;
    let table = crate::tensor::all_gather(comm, &Tensor::new(mine.as_slice(), device)?)?
        .reshape((comm.world_size(), COLS))?
        .to_vec2::<f64>()?;
    if let Some((rank, _)) = table.iter().enumerate().find(|(_, r)| r[3] != table[0][3]) {
        return Err(bad(format!(
            "rank {rank}'s StateCarry says with_replica({}), rank 0's with_replica({}): every rank must say the same",
            table[rank][3] == 1.0,
            table[0][3] == 1.0
        )));
    }
    let holders: Vec<(usize, &Vec<f64>)> = table
        .iter()
        .enumerate()
        .filter(|(_, r)| own_of(r)[0] == 1.0)
        .collect();
    let fresh = |len: usize| -> Result<FlatState> {
        Ok(FlatState {
            step: 0,
            tensors: (0..copies)
                .map(|_| Tensor::zeros(len, dtype, device))
                .collect::<candle_core::Result<_>>()?,
        })
    };
    let Some((_, first)) = holders.first() else {
        // Nobody carries anything: the state starts afresh everywhere.
        return want.iter().map(|w| fresh(w.len())).collect();
    };
    // The step count every rank takes (rank 0's, the first holder's; from before its last
    // step when that step failed after its optimizer had stepped). A rank whose step
    // completed where rank 0's failed (NCCL's launch thread makes it possible: a rank's wait
    // for the launch ends with the clique's abort), or the other way round, carries both
    // states and takes the one that agrees.
    let (f_now, f_before) = (own_of(first)[3], own_of(first)[4]);
    let step = if first[4] == 1.0 && f_before >= 0.0 {
        f_before
    } else {
        f_now
    };
    let range_of = |p: &[f64]| p[1] as usize..p[2] as usize;
    for (i, (rank, r)) in holders.iter().enumerate() {
        if r[0] != total as f64 || r[1] != copies as f64 || r[2] != code(dtype) {
            return Err(bad(format!(
                "rank {rank} carries a state of {} tensors over {} elements (dtype code {}), the optimizer has {copies} of {dtype:?} over {total}",
                r[1], r[0], r[2]
            )));
        }
        let own = own_of(r);
        // A state lower ranks carry all of is not used (DDP's beyond the first holder's):
        // a rank whose step failed before its optimizer stepped may carry an older one.
        let lower: Vec<Range<usize>> = holders[..i]
            .iter()
            .map(|(_, l)| range_of(own_of(l)))
            .collect();
        if uncovered(range_of(own), lower).is_empty() {
            continue;
        }
        if own[3] != step && own[4] != step {
            return Err(bad(format!(
                "rank {rank}'s state is at step {}, the first holder's at {step}",
                own[3]
            )));
        }
    }
    // The pieces used, in order of precedence: (rank, is replica, range).
    let at_step = |p: &[f64]| p[0] == 1.0 && (p[3] == step || p[4] == step);
    let mut order: Vec<(usize, bool, Range<usize>)> = Vec::new();
    for (rank, r) in &holders {
        order.push((*rank, false, own_of(r)[1] as usize..own_of(r)[2] as usize));
    }
    for (rank, r) in &holders {
        let p = replica_of(r);
        if at_step(p) {
            order.push((*rank, true, p[1] as usize..p[2] as usize));
        }
    }
    // This rank's pieces at the agreed step, and the parts of each that no piece before it
    // carries.
    let pick = |now: FlatState, before: Option<FlatState>| match before {
        Some(b) if now.step as f64 != step => b,
        _ => now,
    };
    let me = comm.rank();
    let mut contributions: Vec<(Range<usize>, FlatState, Vec<Range<usize>>)> = Vec::new();
    if let Some(c) = carried {
        let own_range = c.range();
        let replica = c.replica;
        let mut add = |is_replica: bool, range: Range<usize>, state: FlatState| {
            let Some(at) = order
                .iter()
                .position(|(r, rep, _)| *r == me && *rep == is_replica)
            else {
                return;
            };
            let covered = order[..at].iter().map(|(_, _, r)| r.clone()).collect();
            let parts = uncovered(range.clone(), covered);
            contributions.push((range, state, parts));
        };
        add(false, own_range, pick(c.now, c.before));
        if let Some(r) = replica {
            let range = r.range();
            add(true, range, pick(r.now, r.before));
        }
    }
    let mut out: Vec<Vec<Tensor>> = want.iter().map(|_| Vec::with_capacity(copies)).collect();
    for k in 0..copies {
        // Each contributed part at its place, zeros elsewhere.
        let mut parts: Vec<(usize, Tensor)> = Vec::new();
        for (range, state, own) in &contributions {
            for o in own {
                parts.push((
                    o.start,
                    state.tensors[k].narrow(0, o.start - range.start, o.len())?,
                ));
            }
        }
        parts.sort_by_key(|(s, _)| *s);
        let mut pieces = Vec::new();
        let mut at = 0;
        for (start, t) in parts {
            if start > at {
                pieces.push(Tensor::zeros(start - at, dtype, device)?);
            }
            at = start + t.elem_count();
            pieces.push(t);
        }
        if at < total {
            pieces.push(Tensor::zeros(total - at, dtype, device)?);
        }
        // A fresh buffer: the all-reduce writes in place.
        let full = if pieces.len() == 1 {
            pieces[0].copy()?
        } else {
            Tensor::cat(&pieces, 0)?
        };
        crate::tensor::all_reduce(comm, &full, ReduceOp::Sum)?;
        for (w, o) in want.iter().zip(out.iter_mut()) {
            let start = w.start.min(total);
            let end = w.end.min(total);
            let mine = full.narrow(0, start, end - start)?;
            // The padding past `total` is zero; a fresh buffer either way (a narrow shares).
            o.push(if end - start < w.len() {
                let pad = Tensor::zeros(w.len() - (end - start), dtype, device)?;
                Tensor::cat(&[mine, pad], 0)?
            } else {
                mine.copy()?
            });
        }
    }
    Ok(out
        .into_iter()
        .map(|tensors| FlatState {
            step: step as u64,
            tensors,
        })
        .collect())
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use nccl_launch::Launcher;

    fn state(step: u64, base: f32, len: usize) -> FlatState {
        let v: Vec<f32> = (0..len).map(|i| base + i as f32).collect();
        FlatState {
            step,
            tensors: vec![Tensor::new(v.as_slice(), &Device::Cpu).unwrap()],
        }
    }

    /// 3 old ranks of 3 elements each (9 in all); old rank 1 is lost after a step whose
    /// exchange reached everyone but whose all-gather failed: every piece carries both
    /// versions (step 5, and step 4 from before), the first holder's before is step 4. On
    /// the 2 ranks left (old ranks 0 and 2), parts of 5: the lost range 3..6 comes from
    /// old rank 0's copy, at step 4 (its `before`), never at step 5; so does everything.
    /// Without the copy's `before` taken, 3..6 would hold 50..53; without the copy, zeros.
    #[test]
    fn a_lost_range_comes_from_the_copy_at_the_agreed_step() {
        let got = Launcher::host(2)
            .try_run(|rank| -> crate::DistResult<Vec<Vec<f32>>> {
                let comm = rank.comm();
                let (own_start, base) = if comm.rank() == 0 {
                    (0, 0.0)
                } else {
                    (6, 20.0)
                };
                let mut c = CarriedState::new(own_start, 9, DType::F32, state(5, base + 100.0, 3))?;
                c.before = Some(state(4, base, 3));
                c.failed = true;
                if comm.rank() == 0 {
                    // Old rank 0's copy of old rank 1's range.
                    c.replica = Some(Replica {
                        start: 3,
                        now: state(5, 50.0, 3),
                        before: Some(state(4, 10.0, 3)),
                    });
                }
                let mine = comm.rank() * 5..(comm.rank() + 1) * 5;
                let want = std::slice::from_ref(&mine);
                let out =
                    reshard_pieces(comm, Some(c), 9, DType::F32, 1, want, true, &Device::Cpu)?;
                assert_eq!(out[0].step, 4);
                Ok(vec![out[0].tensors[0].to_vec1::<f32>()?])
            })
            .unwrap();
        assert_eq!(got[0][0], [0.0, 1.0, 2.0, 10.0, 11.0]);
        // 12.0, then old rank 2's 20, 21, 22, then the padding.
        assert_eq!(got[1][0], [12.0, 20.0, 21.0, 22.0, 0.0]);
    }
}
