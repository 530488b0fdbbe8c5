// While registered, the buffer is reached only through its Registration (which cannot
// hand out `&mut` to the buffer itself, so it cannot be swapped out and freed).
use nccl_safe::{Communicator, Config, CommDevice, Stream, ReduceOp};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let mut buf = vec![1.0f32; 4];
    let reg = comm.register(&mut buf)?;
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &Stream::Host)?;
    drop(reg);
    Ok(())
}
