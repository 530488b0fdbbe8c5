//! What the rendezvous, the desync board and the c10d store client share (a leaf of
//! `launch` over `wire`, so those three never import each other in a circle): the id's
//! length, the token's rules, the listener and a refusal's reading; their errors, from
//! [`crate::error`].

use super::wire;
pub use crate::error::launch::{MAX_VALUE_LEN, MIN_TOKEN_LEN, TOKEN_VAR};
pub use crate::error::{Refusal, RendezvousError, StoreError};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::time::Duration;

/// Length of an NCCL unique id (`ncclUniqueId`) in bytes.
pub const ID_LEN: usize = 128;
/// Default overall deadline of a rendezvous (and of the id exchange through a store).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Wraps an I/O error with what was being done.
pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RendezvousError {
    let context = context.into();
    move |source| RendezvousError::Io { context, source }
}

/// A non-blocking listener on `addrs` (each in turn; the error is the last one's) and the
/// address it bound; `addr` and `what` name it in errors.
pub(crate) fn listen(
    addrs: impl ToSocketAddrs,
    addr: String,
    what: &str,
) -> Result<(TcpListener, SocketAddr), RendezvousError> {
    let listener =
        TcpListener::bind(addrs).map_err(|source| RendezvousError::Bind { addr, source })?;
    let local = (listener.local_addr()).map_err(io_err(format!("{what} listener address")))?;
    (listener.set_nonblocking(true)).map_err(io_err(format!("{what} listener")))?;
    Ok((listener, local))
}

/// Refuses a token shorter than [`MIN_TOKEN_LEN`].
pub(crate) fn check_token(token: &[u8]) -> Result<(), RendezvousError> {
    if token.len() < MIN_TOKEN_LEN {
        return Err(RendezvousError::WeakToken { len: token.len() });
    }
    Ok(())
}

/// The error a `REFUSE` frame read in place of an answer stands for (`None`: not one). Only
/// the wrong-token refusal comes before the peer authenticated; any other without a valid
/// MAC is [`RendezvousError::ServerAuthentication`] (a relay's forgery).
pub(crate) fn refused(
    frame: &[u8],
    session: &wire::Session,
    addr: &str,
    rank: usize,
) -> Option<RendezvousError> {
    let (code, a, b) = wire::parse_refuse(frame)?;
    let addr = addr.to_string();
    let reason = match code {
        wire::R_TOKEN => Refusal::BadToken,
        wire::R_WORLD => Refusal::WorldSizeMismatch {
            server: a,
            client: b,
        },
        wire::R_RANGE => Refusal::RankOutOfRange { world_size: a },
        wire::R_DUPLICATE => Refusal::DuplicateRank,
        wire::R_BUSY => Refusal::Busy,
        wire::R_IN_PROGRESS => Refusal::InProgress,
        c => {
            let detail = format!("unknown refusal code {c}");
            return Some(RendezvousError::Protocol { addr, detail });
        }
    };
    if reason != Refusal::BadToken && !session.refuse_is_authentic(frame) {
        return Some(RendezvousError::ServerAuthentication { addr });
    }
    Some(RendezvousError::Refused { addr, rank, reason })
}
