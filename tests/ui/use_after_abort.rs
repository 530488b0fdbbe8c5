// abort(self) consumes the communicator: no call can reach an aborted handle.
use nccl_safe::{Communicator, Config, CommDevice};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    comm.abort()?;
    let _child = comm.split(Some(0), 0)?;
    Ok(())
}
