// A borrowed view cannot outlive the owner of its handle: the owner cannot be dropped (or
// moved) while the view exists.
use nccl_safe::{CommRef, Config, CommDevice, Stream, Library, ReduceOp};

struct Owner(nccl_sys::ncclComm_t);

impl Drop for Owner {
    fn drop(&mut self) {
        unsafe { (Library::host().table().ncclCommDestroy)(self.0) };
    }
}

fn main() -> nccl_safe::Result<()> {
    let lib = Library::host();
    let id = CommDevice::Host.unique_id()?;
    let mut raw = std::ptr::null_mut();
    unsafe { (lib.table().ncclCommInitRank)(&mut raw, 1, id.to_raw(), 0) };
    let owner = Owner(raw);
    let view = unsafe { CommRef::from_raw_borrowed(&owner, lib, owner.0, CommDevice::Host, &Config::new())? };
    drop(owner);
    let mut x = vec![1.0f32; 4];
    view.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
    Ok(())
}
