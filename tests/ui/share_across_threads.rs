// NCCL forbids concurrent calls on one communicator: &Communicator cannot cross threads.
use nccl_safe::{Communicator, Config, CommDevice, Stream, ReduceOp};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let shared = &comm;
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut x = vec![1.0f32; 4];
            shared.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
        });
    });
    Ok(())
}
