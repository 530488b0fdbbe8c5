// A suspended communicator runs no collective and registers no memory: it has no such
// methods (and does not deref to a Communicator).
use nccl_safe::{CommDevice, Communicator, Config, ReduceOp, Stream};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let suspended = comm.suspend().map_err(|(_, e)| e)?;
    let mut x = vec![1.0f32; 4];
    suspended.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
    suspended.register(&mut x)?;
    Ok(())
}
