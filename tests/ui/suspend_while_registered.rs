// Suspending takes the communicator by value: not while a Registration or Window borrows it.
use nccl_safe::{CommDevice, Communicator, Config};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let mut buf = vec![1.0f32; 4];
    let reg = comm.register(&mut buf)?;
    let suspended = comm.suspend().map_err(|(_, e)| e)?;
    drop(reg);
    drop(suspended);
    Ok(())
}
