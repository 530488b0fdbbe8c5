//! Buffer registration as borrows: [`Registration`] (`ncclCommRegister`, NCCL 2.19+) and
//! [`Window`] (`ncclCommWindowRegister`, NCCL 2.27+).
//!
//! A registration borrows its communicator and, mutably, its buffer, and deregisters on
//! drop exactly once. So the borrow checker forbids what NCCL forbids: tearing the
//! communicator down ([`Communicator::destroy`] takes it by value) or freeing the buffer
//! while it is registered. The registration *is* the buffer for everything else: pass it
//! (`&reg`, `&mut reg`) to any collective, or to cudarc's copies when the buffer is a cudarc
//! one; NCCL finds the registration by address, so a collective needs no extra argument.
//! The buffer itself is not handed out mutably (`mem::swap` or `mem::replace` through
//! it would move the allocation out of the borrow and let it be freed while registered).
//!
//! ```
//! use nccl_launch::Launcher;
//! use nccl_safe::{NcclMemory, ReduceOp, WindowFlags};
//! Launcher::host(2).run(|rank| {
//!     let (comm, s) = (rank.comm(), rank.stream());
//!     let mut grads = NcclMemory::<f32>::alloc_zeros(comm, 1024, s.clone())?;
//!     grads.copy_from_host(&vec![1.0; 1024], s)?;
//!     {
//!         // Collective: every rank registers the same size.
//!         let mut win = comm.register_window(&mut grads, WindowFlags::COLL_SYMMETRIC)?;
//!         comm.all_reduce_in_place(&mut win, ReduceOp::Sum, s)?;
//!         // comm.destroy() or drop(grads) here would not compile.
//!     } // deregistered here, once
//!     assert_eq!(grads.to_vec(s)?[0], 2.0);
//!     Ok(())
//! })?;
//! # Ok::<(), nccl_launch::Error>(())
//! ```
//!
//! Symmetric windows also carry NCCL's one-sided calls (NCCL 2.29+): [`Window::put_signal`]
//! writes into a peer's counterpart of a window, [`Communicator::signal`] signals a peer,
//! and [`Window::wait_signal`] waits for the peers' signals, with the window held mutably
//! while their data lands.
//!
//! On the host provider registration is bookkeeping (counted in `nccl_safe::host::stats`),
//! so every rule here is tested without a GPU.

use std::ffi::{c_int, c_void};
use std::panic::Location;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use nccl_sys::bindings::ncclWindow_t;
use nccl_sys::{ncclComm_t, EntryPoint};

use crate::buffer::{sealed, BufferGuard, Memory, RecvBuffer, SendBuffer};
use crate::comm::{CommDevice, Communicator};
use crate::error::{invalid, Error, Result};
use crate::library::Provider;
use crate::memory::{on_device_lane, NcclMemory};
use crate::ops::Op;
use crate::stream::{AsStream, StreamRef};
use crate::types::NcclType;
use crate::version::Version;

bitflags::bitflags! {
    /// Flags of [`Communicator::register_window`] (`NCCL_WIN_*`). The empty set is
    /// `NCCL_WIN_DEFAULT`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct WindowFlags: c_int {
        /// `NCCL_WIN_COLL_SYMMETRIC` (NCCL 2.27+): every rank registers a buffer of the same
        /// size from NCCL's allocator ([`NcclMemory`]), which lets collectives on it use
        /// NCCL's symmetric-memory kernels.
        const COLL_SYMMETRIC = nccl_sys::bindings::NCCL_WIN_COLL_SYMMETRIC as c_int;
        /// `NCCL_WIN_STRICT_ORDERING` (NCCL 2.30+).
        const STRICT_ORDERING = nccl_sys::bindings::NCCL_WIN_STRICT_ORDERING as c_int;
    }
}

impl WindowFlags {
    /// The newest flag in the set with the release that introduced it, when that is newer
    /// than the window API itself (2.27).
    fn newest(self) -> Option<(&'static str, Version)> {
        if self.contains(WindowFlags::STRICT_ORDERING) {
            Some(("NCCL_WIN_STRICT_ORDERING", Version::new(2, 30, 0)))
        } else {
            None
        }
    }
}

/// A buffer registered with a communicator (`ncclCommRegister`), deregistered
/// (`ncclCommDeregister`) on drop, exactly once. Made by [`Communicator::register`].
///
/// It borrows the communicator and the buffer, so neither can be torn down or freed while it
/// lives, and it stands for the buffer: pass it to collectives (`&reg` as a send buffer,
/// `&mut reg` as a receive buffer) and, for cudarc buffers, to cudarc's copies.
///
/// Deregistration is local, so it also happens after the communicator failed; only a
/// communicator the watchdog already aborted is skipped (NCCL released its registrations
/// with it).
#[must_use = "dropping a Registration deregisters the buffer at once"]
pub struct Registration<'comm, 'buf, B: ?Sized> {
    comm: &'comm Communicator,
    buf: &'buf mut B,
    /// NCCL's handle (null when NCCL chose not to register, e.g. `NCCL_LOCAL_REGISTER=0`).
    handle: *mut c_void,
    /// Whether it still has to be deregistered.
    live: bool,
}

/// A buffer registered as a window (`ncclCommWindowRegister`, a collective: every rank
/// registers), deregistered (`ncclCommWindowDeregister`, also collective) on drop, exactly
/// once. Made by [`Communicator::register_window`]; it stands for the buffer as a
/// [`Registration`] does.
///
/// Deregistration goes through the operation path (watched by the watchdog, and checked by
/// the fingerprint check when it is on). On a communicator that failed it is not attempted
/// (its peers may never join it): [`deregister`](Self::deregister) reports
/// [`Error::CommunicatorFailed`], and NCCL releases the window when the communicator is
/// aborted.
#[must_use = "dropping a Window deregisters it at once"]
pub struct Window<'comm, 'buf, B: ?Sized> {
    comm: &'comm Communicator,
    buf: &'buf mut B,
    /// NCCL's window: without symmetric support (say `NCCL_WIN_ENABLE=0`) the handle of a
    /// local registration (dev_runtime.cc:591-596 of 2.28.9), null when NCCL registered
    /// nothing (`NCCL_LOCAL_REGISTER=0` too).
    win: ncclWindow_t,
    flags: WindowFlags,
    live: bool,
}

impl<B: ?Sized> std::fmt::Debug for Registration<'_, '_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("rank", &self.comm.rank())
            .field("handle", &self.handle)
            .finish()
    }
}

impl<B: ?Sized> std::fmt::Debug for Window<'_, '_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("rank", &self.comm.rank())
            .field("win", &self.win)
            .field("flags", &self.flags)
            .finish()
    }
}

/// Why memory of kind `memory` cannot be registered with a communicator of `provider` on
/// CUDA device `device`; `None` when it can.
fn unregistrable(provider: Provider, device: Option<usize>, memory: Memory) -> Option<String> {
    match (provider, memory) {
        (Provider::Host, Memory::Host) => None,
        (Provider::Nccl, Memory::Device(d)) if Some(d) == device => None,
        (Provider::Nccl, Memory::Device(d)) => Some(format!(
            "the buffer is on CUDA device {d} but the communicator on device {device:?}"
        )),
        (Provider::Nccl, Memory::Host) => {
            Some("the buffer is host memory: NVIDIA's NCCL registers device memory only".into())
        }
        (Provider::Host, Memory::Device(_)) => {
            Some("the buffer is GPU memory, which the host provider cannot use".into())
        }
    }
}

impl Communicator {
    /// The buffer's address and byte size, after checking it is memory this communicator's
    /// NCCL can register: device memory of its device (NVIDIA's NCCL) or host memory (the
    /// host provider), not empty.
    fn registration_target<T: NcclType, B: SendBuffer<T> + ?Sized>(
        &self,
        call: &'static str,
        buf: &B,
    ) -> Result<(*mut c_void, usize)> {
        let reason = unregistrable(self.library().provider(), self.cuda_ordinal(), buf.memory());
        if let Some(reason) = reason {
            return Err(invalid(call, reason));
        }
        if buf.is_empty() {
            return Err(invalid(
                call,
                "the buffer is empty: there is nothing to register",
            ));
        }
        // A buffer that exists cannot overflow its own byte size.
        let bytes = buf.len().saturating_mul(std::mem::size_of::<T>());
        if let CommDevice::Cuda(ctx) = self.device() {
            // Not `bind_to_thread`: the context's recorded error stays the user's.
            crate::stream::make_current(ctx)?;
        }
        Ok((buf.base_ptr().cast_mut(), bytes))
    }

    /// Registers `buf` with this communicator (`ncclCommRegister`, NCCL 2.19+) until the
    /// returned [`Registration`] is dropped, so NCCL can use it without copies (NVLink
    /// SHARP, CollNet, ...). Registration is local: ranks need not register together.
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.19; [`Error::InvalidArgument`] for host
    /// memory on NVIDIA's NCCL, memory of another device, GPU memory on the host provider,
    /// or an empty buffer. A failed registration leaves the communicator usable.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::ReduceOp;
    /// Launcher::host(2).run(|rank| {
    ///     let (comm, s) = (rank.comm(), rank.stream());
    ///     let mut buf = vec![1i32; 8];
    ///     let mut reg = comm.register(&mut buf)?;
    ///     for _ in 0..3 {
    ///         comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, s)?;
    ///     }
    ///     drop(reg); // deregisters; `buf` is free again
    ///     assert_eq!(buf, vec![8; 8]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    pub fn register<'comm, 'buf, T, B>(
        &'comm self,
        buf: &'buf mut B,
    ) -> Result<Registration<'comm, 'buf, B>>
    where
        T: NcclType,
        B: SendBuffer<T> + ?Sized,
    {
        const OP: &str = "ncclCommRegister";
        let caller = Location::caller();
        let lib = self.library();
        let register = lib.optional(lib.table().ncclCommRegister, OP)?;
        lib.optional(lib.table().ncclCommDeregister, "ncclCommDeregister")?;
        self.ensure_usable(OP)?;
        let (ptr, bytes) = self.registration_target::<T, B>(OP, buf)?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // Not `issue`: registration is local (no sequence number, nothing to watch), and a
        // refused registration does not break the communicator. Pinned: the watchdog
        // cannot abort the handle during the call.
        self.pinned(|| {
            // SAFETY: the communicator is live (borrowed, and pinned against the
            // watchdog); `ptr` and `bytes` are the address and size of memory this NCCL can
            // register (checked above), kept alive and in place by the borrow the
            // Registration holds; `handle` is writable.
            let r = unsafe { register(self.as_raw(), ptr, bytes, &mut handle) };
            lib.check(OP, r, self.context(caller))
        })?;
        Ok(Registration {
            comm: self,
            buf,
            handle,
            live: true,
        })
    }

    /// Registers `buf` as a window (`ncclCommWindowRegister`, NCCL 2.27+) until the returned
    /// [`Window`] is dropped. A collective call: every rank registers, in the same order
    /// relative to its collectives (the watchdog and the fingerprint check treat it as
    /// one). [`WindowFlags::COLL_SYMMETRIC`] needs a buffer from NCCL's allocator
    /// ([`NcclMemory`] or a view of one) of the same size on every rank.
    ///
    /// **What every rank must agree on.** NCCL finds a peer's part of a symmetric window
    /// from this rank's own layout: the peer's window of the same registration order, at
    /// this rank's offset into its own (`ncclSymkMakeDevWork`, sym_kernels.cc:372-381;
    /// `ncclDevrGetLsaRankPtr`, dev_runtime.cc:1038-1043 of 2.28.9; the copy-engine
    /// collectives likewise, ce_coll.cc). So every rank registers its windows in the same
    /// order, over allocations of the same size at the same offset, and passes each
    /// collective buffers at the same offsets of the same window; off the root of a gather,
    /// a `recv` laid out as the root's. A rank that does not makes NCCL write into its
    /// peers' windows outside the buffers they passed: memory those peers may hold through
    /// other views. Nothing checks this across ranks, the fingerprint check included. With
    /// `NCCL_CTA_POLICY_ZERO` ([`Config::cta_policy`](crate::Config::cta_policy), or
    /// `NCCL_CTA_POLICY`), all-gather, all-to-all, gather and scatter over symmetric windows
    /// on one node run on the copy engines, each rank choosing from its own buffers: every
    /// rank needs the same policy and the same in-place form, and an empty off-root buffer
    /// of a gather or scatter (passed as null) sends its rank down the other path, which
    /// leaves the collective to the watchdog's timeout.
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.27 (or before the release of a flag);
    /// [`Error::InvalidArgument`] as for [`register`](Self::register), and for a symmetric
    /// window on memory not from `ncclMemAlloc`, or not starting a multiple of 4096 bytes
    /// (`NCCL_WIN_REQUIRED_ALIGNMENT`) into it, which NCCL would refuse only in its job,
    /// failing the communicator.
    #[track_caller]
    pub fn register_window<'comm, 'buf, T, B>(
        &'comm self,
        buf: &'buf mut B,
        flags: WindowFlags,
    ) -> Result<Window<'comm, 'buf, B>>
    where
        T: NcclType,
        B: SendBuffer<T> + ?Sized,
    {
        const CALL: EntryPoint = EntryPoint::ncclCommWindowRegister;
        const OP: &str = CALL.name();
        let caller = Location::caller();
        let lib = self.library();
        let register = lib.optional(lib.table().ncclCommWindowRegister, OP)?;
        lib.optional(
            lib.table().ncclCommWindowDeregister,
            "ncclCommWindowDeregister",
        )?;
        if let Some((flag, needs)) = flags.newest() {
            if lib.version() < needs {
                return Err(Error::Unsupported {
                    symbol: flag,
                    needs,
                    found: lib.version(),
                });
            }
        }
        if flags.contains(WindowFlags::COLL_SYMMETRIC) {
            // NCCL refuses the rest in its job, which fails a non-blocking communicator
            // (dev_runtime.cc:605-611 of 2.28.9).
            const ALIGN: usize = nccl_sys::bindings::NCCL_WIN_REQUIRED_ALIGNMENT as usize;
            let refusal = match buf.nccl_alloc_offset() {
                None => Some(
                    "a symmetric window (WindowFlags::COLL_SYMMETRIC) needs memory from \
                     NCCL's allocator: allocate the buffer as an NcclMemory"
                        .to_string(),
                ),
                Some(at) if at % ALIGN != 0 => Some(format!(
                    "a symmetric window must start a multiple of {ALIGN} bytes into its \
                     NcclMemory (NCCL_WIN_REQUIRED_ALIGNMENT); this one starts {at} bytes in"
                )),
                Some(_) => None,
            };
            if let Some(reason) = refusal {
                return Err(invalid(OP, reason));
            }
        }
        self.ensure_usable(OP)?;
        let (ptr, bytes) = self.registration_target::<T, B>(OP, buf)?;
        // NCCL's group thread writes the window at the end of its job, after the call
        // returned ncclSuccess (dev_runtime.cc:891-922, 533): a heap out-pointer, read once the
        // communicator left ncclInProgress (see `Communicator::issue_job`).
        let dest = crate::comm::AsyncOut::new();
        let out = dest.out();
        let mut win: ncclWindow_t = std::ptr::null_mut();
        let r = self.issue_job(
            CALL,
            caller,
            |_, comm| {
                // SAFETY: as in `register`; `out` is the heap out-pointer the job writes, alive
                // until the job ended (else leaked); the flags are NCCL_WIN_* bits this
                // NCCL knows (checked above).
                unsafe { register(comm, ptr, bytes, out, flags.bits()) }
            },
            || {
                win = dest.take();
                Ok(())
            },
        );
        if let Err(e) = r {
            // A job that may still be running keeps its out-pointer; one that ended failed the
            // communicator, whose abort releases what it registered.
            if !self.job_ended() {
                dest.leak();
            }
            return Err(e);
        }
        Ok(Window {
            comm: self,
            buf,
            win,
            flags,
            live: true,
        })
    }
}

impl<B: ?Sized> Registration<'_, '_, B> {
    /// NCCL's registration handle (null when NCCL chose not to register the buffer).
    pub fn as_raw(&self) -> *mut c_void {
        self.handle
    }

    /// Deregisters now (`ncclCommDeregister`), reporting an error that drop would ignore.
    #[track_caller]
    pub fn deregister(mut self) -> Result<()> {
        self.release(Location::caller())
    }

    fn release(&mut self, caller: &'static Location<'static>) -> Result<()> {
        const OP: &str = "ncclCommDeregister";
        if !deregister_now(&mut self.live, self.comm, OP) {
            return Ok(());
        }
        // A communicator the watchdog aborted has no handle left: NCCL released its
        // registrations with it.
        self.comm.diag.check_alive()?;
        let lib = self.comm.library();
        let deregister = lib.optional(lib.table().ncclCommDeregister, OP)?;
        let handle = self.handle;
        let CommDevice::Cuda(ctx) = self.comm.device() else {
            return self.comm.pinned(|| {
                // SAFETY: the communicator is live (borrowed, and pinned against the
                // watchdog); `handle` came from its ncclCommRegister and is deregistered
                // exactly once (`live` was cleared above).
                let r = unsafe { deregister(self.comm.as_raw(), handle) };
                lib.check(OP, r, self.comm.context(caller))
            });
        };
        // On a GPU, NCCL releases the registration's mappings through the driver, which may
        // wait for the device's work: the call runs on the device's teardown lane, bounded
        // by the communicator's abort timeout. Past it the communicator is marked failed,
        // so its teardown (an abort, queued on the same lane behind this call, never beside
        // it) releases the rest, and this returns.
        let what = format!("ncclCommDeregister on CUDA device {}", ctx.ordinal());
        let then = "left to the background, and the communicator is failed";
        self.comm.pinned(|| {
            let (raw, handle) = (self.comm.as_raw() as usize, handle as usize);
            // SAFETY: the communicator is live: it was pinned when this was queued, and any
            // teardown of it runs on this lane after this call; `handle` came from its
            // ncclCommRegister and is deregistered exactly once.
            let call = move || unsafe { deregister(raw as ncclComm_t, handle as *mut c_void) };
            let b = self.comm.diag.bound();
            match on_device_lane(Arc::clone(ctx), b, what, then, call) {
                Ok(r) => lib.check(OP, r, self.comm.context(caller)),
                Err(e) => {
                    self.comm.mark_failed(&e);
                    Err(e)
                }
            }
        })
    }
}

impl<B: ?Sized> Drop for Registration<'_, '_, B> {
    fn drop(&mut self) {
        let _ = self.release(Location::caller());
    }
}

impl<B: ?Sized> Window<'_, '_, B> {
    /// The flags it was registered with.
    pub fn flags(&self) -> WindowFlags {
        self.flags
    }

    /// NCCL's window handle, for NCCL's one-sided API. Without symmetric support on this
    /// system NCCL returns its local registration's handle instead (dev_runtime.cc:591-596
    /// of 2.28.9), and null when it registered nothing.
    pub fn as_raw(&self) -> ncclWindow_t {
        self.win
    }

    /// Deregisters now (`ncclCommWindowDeregister`, collective), reporting an error that
    /// drop would ignore.
    #[track_caller]
    pub fn deregister(mut self) -> Result<()> {
        self.release(Location::caller(), false)
    }

    /// Deregisters (`dropping`: from `Drop`, bounded by the abort timeout).
    fn release(&mut self, caller: &'static Location<'static>, dropping: bool) -> Result<()> {
        const CALL: EntryPoint = EntryPoint::ncclCommWindowDeregister;
        const OP: &str = CALL.name();
        if !deregister_now(&mut self.live, self.comm, OP) {
            return Ok(());
        }
        // Dropped: NCCL's deregistration unmaps through the driver, behind the
        // communicator's work, so a drop behind work that does not complete (a stalled
        // stream, a missing peer) would wait as long as that work. Like the communicator's
        // own drop, it waits for that work up to the abort timeout; past it the
        // deregistration is skipped and the communicator failed (its abort, when it is
        // dropped, releases the window).
        if dropping {
            self.comm.ensure_usable_for(CALL)?;
            let bound = self.comm.diag.abort_timeout();
            if !self.comm.diag.drain(std::time::Instant::now() + bound) {
                let e = Error::Timeout {
                    what: format!(
                        "{OP} on rank {} skipped: the communicator's work did not complete within the abort timeout (Config::abort_timeout), and the deregistration would wait behind it; the communicator is failed, and its abort releases the window",
                        self.comm.rank()
                    ),
                    timeout: bound,
                };
                self.comm.mark_failed(&e);
                return Err(e);
            }
        }
        let lib = self.comm.library();
        let deregister = lib.optional(lib.table().ncclCommWindowDeregister, OP)?;
        let win = self.win;
        // Through the operation path: it is collective, so a failed communicator (whose
        // peers may never call it) skips it, and the watchdog bounds it.
        self.comm.issue(CALL, caller, |_, comm| {
            // SAFETY: the communicator is live; `win` came from its ncclCommWindowRegister
            // and is deregistered exactly once (`live` was cleared above).
            unsafe { deregister(comm, win) }
        })
    }
}

impl<B: ?Sized> Drop for Window<'_, '_, B> {
    fn drop(&mut self) {
        let _ = self.release(Location::caller(), true);
    }
}

/// A signal of NCCL's one-sided calls ([`Window::put_signal`], [`Communicator::signal`],
/// [`Window::wait_signal`]): its index and its context. NCCL 2.29 and 2.30 accept index 0
/// of context 0 only (`rmaTaskAppend`, enqueue.cc:2825-2838 of 2.30.7); any other is
/// refused before NCCL sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Signal {
    /// The signal index (`sigIdx`).
    pub index: u32,
    /// The context (`ctx`).
    pub ctx: u32,
}

impl Signal {
    /// Index 0 of context 0, the one signal NCCL 2.29-2.30 has.
    pub const DEFAULT: Signal = Signal { index: 0, ctx: 0 };

    /// `(sigIdx, ctx)` for NCCL, or the typed error of a signal NCCL does not have.
    fn raw(self, call: &'static str) -> Result<(c_int, c_int)> {
        if self != Signal::DEFAULT {
            return Err(invalid(
                call,
                format!(
                    "signal index {} of context {}: NCCL 2.29-2.30 has signal index 0 of context 0 only",
                    self.index, self.ctx
                ),
            ));
        }
        Ok((0, 0))
    }
}

/// What [`Window::wait_signal`] waits for: `count` signals from rank `peer` on `signal`
/// (one `ncclWaitSignalDesc_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SignalWait {
    /// The rank whose puts and signals are counted.
    pub peer: usize,
    /// How many (at least 1).
    pub count: u32,
    /// On which signal.
    pub signal: Signal,
}

impl SignalWait {
    /// `count` signals from `peer` on [`Signal::DEFAULT`].
    pub fn new(peer: usize, count: u32) -> SignalWait {
        SignalWait {
            peer,
            count,
            signal: Signal::DEFAULT,
        }
    }
}

impl Communicator {
    /// `rank` as the peer of a one-sided call, or [`Error::RankOutOfRange`].
    fn one_sided_peer(&self, call: &'static str, rank: usize) -> Result<c_int> {
        if rank < self.world_size() {
            return Ok(rank as c_int);
        }
        Err(Error::RankOutOfRange {
            call,
            what: "peer",
            rank,
            world_size: self.world_size(),
        })
    }

    /// Sends `signal` to rank `peer` without data (`ncclSignal`, NCCL 2.29+), ordered on
    /// `stream` after this rank's earlier puts to it: the peer's [`Window::wait_signal`]
    /// counts it as it counts a put's.
    ///
    /// Errors, before NCCL sees the call: [`Error::Unsupported`] before NCCL 2.29;
    /// [`Error::RankOutOfRange`] for a peer outside the communicator;
    /// [`Error::InvalidArgument`] for a signal NCCL does not have (see [`Signal`]) or a
    /// stream of another device. As any operation, a failed or revoked communicator is
    /// refused.
    #[track_caller]
    pub fn signal(&self, peer: usize, signal: Signal, stream: &impl AsStream) -> Result<()> {
        self.signal_op(peer, signal, stream)?.run()
    }

    /// [`signal`](Self::signal) described, for [`Op::run`] or a [`Group`](crate::Group),
    /// which makes it at its end with the group's other operations (NCCL plans a group's
    /// puts and signals together).
    #[track_caller]
    pub fn signal_op<'a>(
        &'a self,
        peer: usize,
        signal: Signal,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>> {
        const CALL: EntryPoint = EntryPoint::ncclSignal;
        const OP: &str = CALL.name();
        let caller = Location::caller();
        let lib = self.library();
        lib.optional(lib.table().ncclSignal, OP)?;
        self.ensure_usable_for(CALL)?;
        let stream = stream.as_stream();
        self.check_stream(OP, stream)?;
        self.one_sided_peer(OP, peer)?;
        signal.raw(OP)?;
        let info = crate::diag::OpInfo::one_sided(CALL, None, 0, Some(peer), stream);
        // The peer is in range and the signal the one NCCL has (checked above).
        let none = (std::ptr::null(), BufferGuard::Host);
        Ok(Op::one_sided(
            self,
            none,
            std::ptr::null_mut(),
            0,
            info,
            caller,
        ))
    }
}

impl<'comm, B: ?Sized> Window<'comm, '_, B> {
    /// Writes elements `src_range` of the window `src` into rank `peer`'s counterpart of
    /// this window, starting `offset` elements into it, then signals the peer
    /// (`ncclPutSignal`, NCCL 2.29+): a one-sided write that the peer does not match with a
    /// receive; its [`wait_signal`](Self::wait_signal) counts the signal, and the data is
    /// there when that wait returns.
    ///
    /// **Which window is written.** NCCL finds the peer's window from this rank's: its
    /// counterpart of the same registration order. Both windows must be
    /// [`WindowFlags::COLL_SYMMETRIC`], which every rank registers over buffers of the same
    /// size, so `offset + src_range.len()` is checked against this window's length; the
    /// element type is the windows' own (`T` of both buffers). As for the collectives on
    /// symmetric windows, nothing checks across ranks that they registered the same sizes
    /// in the same order (see [`Communicator::register_window`]).
    ///
    /// **Borrows.** `src` is read on `stream` after the call returns; it is borrowed for the
    /// call, and its buffer's guard (cudarc's event tracking, or NCCL memory freed behind
    /// the stream) orders later writes and its free behind the read, as for a collective's
    /// send buffer. Nothing else is left in NCCL's hands: `mem::forget` of either window
    /// leaks its registration, never its memory.
    ///
    /// Errors, before NCCL sees the call: [`Error::Unsupported`] before NCCL 2.29;
    /// [`Error::RankOutOfRange`] for a peer outside the communicator;
    /// [`Error::InvalidArgument`] for a range past `src`'s end, a put past the end of this
    /// window, a window that is not symmetric (or that NCCL registered as nothing), windows
    /// of two communicators, a signal NCCL does not have (see [`Signal`]), or a stream of
    /// another device.
    ///
    /// ```
    /// use nccl_launch::Launcher;
    /// use nccl_safe::{NcclMemory, SignalWait, Signal, WindowFlags};
    /// Launcher::host(2).run(|rank| {
    ///     let (comm, s) = (rank.comm(), rank.stream());
    ///     let (me, peer) = (rank.rank(), 1 - rank.rank());
    ///     let mut src = NcclMemory::<f32>::alloc_zeros(comm, 1024, s.clone())?;
    ///     src.copy_from_host(&vec![me as f32; 1024], s)?;
    ///     let mut dst = NcclMemory::<f32>::alloc_zeros(comm, 1024, s.clone())?;
    ///     let src = comm.register_window(&mut src, WindowFlags::COLL_SYMMETRIC)?;
    ///     let mut dst = comm.register_window(&mut dst, WindowFlags::COLL_SYMMETRIC)?;
    ///     // Elements 0..4 of my source into the peer's `dst`, at element 8.
    ///     dst.put_signal(&src, 0..4, peer, 8, Signal::DEFAULT, s)?;
    ///     dst.wait_signal(&[SignalWait::new(peer, 1)], s)?;
    ///     assert_eq!(dst.buffer().to_vec(s)?[8..12], [peer as f32; 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), nccl_launch::Error>(())
    /// ```
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    pub fn put_signal<T, S>(
        &self,
        src: &Window<'_, '_, S>,
        src_range: std::ops::Range<usize>,
        peer: usize,
        offset: usize,
        signal: Signal,
        stream: &impl AsStream,
    ) -> Result<()>
    where
        T: NcclType,
        B: SendBuffer<T>,
        S: SendBuffer<T> + ?Sized,
    {
        self.put_signal_op(src, src_range, peer, offset, signal, stream)?
            .run()
    }

    /// [`put_signal`](Self::put_signal) described, for [`Op::run`] or a
    /// [`Group`](crate::Group), which makes it at its end with the group's other operations
    /// (puts to several peers planned together, as NCCL does). The [`Op`] borrows both
    /// windows until it has run, so neither can be deregistered or freed before the group's
    /// end.
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    pub fn put_signal_op<'a, T, S>(
        &'a self,
        src: &'a Window<'_, '_, S>,
        src_range: std::ops::Range<usize>,
        peer: usize,
        offset: usize,
        signal: Signal,
        stream: &'a impl AsStream,
    ) -> Result<Op<'a>>
    where
        T: NcclType,
        B: SendBuffer<T>,
        S: SendBuffer<T> + ?Sized,
    {
        const CALL: EntryPoint = EntryPoint::ncclPutSignal;
        const OP: &str = CALL.name();
        let caller = Location::caller();
        let comm = self.comm;
        let lib = comm.library();
        lib.optional(lib.table().ncclPutSignal, OP)?;
        comm.ensure_usable_for(CALL)?;
        let stream = stream.as_stream();
        comm.check_stream(OP, stream)?;
        T::DATA_TYPE.check_supported(lib)?;
        comm.one_sided_peer(OP, peer)?;
        signal.raw(OP)?;
        if !std::ptr::eq(src.comm, comm) {
            return Err(invalid(
                OP,
                "the source window is registered with another communicator than the target window",
            ));
        }
        for (what, w) in [("target", self.flags), ("source", src.flags)] {
            if !w.contains(WindowFlags::COLL_SYMMETRIC) {
                return Err(invalid(OP, format!(
                    "the {what} window is not symmetric: one-sided puts need windows registered with WindowFlags::COLL_SYMMETRIC"
                )));
            }
        }
        if self.win.is_null() {
            return Err(invalid(
                OP,
                "NCCL registered nothing for the target window (no symmetric memory support)",
            ));
        }
        let (src_len, dst_len) = (SendBuffer::len(src), SendBuffer::len(self));
        if src_range.start > src_range.end || src_range.end > src_len {
            return Err(invalid(
                OP,
                format!(
                    "source range {src_range:?} is outside the source window's {src_len} elements"
                ),
            ));
        }
        let count = src_range.len();
        if offset.checked_add(count).is_none_or(|end| end > dst_len) {
            return Err(invalid(OP, format!(
                "a put of {count} elements at element {offset} ends past the window's end ({dst_len} elements)"
            )));
        }
        comm.check_memory(OP, crate::error::BufferRole::Send, src.memory())?;
        let size = std::mem::size_of::<T>();
        let (base, guard) = src.send_ptr(stream);
        let local = base
            .cast::<u8>()
            .wrapping_add(src_range.start * size)
            .cast::<c_void>();
        // The source range and the target's end were checked against both windows, the
        // peer and the signal (the one NCCL has) too; the Op keeps the source's guard and
        // both windows borrowed until it ran.
        let info =
            crate::diag::OpInfo::one_sided(CALL, Some(T::DATA_TYPE), count, Some(peer), stream);
        Ok(Op::one_sided(
            comm,
            (local, guard),
            self.win.cast(),
            offset * size,
            info,
            caller,
        ))
    }

    /// Makes `stream` wait until the signals in `waits` have arrived (`ncclWaitSignal`,
    /// NCCL 2.29+): `count` from each `peer`, counting their puts into any window of this
    /// communicator and their [`Communicator::signal`]s. After it, the data of the counted
    /// puts into this window is in it, on `stream`.
    ///
    /// It takes the window mutably, so no reference into its buffer lives while peers'
    /// data lands. The host provider lands data only in this window during the call (data
    /// of counted puts into another window lands in the next wait on that window); NVIDIA's
    /// NCCL writes device memory, which no Rust reference sees.
    ///
    /// A wait for signals that never come is a stuck operation like any other: the
    /// watchdog's timeout fails the communicator.
    ///
    /// Errors, before NCCL sees the call: [`Error::Unsupported`] before NCCL 2.29;
    /// [`Error::RankOutOfRange`] for a peer outside the communicator;
    /// [`Error::InvalidArgument`] for no waits, a count of 0 or above `i32::MAX`, a signal
    /// NCCL does not have (see [`Signal`]), or a stream of another device.
    #[track_caller]
    pub fn wait_signal(&mut self, waits: &[SignalWait], stream: &impl AsStream) -> Result<()> {
        const CALL: EntryPoint = EntryPoint::ncclWaitSignal;
        const OP: &str = CALL.name();
        let caller = Location::caller();
        let comm = self.comm;
        let lib = comm.library();
        let f = lib.optional(lib.table().ncclWaitSignal, OP)?;
        comm.ensure_usable_for(CALL)?;
        let stream = stream.as_stream();
        comm.check_stream(OP, stream)?;
        if waits.is_empty() || waits.len() > c_int::MAX as usize {
            return Err(invalid(
                OP,
                format!("{} waits: give 1 to {}", waits.len(), c_int::MAX),
            ));
        }
        let mut descs = Vec::with_capacity(waits.len());
        for w in waits {
            let peer = comm.one_sided_peer(OP, w.peer)?;
            let (sig_idx, ctx) = w.signal.raw(OP)?;
            if w.count == 0 || w.count > c_int::MAX as u32 {
                return Err(invalid(
                    OP,
                    format!(
                        "a wait for {} signals from peer {}: the count is 1 to {}",
                        w.count,
                        w.peer,
                        c_int::MAX
                    ),
                ));
            }
            descs.push(nccl_sys::bindings::ncclWaitSignalDesc_t {
                opCnt: w.count as c_int,
                peer,
                sigIdx: sig_idx,
                ctx,
            });
        }
        let (n, ptr) = (descs.len() as c_int, descs.as_mut_ptr());
        let win = self.win;
        let info = crate::diag::OpInfo::one_sided(CALL, None, 0, None, stream);
        comm.issue(info, caller, |_, raw| {
            // SAFETY: the communicator is live; `descs` holds `n` checked descriptors,
            // which NCCL copies during the call (enqueue.cc:2942-2948 of 2.30.7).
            let make = || unsafe { f(n, ptr, raw, stream.raw()) };
            #[cfg(feature = "host")]
            return crate::host::with_caller(caller, || crate::host::with_landing(win, make));
            #[cfg(not(feature = "host"))]
            {
                let _ = win;
                make()
            }
        })
    }
}

/// Whether a registration still to deregister (`live`, cleared here) is deregistered now:
/// not during a panic, when `comm` is marked failed instead and its abort releases the
/// registration (a window's peers may never reach its collective deregistration).
fn deregister_now(live: &mut bool, comm: &Communicator, call: &'static str) -> bool {
    if !std::mem::replace(live, false) {
        return false;
    }
    if std::thread::panicking() {
        let why = "dropped while its thread panicked: skipped, and the communicator is aborted when dropped";
        comm.mark_failed(&invalid(call, why));
        return false;
    }
    true
}

/// Buffer behaviour shared by [`Registration`] and [`Window`]: they stand for their buffer.
macro_rules! stands_for_buffer {
    ($($ty:ident),*) => {$(
        impl<B: ?Sized> sealed::Sealed for $ty<'_, '_, B> {}

        impl<T: NcclType, B: SendBuffer<T> + ?Sized> SendBuffer<T> for $ty<'_, '_, B> {
            fn len(&self) -> usize {
                self.buf.len()
            }
            fn memory(&self) -> Memory {
                self.buf.memory()
            }
            fn send_ptr<'a>(&'a self, stream: StreamRef<'a>) -> (*const c_void, BufferGuard<'a>) {
                self.buf.send_ptr(stream)
            }
            fn base_ptr(&self) -> *const c_void {
                self.buf.base_ptr()
            }
            fn nccl_alloc_offset(&self) -> Option<usize> {
                self.buf.nccl_alloc_offset()
            }
        }

        impl<T: NcclType, B: RecvBuffer<T> + ?Sized> RecvBuffer<T> for $ty<'_, '_, B> {
            fn recv_ptr<'a>(&'a mut self, stream: StreamRef<'a>) -> (*mut c_void, BufferGuard<'a>) {
                self.buf.recv_ptr(stream)
            }
        }

        impl<T, B: DeviceSlice<T> + ?Sized> DeviceSlice<T> for $ty<'_, '_, B> {
            fn len(&self) -> usize {
                self.buf.len()
            }
            fn stream(&self) -> &Arc<CudaStream> {
                self.buf.stream()
            }
        }

        impl<T, B: DevicePtr<T> + ?Sized> DevicePtr<T> for $ty<'_, '_, B> {
            fn device_ptr<'a>(
                &'a self,
                stream: &'a CudaStream,
            ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
                self.buf.device_ptr(stream)
            }
        }

        impl<T, B: DevicePtrMut<T> + ?Sized> DevicePtrMut<T> for $ty<'_, '_, B> {
            fn device_ptr_mut<'a>(
                &'a mut self,
                stream: &'a CudaStream,
            ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
                self.buf.device_ptr_mut(stream)
            }
        }

        impl<B: ?Sized> $ty<'_, '_, B> {
            /// The registered buffer.
            pub fn buffer(&self) -> &B {
                self.buf
            }

            /// The communicator it is registered with.
            pub fn communicator(&self) -> &Communicator {
                self.comm
            }

            /// The buffer's elements, mutably, for host buffers (`Vec<T>`, `[T]`): writing
            /// them cannot move the allocation.
            pub fn as_mut_slice<T>(&mut self) -> &mut [T]
            where
                B: AsMut<[T]>,
            {
                self.buf.as_mut()
            }
        }

        impl<T: NcclType> $ty<'_, '_, NcclMemory<T>> {
            /// [`NcclMemory::copy_from_host`] on the registered memory.
            pub fn copy_from_host(&mut self, src: &[T], stream: &impl AsStream) -> Result<()> {
                self.buf.copy_from_host(src, stream)
            }

            /// [`NcclMemory::slice_mut`] of the registered memory.
            pub fn slice_mut(
                &mut self,
                range: impl std::ops::RangeBounds<usize>,
            ) -> Result<crate::memory::NcclViewMut<'_, T>> {
                self.buf.slice_mut(range)
            }

            /// [`NcclMemory::as_host_slice_mut`] of the registered memory.
            pub fn as_host_slice_mut(&mut self) -> Result<&mut [T]> {
                self.buf.as_host_slice_mut()
            }
        }
    )*};
}

stands_for_buffer!(Registration, Window);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_memory_of_the_communicators_kind_and_device_is_registrable() {
        let nccl = Provider::Nccl;
        assert_eq!(unregistrable(nccl, Some(1), Memory::Device(1)), None);
        assert_eq!(unregistrable(Provider::Host, None, Memory::Host), None);
        let host_on_nccl = unregistrable(nccl, Some(0), Memory::Host).unwrap();
        assert!(host_on_nccl.contains("host memory"), "{host_on_nccl}");
        let other = unregistrable(nccl, Some(0), Memory::Device(3)).unwrap();
        assert!(
            other.contains("device 3") && other.contains("Some(0)"),
            "{other}"
        );
        let gpu_on_host = unregistrable(Provider::Host, None, Memory::Device(0)).unwrap();
        assert!(gpu_on_host.contains("GPU memory"), "{gpu_on_host}");
    }
}
