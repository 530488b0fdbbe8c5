//! What the library search looked at: the records an [`crate::Error::NotFound`] lists.
//! A leaf module (it depends on nothing of the crate), so that the error type stays one.

use std::fmt;
use std::path::PathBuf;

/// One place the library search looked at, and what it found there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tried {
    /// Where the candidate came from.
    pub source: Source,
    /// The file path, or the bare name handed to the system loader.
    pub location: PathBuf,
    /// Why it was not used: "no such file", or the loader's or this crate's error.
    pub outcome: String,
}

/// The sources the library search uses, in its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Source {
    /// A libnccl the process had already mapped before the search (loaded by PyTorch, by
    /// cudarc for another crate, by a C++ library): looked for first, so that a process
    /// never holds two NCCLs.
    AlreadyLoaded,
    /// A path given in code.
    Explicit,
    /// `$NCCL_LIBRARY`: a file.
    NcclLibrary,
    /// `$NCCL_HOME/lib*`.
    NcclHome,
    /// `$NCCL_ROOT/lib*`.
    NcclRoot,
    /// `$CUDA_HOME/lib*`.
    CudaHome,
    /// `$VIRTUAL_ENV/lib/python3*/site-packages/nvidia/nccl/lib`.
    VirtualEnv,
    /// `$CONDA_PREFIX/lib` and its `site-packages/nvidia/nccl/lib`.
    CondaPrefix,
    /// The dynamic loader's own search (`LD_LIBRARY_PATH`, ld.so.cache, ...).
    SystemLoader,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::AlreadyLoaded => "already loaded by the process",
            Source::Explicit => "path given in code",
            Source::NcclLibrary => "NCCL_LIBRARY",
            Source::NcclHome => "NCCL_HOME",
            Source::NcclRoot => "NCCL_ROOT",
            Source::CudaHome => "CUDA_HOME",
            Source::VirtualEnv => "VIRTUAL_ENV",
            Source::CondaPrefix => "CONDA_PREFIX",
            Source::SystemLoader => "system loader",
        })
    }
}

pub(crate) fn fmt_not_found(tried: &[Tried]) -> String {
    let mut s = String::from("NCCL library (libnccl.so.2) not found. Tried:");
    for t in tried {
        s.push_str(&format!(
            "\n  - [{}] {}: {}",
            t.source,
            t.location.display(),
            t.outcome
        ));
    }
    s.push_str(
        "\nTo get NCCL: `pip install nvidia-nccl-cu12` in the active Python environment \
         (VIRTUAL_ENV or CONDA_PREFIX), or set NCCL_LIBRARY=/path/to/libnccl.so.2.",
    );
    s
}
