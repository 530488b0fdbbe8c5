// A borrowed view cannot tear its handle down: destroy, abort, finalize and into_raw take a
// Communicator by value, which cannot be moved out of the view.
use nccl_safe::{CommRef, Config, CommDevice, Library};

fn main() -> nccl_safe::Result<()> {
    let lib = Library::host();
    let id = CommDevice::Host.unique_id()?;
    let mut raw = std::ptr::null_mut();
    unsafe { (lib.table().ncclCommInitRank)(&mut raw, 1, id.to_raw(), 0) };
    let owner = raw as usize;
    let view = unsafe { CommRef::from_raw_borrowed(&owner, lib, raw, CommDevice::Host, &Config::new())? };
    let _ = view.destroy();
    let _ = view.finalize(std::time::Duration::from_secs(1));
    Ok(())
}
