// A Registration borrows its communicator: it cannot outlive it (ncclCommDeregister needs
// a live communicator).
use nccl_safe::{Communicator, Config, CommDevice};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let mut buf = vec![1.0f32; 4];
    let reg;
    {
        let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
        reg = comm.register(&mut buf)?;
    }
    drop(reg);
    Ok(())
}
