// A second owner would mean a second teardown: Communicator is not Clone.
use nccl_safe::{Communicator, Config, CommDevice};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let twin = comm.clone();
    drop((comm, twin));
    Ok(())
}
