//! What every call checks of the communicator before NCCL sees anything: that it has not
//! failed, and that the stream and each buffer's memory are where it runs (the host
//! provider takes host memory and `Stream::Host`; NVIDIA's NCCL device memory and a CUDA
//! stream of its device). The operations (`ops`), registrations, windows and memory pools
//! call them; each is a few loads, its error built out of line.

use crate::buffer::Memory;
use crate::error::{invalid, BufferRole, Error, Result};
use crate::library::Provider;
use crate::stream::StreamRef;

use super::Communicator;

impl Communicator {
    /// [`ensure_usable`](Self::ensure_usable) as the first check of every operation, before
    /// its buffers or the CUDA driver are touched: a failed communicator (an NCCL error, or
    /// a timeout the watchdog declared) fails at once, and a refused collective is counted.
    /// A few loads.
    #[inline(always)]
    pub(crate) fn ensure_usable_for(&self, op: nccl_sys::EntryPoint) -> Result<()> {
        if self.failure.get().is_some() || self.diag.failed() {
            return self.refuse(op);
        }
        Ok(())
    }

    #[cold]
    fn refuse(&self, op: nccl_sys::EntryPoint) -> Result<()> {
        let r = self.ensure_usable(op.name());
        if r.is_err() && crate::diag::is_collective(op) {
            self.refused.set(self.refused.get() + 1);
        }
        // The clique's report is shared by its ranks: say first what happened to this one.
        r.map_err(|e| match e {
            Error::Timeout { what, timeout } => Error::Timeout {
                what: format!(
                    "{op} on rank {}: refused, the watchdog had already failed this communicator. {what}",
                    self.rank
                ),
                timeout,
            },
            e => e,
        })
    }

    #[inline(always)]
    pub(crate) fn check_stream(&self, call: &'static str, stream: StreamRef<'_>) -> Result<()> {
        match (self.library().provider(), stream) {
            (Provider::Host, StreamRef::Host) => Ok(()),
            (Provider::Nccl, StreamRef::Cuda(_))
                if stream.cuda_ordinal() == self.cuda_ordinal() =>
            {
                Ok(())
            }
            _ => Err(self.stream_error(call, stream)),
        }
    }

    #[cold]
    fn stream_error(&self, call: &'static str, stream: StreamRef<'_>) -> Error {
        let reason = match (self.library().provider(), stream) {
            (Provider::Nccl, StreamRef::Cuda(_)) => format!(
                "the stream is on CUDA device {:?} but the communicator on device {:?}",
                stream.cuda_ordinal(),
                self.cuda_ordinal()
            ),
            (Provider::Host, _) => {
                "a host-provider communicator takes Stream::Host, not a CUDA stream".into()
            }
            (_, _) => "NVIDIA's NCCL needs a CUDA stream, not Stream::Host".into(),
        };
        invalid(call, reason)
    }

    #[inline(always)]
    pub(crate) fn check_memory(
        &self,
        call: &'static str,
        role: BufferRole,
        memory: Memory,
    ) -> Result<()> {
        match (self.library().provider(), memory) {
            (Provider::Host, Memory::Host) => Ok(()),
            (Provider::Nccl, Memory::Device(d)) if Some(d) == self.cuda_ordinal() => Ok(()),
            _ => Err(self.memory_error(call, role, memory)),
        }
    }

    #[cold]
    fn memory_error(&self, call: &'static str, role: BufferRole, memory: Memory) -> Error {
        let reason = match (self.library().provider(), memory) {
            (Provider::Nccl, Memory::Device(d)) => format!(
                "the {role} is on CUDA device {d} but the communicator on device {:?}",
                self.cuda_ordinal()
            ),
            (Provider::Nccl, Memory::Host) => format!(
                "the {role} is host memory, which NVIDIA's NCCL cannot read: copy it to the device"
            ),
            (_, Memory::Device(_)) => {
                format!("the {role} is GPU memory, which the host provider cannot read")
            }
            (_, Memory::Host) => format!("the {role} is host memory"),
        };
        invalid(call, reason)
    }
}
