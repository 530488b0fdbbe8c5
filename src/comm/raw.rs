//! [`RawComm`]: the one owner of an `ncclComm_t`, on which [`Communicator`] and
//! [`crate::CommRef`] are built: the handle, the library that made it, and whether its
//! teardown is this crate's (owned) or someone else's (borrowed). Taking the handle out
//! ([`RawComm::take`]) is the only way to tear it down or give it away, and it yields an
//! owned handle once, so no path can tear a handle down twice or tear down one it
//! borrowed. The shape is rusqlite's `InnerConnection` under `Connection` (`from_handle` /
//! `from_handle_owned`).

use std::cell::Cell;
use std::sync::Arc;

use nccl_sys::{ncclComm_t, FunctionTable};

use crate::library::Library;

/// An `ncclComm_t` and the library that made it, owned or borrowed.
pub(crate) struct RawComm {
    /// Null once taken. A `Cell`: a communicator whose launch must end at once is aborted
    /// in place, through a shared reference (`Communicator::end_launches`).
    raw: Cell<ncclComm_t>,
    lib: Arc<Library>,
    owned: bool,
}

impl RawComm {
    /// A handle whose one teardown is ours.
    pub(crate) fn owned(raw: ncclComm_t, lib: Arc<Library>) -> RawComm {
        RawComm {
            raw: Cell::new(raw),
            lib,
            owned: true,
        }
    }

    /// A handle someone else owns: [`take`](Self::take) never yields it, so nothing here
    /// tears it down.
    pub(crate) fn borrowed(raw: ncclComm_t, lib: Arc<Library>) -> RawComm {
        RawComm {
            raw: Cell::new(raw),
            lib,
            owned: false,
        }
    }

    /// The handle for a call (null once taken).
    #[inline(always)]
    pub(crate) fn get(&self) -> ncclComm_t {
        self.raw.get()
    }

    /// The library that made the handle.
    #[inline(always)]
    pub(crate) fn lib(&self) -> &Arc<Library> {
        &self.lib
    }

    /// The library's function table.
    #[inline(always)]
    pub(crate) fn table(&self) -> &FunctionTable {
        self.lib.table()
    }

    /// Whether the handle's teardown is ours.
    pub(crate) fn is_owned(&self) -> bool {
        self.owned
    }

    /// Whether the handle is still here (not taken).
    pub(crate) fn is_live(&self) -> bool {
        !self.raw.get().is_null()
    }

    /// Takes the handle out for its one teardown (or to give it away): `Some` once for an
    /// owned handle, `None` for a borrowed one or when already taken. Afterwards
    /// [`get`](Self::get) is null.
    pub(crate) fn take(&self) -> Option<ncclComm_t> {
        let raw = self.raw.replace(std::ptr::null_mut());
        (self.owned && !raw.is_null()).then_some(raw)
    }

    /// Gives the handle up with no teardown, owned or not: afterwards it is the caller's
    /// (or stays its owner's). Null when already taken.
    pub(crate) fn into_raw(self) -> ncclComm_t {
        self.raw.replace(std::ptr::null_mut())
    }
}

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;

    fn one_rank() -> (ncclComm_t, crate::id::UniqueId) {
        let lib = Library::host();
        let id = crate::CommDevice::Host.unique_id().unwrap();
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is writable; a one-rank communicator needs no peer.
        let r = unsafe { (lib.table().ncclCommInitRank)(&mut raw, 1, id.to_raw(), 0) };
        assert_eq!(r, nccl_sys::bindings::ncclSuccess);
        (raw, id)
    }

    fn counts(id: &crate::id::UniqueId) -> (u64, u64, u64, u64) {
        let s = crate::host::stats_for(&id.to_raw());
        (s.created, s.destroyed, s.aborted, s.misused)
    }

    #[test]
    fn an_owned_handle_is_taken_once_and_a_borrowed_one_never() {
        let (raw, id) = one_rank();
        let owned = RawComm::owned(raw, Library::host());
        assert_eq!(owned.take(), Some(raw));
        assert!(!owned.is_live());
        assert_eq!(owned.take(), None);
        drop(owned); // taken: nothing to tear down

        // Given up: neither torn down here nor taken again.
        assert_eq!(RawComm::owned(raw, Library::host()).into_raw(), raw);

        let view = RawComm::borrowed(raw, Library::host());
        assert_eq!(view.get(), raw);
        assert_eq!(view.take(), None);
        drop(view);
        assert_eq!(counts(&id), (1, 0, 0, 0));

        // SAFETY: `raw` is live and ours: its one teardown.
        let r = unsafe { (Library::host().table().ncclCommDestroy)(raw) };
        assert_eq!(r, nccl_sys::bindings::ncclSuccess);
        assert_eq!(counts(&id), (1, 1, 0, 0));
    }

    #[test]
    fn an_owned_handle_never_taken_is_aborted_once_on_drop() {
        let (raw, id) = one_rank();
        drop(RawComm::owned(raw, Library::host()));
        assert_eq!(counts(&id), (1, 0, 1, 0));
    }
}
