//! What an operation is, as the per-operation hooks record and check it.

use nccl_sys::EntryPoint;

use crate::stream::StreamRef;
use crate::types::DataType;

/// What an operation is, as `issue` records and checks it.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "diag"), allow(dead_code))]
pub(crate) struct OpInfo<'a> {
    pub(super) name: EntryPoint,
    pub(super) collective: bool,
    pub(super) dtype: Option<DataType>,
    pub(super) count: usize,
    /// A rank (a `c_int` for NCCL): 32 bits keep an `Op` within 128 bytes.
    pub(super) root: Option<u32>,
    pub(super) stream: StreamRef<'a>,
    /// Issued by a [`crate::Group`]'s end, between its `ncclGroupStart` and
    /// `ncclGroupEnd` (no code of the caller's runs there): NCCL only queues it until the
    /// group's end, so it is not fingerprint-checked (one thread may drive several ranks),
    /// and its work is published, and marked, by the group's end. Only a group's end issues
    /// operations inside an NCCL group, so this flag, carried with the operation, says so
    /// with no thread-local read on the per-operation path.
    pub(super) grouped: bool,
}

impl<'a> OpInfo<'a> {
    /// A collective moving `count` elements of `dtype` on `stream`, with its root or peer.
    #[inline]
    pub(crate) fn new(
        call: nccl_sys::Collective,
        dtype: DataType,
        count: usize,
        root: Option<usize>,
        stream: StreamRef<'a>,
    ) -> OpInfo<'a> {
        OpInfo {
            name: call.entry_point(),
            collective: call.every_rank(),
            dtype: Some(dtype),
            count,
            root: root.map(|r| r as u32),
            stream,
            grouped: false,
        }
    }

    /// A one-sided call (`ncclPutSignal`, `ncclSignal`, `ncclWaitSignal`): made by one
    /// rank, so neither sequence-numbered nor fingerprinted; `peer` is its target (none for
    /// a wait, which may name several).
    #[inline]
    pub(crate) fn one_sided(
        name: EntryPoint,
        dtype: Option<DataType>,
        count: usize,
        peer: Option<usize>,
        stream: StreamRef<'a>,
    ) -> OpInfo<'a> {
        OpInfo {
            name,
            collective: false,
            dtype,
            count,
            root: peer.map(|r| r as u32),
            stream,
            grouped: false,
        }
    }

    /// The NCCL call.
    #[inline]
    pub(crate) fn name(&self) -> &'static str {
        self.name.name()
    }

    /// The NCCL call, as its entry point.
    #[inline(always)]
    pub(crate) fn entry_point(&self) -> EntryPoint {
        self.name
    }

    /// Its root or peer, if it has one.
    #[inline(always)]
    pub(crate) fn rank(&self) -> Option<u32> {
        self.root
    }

    /// The number of elements.
    #[inline(always)]
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// The element type (`None` for an operation that moves no elements).
    #[inline(always)]
    pub(crate) fn data_type(&self) -> Option<DataType> {
        self.dtype
    }

    /// The stream it runs on.
    #[inline(always)]
    pub(crate) fn stream(&self) -> StreamRef<'a> {
        self.stream
    }

    /// The same operation, run on `stream` instead (a relay of the per-thread stream).
    #[inline]
    pub(crate) fn on(self, stream: StreamRef<'a>) -> OpInfo<'a> {
        OpInfo { stream, ..self }
    }

    /// The same operation, issued by a group's end (see [`grouped`](Self::grouped)).
    #[inline(always)]
    pub(crate) fn in_group(self) -> OpInfo<'a> {
        OpInfo {
            grouped: true,
            ..self
        }
    }
}

/// Collectives get a sequence number and a fingerprint; point-to-point calls (made by two
/// ranks), the one-sided calls (made by one) and shrink (not called by the excluded ranks)
/// do not.
#[inline]
pub(crate) fn is_collective(call: EntryPoint) -> bool {
    match call.collective() {
        Some(c) => c.every_rank(),
        None => !matches!(
            call,
            EntryPoint::ncclCommShrink
                | EntryPoint::ncclPutSignal
                | EntryPoint::ncclSignal
                | EntryPoint::ncclWaitSignal
        ),
    }
}

impl From<EntryPoint> for OpInfo<'static> {
    #[inline]
    fn from(name: EntryPoint) -> Self {
        OpInfo {
            name,
            collective: is_collective(name),
            dtype: None,
            count: 0,
            root: None,
            stream: StreamRef::Host,
            grouped: false,
        }
    }
}
