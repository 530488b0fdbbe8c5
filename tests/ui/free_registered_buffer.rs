// A registered buffer cannot be freed (or moved) while its Registration lives: NCCL
// would keep using memory given back to the allocator.
use nccl_safe::{Communicator, Config, CommDevice, Stream, NcclMemory};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let mut mem = NcclMemory::<f32>::alloc_zeros(&comm, 4, Stream::Host)?;
    let reg = comm.register(&mut mem)?;
    mem.free()?;
    drop(reg);
    Ok(())
}
