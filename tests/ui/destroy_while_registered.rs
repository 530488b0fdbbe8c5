// Tearing a communicator down takes it by value: not while a Registration borrows it.
use nccl_safe::{Communicator, Config, CommDevice};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let mut buf = vec![1.0f32; 4];
    let reg = comm.register(&mut buf)?;
    comm.destroy().map_err(|(_, e)| e)?;
    drop(reg);
    Ok(())
}
