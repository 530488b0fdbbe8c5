// Buffers passed to a Group stay borrowed until the group ends: they cannot be freed or
// written while NCCL may still use them.
use nccl_safe::{Communicator, Config, CommDevice, Group, Stream, ReduceOp};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let mut send = vec![1.0f32; 4];
    let mut recv = vec![0.0f32; 4];
    let mut g = Group::new();
    g.push(comm.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &Stream::Host)?)?;
    drop(recv);
    send[0] = 2.0;
    g.end()?;
    Ok(())
}
