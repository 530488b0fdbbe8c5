//! The communication stream of [`DistributedDataParallel`](crate::DistributedDataParallel)
//! on CUDA: a stream of its own beside candle's, ordered against it by events.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream};
use candle_core::{CudaDevice, Device};

use crate::error::DistResult as Result;

/// A CUDA stream for NCCL's calls, created in the context of candle's device, and the two
/// events that order it against candle's stream (recorded again for every use: a wait
/// takes the work recorded at the time of the wait, so reusing them is sound).
pub(crate) struct CommStream {
    /// candle's device: its stream runs the kernels that pack and read the buffers.
    device: CudaDevice,
    stream: Arc<CudaStream>,
    /// Recorded on candle's stream; the communication stream waits on it.
    packed: CudaEvent,
    /// Recorded on the communication stream; candle's stream waits on it.
    reduced: CudaEvent,
}

impl std::fmt::Debug for CommStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommStream")
            .field("ordinal", &self.stream.context().ordinal())
            .finish()
    }
}

fn driver(e: candle_core::cuda_backend::cudarc::driver::DriverError) -> crate::DistError {
    crate::DistError::from(nccl_safe::Error::from(e))
}

impl CommStream {
    /// A new non-blocking stream in the context of candle's `device`. Its creation puts the
    /// context in cudarc's multi-stream mode: with event tracking on (candle's default),
    /// cudarc then orders every buffer's uses across streams by that buffer's events.
    pub(crate) fn new(device: &CudaDevice) -> Result<Self> {
        let ctx = device.cuda_stream().context().clone();
        Ok(CommStream {
            stream: ctx.new_stream().map_err(driver)?,
            packed: ctx.new_event(None).map_err(driver)?,
            reduced: ctx.new_event(None).map_err(driver)?,
            device: device.clone(),
        })
    }

    /// The communication stream, for NCCL's calls.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether `device` is the candle device this stream was made for.
    pub(crate) fn serves(&self, device: &Device) -> bool {
        device.same_device(&Device::Cuda(self.device.clone()))
    }

    /// The communication stream waits for all the work enqueued on candle's stream so far
    /// (an event recorded on candle's stream).
    pub(crate) fn wait_for_candle(&self) -> Result<()> {
        self.packed
            .record(&self.device.cuda_stream())
            .map_err(driver)?;
        self.stream.wait(&self.packed).map_err(driver)
    }

    /// candle's stream waits for all the work enqueued on the communication stream so far
    /// (an event recorded on the communication stream).
    pub(crate) fn join_candle(&self) -> Result<()> {
        self.reduced.record(&self.stream).map_err(driver)?;
        self.device
            .cuda_stream()
            .wait(&self.reduced)
            .map_err(driver)
    }

    /// A guard that makes candle's stream wait for the communication stream when it goes
    /// out of scope, on every path: work on buffers that candle frees on its stream stays
    /// ordered before the free even when a call fails half-way.
    pub(crate) fn joiner(&self) -> Joiner<'_> {
        Joiner { cs: Some(self) }
    }
}

/// See [`CommStream::joiner`].
pub(crate) struct Joiner<'a> {
    cs: Option<&'a CommStream>,
}

impl Joiner<'_> {
    /// Joins now, with the driver's error if the join fails.
    pub(crate) fn finish(mut self) -> Result<()> {
        match self.cs.take() {
            Some(cs) => cs.join_candle(),
            None => Ok(()),
        }
    }
}

impl Drop for Joiner<'_> {
    fn drop(&mut self) {
        if let Some(cs) = self.cs.take() {
            // An error path already: the first error is the one reported.
            let _ = cs.join_candle();
        }
    }
}
