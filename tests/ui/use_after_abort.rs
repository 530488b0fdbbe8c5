// abort(self) consumes the communicator: no call can reach an aborted handle.
use nccl_safe::{Communicator, Config, Device};

fn main() -> nccl_safe::Result<()> {
    let id = Device::Host.unique_id()?;
    let comm = Communicator::init_rank(&Device::Host, 1, 0, &id, &Config::new())?;
    comm.abort()?;
    let _child = comm.split(Some(0), 0)?;
    Ok(())
}
