//! Raw-handle interop: adopting an `ncclComm_t` made elsewhere ([`Communicator::from_raw`]),
//! giving one back ([`Communicator::into_raw`]), and borrowing one that someone else owns
//! ([`CommRef`]).
//!
//! The shapes follow NVIDIA CCCL's `nccl_communicator` (owning, move-only, `release()`) next
//! to `nccl_communicator_ref` (non-owning), rusqlite's `Connection::from_handle` and git2's
//! `from_raw`. Each keeps the crate's guarantee that a handle is torn down exactly once:
//!
//! | | who tears the handle down | the watchdog, on a timeout |
//! |---|---|---|
//! | [`Communicator::from_raw`] | the [`Communicator`] (drop, `destroy`, `abort`, `finalize`) | aborts it, as any communicator |
//! | [`Communicator::into_raw`] | the caller, from then on | no longer watches it |
//! | [`CommRef`] | its owner, never the view | marks the view failed and reports; never aborts |
//!
//! A view or an adopted communicator has its own diagnostics (flight recorder, watchdog
//! timeout from the [`Config`] passed in), in a desync clique of its own: the unique id its
//! ranks joined with is not known here.

use std::ffi::c_int;
use std::marker::PhantomData;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use nccl_sys::ncclComm_t;

use crate::comm::{CommDevice, Communicator, RawComm};
use crate::config::Config;
use crate::diag::DEFAULT_TIMEOUT;
use crate::error::invalid;
use crate::error::Result;
use crate::id::{UniqueId, UNIQUE_ID_BYTES};
use crate::library::{CallContext, Library};
use crate::nccl_call;

impl Communicator {
    /// Adopts a communicator created elsewhere (by C++, PyTorch or another crate): from now
    /// on it is this [`Communicator`]'s, torn down exactly once, by drop or by
    /// [`destroy`](Self::destroy) / [`abort`](Self::abort) / [`finalize`](Self::finalize),
    /// like one made by [`init_rank`](Self::init_rank).
    ///
    /// Rank and size are read from NCCL (`ncclCommUserRank`, `ncclCommCount`). `config`
    /// gives the diagnostics (watchdog timeout, flight recorder) and whether the handle was
    /// created non-blocking ([`Config::blocking`]; then this waits, up to
    /// [`DEFAULT_TIMEOUT`], for its init to finish); its NCCL options are not applied
    /// (the communicator exists already). For [`CommDevice::Cuda`] the handle's device
    /// (`ncclCommCuDevice`) must be the context's.
    ///
    /// On an error the handle is left as it was and still belongs to the caller.
    ///
    /// ```
    /// use nccl_safe::{Communicator, Config, CommDevice, Stream, Library, ReduceOp};
    /// let lib = Library::host();
    /// let id = CommDevice::Host.unique_id()?;
    /// // A handle from C: a one-rank communicator made through the raw table.
    /// let mut raw = std::ptr::null_mut();
    /// // SAFETY: `raw` is writable; a one-rank communicator needs no peer.
    /// let r = unsafe { (lib.table().ncclCommInitRank)(&mut raw, 1, id.to_raw(), 0) };
    /// assert_eq!(r, nccl_sys::bindings::ncclSuccess);
    /// // SAFETY: `raw` is a live host communicator that nothing else uses or tears down.
    /// let comm = unsafe { Communicator::from_raw(lib, raw, CommDevice::Host, &Config::new())? };
    /// let mut x = vec![2.0f32; 4];
    /// comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
    /// drop(comm); // ncclCommDestroy, once
    /// assert_eq!(nccl_safe::host::stats_for(&id.to_raw()).destroyed, 1);
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    ///
    /// # Safety
    ///
    /// * `raw` is a live communicator (not destroyed, finalized or aborted) created through
    ///   `lib`: the same loaded NCCL (a handle means nothing to another copy of NCCL), or
    ///   the host provider for [`Library::host`]. [`Library::load`] finds the libnccl the
    ///   process has already mapped, which is the creator's when it loaded NCCL as a shared
    ///   library ([`Library::source`] is then [`crate::error::Source::AlreadyLoaded`]); a
    ///   copy of NCCL linked statically into the creator is not visible to it.
    /// * Its ownership moves here: nothing else tears it down afterwards, nor calls NCCL
    ///   on it while the returned communicator exists (it may be used from any thread).
    /// * `device` is the device it was created on (for CUDA, also checked).
    #[track_caller]
    pub unsafe fn from_raw(
        lib: Arc<Library>,
        raw: ncclComm_t,
        device: CommDevice,
        config: &Config,
    ) -> Result<Communicator> {
        wrap(
            "Communicator::from_raw",
            RawComm::owned(raw, lib),
            device,
            config,
            Location::caller(),
        )
    }

    /// Gives the handle back without tearing it down: from now on the caller owns it (and
    /// must destroy, finalize or abort it once). No diagnostics stay behind: the watchdog
    /// no longer watches it and its desync clique forgets it.
    ///
    /// The name strings of the [`Config`] it was made with ([`Config::comm_name`],
    /// [`Config::net_name`]) stay alive for the rest of the process: NCCL keeps `commName`
    /// by pointer and reads it again later (2.28.9 profiler.cc:192, at a split), and a
    /// child split from the handle without a config inherits the pointer, for as long as
    /// the caller keeps them, which this crate cannot see.
    ///
    /// Returns null when the handle is no longer there to give: the watchdog already aborted
    /// it after a timeout (that was its one teardown). A communicator that saw an error is
    /// given back as it is; [`is_failed`](Self::is_failed) says so beforehand, and NCCL
    /// expects such a handle to be aborted. Work it enqueued on CUDA streams is not waited
    /// for (stream order keeps later work behind it).
    ///
    /// ```
    /// use nccl_safe::{Communicator, Config, CommDevice, Library};
    /// let id = CommDevice::Host.unique_id()?;
    /// let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
    /// let raw = comm.into_raw(); // no teardown
    /// assert!(!raw.is_null());
    /// // The caller's now: here it hands it to C, which destroys it.
    /// // SAFETY: `raw` is live and this is its one teardown.
    /// let r = unsafe { (Library::host().table().ncclCommDestroy)(raw) };
    /// assert_eq!(r, nccl_sys::bindings::ncclSuccess);
    /// assert_eq!(nccl_safe::host::stats_for(&id.to_raw()).destroyed, 1);
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[must_use = "the handle is the caller's to tear down; dropping it leaks the communicator"]
    pub fn into_raw(self) -> ncclComm_t {
        self.release_handle()
    }
}

/// A communicator someone else owns, borrowed for `'a`: it runs collectives, point-to-point
/// operations, groups and splits through [`Deref`](std::ops::Deref) to [`Communicator`],
/// and never tears the handle down.
///
/// * **Never destroys, finalizes or aborts.** Dropping the view leaves the handle alone,
///   and the consuming teardowns ([`Communicator::destroy`], [`Communicator::abort`],
///   [`Communicator::finalize`], [`Communicator::into_raw`]) take a `Communicator` by value,
///   which cannot be moved out of a view.
/// * **Cannot outlive the owner.** [`from_raw_borrowed`](Self::from_raw_borrowed) ties the
///   view to a borrow of the owner (whatever keeps the handle alive); the owner cannot be
///   dropped or moved while the view exists.
/// * **The watchdog never aborts it.** When an operation through the view runs out of
///   time, the watchdog marks the view failed (later operations return
///   [`Error::Timeout`](crate::Error::Timeout) with the desync report) and, when
///   configured, dumps the flight record, but the handle is the owner's to abort; a call
///   blocked inside NCCL stays blocked until the owner aborts it (then it returns
///   [`Error::Timeout`](crate::Error::Timeout) with the report).
/// * Like [`Communicator`], `Send` but not `Sync`.
///
/// A child made by [`Communicator::split`] or [`Communicator::shrink`] through a view is a
/// new, owned [`Communicator`].
///
/// ```
/// use nccl_safe::{CommRef, Config, CommDevice, Stream, Library, ReduceOp};
/// let lib = Library::host();
/// let id = CommDevice::Host.unique_id()?;
/// /// What another library hands out: it owns the handle and destroys it.
/// struct Owner(nccl_sys::ncclComm_t);
/// impl Drop for Owner {
///     fn drop(&mut self) {
///         // SAFETY: the owner's handle is live; this is its one teardown.
///         unsafe { (nccl_safe::Library::host().table().ncclCommDestroy)(self.0) };
///     }
/// }
/// let mut raw = std::ptr::null_mut();
/// // SAFETY: `raw` is writable; a one-rank communicator needs no peer.
/// unsafe { (lib.table().ncclCommInitRank)(&mut raw, 1, id.to_raw(), 0) };
/// let owner = Owner(raw);
/// {
///     // SAFETY: `owner` keeps the handle alive and makes no call on it meanwhile.
///     let view = unsafe {
///         CommRef::from_raw_borrowed(&owner, lib, owner.0, CommDevice::Host, &Config::new())?
///     };
///     let mut x = vec![1.0f32; 4];
///     view.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
/// } // the view is gone; the handle is untouched
/// assert_eq!(nccl_safe::host::stats_for(&id.to_raw()).destroyed, 0);
/// drop(owner);
/// assert_eq!(nccl_safe::host::stats_for(&id.to_raw()).destroyed, 1);
/// # Ok::<(), nccl_safe::Error>(())
/// ```
pub struct CommRef<'a> {
    /// Built on a borrowed [`RawComm`], so its `Drop` never tears the handle down.
    comm: Communicator,
    _owner: PhantomData<&'a ()>,
}

impl<'a> CommRef<'a> {
    /// A view of `raw`, which `owner` keeps alive, for as long as `owner` is borrowed.
    ///
    /// `owner` is anything whose life bounds the handle's: the object of the library that
    /// created it, a guard, or the handle itself. Rank, size, blocking-ness, diagnostics
    /// and the device are as in [`Communicator::from_raw`].
    ///
    /// A [`Communicator`] of this crate needs no view: use `&Communicator` (a view beside
    /// it could see its watchdog abort the handle after a timeout).
    ///
    /// # Safety
    ///
    /// * `raw` is a live communicator created through `lib` (the same loaded NCCL: see
    ///   [`Communicator::from_raw`]), and stays live (not destroyed, finalized, aborted or revoked)
    ///   while `owner` is borrowed.
    /// * Nothing calls NCCL on it while the view makes a call: the owner may use it between
    ///   the view's calls on the view's thread, but not from another thread meanwhile.
    /// * `device` is the device it was created on (for CUDA, also checked).
    #[track_caller]
    pub unsafe fn from_raw_borrowed<O: ?Sized>(
        owner: &'a O,
        lib: Arc<Library>,
        raw: ncclComm_t,
        device: CommDevice,
        config: &Config,
    ) -> Result<CommRef<'a>> {
        let _ = owner;
        let comm = wrap(
            "CommRef::from_raw_borrowed",
            RawComm::borrowed(raw, lib),
            device,
            config,
            Location::caller(),
        )?;
        Ok(CommRef {
            comm,
            _owner: PhantomData,
        })
    }
}

impl std::ops::Deref for CommRef<'_> {
    type Target = Communicator;

    fn deref(&self) -> &Communicator {
        &self.comm
    }
}

impl std::fmt::Debug for CommRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CommRef").field(&self.comm).finish()
    }
}

/// A process-unique stand-in for the unique id of a communicator made elsewhere: it keys
/// the wrapped communicator's desync clique (one of its own).
fn foreign_clique_id() -> UniqueId {
    static N: AtomicU64 = AtomicU64::new(0);
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    let tag = b"nccl-safe: a handle made elsewhere";
    bytes[..tag.len()].copy_from_slice(tag);
    let n = N.fetch_add(1, Ordering::Relaxed);
    bytes[64..72].copy_from_slice(&n.to_le_bytes());
    bytes[72..76].copy_from_slice(&std::process::id().to_le_bytes());
    UniqueId::from_bytes(&bytes).expect("UNIQUE_ID_BYTES bytes")
}

/// Wraps `raw`: checks it and the device, reads rank and size, attaches diagnostics. An
/// adopted handle is the watchdog's to abort on a timeout; a borrowed one never is (its
/// diagnostics hold no handle). On an error the handle is left untouched.
fn wrap(
    call: &'static str,
    handle: RawComm,
    device: CommDevice,
    config: &Config,
    caller: &'static Location<'static>,
) -> Result<Communicator> {
    let (raw, lib) = (handle.get(), Arc::clone(handle.lib()));
    let ctx = CallContext {
        comm: raw,
        rank: None,
        caller: Some(caller),
    };
    let shape = (|| {
        if raw.is_null() {
            return Err(invalid(call, "the communicator handle is null"));
        }
        crate::comm::check_device(call, &lib, &device)?;
        crate::diag::check_settings(call, &config.diag, lib.provider())?;
        // A handle made with resource sharing shares an abort flag with its parent and
        // children, which the crate cannot keep apart (see `Config::split_share`).
        if let Some(field) = config.shared_resources() {
            return Err(invalid(call, format!("a communicator made with {field} on shares NCCL's abort flag with its family, whose abort would make its collectives return success without moving data: adopt only one made without resource sharing")));
        }
        // NCCL_COMM_BLOCKING=0 made the handle non-blocking whatever its creator asked,
        // and its ncclCommInitRank returned ncclSuccess with the init still running
        // (init.cc:2055).
        if !config.is_blocking() || nccl_sys::param("NCCL_COMM_BLOCKING") == Some(0) {
            // A borrowed stand-in with diagnostics of its own (none attached), for the
            // wait's polls: its drop leaves the handle alone.
            Communicator::new(
                RawComm::borrowed(raw, Arc::clone(&lib)),
                device.clone(),
                0,
                0,
                crate::diag::CommDiag::for_id(&config.diag, &foreign_clique_id(), 0, 0),
            )
            .wait_ready("ncclCommInitRankConfig", caller, DEFAULT_TIMEOUT)?;
        }
        let (mut rank, mut count): (c_int, c_int) = (-1, -1);
        // SAFETY: the caller guarantees `raw` is a live communicator of `lib`; `rank` and
        // `count` are writable for the calls.
        unsafe {
            nccl_call!(&lib, ncclCommUserRank(raw, &mut rank), ctx)?;
            nccl_call!(&lib, ncclCommCount(raw, &mut count), ctx)?;
        }
        if count < 1 || rank < 0 || rank >= count {
            return Err(invalid(
                call,
                format!("NCCL reports rank {rank} of {count}"),
            ));
        }
        if let CommDevice::Cuda(cuda) = &device {
            let mut dev: c_int = -1;
            // SAFETY: as above; `dev` is writable.
            unsafe { nccl_call!(&lib, ncclCommCuDevice(raw, &mut dev), ctx)? };
            if usize::try_from(dev).ok() != Some(cuda.ordinal()) {
                return Err(invalid(
                    call,
                    format!(
                        "the communicator is on CUDA device {dev}, the context on {}",
                        cuda.ordinal()
                    ),
                ));
            }
        }
        Ok((rank as usize, count as usize))
    })();
    let (rank, world_size) = match shape {
        Ok(s) => s,
        Err(e) => {
            // The handle goes back untouched (still the caller's or its owner's).
            let _ = handle.into_raw();
            return Err(e);
        }
    };
    // The handle the watchdog may take and abort: none for a borrowed one, so a timeout
    // only marks the view failed.
    let watched = if handle.is_owned() {
        raw
    } else {
        std::ptr::null_mut()
    };
    let comm = Communicator::new(
        handle,
        device,
        rank,
        world_size,
        crate::diag::CommDiag::for_id(&config.diag, &foreign_clique_id(), 0, 0),
    );
    let view = crate::diag::CommView {
        raw: watched,
        ..comm.diag_view()
    };
    comm.diag.attach(view);
    Ok(comm)
}

#[cfg(all(test, feature = "host", feature = "diag"))]
mod tests {
    use super::*;
    use crate::{ReduceOp, Stream};

    fn sum(c: &Communicator) {
        let mut x = vec![1.0f32; 4];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
            .unwrap();
    }

    /// `into_raw` and a view's drop leave no diagnostics behind: nothing (the watchdog's
    /// registry, the clique) keeps the communicator's shared state alive.
    #[test]
    fn no_diagnostics_stay_behind() {
        let lib = Library::host();
        let id = CommDevice::Host.unique_id().unwrap();
        let c = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new()).unwrap();
        sum(&c);
        let shared = Arc::downgrade(c.diag.shared(c.diag_view()));
        assert!(shared.upgrade().is_some());
        let raw = c.into_raw();
        assert!(shared.upgrade().is_none());

        let owner = raw as usize;
        // SAFETY: `raw` is live and ours; nothing else uses it while the view exists.
        let view = unsafe {
            CommRef::from_raw_borrowed(
                &owner,
                Arc::clone(&lib),
                raw,
                CommDevice::Host,
                &Config::new(),
            )
        }
        .unwrap();
        sum(&view);
        let shared = Arc::downgrade(view.diag.shared(view.diag_view()));
        drop(view);
        assert!(shared.upgrade().is_none());

        // SAFETY: `raw` is live and ours: its one teardown.
        assert_eq!(
            unsafe { (lib.table().ncclCommDestroy)(raw) },
            nccl_sys::bindings::ncclSuccess
        );
        let st = crate::host::stats_for(&id.to_raw());
        assert_eq!(
            (st.created, st.destroyed, st.aborted, st.misused),
            (1, 1, 0, 0)
        );
    }
}
