//! What the launchers (the crate nccl-launch, a layer above this one) use of the core's
//! internals. Not an API: hidden from the docs, with no stability promise; everything a user
//! needs is public elsewhere.

use std::time::Instant;

use crate::{Communicator, Config};

/// A post to a desync board that the process's exit waits for (until its deadline);
/// dropping it ends the post.
#[derive(Debug)]
pub struct Posting(#[allow(dead_code)] crate::teardown::exit::Busy);

/// Enters a post that exit waits for until `deadline`: `None` once the process is exiting
/// (then nothing must be posted).
pub fn posting(deadline: Instant) -> Option<Posting> {
    crate::teardown::exit::posting(deadline).map(Posting)
}

/// Runs `f` (which makes a CUDA stream) keeping the context's recorded error as it was.
pub fn keeping_recorded_error<R>(ctx: &cudarc::driver::CudaContext, f: impl FnOnce() -> R) -> R {
    crate::stream::keeping_recorded_error(ctx, f)
}

/// Which root (unique id) `rank` makes in a scalable init of `roots` over `world_size`
/// ranks, if it makes one.
pub fn root_made_by(world_size: usize, roots: usize, rank: usize) -> Option<usize> {
    crate::id::root_made_by(world_size, roots, rank)
}

/// This rank is done with `comm` (its launcher closure returned): peers that wait for a
/// collective it never issued fail at once with [`crate::Error::RankLeft`].
pub fn leave(comm: &Communicator, how: &str) {
    comm.leave(how)
}

/// Collectives `comm`'s rank called: those issued and those refused after a failure.
#[cfg(feature = "diag")]
pub fn collectives_called(comm: &Communicator) -> u64 {
    comm.collectives_called()
}

/// `config` with [`Config::timing`] set to `precise`, unless it was set.
pub fn timing_unless_set(config: Config, precise: bool) -> Config {
    config.timing_unless_set(precise)
}

/// `config` with the job's desync board (shared: one board for every communicator).
#[cfg(feature = "diag")]
pub fn remote_board(config: Config, board: std::sync::Arc<dyn crate::diag::RemoteBoard>) -> Config {
    config.remote_board(board)
}

/// A desync post's wire form.
#[cfg(feature = "diag")]
pub fn encode_post(post: &crate::diag::DesyncPost) -> Vec<u8> {
    post.encode()
}

/// The desync post of a wire form; `None` when it is not one.
#[cfg(feature = "diag")]
pub fn decode_post(b: &[u8]) -> Option<crate::diag::DesyncPost> {
    crate::diag::DesyncPost::decode(b)
}

/// Whether `config` asks for an elastic communicator (`None`: not set).
pub fn elastic(config: &Config) -> Option<bool> {
    config.diag.elastic
}
