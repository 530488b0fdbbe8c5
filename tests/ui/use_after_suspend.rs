// Suspending moves the communicator: the old binding runs no collective afterwards.
use nccl_safe::{CommDevice, Communicator, Config, ReduceOp, Stream};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let suspended = comm.suspend().map_err(|(_, e)| e)?;
    let mut x = vec![1.0f32; 4];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
    drop(suspended);
    Ok(())
}
