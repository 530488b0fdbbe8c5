// A second owner would mean a second teardown: Communicator is not Clone.
use nccl_safe::{Communicator, Config, Device};

fn main() -> nccl_safe::Result<()> {
    let id = Device::Host.unique_id()?;
    let comm = Communicator::init_rank(&Device::Host, 1, 0, &id, &Config::new())?;
    let twin = comm.clone();
    drop((comm, twin));
    Ok(())
}
