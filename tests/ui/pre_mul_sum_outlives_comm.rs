// A PreMulSum borrows its communicator: the communicator cannot be destroyed while the
// operator is alive (ncclRedOpDestroy needs a live communicator).
use nccl_safe::{Communicator, Config, CommDevice, Stream};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let half = comm.create_pre_mul_sum(0.5f32)?;
    comm.destroy().map_err(|(_, e)| e)?;
    let mut x = vec![4.0f32; 2];
    let _ = (&half, &mut x, Stream::Host);
    Ok(())
}
