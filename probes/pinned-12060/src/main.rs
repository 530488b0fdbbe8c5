//! An application pinned to CUDA 12.6 bindings and to linking libcuda. It builds only if
//! cudarc, beside nccl-safe, really got both: nccl-safe selects neither.
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use nccl_safe::{Communicator, ReduceOp};

// CUDA 12.6 bindings: cudarc defines `CUDA_VERSION` once per version feature, so a second
// version (e.g. 12.8 forced by a library) would not compile, and another alone fails here.
const _: () = assert!(cudarc::driver::sys::CUDA_VERSION == 12060);

// No run-time loading: under `dynamic-loading` cudarc's driver bindings also define
// `is_culib_present` (an `unsafe fn() -> bool`), the glob import below brings it in, and
// the call in `main` does not compile; under `dynamic-linking` only `linked` has it.
mod linked {
    /// Stands in for cudarc's loader probe, which must not exist when libcuda is linked.
    pub fn is_culib_present() -> &'static str {
        "libcuda is linked, not loaded"
    }
}
#[allow(unused_imports)]
use cudarc::driver::sys::*;
use linked::*;

pub fn reduce_gradients(
    comm: &Communicator,
    grads: &mut CudaSlice<f32>,
    stream: &Arc<CudaStream>,
) -> nccl_safe::Result<()> {
    comm.all_reduce_in_place(grads, ReduceOp::Sum, stream)
}

fn main() {
    let mode: &'static str = is_culib_present();
    println!("CUDA {CUDA_VERSION}: {mode}");
    let _ = reduce_gradients;
}
