// An Op holds its borrows until it runs or its group ends: its buffers cannot be dropped
// or written meanwhile, nor its PreMulSum destroyed (ncclRedOpDestroy) before the group
// has enqueued the work that uses it.
use nccl_safe::{Communicator, Config, CommDevice, Group, Stream, ReduceOp};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let send = vec![1.0f32; 4];
    let mut recv = vec![0.0f32; 4];
    let op = comm.all_reduce_op(&send, &mut recv, ReduceOp::Sum, &Stream::Host)?;
    drop(recv);
    op.run()?;

    let half = comm.create_pre_mul_sum(0.5f32)?;
    let mut x = vec![4.0f32; 2];
    let mut g = Group::new();
    g.push(comm.all_reduce_in_place_op(&mut x, &half, &Stream::Host)?)?;
    drop(half);
    x[0] = 1.0;
    g.end()?;
    Ok(())
}
