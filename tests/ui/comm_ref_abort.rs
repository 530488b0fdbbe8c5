// Neither abort nor into_raw can be called through a borrowed view, and the view cannot be
// turned into an owning Communicator.
use nccl_safe::{CommRef, Communicator, Config, CommDevice, Library};

fn main() -> nccl_safe::Result<()> {
    let lib = Library::host();
    let id = CommDevice::Host.unique_id()?;
    let mut raw = std::ptr::null_mut();
    unsafe { (lib.table().ncclCommInitRank)(&mut raw, 1, id.to_raw(), 0) };
    let owner = raw as usize;
    let view = unsafe { CommRef::from_raw_borrowed(&owner, lib, raw, CommDevice::Host, &Config::new())? };
    let _ = view.abort();
    let _ = view.into_raw();
    let _owned: Communicator = *view;
    Ok(())
}
