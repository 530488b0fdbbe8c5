//! Reduction operators: NCCL's built-ins and the owned `PreMulSum`.

use std::marker::PhantomData;
use std::panic::Location;

use nccl_sys::{ncclRedOp_t, EntryPoint};

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::{NcclType, ReduceOp};

/// The reduction a collective applies: a built-in [`ReduceOp`] or a [`PreMulSum`].
#[derive(Debug, Clone, Copy)]
pub enum Reduction<'a, T> {
    /// A built-in operator.
    BuiltIn(ReduceOp),
    /// A pre-multiplied sum created on the same communicator.
    PreMulSum(&'a PreMulSum<'a, T>),
}

impl<T> From<ReduceOp> for Reduction<'_, T> {
    fn from(op: ReduceOp) -> Self {
        Reduction::BuiltIn(op)
    }
}

impl<'a, T> From<&'a PreMulSum<'a, T>> for Reduction<'a, T> {
    fn from(op: &'a PreMulSum<'a, T>) -> Self {
        Reduction::PreMulSum(op)
    }
}

impl<T> Reduction<'_, T> {
    /// The raw operator for `comm`; a `PreMulSum` of another communicator is refused.
    #[inline(always)]
    pub(crate) fn raw_for(&self, comm: &Communicator, call: &'static str) -> Result<ncclRedOp_t> {
        match self {
            Reduction::BuiltIn(o) => Ok(o.to_raw()),
            Reduction::PreMulSum(p) if std::ptr::eq(p.comm, comm) => Ok(p.raw),
            Reduction::PreMulSum(_) => Err(foreign_pre_mul_sum(call)),
        }
    }
}

#[cold]
fn foreign_pre_mul_sum(call: &'static str) -> Error {
    crate::error::invalid(call, "this PreMulSum was created on another communicator")
}

/// `sum over ranks of (scalar x input)`: an operator created with
/// `ncclRedOpCreatePreMulSum` on one communicator for one element type, destroyed exactly
/// once with `ncclRedOpDestroy` when dropped. It borrows its communicator, so it cannot
/// outlive it. Each rank may use its own scalar.
///
/// ```
/// # use nccl_safe::{Communicator, Config, CommDevice, Stream};
/// # let id = CommDevice::Host.unique_id()?;
/// let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new())?;
/// let half = comm.create_pre_mul_sum(0.5f32)?;
/// let mut x = vec![4.0f32, 8.0];
/// comm.all_reduce_in_place(&mut x, &half, &Stream::Host)?;
/// assert_eq!(x, vec![2.0, 4.0]);
/// # Ok::<(), nccl_safe::Error>(())
/// ```
pub struct PreMulSum<'c, T> {
    raw: ncclRedOp_t,
    comm: &'c Communicator,
    _type: PhantomData<T>,
}

impl<T> std::fmt::Debug for PreMulSum<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreMulSum")
            .field("raw", &self.raw)
            .field("rank", &self.comm.rank())
            .finish()
    }
}

impl Communicator {
    /// Creates a [`PreMulSum`] with a host scalar read at once
    /// (`ncclRedOpCreatePreMulSum`, `ncclScalarHostImmediate`).
    #[track_caller]
    pub fn create_pre_mul_sum<T: NcclType>(&self, scalar: T) -> Result<PreMulSum<'_, T>> {
        const CALL: EntryPoint = EntryPoint::ncclRedOpCreatePreMulSum;
        T::DATA_TYPE.check_supported(self.library())?;
        let mut raw: ncclRedOp_t = 0;
        let mut scalar = scalar;
        self.issue(CALL, Location::caller(), |t, comm| {
            // SAFETY: `raw` is writable; `scalar` is a T read before the call returns
            // (HostImmediate); the data type matches T.
            unsafe {
                (t.ncclRedOpCreatePreMulSum)(
                    &mut raw,
                    (&mut scalar as *mut T).cast(),
                    T::DATA_TYPE.to_raw(),
                    nccl_sys::bindings::ncclScalarHostImmediate,
                    comm,
                )
            }
        })?;
        Ok(PreMulSum {
            raw,
            comm: self,
            _type: PhantomData,
        })
    }
}

impl<T> Drop for PreMulSum<'_, T> {
    fn drop(&mut self) {
        let raw = self.raw;
        // SAFETY: `raw` was created on this live communicator and is destroyed only here.
        let _ = self.comm.issue(
            EntryPoint::ncclRedOpDestroy,
            Location::caller(),
            |t, comm| unsafe { (t.ncclRedOpDestroy)(raw, comm) },
        );
    }
}
