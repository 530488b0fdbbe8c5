// An in-place all_reduce writes its buffer: a shared reference is not accepted.
use nccl_safe::{Communicator, Config, CommDevice, Stream, ReduceOp};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let grads = vec![1.0f32; 4];
    comm.all_reduce_in_place(&grads, ReduceOp::Sum, &Stream::Host)?;
    Ok(())
}
