// A wait for signals takes its window mutably: no reference into the window's buffer may
// live across it, since the peers' puts land in the buffer during the wait.
use nccl_safe::{CommDevice, Communicator, Config, NcclMemory, SignalWait, Stream, WindowFlags};

fn main() -> nccl_safe::Result<()> {
    let id = CommDevice::Host.unique_id()?;
    let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    let mut mem = NcclMemory::<f32>::alloc_zeros(&comm, 1024, Stream::Host)?;
    let mut win = comm.register_window(&mut mem, WindowFlags::COLL_SYMMETRIC)?;
    let seen = win.buffer();
    win.wait_signal(&[SignalWait::new(0, 1)], &Stream::Host)?;
    drop(seen);
    Ok(())
}
