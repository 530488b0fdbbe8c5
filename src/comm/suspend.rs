//! Suspend and resume as a type state ([`Communicator::suspend`],
//! [`SuspendedCommunicator::resume`], `ncclCommSuspend`/`ncclCommResume`, NCCL 2.30) and the
//! memory figures NCCL reports ([`Communicator::mem_stats`], `ncclCommMemStats`, 2.30).
//!
//! What NCCL does in each call, read from its source (`src/mem_manager.cc` at tag
//! `v2.30.7-1`), is in ARCHITECTURE.md's table ("NCCL's asynchronous contract").

use std::ffi::c_int;

use super::*;
use nccl_sys::EntryPoint;

/// How much device memory a communicator's NCCL holds (`ncclCommMemStats`, NCCL 2.30+), in
/// bytes, as NCCL's memory manager counts its own allocations (mem_manager.cc:1009-1047 of
/// 2.30.7).
///
/// NCCL's counters are what was allocated, and a suspend leaves them as they are: only
/// [`suspended`](Self::suspended) says the [`suspendable`](Self::suspendable) part was
/// released. [`resident`](Self::resident) is what the device holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemStats {
    /// Everything NCCL allocated for the communicator (`ncclStatGpuMemTotal`).
    pub total: u64,
    /// The part a suspend keeps (`ncclStatGpuMemPersist`).
    pub persistent: u64,
    /// The part a suspend releases (`ncclStatGpuMemSuspend`: scratch and offloaded
    /// buffers).
    pub suspendable: u64,
    /// Whether that part is released now (`ncclStatGpuMemSuspended`).
    pub suspended: bool,
}

impl MemStats {
    /// The bytes the device holds for the communicator now: [`total`](Self::total), less
    /// [`suspendable`](Self::suspendable) while [`suspended`](Self::suspended).
    pub fn resident(&self) -> u64 {
        if self.suspended {
            self.total.saturating_sub(self.suspendable)
        } else {
            self.total
        }
    }
}

/// A communicator whose NCCL memory is released ([`Communicator::suspend`]): it runs no
/// collective and registers no memory (it has no such methods), until
/// [`resume`](Self::resume) gives the [`Communicator`] back.
///
/// Teardown is exactly once, as a [`Communicator`]'s: dropping it destroys a healthy one
/// and aborts one that saw an error; [`abort`](Self::abort) and [`destroy`](Self::destroy)
/// consume it. Nothing is in flight on it (its suspend waited for every rank), so the
/// watchdog has nothing to time out.
#[derive(Debug)]
pub struct SuspendedCommunicator {
    comm: Communicator,
}

impl Communicator {
    /// Releases NCCL's device memory of this communicator (`ncclCommSuspend` with
    /// `NCCL_SUSPEND_MEM`, NCCL 2.30+), for another job to use the same GPUs until
    /// [`SuspendedCommunicator::resume`]. Collective over all its ranks: NCCL's suspend waits
    /// for the device and meets every rank in a barrier (mem_manager.cc:417-418 of 2.30.7),
    /// watched by the watchdog as any operation.
    ///
    /// Taking `self` is what makes the rules hold: a suspended communicator has no
    /// collectives, and while a [`Registration`](crate::Registration) or
    /// [`Window`](crate::Window) borrows this communicator it cannot be suspended (the
    /// compiler refuses the move).
    ///
    /// Errors (the communicator comes back with the error): [`Error::Unsupported`] before
    /// NCCL 2.30 (nothing is called); [`Error::CommunicatorFailed`] for one that already
    /// failed; NCCL's error (say `ncclInvalidUsage` under `NCCL_DISABLE_MEM_MANAGER=1`) or
    /// the watchdog's [`Error::Timeout`] when a peer never suspends, which mark it failed,
    /// so that dropping it aborts.
    ///
    /// ```
    /// use nccl_safe::{Communicator, Config, CommDevice, Stream, ReduceOp};
    /// let id = CommDevice::Host.unique_id()?;
    /// std::thread::scope(|s| {
    ///     let ranks: Vec<_> = (0..2).map(|rank| {
    ///         s.spawn(move || -> nccl_safe::Result<()> {
    ///             let comm = Communicator::init_rank(&CommDevice::Host, 2, rank, &id, &Config::new())?;
    ///             let before = comm.mem_stats()?;
    ///             let suspended = comm.suspend().map_err(|(_, e)| e)?;
    ///             assert!(suspended.mem_stats()?.resident() < before.resident());
    ///             let comm = suspended.resume().map_err(|(_, e)| e)?;
    ///             let mut x = vec![1.0f32; 4];
    ///             comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)?;
    ///             assert_eq!(x, vec![2.0; 4]);
    ///             Ok(())
    ///         })
    ///     }).collect();
    ///     ranks.into_iter().try_for_each(|r| r.join().unwrap())
    /// })?;
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    #[allow(clippy::result_large_err)] // the communicator comes back, as with `destroy`
    pub fn suspend(self) -> std::result::Result<SuspendedCommunicator, (Communicator, Error)> {
        match self.mem_task(EntryPoint::ncclCommSuspend, Location::caller()) {
            Ok(()) => Ok(SuspendedCommunicator { comm: self }),
            Err(e) => Err((self, e)),
        }
    }

    /// `ncclCommSuspend(NCCL_SUSPEND_MEM)` or `ncclCommResume` through the one checked path
    /// of a job (NCCL runs either as a task of the call's group and, on the non-blocking
    /// communicator the crate makes, returns ncclInProgress until it ends: mem_manager.cc:
    /// 956-960, 998-1002).
    fn mem_task(&self, call: EntryPoint, caller: &'static Location<'static>) -> Result<()> {
        let op = call.name();
        let f = if call == EntryPoint::ncclCommSuspend {
            let suspend = self.optional(|t| t.ncclCommSuspend, op)?;
            // SAFETY (of the call below): the handle is live (issue pins it); the flag
            // is the only one NCCL defines.
            Ok(move |comm| unsafe { suspend(comm, nccl_sys::bindings::NCCL_SUSPEND_MEM as c_int) })
        } else {
            Err(self.optional(|t| t.ncclCommResume, op)?)
        };
        crate::teardown::check_lane(op, self.lane())?;
        self.issue_job(
            call,
            caller,
            |_, comm| match f {
                Ok(suspend) => suspend(comm),
                // SAFETY: the handle is live (issue pins it).
                Err(resume) => unsafe { resume(comm) },
            },
            || Ok(()),
        )
    }

    /// How much device memory NCCL holds for this communicator (`ncclCommMemStats`, NCCL
    /// 2.30+; four calls, one per figure). No NCCL call on a failed communicator.
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.30; [`Error::CommunicatorFailed`] for
    /// a failed one; NCCL's `ncclInvalidUsage` under `NCCL_DISABLE_MEM_MANAGER=1`.
    #[track_caller]
    pub fn mem_stats(&self) -> Result<MemStats> {
        const OP: &str = EntryPoint::ncclCommMemStats.name();
        let caller = Location::caller();
        let stats = self.optional(|t| t.ncclCommMemStats, OP)?;
        self.ensure_usable(OP)?;
        use nccl_sys::bindings::{
            ncclStatGpuMemPersist, ncclStatGpuMemSuspend, ncclStatGpuMemSuspended,
            ncclStatGpuMemTotal,
        };
        let read = |stat| -> Result<u64> {
            let mut value = 0u64;
            let r = self.pinned(|| {
                // SAFETY: the handle is live (pinned); `value` is a valid out-pointer that
                // NCCL writes before it returns (mem_manager.cc:1029-1043 of 2.30.7).
                Ok(unsafe { stats(self.handle.get(), stat, &mut value) })
            })?;
            if r != ncclSuccess {
                // A refusal changes nothing in the communicator (mem_manager.cc:1013-1020).
                return Err(self.nccl_error(OP, r, caller));
            }
            Ok(value)
        };
        Ok(MemStats {
            total: read(ncclStatGpuMemTotal)?,
            persistent: read(ncclStatGpuMemPersist)?,
            suspendable: read(ncclStatGpuMemSuspend)?,
            suspended: read(ncclStatGpuMemSuspended)? != 0,
        })
    }
}

impl SuspendedCommunicator {
    /// Gives NCCL its memory back (`ncclCommResume`, NCCL 2.30+) and the communicator with
    /// it. Collective over all its ranks, as the suspend: NCCL re-imports its peers' buffers
    /// and meets every rank (its allgather and barrier, mem_manager.cc:687, 896 of 2.30.7).
    ///
    /// Errors (the suspended communicator comes back with the error, marked failed, so
    /// that dropping it aborts): NCCL's error, or the watchdog's [`Error::Timeout`] when a
    /// peer never resumes.
    #[track_caller]
    #[allow(clippy::result_large_err)] // the communicator comes back, as with `destroy`
    pub fn resume(self) -> std::result::Result<Communicator, (SuspendedCommunicator, Error)> {
        match self
            .comm
            .mem_task(EntryPoint::ncclCommResume, Location::caller())
        {
            Ok(()) => Ok(self.comm),
            Err(e) => Err((self, e)),
        }
    }

    /// As [`Communicator::mem_stats`]: [`MemStats::suspended`] is true.
    #[track_caller]
    pub fn mem_stats(&self) -> Result<MemStats> {
        self.comm.mem_stats()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The device this rank runs on.
    pub fn device(&self) -> &CommDevice {
        self.comm.device()
    }

    /// Whether an error was seen (drop will abort). No NCCL call.
    pub fn is_failed(&self) -> bool {
        self.comm.is_failed()
    }

    /// Aborts it (`ncclCommAbort`), as [`Communicator::abort`].
    #[track_caller]
    pub fn abort(self) -> Result<()> {
        self.comm.abort()
    }

    /// Destroys it (`ncclCommDestroy`), as [`Communicator::destroy`]; on failure the
    /// suspended communicator comes back with the error (marked failed: dropping it aborts).
    #[track_caller]
    #[allow(clippy::result_large_err)] // the shape of `Communicator::destroy`
    pub fn destroy(self) -> std::result::Result<(), (SuspendedCommunicator, Error)> {
        self.comm
            .destroy()
            .map_err(|(comm, e)| (SuspendedCommunicator { comm }, e))
    }
}
