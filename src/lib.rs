//! nccl-safe: a safe Rust API over NVIDIA NCCL.
//!
//! Four ranks all-reduce a gradient and broadcast a parameter, as threads of one process on
//! the host provider (NCCL's API on the CPU, so this runs anywhere, `cargo test` included).
//! The ranks are started by the crate nccl-launch: with GPUs,
//! `Launcher::all_devices()?` runs a rank per visible GPU (`Launcher::auto` picks GPUs or
//! the host), and `Launcher::from_env()?.init()?` a rank per process under torchrun, Slurm
//! or mpirun; the body stays the same.
//!
//! ```
//! use nccl_launch::Launcher;
//! use nccl_safe::{Error, ReduceOp};
//!
//! let sums = Launcher::host(4).run(|rank| {
//!     let (comm, stream) = (rank.comm(), rank.stream());
//!     // Every rank contributes its own gradient; every rank gets the sum.
//!     let mut grad = vec![rank.rank() as f32 + 1.0; 1024];
//!     comm.all_reduce_in_place(&mut grad, ReduceOp::Sum, stream)?;
//!     // Rank 0's parameter reaches everyone.
//!     let mut param = [if rank.rank() == 0 { 0.5f64 } else { 0.0 }];
//!     comm.broadcast_in_place(&mut param, 0, stream)?;
//!     assert_eq!(param, [0.5]);
//!     // Bad input is a typed error before NCCL sees it, and the communicator stays usable.
//!     let mut short = vec![0.0f32; 3];
//!     let e = comm.all_reduce(&grad, &mut short, ReduceOp::Sum, stream).unwrap_err();
//!     assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
//!     Ok(grad[0])
//! })?;
//! assert_eq!(sums, vec![10.0; 4]);
//! # Ok::<(), nccl_launch::Error>(())
//! ```
//!
//! Each [`Communicator`] is torn down exactly once, by its `Drop` (destroyed when healthy,
//! aborted after a failure; [`Communicator::destroy`] and [`Communicator::abort`] consume
//! it). A watchdog times out a collective whose peers never come and aborts the clique, so
//! ranks that took different paths get an error naming who called what, not a hang.
//!
//! # Map
//!
//! * [`library`]: finding and loading `libnccl.so.2` at run time ([`Discovery`]; no link
//!   step, no CUDA toolkit to build), its version and the function table every call goes
//!   through. Every NCCL result goes through one check and fails with an [`Error`] that
//!   carries NCCL's error string, its last-error text, the call and the caller.
//! * [`Communicator`]: init, split and shrink, collectives (`all_reduce`, `broadcast`, ...,
//!   each with an `_op` form that returns an [`Op`] for a [`Group`]), teardown. Buffers are
//!   slices, vectors and arrays on the host provider, cudarc's device slices on GPUs
//!   ([`SendBuffer`], [`RecvBuffer`]); streams are a [`Stream`] (`Stream::Host` on the host provider) or cudarc's.
//! * [`NcclMemory`], [`Registration`], [`Window`]: NCCL's allocator, buffer registration and
//!   symmetric windows, borrows that end exactly once. fp8 element types
//!   ([`float8::F8E4M3`], [`float8::F8E5M2`]) need NCCL 2.24.
//! * The crate nccl-launch (a layer above this one): ranks as threads (`Launcher`) or
//!   processes (`ProcessLauncher`), the unique-id exchange (torchrun's store, an
//!   authenticated TCP rendezvous) and the desync board that names diverging ranks.
//! * [`diag`]: the watchdog, the flight recorder and straggler reports; [`Config`] sets
//!   their timeouts.
//! * [`host`]: the host provider, NCCL's C API over CPU memory, for ranks as threads or as
//!   processes sharing memory, with fault injection for tests.
//! * [`error`], [`version`]: the error type and NCCL versions.
#![deny(missing_docs)]

mod buffer;
mod comm;
mod comm_ref;
mod config;
pub mod diag;
mod discovery;
pub mod error;
mod group;
// The host provider is the crate nccl-host (`nccl_safe::host` keeps its paths).
#[cfg(feature = "host")]
#[doc(inline)]
pub use nccl_host as host;
mod id;
pub mod library;
mod memory;
mod ops;
mod param;
mod register;
#[doc(hidden)]
pub mod seam;
mod stream;
mod teardown;
mod types;
pub mod version;

pub use buffer::{BufferGuard, Memory, RecvBuffer, SendBuffer, StreamBound};
pub use comm::{
    CommDevice, Communicator, GinType, MemStats, PendingCommunicator, Properties,
    SuspendedCommunicator,
};
pub use comm_ref::CommRef;
pub use config::Config;
pub use diag::DEFAULT_TIMEOUT;
pub use error::{Error, NcclError, Result, ResultCode};
pub use group::Group;
pub use id::{scalable_root_rank, scalable_roots, UniqueId, RANKS_PER_ROOT, UNIQUE_ID_BYTES};
pub use library::{CallContext, Discovery, Library, Provider};
pub use memory::{NcclMemory, NcclView, NcclViewMut};
pub use ops::{Op, PreMulSum, Reduction};
pub use param::{Param, ParamType};
pub use register::{Registration, Signal, SignalWait, Window, WindowFlags};
pub use stream::{AsStream, Stream};
pub use types::{DataType, NcclType, ReduceOp};
pub use version::Version;
