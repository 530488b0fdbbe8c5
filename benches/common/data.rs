//! Inputs whose exact results are known, and the count of wrong elements.
//!
//! Every input is a small integer, exact in every element type (int8 through bfloat16), and
//! every sum stays exact for up to 42 ranks (3 x 42 < 127, the int8 limit). Products are
//! exact too: each element is 2 on exactly one rank and 1 elsewhere.

use nccl_safe::ReduceOp;

use super::ranks::Elem;

/// The value rank `rank` contributes at index `i` of a reduction.
pub fn reduce_input(op: ReduceOp, rank: usize, i: usize, ranks: usize) -> f64 {
    match op {
        ReduceOp::Prod => {
            if i % ranks == rank {
                2.0
            } else {
                1.0
            }
        }
        _ => ((rank * 5 + i * 3) % 4) as f64,
    }
}

/// The reduction over all ranks of index `i`, as NCCL must compute it.
pub fn reduce_expected(op: ReduceOp, i: usize, ranks: usize, integer: bool) -> f64 {
    let values = (0..ranks).map(|r| reduce_input(op, r, i, ranks));
    match op {
        ReduceOp::Sum => values.sum(),
        ReduceOp::Prod => values.product(),
        ReduceOp::Max => values.fold(f64::MIN, f64::max),
        ReduceOp::Min => values.fold(f64::MAX, f64::min),
        ReduceOp::Avg => {
            let sum: f64 = values.sum();
            if integer {
                (sum / ranks as f64).floor()
            } else {
                sum / ranks as f64
            }
        }
    }
}

/// The value rank `rank` holds at index `i` of a data-movement input (distinct per rank).
pub fn move_input(rank: usize, i: usize) -> f64 {
    ((rank * 29 + i * 7) % 97) as f64
}

/// What the receive buffers hold before a checked run, so stale results cannot pass.
pub const SENTINEL: f64 = 123.0;

/// `n` elements of `f(i)`.
pub fn fill<T: Elem>(n: usize, f: impl Fn(usize) -> f64) -> Vec<T> {
    (0..n).map(|i| T::from_f64(f(i))).collect()
}

/// Elements of `got` that differ from `expected(i)`; `tolerant` allows NCCL's rounding
/// (for `avg` of floating-point types, which NCCL may compute as a multiply by 1/n).
pub fn count_wrong<T: Elem>(got: &[T], expected: impl Fn(usize) -> f64, tolerant: bool) -> u64 {
    got.iter()
        .enumerate()
        .filter(|(i, g)| {
            let want = T::from_f64(expected(*i));
            if tolerant {
                let (g, w) = (g.to_f64(), want.to_f64());
                (g - w).abs() > T::EPSILON * w.abs().max(1.0)
            } else {
                **g != want
            }
        })
        .count() as u64
}
