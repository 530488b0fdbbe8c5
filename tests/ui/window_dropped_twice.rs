// A Window deregisters once: dropping (or deregistering) it a second time does not compile.
use nccl_safe::{Communicator, Config, CommDevice, Stream, NcclMemory, WindowFlags};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let mut mem = NcclMemory::<f32>::alloc_zeros(&comm, 4, Stream::Host)?;
    let win = comm.register_window(&mut mem, WindowFlags::COLL_SYMMETRIC)?;
    drop(win);
    drop(win);
    Ok(())
}
