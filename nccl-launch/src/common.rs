//! What the rendezvous, the desync board and the c10d store client share (a leaf of
//! `launch` over `wire`, so those three never import each other in a circle): the id's
//! length, the token's rules, the server's thread, the client's handshake and retry, and a
//! refusal's reading; their errors, from [`crate::error`].

use super::wire;
pub use crate::error::{Refusal, RendezvousError, StoreError};
pub use crate::error::{MAX_VALUE_LEN, MIN_TOKEN_LEN, TOKEN_VAR};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
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

/// Non-blocking listeners on each of `addrs` that can be bound, and the addresses bound
/// (with port 0, the others take the first one's port). An address that cannot be bound
/// (another program holds it, say) is left out: clients take only an answer that proves
/// the token, so whatever answers there costs them time, not the job. With none bound,
/// [`RendezvousError::Bind`] naming `name`, with the first address's error.
pub(crate) fn listen(
    addrs: &[SocketAddr],
    name: String,
    what: &str,
) -> Result<(Vec<TcpListener>, Vec<SocketAddr>), RendezvousError> {
    let (mut listeners, mut bound, mut first_err) = (Vec::new(), Vec::<SocketAddr>::new(), None);
    for (i, &a) in addrs.iter().enumerate() {
        if addrs[..i].contains(&a) {
            continue;
        }
        let mut a = a;
        if let (0, Some(b)) = (a.port(), bound.first()) {
            a.set_port(b.port());
        }
        match TcpListener::bind(a) {
            Ok(l) => {
                let local = l
                    .local_addr()
                    .map_err(io_err(format!("{what} listener address")))?;
                l.set_nonblocking(true)
                    .map_err(io_err(format!("{what} listener")))?;
                listeners.push(l);
                bound.push(local);
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if listeners.is_empty() {
        let source = first_err.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::AddrNotAvailable, "it resolved to no address")
        });
        return Err(RendezvousError::Bind { addr: name, source });
    }
    Ok((listeners, bound))
}

/// A server's background thread (the rendezvous's, the desync board's) and its stop flag.
#[derive(Debug)]
pub(crate) struct Background<T> {
    /// The addresses bound, never empty.
    pub local_addrs: Vec<SocketAddr>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<T>>,
}

impl<T: Send + 'static> Background<T> {
    /// Runs `run` over the listeners of [`listen`] on a thread named `name`; `run` returns
    /// once the flag it is given is set.
    pub(crate) fn spawn(
        name: &str,
        (listeners, local_addrs): (Vec<TcpListener>, Vec<SocketAddr>),
        run: impl FnOnce(Vec<TcpListener>, &AtomicBool) -> T + Send + 'static,
    ) -> Result<Self, RendezvousError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = (thread::Builder::new().name(name.into()))
            .spawn(move || run(listeners, &flag))
            .map_err(io_err(format!("spawning the {name} thread")))?;
        Ok(Background {
            local_addrs,
            stop,
            thread: Some(thread),
        })
    }

    /// The first address bound.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addrs[0]
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

    /// Moves the connection's deadline to `deadline` (for a request that takes longer than
    /// a handshake).
    pub(crate) fn extend_to(&mut self, deadline: Instant) {
        self.deadline = self.deadline.max(deadline);
    }
}

/// Client side, steps 1 and 2: connects to `to` (within `io_timeout`), reads the server's
/// hello of `magic` and proves `token` for `rank` of `world`, every wait ending by
/// `deadline`, the connection's deadline too. A busy server is [`Refusal::Busy`]; `label`
/// names the protocol's server and `addr` the address in errors.
pub(crate) fn dial<'t>(
    to: SocketAddr,
    addr: &str,
    (label, magic): (&str, &'t [u8; 16]),
    token: &'t [u8],
    (rank, world): (u32, u32),
    io_timeout: Duration,
    deadline: Instant,
) -> Result<Conn<'t>, RendezvousError> {
    let io = |what: &str| io_err(format!("{label} at {addr}: {what}"));
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io("connecting")(io::ErrorKind::TimedOut.into()));
    }
    let s = TcpStream::connect_timeout(&to, left.min(io_timeout)).map_err(io("connecting"))?;
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
    let session = wire::Session::new((magic, token), sn, cn, rank, world);
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

/// Whether an error a client met proves nothing about the server, so the client tries
/// again: the network's errors, a busy or in-progress answer, and every answer that does
/// not carry the token's MAC (a wrong-token refusal, a hello of another protocol, a
/// refusal or an id whose MAC fails). Only an answer the server proved the token with
/// (world size, rank out of range, duplicate rank) or a local error ends a client early.
pub(crate) fn proves_nothing(e: &RendezvousError) -> bool {
    match e {
        RendezvousError::Refused { reason, .. } => {
            matches!(
                reason,
                Refusal::BadToken
                    | Refusal::Busy
                    | Refusal::InProgress
                    | Refusal::WaitingForRoots { .. }
            )
        }
        RendezvousError::ServerAuthentication { .. }
        | RendezvousError::Protocol { .. }
        | RendezvousError::Io { .. }
        | RendezvousError::Resolve { .. } => true,
        _ => false,
    }
}

/// `name` (`host:port`), and the address `to` it stands for when that is not the same text.
fn naming(name: &str, to: SocketAddr) -> String {
    if name.parse() == Ok(to) {
        name.to_string()
    } else {
        format!("{name} ({to})")
    }
}

/// Client side: runs `attempt` on each address `resolve` gives for `name`, in turn (from a
/// different one each round, so that one that never answers does not always come first),
/// pausing between rounds (from 10 ms, doubling up to `max_pause`), until an attempt
/// succeeds, one fails with an error that does not [prove nothing](proves_nothing), or
/// `deadline` passes: then `timed_out` of the last error, which names the address that
/// gave it. `attempt` gets the address and its name for errors.
pub(crate) fn retry<T>(
    name: &str,
    resolve: impl Fn() -> Result<Vec<SocketAddr>, RendezvousError>,
    deadline: Instant,
    max_pause: Duration,
    mut attempt: impl FnMut(SocketAddr, &str) -> Result<T, RendezvousError>,
    timed_out: impl FnOnce(String) -> RendezvousError,
) -> Result<T, RendezvousError> {
    let mut backoff = Duration::from_millis(10);
    let mut last = format!("{name} resolved to no address");
    for round in 0.. {
        let addrs = match resolve() {
            Ok(a) => a,
            Err(e) => {
                last = e.to_string();
                Vec::new()
            }
        };
        for k in 0..addrs.len() {
            let to = addrs[(round + k) % addrs.len()];
            let named = naming(name, to);
            match attempt(to, &named) {
                Ok(t) => return Ok(t),
                Err(RendezvousError::Refused {
                    reason: Refusal::Busy,
                    ..
                }) => last = format!("{named} was busy (too many connections open)"),
                Err(e) if proves_nothing(&e) => last = e.to_string(),
                Err(e) => return Err(e),
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        if !pause(deadline, &mut backoff, max_pause) {
            break;
        }
    }
    Err(timed_out(last))
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
        wire::R_ROOTS_PENDING => Refusal::WaitingForRoots { have: a, roots: b },
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
