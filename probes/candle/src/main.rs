//! Builds (with `cargo check`) only if nccl-safe and candle's cudarc feature set agree:
//! the same cudarc types flow from the application into nccl-safe.
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use nccl_safe::{Communicator, ReduceOp};

/// What candle's `InplaceOp1::cuda_fwd` would do with a `CudaStorage`'s slice and stream.
pub fn reduce_gradients(
    comm: &Communicator,
    grads: &mut CudaSlice<half::f16>,
    stream: &Arc<CudaStream>,
) -> nccl_safe::Result<()> {
    comm.all_reduce_in_place(grads, ReduceOp::Sum, stream)
}

fn main() {
    println!(
        "cudarc CUDA {}, nccl-safe on {} CUDA device(s)",
        cudarc::driver::sys::CUDA_VERSION,
        nccl_launch::cuda_device_count()
    );
    let _ = reduce_gradients;
}
