// A put described for a Group borrows its windows until the group's end: deregistering the
// target (or the source) before it would leave NCCL a window that is gone.
use nccl_safe::{CommDevice, Communicator, Config, Group, NcclMemory, Signal, Stream, WindowFlags};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let mut a = NcclMemory::<f32>::alloc_zeros(&comm, 1024, Stream::Host)?;
    let mut b = NcclMemory::<f32>::alloc_zeros(&comm, 1024, Stream::Host)?;
    let src = comm.register_window(&mut a, WindowFlags::COLL_SYMMETRIC)?;
    let dst = comm.register_window(&mut b, WindowFlags::COLL_SYMMETRIC)?;
    let mut g = Group::new();
    g.push(dst.put_signal_op(&src, 0..4, 0, 0, Signal::DEFAULT, &Stream::Host)?)?;
    drop(dst);
    g.end()?;
    drop(src);
    Ok(())
}
