//! What the rendezvous, the desync board and the c10d store client share (a leaf of
//! `launch` over `wire`, so those three never import each other in a circle): the id's
//! length, the token's rules, the server's thread, the client's handshake and retry, and a
//! refusal's reading; their errors, from [`crate::error`].

use super::wire;
pub use crate::error::launch::{MAX_VALUE_LEN, MIN_TOKEN_LEN, TOKEN_VAR};
pub use crate::error::{Refusal, RendezvousError, StoreError};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

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

/// A server's background thread (the rendezvous's, the desync board's) and its stop flag.
#[derive(Debug)]
pub(crate) struct Background<T> {
    pub local_addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<T>>,
}

impl<T: Send + 'static> Background<T> {
    /// Runs `run` over the listener of [`listen`] on a thread named `name`; `run` returns
    /// once the flag it is given is set.
    pub(crate) fn spawn(
        name: &str,
        (listener, local_addr): (TcpListener, SocketAddr),
        run: impl FnOnce(TcpListener, &AtomicBool) -> T + Send + 'static,
    ) -> Result<Self, RendezvousError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = (thread::Builder::new().name(name.into()))
            .spawn(move || run(listener, &flag))
            .map_err(io_err(format!("spawning the {name} thread")))?;
        Ok(Background {
            local_addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Whether the thread has ended.
    pub(crate) fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for the thread to end (asking it to stop first when `stop`); `None` when it
    /// was joined before.
    pub(crate) fn join(&mut self, stop: bool) -> Option<thread::Result<T>> {
        if stop {
            self.stop.store(true, Ordering::Release);
        }
        self.thread.take().map(JoinHandle::join)
    }
}

/// A client's authenticated connection: its stream, its session, and the deadline that ends
/// every read and write on it.
pub(crate) struct Conn<'t> {
    s: TcpStream,
    pub session: wire::Session<'t>,
    deadline: Instant,
}

impl Conn<'_> {
    /// The stream, every read and write ending by the connection's deadline.
    pub(crate) fn io(&self) -> wire::Deadlined<'_> {
        wire::Deadlined::new(&self.s, self.deadline)
    }
}

/// Client side, steps 1 and 2: connects to the first of `addrs` that answers (each try
/// bounded by `io_timeout`), reads the server's hello of `magic` and proves `token` for
/// `rank` of `world`, every wait ending by `deadline`. A busy server is
/// [`Refusal::Busy`]; `label` and `addr` name the server in errors.
pub(crate) fn dial<'t>(
    addrs: Vec<SocketAddr>,
    addr: &str,
    (label, magic): (&str, &[u8; 16]),
    token: &'t [u8],
    (rank, world): (u32, u32),
    io_timeout: Duration,
    deadline: Instant,
) -> Result<Conn<'t>, RendezvousError> {
    let io = |what: &str| io_err(format!("{label} at {addr}: {what}"));
    let s = wire::connect_any(addrs, io_timeout, Some(deadline)).map_err(io("connecting"))?;
    wire::bound_waits(&s, io_timeout).map_err(io("setting timeouts"))?;
    let mut d = wire::Deadlined::new(&s, deadline);
    let hello = wire::read_frame(&mut d).map_err(io("reading the hello"))?;
    let addr = addr.to_string();
    if wire::is_busy(&hello) {
        let (rank, reason) = (rank as usize, Refusal::Busy);
        return Err(RendezvousError::Refused { addr, rank, reason });
    }
    let Some(sn) = wire::parse_hello(&hello, magic) else {
        let detail = format!("{label}: unexpected hello");
        return Err(RendezvousError::Protocol { addr, detail });
    };
    let cn = wire::nonce().map_err(io("drawing a nonce"))?;
    let session = wire::Session::new(token, sn, cn, rank, world);
    wire::write_frame(&mut d, &session.auth_frame()).map_err(io("authenticating"))?;
    Ok(Conn {
        s,
        session,
        deadline,
    })
}

/// A client's pause before its next try: sleeps `backoff` (at most until `deadline`) and
/// doubles it, up to `max`; whether time is left for that try.
pub(crate) fn pause(deadline: Instant, backoff: &mut Duration, max: Duration) -> bool {
    thread::sleep((*backoff).min(deadline.saturating_duration_since(Instant::now())));
    *backoff = (*backoff * 2).min(max);
    Instant::now() < deadline
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
