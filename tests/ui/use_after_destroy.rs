// destroy(self) consumes the communicator: no call can reach a destroyed handle.
use nccl_safe::{Communicator, Config, CommDevice, Stream, ReduceOp};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    comm.destroy().map_err(|(_, e)| e)?;
    let mut x = vec![1.0f32; 4];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
    Ok(())
}
