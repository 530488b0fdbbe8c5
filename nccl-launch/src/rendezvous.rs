//! Getting rank 0's unique id (or, for a scalable init, each root rank's) to every other
//! rank of a multi-process job.
//!
//! [`Rendezvous`] is one entry point over four transports:
//! - [`TcpRendezvous`]: rank 0 serves the id on `MASTER_ADDR:MASTER_PORT` from a background
//!   thread; the other ranks fetch it. Peers prove they hold a job token (HMAC-SHA-256
//!   challenge/response over fresh nonces; the token never crosses the network and the id
//!   travels masked), every frame is at most 4 KiB, every wait is bounded.
//! - [`FileRendezvous`]: rank 0 writes the id to a shared file atomically, the others poll.
//! - [`StoreRendezvous`]: through torchrun's c10d store (see [`super::store`]).
//! - [`Rendezvous::custom`]: a closure of yours (an `MPI_Bcast`, a key-value store, ...).
//!
//! The TCP protocol (each message is a big-endian `u32` length and a body of at most 4 KiB;
//! every MAC is keyed by the token and begins with the protocol's magic, so no MAC of the
//! rendezvous is one of the desync board's, which speaks the same handshake):
//! 1. server -> client `HELLO`: magic `nccl-safe-rdzv/1` and a 32-byte server nonce `sn`.
//! 2. client -> server `AUTH`: rank, world size, client nonce `cn`,
//!    `HMAC(token, magic | "client" | sn | cn | rank | world)`.
//! 3. server -> client `REFUSE` or `ID`: the id XORed with
//!    `HMAC(token, magic | "stream" | sn | cn | i)` blocks and
//!    `HMAC(token, magic | "server" | sn | cn | rank | world | masked id)`. A refusal of an
//!    authenticated peer (world-size mismatch, rank out of range, duplicate rank, rank being
//!    served) carries `HMAC(token, magic | "refuse" | sn | cn | rank | world | refusal)`, so
//!    a relay cannot forge one; only the wrong-token refusal cannot be authenticated.
//! 4. client -> server `ACK`; the rank counts as served. Once all ranks are, the server
//!    closes its listener and its thread ends.
//!
//! A job whose init has several unique ids (roots of `ncclCommInitRankScalable`, see
//! [`Rendezvous::exchange_roots`]) speaks the same handshake, with bit 31 set in the world
//! size both sides put in `AUTH` (and in its MACs): a rank of one root (or of an older
//! nccl-safe) and a rank 0 of several then refuse each other with the authenticated
//! world-size refusal at once, which this side reads as
//! [`RendezvousError::RootsMismatch`]. Step 3 becomes:
//! - to a rank that makes root `i`'s id, when rank 0 lacks it: `WANT` (the number of roots
//!   and `i`, with `HMAC(.. | "want" | ..)`), answered by `PUT` (`i` and the id XORed with
//!   the `"put"` keystream of `i`, with the client's MAC);
//! - once rank 0 holds every id: `IDS` frames of up to 24 ids each (the number of roots,
//!   the first id's number, the count, the ids XORed with the `"ids"` keystreams, a MAC),
//!   then the rank's `ACK`;
//! - before that: an authenticated refusal saying how many ids rank 0 holds, and the rank
//!   tries again (within its deadline, as for a busy rank 0).
//!
//! A rank that finds another number of roots in an authenticated `WANT` or `IDS` (or one
//! id where it expects several) fails at once with [`RendezvousError::RootsMismatch`].
//!
//! What a hostile peer can and cannot do. Any user of the node (or of the network that
//! reaches `MASTER_ADDR`) is a stranger; only the token makes a peer a rank.
//! - Tokens shorter than [`MIN_TOKEN_LEN`] bytes are refused ([`RendezvousError::WeakToken`]):
//!   one captured handshake would let a stranger search a short token offline.
//! - Each connection has one deadline for its whole handshake, on both sides
//!   ([`TcpRendezvous::io_timeout`]): a peer sending a byte at a time is cut off there,
//!   and a client never waits past its own overall deadline.
//! - Rank 0 cannot be made to run out of descriptors. When its first server starts, its
//!   soft open-file limit is raised toward the hard limit (to at most 65,536), and its
//!   servers (this one and the desync board) together hold at most the descriptors left
//!   once half of the limit, and what was open then, is kept back for NCCL's init and the
//!   process's own files. Each connection costs one descriptor, taken from that budget
//!   before the server accepts it. With the budget spent, connections that have not
//!   authenticated are closed to make room: those of the source (an IPv4 address, or an
//!   IPv6 /64) holding the most of them, oldest first, so a stranger's connections go
//!   before a rank's. The nonces come from `getrandom(2)`, with no file opened.
//! - Each server keeps at most 256 connections open, and at most 64 not yet authenticated
//!   from one source (and a quarter of the budget). When a new one would pass a limit, one
//!   that has not authenticated is closed to make room (as above), so a stranger holding
//!   idle connections (or flooding new ones) cannot keep a rank out. Only when every open
//!   connection has authenticated does a newcomer get a busy refusal (in place of the
//!   hello); clients retry busy until their deadline.
//! - Rank 0 binds every address the host resolves to (`localhost` may be `::1` and
//!   `127.0.0.1`), each it can; the clients try every one in turn. An address another
//!   program holds costs a rank time, never its id: only an answer that proves the token
//!   (the id, or a refusal of this rank with its MAC) ends a rank before its deadline.
//!   A wrong-token refusal, another protocol's hello, or a refusal or id whose MAC fails
//!   (a relay's forgery) is tried again, and the last of them, naming the address that
//!   gave it, is in the [`RendezvousError::ClientTimeout`] at the deadline. (So a rank
//!   with the wrong token, too, tries until its deadline.)
//! - A rank whose id is still being delivered on another connection is told so and retries.
//! - A rank whose final acknowledgement is lost still counts: its id was delivered, so rank
//!   0 reports it missing only if it was never delivered (and serves it again if it comes
//!   back for it).

use super::common::{check_token, dial, io_err, listen, refused, retry, Background, Conn};
pub use super::common::{
    Refusal, RendezvousError, DEFAULT_TIMEOUT, ID_LEN, MIN_TOKEN_LEN, TOKEN_VAR,
};
use super::env::ProcessEnv;
use super::store::StoreRendezvous;
use super::wire::{self, N};
use crate::error::{invalid, Error};
use crate::lock;
use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default deadline of one connection: its connect, and its whole handshake on either side.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP rendezvous: rank 0 serves the id, the others fetch it (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct TcpRendezvous {
    host: String,
    port: u16,
    token: wire::Token,
    timeout: Duration,
    io_timeout: Duration,
    limits: wire::Limits,
    ips: Vec<IpAddr>,
}

impl TcpRendezvous {
    /// A rendezvous at `host:port` authenticated by `token`, with the default timeouts.
    /// Rank 0 binds exactly the addresses `host` resolves to (give `0.0.0.0` to listen on
    /// every interface). A token
    /// shorter than [`MIN_TOKEN_LEN`] makes [`serve`](Self::serve) and [`fetch`](Self::fetch)
    /// fail with [`RendezvousError::WeakToken`].
    pub fn new(host: impl Into<String>, port: u16, token: impl Into<Vec<u8>>) -> Self {
        Self {
            host: host.into(),
            port,
            token: wire::Token(token.into()),
            timeout: DEFAULT_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
            limits: wire::LIMITS,
            ips: Vec::new(),
        }
    }

    /// The rendezvous of a launched job: `MASTER_ADDR:MASTER_PORT` of `env`, the token from
    /// the process environment variable [`TOKEN_VAR`].
    pub fn from_env(env: &ProcessEnv) -> Result<Self, RendezvousError> {
        Self::from_lookup(env, TOKEN_VAR, |v| std::env::var(v).ok())
    }

    /// As [`from_env`](Self::from_env), with the token read from `token_var` through `lookup`.
    pub fn from_lookup(
        env: &ProcessEnv,
        token_var: &str,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, RendezvousError> {
        match lookup(token_var) {
            Some(t) if !t.is_empty() => {
                check_token(t.as_bytes())?;
                Ok(Self::new(
                    env.master_addr.clone(),
                    env.master_port,
                    t.into_bytes(),
                ))
            }
            _ => Err(RendezvousError::MissingToken {
                var: token_var.to_string(),
            }),
        }
    }

    /// Sets the overall deadline (default [`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the deadline of one connection (default [`DEFAULT_IO_TIMEOUT`]): its connect,
    /// and its whole handshake, on rank 0's side as on the fetching rank's.
    pub fn io_timeout(mut self, io_timeout: Duration) -> Self {
        self.io_timeout = io_timeout;
        self
    }

    /// Sets how many connections rank 0 keeps open at once, in all (default 256), and not
    /// yet authenticated from one source, an IPv4 address or an IPv6 /64 (default 64, and
    /// at most a quarter of the process's descriptor budget); see the [module docs](self)
    /// for what happens at the limits. Values below 1 count as 1.
    pub fn max_connections(mut self, total: usize, per_peer: usize) -> Self {
        self.limits = wire::Limits { total, per_peer };
        self
    }

    /// Takes `ips`, in this order, as the addresses the host stands for, instead of asking
    /// the system's resolver (an empty list: ask it again).
    pub fn resolve_to(mut self, ips: impl IntoIterator<Item = IpAddr>) -> Self {
        self.ips = ips.into_iter().collect();
        self
    }

    /// `host:port` of the rendezvous.
    pub fn addr(&self) -> String {
        super::store::host_port(&self.host, self.port)
    }

    /// `host:port+1`, where rank 0 hosts the desync board, and the job token (`None` when
    /// the port is the last one).
    pub(crate) fn board(&self) -> Option<(String, Vec<u8>)> {
        let port = self.port.checked_add(super::desync::BOARD_PORT_OFFSET)?;
        Some((
            super::store::host_port(&self.host, port),
            self.token.to_vec(),
        ))
    }

    fn resolve(&self) -> Result<Vec<SocketAddr>, RendezvousError> {
        if !self.ips.is_empty() {
            return Ok(self
                .ips
                .iter()
                .map(|&ip| SocketAddr::new(ip, self.port))
                .collect());
        }
        let addr = self.addr();
        let host = self.host.trim_start_matches('[').trim_end_matches(']');
        (host, self.port)
            .to_socket_addrs()
            .map(Iterator::collect)
            .map_err(|source| RendezvousError::Resolve { addr, source })
    }

    /// Rank 0: listens on every address the host stands for (each it can bind; an error
    /// only when none) and serves `id` to ranks `1..world_size` from a background thread,
    /// until each has it (then closes the listeners) or the deadline passes.
    pub fn serve(
        &self,
        world_size: usize,
        id: [u8; ID_LEN],
    ) -> Result<ServerHandle, RendezvousError> {
        self.serve_roots(world_size, 1, id)
            .map(|(server, _)| server)
    }

    /// Rank 0 of a job whose init has `roots` (in `1..=world_size`) unique ids: serves
    /// `id` (root 0's) as [`serve`](Self::serve) does when `roots` is 1, byte for byte;
    /// with more, takes each other root's id from the rank that makes it and serves every
    /// id to every rank once all are in. The ids as they come in (root 0's at once).
    pub(crate) fn serve_roots(
        &self,
        world_size: usize,
        roots: usize,
        id: [u8; ID_LEN],
    ) -> Result<(ServerHandle, RootIds), RendezvousError> {
        if world_size == 0 || roots == 0 || roots > world_size {
            return Err(RendezvousError::InvalidRank {
                rank: 0,
                world_size,
            });
        }
        check_token(&self.token)?;
        let listeners = listen(&self.resolve()?, self.addr(), "rendezvous")?;
        let mut ids = vec![None; roots];
        ids[0] = Some(id);
        let ids: RootIds = Arc::new(Mutex::new(ids));
        let server = Server {
            world_size,
            id,
            ids: Arc::clone(&ids),
            token: self.token.to_vec(),
            deadline: Instant::now() + self.timeout,
            timeout: self.timeout,
            io_timeout: self.io_timeout,
            limits: self.limits,
            addr: (listeners.1.iter().map(ToString::to_string))
                .collect::<Vec<_>>()
                .join(", "),
        };
        let run = move |listeners, stop: &AtomicBool| server.run(listeners, stop);
        let server = Background::spawn("nccl-rendezvous", listeners, run).map(ServerHandle)?;
        Ok((server, ids))
    }

    /// Ranks `1..world_size`: fetches the id from rank 0, trying each address the host
    /// stands for in turn, until the deadline. Only an answer rank 0 proves the token with
    /// ends it early: the id, or a refusal of this rank (world size, rank out of range,
    /// duplicate rank). Everything else is tried again until the deadline, and the last of
    /// it is in the [`RendezvousError::ClientTimeout`]: rank 0 not reachable yet, busy, or
    /// still serving an earlier connection of this rank, and any answer that proves
    /// nothing (a wrong-token refusal, which a server without the token can send as well
    /// as rank 0, another protocol, a refusal or id whose MAC fails).
    pub fn fetch(&self, rank: usize, world_size: usize) -> Result<[u8; ID_LEN], RendezvousError> {
        let ids = self.fetch_roots(rank, world_size, 1, None)?;
        Ok(ids[0])
    }

    /// Ranks `1..world_size` of a job with `roots` unique ids: [`fetch`](Self::fetch)
    /// when `roots` is 1 (the same bytes on the wire); with more, `mine` (root number and
    /// id) on the rank that makes one of them, which rank 0 asks for, and every id once
    /// rank 0 holds them all (until then rank 0 says so and the rank tries again). A rank
    /// 0 that serves another number of ids is [`RendezvousError::RootsMismatch`] at once.
    pub(crate) fn fetch_roots(
        &self,
        rank: usize,
        world_size: usize,
        roots: usize,
        mine: Option<(usize, [u8; ID_LEN])>,
    ) -> Result<Vec<[u8; ID_LEN]>, RendezvousError> {
        let (r32, w32) = match (u32::try_from(rank), u32::try_from(world_size)) {
            (Ok(r), Ok(w)) if (1..w).contains(&r) && w < wire::SEVERAL_ROOTS => (r, w),
            _ => return Err(RendezvousError::InvalidRank { rank, world_size }),
        };
        if roots == 0 || roots > world_size {
            let (addr, published) = (self.addr(), None);
            let expected = roots;
            return Err(RendezvousError::RootsMismatch {
                addr,
                rank,
                published,
                expected,
            });
        }
        let w32 = if roots > 1 {
            w32 | wire::SEVERAL_ROOTS
        } else {
            w32
        };
        check_token(&self.token)?;
        let addr = self.addr();
        let start = Instant::now();
        let deadline = start + self.timeout;
        let attempt = |to, named: &str| {
            // One deadline for this connection: its connect and handshake.
            let by = (Instant::now() + self.io_timeout).min(deadline);
            let proto = ("rank 0", wire::MAGIC);
            let c = dial(
                to,
                named,
                proto,
                &self.token,
                (r32, w32),
                self.io_timeout,
                by,
            )?;
            let got = if roots == 1 {
                self.receive(&c, named, rank).map(|id| vec![id])
            } else {
                self.receive_roots(&c, named, rank, roots, mine)
            };
            got.map_err(|e| roots_refusal(e, roots))
        };
        let timed_out = |last_error| RendezvousError::ClientTimeout {
            addr: addr.clone(),
            rank,
            timeout: self.timeout,
            elapsed: start.elapsed(),
            last_error,
        };
        let resolve = || self.resolve();
        retry(
            &addr,
            resolve,
            deadline,
            Duration::from_millis(500),
            attempt,
            timed_out,
        )
    }

    /// Step 3 on an authenticated connection to `addr`: the id, or rank 0's refusal.
    fn receive(&self, c: &Conn, addr: &str, rank: usize) -> Result<[u8; ID_LEN], RendezvousError> {
        let mut s = c.io();
        let context = format!("rank 0 at {addr}: reading its reply");
        let reply = wire::read_frame(&mut s).map_err(io_err(context))?;
        if let Some(e) = refused(&reply, &c.session, addr, rank) {
            return Err(e);
        }
        let addr = addr.to_string();
        match reply.first() {
            Some(&wire::ID) if reply.len() == 1 + ID_LEN + N => {
                let (ct, mac) = reply[1..].split_at(ID_LEN);
                if !wire::ct_eq(mac, &c.session.server_mac(ct)) {
                    return Err(RendezvousError::ServerAuthentication { addr });
                }
                let mut masked = [0u8; ID_LEN];
                masked.copy_from_slice(ct);
                let id = c.session.mask(&masked);
                // The id is ours whether or not the acknowledgement arrives.
                let _ = wire::write_frame(&mut s, &[wire::ACK]);
                Ok(id)
            }
            _ => {
                let detail = "unexpected reply to authentication".into();
                Err(RendezvousError::Protocol { addr, detail })
            }
        }
    }

    /// Step 3 of a job with several roots: sends this rank's id when rank 0 asks for it
    /// (`WANT`, `PUT`), then reads every id (`IDS` frames) and acknowledges them.
    fn receive_roots(
        &self,
        c: &Conn,
        addr: &str,
        rank: usize,
        roots: usize,
        mine: Option<(usize, [u8; ID_LEN])>,
    ) -> Result<Vec<[u8; ID_LEN]>, RendezvousError> {
        let mut s = c.io();
        let forged = || RendezvousError::ServerAuthentication { addr: addr.into() };
        let mismatch = |published| RendezvousError::RootsMismatch {
            addr: addr.into(),
            rank,
            published: Some(published),
            expected: roots,
        };
        let mut got = vec![None; roots];
        loop {
            let context = format!("rank 0 at {addr}: reading its reply");
            let reply = wire::read_frame(&mut s).map_err(io_err(context))?;
            if let Some(e) = refused(&reply, &c.session, addr, rank) {
                return Err(e);
            }
            match reply.first() {
                // One id, with rank 0's MAC: rank 0 serves a job of one root.
                Some(&wire::ID) if reply.len() == 1 + ID_LEN + N => {
                    let (ct, mac) = reply[1..].split_at(ID_LEN);
                    if !wire::ct_eq(mac, &c.session.server_mac(ct)) {
                        return Err(forged());
                    }
                    return Err(mismatch(1));
                }
                Some(&wire::WANT) => {
                    let (n, root) = c.session.parse_want(&reply).ok_or_else(forged)?;
                    if n as usize != roots {
                        return Err(mismatch(n as usize));
                    }
                    let Some((_, id)) = mine.filter(|&(i, _)| i == root as usize) else {
                        let detail = format!("it asked rank {rank} for the id of root {root}, which rank {rank} does not make");
                        return Err(RendezvousError::Protocol {
                            addr: addr.into(),
                            detail,
                        });
                    };
                    let context = format!("rank 0 at {addr}: sending root {root}'s id");
                    wire::write_frame(&mut s, &c.session.put(root, &id))
                        .map_err(io_err(context))?;
                }
                Some(&wire::IDS) => {
                    let (n, first, ids) = c.session.parse_ids(&reply).ok_or_else(forged)?;
                    if n as usize != roots {
                        return Err(mismatch(n as usize));
                    }
                    for (k, id) in ids.into_iter().enumerate() {
                        match got.get_mut(first as usize + k) {
                            Some(entry) => *entry = Some(id),
                            None => {
                                let detail = format!("id {} of {roots}", first as usize + k);
                                return Err(RendezvousError::Protocol {
                                    addr: addr.into(),
                                    detail,
                                });
                            }
                        }
                    }
                    if let Some(all) = got.iter().copied().collect::<Option<Vec<_>>>() {
                        // The ids are ours whether or not the acknowledgement arrives.
                        let _ = wire::write_frame(&mut s, &[wire::ACK]);
                        return Ok(all);
                    }
                }
                _ => {
                    let detail = "unexpected reply to authentication".into();
                    return Err(RendezvousError::Protocol {
                        addr: addr.into(),
                        detail,
                    });
                }
            }
        }
    }
}

/// The ids of a job's roots as rank 0's server holds them.
pub(crate) type RootIds = Arc<Mutex<Vec<Option<[u8; ID_LEN]>>>>;

/// A world-size refusal where one side has several roots and the other one (the
/// [`wire::SEVERAL_ROOTS`] bit differs; the sizes are the same): the roots disagree, said
/// as such. Other refusals lose the bit from the sizes they carry.
fn roots_refusal(e: RendezvousError, roots: usize) -> RendezvousError {
    let bit = wire::SEVERAL_ROOTS as usize;
    match e {
        RendezvousError::Refused {
            addr,
            rank,
            reason: Refusal::WorldSizeMismatch { server, client },
        } => {
            if (server ^ client) == bit {
                let published = if server & bit == 0 { Some(1) } else { None };
                let expected = roots;
                return RendezvousError::RootsMismatch {
                    addr,
                    rank,
                    published,
                    expected,
                };
            }
            let (server, client) = (server & !bit, client & !bit);
            let reason = Refusal::WorldSizeMismatch { server, client };
            RendezvousError::Refused { addr, rank, reason }
        }
        e => e,
    }
}

/// Rank 0's running server. Dropping it leaves the server running in the background until
/// every rank has the id or the deadline passes.
#[derive(Debug)]
pub struct ServerHandle(Background<Result<(), RendezvousError>>);

impl ServerHandle {
    /// The first address bound (its port is the real one when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }

    /// Every address bound: each the host stands for that rank 0 could bind.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.0.local_addrs
    }

    /// Whether the server has stopped (all ranks served, or the deadline passed).
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }

    /// Waits for the server to stop. `Ok` once every rank `1..world_size` has the id (a
    /// rank whose final acknowledgement was lost counts once its id was sent);
    /// [`RendezvousError::ServerTimeout`] lists the ranks that never got it.
    pub fn wait(mut self) -> Result<(), RendezvousError> {
        match self.0.join(false) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(RendezvousError::ServerPanicked),
            None => Ok(()),
        }
    }

    /// Stops serving now and closes the listener (within a few milliseconds), for when
    /// something else proved that every rank has the id (e.g. the communicator of all ranks
    /// was created).
    pub fn stop(mut self) {
        self.0.join(true);
    }
}

/// Where the delivery of the id to one rank stands (one per rank).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Delivery {
    /// Not sent yet.
    Pending,
    /// Being sent on a connection.
    InProgress,
    /// Sent, but its acknowledgement did not arrive (the rank may come back for it).
    Delivered,
    /// Sent and acknowledged.
    Served,
}

struct Server {
    world_size: usize,
    id: [u8; ID_LEN],
    /// Every root's id (root 0's is `id`), filled as root ranks send theirs.
    ids: RootIds,
    token: Vec<u8>,
    deadline: Instant,
    timeout: Duration,
    io_timeout: Duration,
    limits: wire::Limits,
    addr: String,
}

impl Server {
    fn run(self, listeners: Vec<TcpListener>, stop: &AtomicBool) -> Result<(), RendezvousError> {
        let mut deliveries = vec![Delivery::Pending; self.world_size];
        deliveries[0] = Delivery::Served;
        let deliveries = Arc::new(Mutex::new(deliveries));
        let this = Arc::new(self);
        // When every rank has been sent the id but some acknowledgement is missing: until
        // when the server waits for it (or for that rank to come back).
        let mut grace: Option<Instant> = None;
        let tick = || {
            let states = lock(&deliveries).clone();
            if states.iter().all(|&s| s == Delivery::Served) {
                return Some(Ok(())); // dropping `listener` stops serving
            }
            let missing: Vec<usize> = (0..states.len())
                .filter(|&r| matches!(states[r], Delivery::Pending | Delivery::InProgress))
                .collect();
            let now = Instant::now();
            if missing.is_empty() {
                let until =
                    *grace.get_or_insert_with(|| (now + this.io_timeout).min(this.deadline));
                if now >= until {
                    return Some(Ok(()));
                }
            } else {
                grace = None;
            }
            (now >= this.deadline).then(|| {
                Err(RendezvousError::ServerTimeout {
                    addr: this.addr.clone(),
                    missing,
                    world_size: this.world_size,
                    timeout: this.timeout,
                })
            })
        };
        let (this2, deliveries2) = (Arc::clone(&this), Arc::clone(&deliveries));
        // Errors only mean this peer is dropped; the server goes on.
        let handle = move |stream: &TcpStream, conn: &wire::Admission| {
            drop(this2.handle(stream, conn, &deliveries2))
        };
        let (limits, thread) = (this.limits, "nccl-rendezvous-peer");
        wire::serve(listeners, limits, stop, thread, tick, handle).unwrap_or(Ok(()))
    }

    fn handle(
        &self,
        s: &TcpStream,
        conn: &wire::Admission,
        deliveries: &Mutex<Vec<Delivery>>,
    ) -> io::Result<()> {
        // One deadline for the whole connection, whatever the peer's pace.
        let deadline = (Instant::now() + self.io_timeout).min(self.deadline);
        wire::bound_waits(s, self.io_timeout)?;
        let mut s = wire::Deadlined::new(s, deadline);
        let roots = lock(&self.ids).len();
        let mut ours = u32::try_from(self.world_size).unwrap_or(u32::MAX);
        if roots > 1 {
            ours |= wire::SEVERAL_ROOTS;
        }
        let proto = (wire::MAGIC, &self.token[..]);
        let Some(session) = wire::accept_peer_as(&mut s, proto, conn, (self.world_size, ours), 1)?
        else {
            return Ok(());
        };
        let r = session.rank as usize;
        let before = {
            let mut g = lock(deliveries);
            let before = g[r];
            if matches!(before, Delivery::Pending | Delivery::Delivered) {
                g[r] = Delivery::InProgress;
            }
            before
        };
        let code = match before {
            Delivery::Pending | Delivery::Delivered => None,
            Delivery::InProgress => Some(wire::R_IN_PROGRESS),
            Delivery::Served => Some(wire::R_DUPLICATE),
        };
        if let Some(code) = code {
            let world = session.world;
            return wire::write_frame(&mut s, &session.refuse(code, world, session.rank));
        }
        if roots > 1 {
            return self.serve_roots(&mut s, &session, (r, before), deliveries);
        }
        let ct = session.mask(&self.id);
        let msg = [&[wire::ID][..], &ct, &session.server_mac(&ct)].concat();
        let sent = wire::write_frame(&mut s, &msg);
        let acked = sent.is_ok() && wire::read_frame(&mut s).is_ok_and(|a| a == [wire::ACK]);
        // Sent but not acknowledged: delivered (served again if the rank comes back for it).
        let after = match (&sent, acked) {
            (Err(_), _) => before,
            (Ok(()), true) => Delivery::Served,
            (Ok(()), false) => Delivery::Delivered,
        };
        lock(deliveries)[r] = after;
        sent
    }

    /// Step 3 with several roots, for rank `r` whose delivery was `before`: asks a root rank
    /// for its id when rank 0 lacks it (`WANT`, `PUT`), then sends every id (`IDS`) once
    /// all are in, else refuses with `R_ROOTS_PENDING` (the rank tries again).
    fn serve_roots(
        &self,
        s: &mut wire::Deadlined,
        session: &wire::Session,
        (r, before): (usize, Delivery),
        deliveries: &Mutex<Vec<Delivery>>,
    ) -> io::Result<()> {
        let roots = lock(&self.ids).len();
        let result = (|| {
            if let Some(i) = nccl_safe::seam::root_made_by(self.world_size, roots, r) {
                if lock(&self.ids)[i].is_none() {
                    wire::write_frame(s, &session.want(roots as u32, i as u32))?;
                    let put = wire::read_frame(s)?;
                    let id = session.parse_put(&put, i as u32).ok_or_else(|| {
                        io::Error::new(io::ErrorKind::InvalidData, "not the root's id")
                    })?;
                    lock(&self.ids)[i] = Some(id);
                }
            }
            let ids: Vec<Option<[u8; ID_LEN]>> = lock(&self.ids).clone();
            let Some(all) = ids.iter().copied().collect::<Option<Vec<_>>>() else {
                let have = ids.iter().filter(|i| i.is_some()).count() as u32;
                let refusal = session.refuse(wire::R_ROOTS_PENDING, have, roots as u32);
                wire::write_frame(s, &refusal)?;
                return Ok(None);
            };
            for frame in session.ids_frames(&all) {
                wire::write_frame(s, &frame)?;
            }
            Ok(Some(wire::read_frame(s).is_ok_and(|a| a == [wire::ACK])))
        })();
        // Sent but not acknowledged: delivered (served again if the rank comes back).
        lock(deliveries)[r] = match result {
            Ok(Some(true)) => Delivery::Served,
            Ok(Some(false)) => Delivery::Delivered,
            Err(_) | Ok(None) => before,
        };
        result.map(drop)
    }
}

/// File rendezvous: rank 0 writes the id to a file every process can see (a shared
/// file system); the others poll for it until the deadline. Use a fresh path per job
/// (e.g. one containing `SLURM_JOB_ID`): a file left by an earlier job would be read.
#[derive(Debug, Clone)]
pub struct FileRendezvous {
    path: PathBuf,
    timeout: Duration,
    poll: Duration,
}

const FILE_LEN: usize = 16 + 4 + ID_LEN;
/// The magic of a root's file when a job has several roots.
const ROOTS_MAGIC: &[u8; 16] = b"nccl-safe-roots1";
const ROOTS_FILE_LEN: usize = 16 + 12 + ID_LEN;

impl FileRendezvous {
    /// A rendezvous through the file at `path`, with the default deadline.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            timeout: DEFAULT_TIMEOUT,
            poll: Duration::from_millis(20),
        }
    }

    /// Sets the deadline for the other ranks to see the file (default [`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rank 0: writes the id (readable by the owner only) to a temporary file next to the
    /// path and renames it into place, so readers never see a partial file.
    pub fn publish(&self, world_size: usize, id: &[u8; ID_LEN]) -> Result<(), RendezvousError> {
        let ferr = |source| RendezvousError::File {
            path: self.path.clone(),
            source,
        };
        let world = u32::try_from(world_size).map_err(|_| RendezvousError::InvalidRank {
            rank: 0,
            world_size,
        })?;
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = self
            .path
            .with_file_name(format!(".{name}.tmp.{}", std::process::id()));
        let data = [&wire::MAGIC[..], &world.to_be_bytes(), id].concat();
        let mut opts = fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let written = opts.open(&tmp).and_then(|mut f| {
            f.write_all(&data)?;
            f.sync_all()
        });
        if let Err(e) = written.and_then(|()| fs::rename(&tmp, &self.path)) {
            let _ = fs::remove_file(&tmp);
            return Err(ferr(e));
        }
        Ok(())
    }

    /// The file of root `root`'s id: the path for root 0, `<path>.root<root>` for the
    /// others.
    fn root_path(&self, root: usize) -> PathBuf {
        if root == 0 {
            return self.path.clone();
        }
        let mut name = self.path.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".root{root}"));
        self.path.with_file_name(name)
    }

    /// The rank that makes root `root`'s id of a job with `roots` (more than one): writes
    /// it, with the world size, the number of roots and its number, to its own file
    /// ([`publish`](Self::publish)'s way, under another magic, so that a reader of one id
    /// refuses it).
    pub(crate) fn publish_root(
        &self,
        world_size: usize,
        roots: usize,
        root: usize,
        id: &[u8; ID_LEN],
    ) -> Result<(), RendezvousError> {
        let numbers = [world_size, roots, root].map(|n| u32::try_from(n).ok());
        let [Some(world), Some(n), Some(i)] = numbers else {
            return Err(RendezvousError::InvalidRank {
                rank: 0,
                world_size,
            });
        };
        let data = [
            &ROOTS_MAGIC[..],
            &world.to_be_bytes(),
            &n.to_be_bytes(),
            &i.to_be_bytes(),
            id,
        ]
        .concat();
        self.write_file(&self.root_path(root), &data)
    }

    /// Every rank of a job with `roots` ids (more than one): waits for each root's file and
    /// reads its id, checking the world size and the number of roots (a file of one id, or
    /// of another number, is [`RendezvousError::RootsMismatch`]).
    pub(crate) fn read_roots(
        &self,
        rank: usize,
        world_size: usize,
        roots: usize,
    ) -> Result<Vec<[u8; ID_LEN]>, RendezvousError> {
        let deadline = Instant::now() + self.timeout;
        let mut ids = Vec::with_capacity(roots.min(1 << 16));
        for root in 0..roots {
            let path = self.root_path(root);
            let data = self.wait_for(&path, deadline)?;
            let bad = |detail: String| RendezvousError::FileContents {
                path: path.clone(),
                detail,
            };
            let mismatch = |n| RendezvousError::RootsMismatch {
                addr: path.display().to_string(),
                rank,
                published: Some(n),
                expected: roots,
            };
            if root == 0 && data.len() == FILE_LEN && &data[..16] == wire::MAGIC {
                return Err(mismatch(1));
            }
            if data.len() != ROOTS_FILE_LEN || &data[..16] != ROOTS_MAGIC {
                return Err(bad(
                    "it was not written by nccl-safe's file rendezvous".into()
                ));
            }
            let be = |at: usize| {
                u32::from_be_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]) as usize
            };
            let (world, n, i) = (be(16), be(20), be(24));
            if world != world_size {
                return Err(bad(format!(
                    "rank {} wrote it for {world} ranks but this rank expects {world_size}",
                    nccl_safe::scalable_root_rank(world_size, roots, root).unwrap_or(0)
                )));
            }
            if n != roots {
                return Err(mismatch(n));
            }
            if i != root {
                return Err(bad(format!("it holds root {i}'s id, not root {root}'s")));
            }
            let mut id = [0u8; ID_LEN];
            id.copy_from_slice(&data[28..]);
            ids.push(id);
        }
        Ok(ids)
    }

    /// Writes `data` (readable by the owner only) to a temporary file next to `path` and
    /// renames it into place, so readers never see a partial file.
    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), RendezvousError> {
        let ferr = |source| RendezvousError::File {
            path: path.to_path_buf(),
            source,
        };
        let name = (path.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
        let mut opts = fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let written = opts.open(&tmp).and_then(|mut f| {
            f.write_all(data)?;
            f.sync_all()
        });
        if let Err(e) = written.and_then(|()| fs::rename(&tmp, path)) {
            let _ = fs::remove_file(&tmp);
            return Err(ferr(e));
        }
        Ok(())
    }

    /// The contents of the file at `path`, once it is there; polled until `deadline`.
    fn wait_for(&self, path: &Path, deadline: Instant) -> Result<Vec<u8>, RendezvousError> {
        loop {
            match fs::read(path) {
                Ok(data) => return Ok(data),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    let path = path.to_path_buf();
                    return Err(RendezvousError::File { path, source });
                }
            }
            // The last read is at the deadline: a file written during the last sleep counts.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RendezvousError::FileTimeout {
                    path: path.to_path_buf(),
                    timeout: self.timeout,
                });
            }
            std::thread::sleep(self.poll.min(left));
        }
    }

    /// Ranks other than 0: waits for the file and reads the id, checking the world size.
    pub fn read(&self, world_size: usize) -> Result<[u8; ID_LEN], RendezvousError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match fs::read(&self.path) {
                Ok(data) => return self.parse(&data, world_size),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(RendezvousError::File {
                        path: self.path.clone(),
                        source,
                    })
                }
            }
            // The last read is at the deadline: a file written during the last sleep counts.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RendezvousError::FileTimeout {
                    path: self.path.clone(),
                    timeout: self.timeout,
                });
            }
            std::thread::sleep(self.poll.min(left));
        }
    }

    fn parse(&self, data: &[u8], world_size: usize) -> Result<[u8; ID_LEN], RendezvousError> {
        let bad = |detail: String| RendezvousError::FileContents {
            path: self.path.clone(),
            detail,
        };
        if data.len() == ROOTS_FILE_LEN && &data[..16] == ROOTS_MAGIC {
            let n = u32::from_be_bytes([data[20], data[21], data[22], data[23]]);
            return Err(bad(format!(
                "it holds the first of {n} unique ids (a scalable init's) but this rank expects one: \
                 give every rank the same number of roots"
            )));
        }
        if data.len() != FILE_LEN || &data[..16] != wire::MAGIC {
            return Err(bad(
                "it was not written by nccl-safe's file rendezvous".into()
            ));
        }
        let world = u32::from_be_bytes([data[16], data[17], data[18], data[19]]) as usize;
        if world != world_size {
            return Err(bad(format!(
                "rank 0 wrote it for {world} ranks but this rank expects {world_size}"
            )));
        }
        let mut id = [0u8; ID_LEN];
        id.copy_from_slice(&data[20..]);
        Ok(id)
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type CustomFn = Box<dyn FnOnce(Option<[u8; ID_LEN]>) -> Result<[u8; ID_LEN], BoxError> + Send>;

/// What [`Rendezvous::exchange`] gives back.
#[derive(Debug)]
pub struct Exchanged {
    /// The job's unique id, the same on every rank.
    pub id: [u8; ID_LEN],
    /// On rank 0 of a TCP rendezvous, the background server (others: `None`). Dropping it
    /// lets the server finish on its own; [`ServerHandle::wait`] reports missing ranks.
    pub server: Option<ServerHandle>,
}

/// How the ranks of a job agree on their unique id ([`exchange`](Self::exchange)), or on
/// the ids of a scalable init ([`exchange_roots`](Self::exchange_roots)): one entry point
/// over every transport.
#[derive(Debug)]
#[non_exhaustive]
pub enum Rendezvous {
    /// Over TCP, served by rank 0.
    Tcp(TcpRendezvous),
    /// Through a shared file.
    File(FileRendezvous),
    /// Through torchrun's c10d store.
    Store(StoreRendezvous),
    /// Through a closure of the user's (build it with [`Rendezvous::custom`]).
    Custom(CustomRendezvous),
}

/// A user-supplied exchange; see [`Rendezvous::custom`].
pub struct CustomRendezvous(CustomFn);

impl fmt::Debug for CustomRendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CustomRendezvous(..)")
    }
}

impl Rendezvous {
    /// The rendezvous of a launched job: under torchrun with the agent's store
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`) that store ([`StoreRendezvous::from_env`], no
    /// token); otherwise the TCP rendezvous ([`TcpRendezvous::from_env`], with its token).
    pub fn from_env(env: &ProcessEnv) -> Result<Self, RendezvousError> {
        if let Some(store) = StoreRendezvous::from_env(env) {
            return Ok(Rendezvous::Store(store));
        }
        TcpRendezvous::from_env(env).map(Rendezvous::Tcp)
    }

    /// A rendezvous through `exchange`, which gets `Some(id)` on rank 0 (to send) and `None`
    /// on the other ranks (to receive), and returns the job's id on every rank; for instance
    /// an `MPI_Bcast` from rank 0 or a put/get on a key-value store.
    pub fn custom<F, E>(exchange: F) -> Self
    where
        F: FnOnce(Option<[u8; ID_LEN]>) -> Result<[u8; ID_LEN], E> + Send + 'static,
        E: Into<BoxError>,
    {
        Rendezvous::Custom(CustomRendezvous(Box::new(move |id| {
            exchange(id).map_err(Into::into)
        })))
    }

    /// Gives every rank the same id. Rank 0 calls `make_id` (e.g. `ncclGetUniqueId`) and
    /// publishes its result; the other ranks receive it and never call `make_id`. Returns at
    /// once on rank 0 (a TCP server goes on in the background, see [`Exchanged::server`]).
    /// Errors of `make_id` come back unchanged; the exchange's own errors
    /// ([`Error::Rendezvous`], or [`Error::Store`] through torchrun's store) through `E::from`.
    pub fn exchange<E: From<Error>>(
        self,
        rank: usize,
        world_size: usize,
        make_id: impl FnOnce() -> Result<[u8; ID_LEN], E>,
    ) -> Result<Exchanged, E> {
        if rank >= world_size {
            return lift(Err(RendezvousError::InvalidRank { rank, world_size }));
        }
        if rank > 0 {
            let id = match self {
                Rendezvous::Tcp(t) => lift(t.fetch(rank, world_size))?,
                Rendezvous::File(f) => lift(f.read(world_size))?,
                Rendezvous::Store(s) => lift(s.read(rank, world_size))?,
                Rendezvous::Custom(CustomRendezvous(f)) => {
                    lift(f(None).map_err(|e| custom_failed(rank, &*e)))?
                }
            };
            return Ok(Exchanged { id, server: None });
        }
        let id = make_id()?;
        let server = match self {
            Rendezvous::Tcp(t) => Some(lift(t.serve(world_size, id))?),
            Rendezvous::File(f) => lift(f.publish(world_size, &id).map(|()| None))?,
            Rendezvous::Store(s) => lift(s.publish(world_size, &id).map(|()| None))?,
            Rendezvous::Custom(CustomRendezvous(f)) => {
                let got = lift(f(Some(id)).map_err(|e| custom_failed(rank, &*e)))?;
                if !wire::ct_eq(&got, &id) {
                    return lift(Err(RendezvousError::CustomMismatch));
                }
                None
            }
        };
        Ok(Exchanged { id, server })
    }
}

/// What [`Rendezvous::exchange_roots`] gives back.
#[derive(Debug)]
pub struct ExchangedIds {
    /// The job's unique ids, one per root, the same on every rank, in root order.
    pub ids: Vec<[u8; ID_LEN]>,
    /// On rank 0 of a TCP rendezvous, the background server (others: `None`).
    pub server: Option<ServerHandle>,
}

impl Rendezvous {
    /// Gives every rank the same `roots` unique ids (in `1..=world_size`), for
    /// `Communicator::init_rank_scalable`: id `i` is made (`make_id`) by rank
    /// [`scalable_root_rank`](nccl_safe::scalable_root_rank)`(world_size, roots, i)`, NCCL's
    /// `rankHasRoot` (docs/userguide usage/communicators.rst of 2.30.7), so each root runs
    /// in a process of the block it serves; the other ranks never call `make_id`. One
    /// root is [`exchange`](Self::exchange), the same messages byte for byte. With more:
    /// - TCP: each root rank sends its id to rank 0 (which asks for it after the
    ///   handshake, `WANT`/`PUT` under the token's MACs), and rank 0 serves every id to
    ///   every rank once it holds them all (`IDS`); until then a rank is told so and tries
    ///   again. The world size the ranks send carries a flag for "several roots", so a rank
    ///   of one root (or of an older nccl-safe) and a rank 0 of several refuse each other
    ///   at once ([`RendezvousError::RootsMismatch`] on this side).
    /// - File: root `i`'s id in `<path>.root<i>` (root 0's in the path), each with the
    ///   world size and the number of roots.
    /// - Store: root `i`'s id under [`StoreRendezvous::root_key`], likewise.
    /// - Custom: moves one id, so more roots are `InvalidArgument`.
    ///
    /// Every rank must ask for the same number of roots; a rendezvous that gives another
    /// is [`RendezvousError::RootsMismatch`] (never a wait). Rank 0 of a TCP rendezvous
    /// returns once every root's id is in.
    pub fn exchange_roots<E: From<Error>>(
        self,
        rank: usize,
        world_size: usize,
        roots: usize,
        make_id: impl FnOnce() -> Result<[u8; ID_LEN], E>,
    ) -> Result<ExchangedIds, E> {
        if rank >= world_size {
            return lift(Err(RendezvousError::InvalidRank { rank, world_size }));
        }
        if roots == 0 || roots > world_size {
            let m = format!("{roots} roots for {world_size} ranks: pass 1 to {world_size}");
            return Err(E::from(invalid("Rendezvous::exchange_roots", m)));
        }
        if roots == 1 {
            let x = self.exchange(rank, world_size, make_id)?;
            let (ids, server) = (vec![x.id], x.server);
            return Ok(ExchangedIds { ids, server });
        }
        if matches!(self, Rendezvous::Custom(_)) {
            let m = format!(
                "a custom rendezvous moves one unique id, not {roots}: use one root, or exchange \
                 the ids yourself and call ProcessLauncher::join_scalable"
            );
            return Err(E::from(invalid("Rendezvous::exchange_roots", m)));
        }
        let mine = match nccl_safe::seam::root_made_by(world_size, roots, rank) {
            Some(i) => Some((i, make_id()?)),
            None => None,
        };
        let (ids, server) = match self {
            Rendezvous::Tcp(t) => match mine {
                Some((0, id)) => {
                    let (server, ids) = lift(t.serve_roots(world_size, roots, id))?;
                    lift(gathered(server, &ids))?
                }
                _ => (lift(t.fetch_roots(rank, world_size, roots, mine))?, None),
            },
            Rendezvous::File(f) => {
                if let Some((i, id)) = mine {
                    lift(f.publish_root(world_size, roots, i, &id))?;
                }
                (lift(f.read_roots(rank, world_size, roots))?, None)
            }
            Rendezvous::Store(s) => {
                if let Some((i, id)) = mine {
                    lift(s.publish_root(world_size, roots, i, &id))?;
                }
                (lift(s.read_roots(rank, world_size, roots))?, None)
            }
            Rendezvous::Custom(_) => unreachable!("refused above"),
        };
        Ok(ExchangedIds { ids, server })
    }
}

/// Rank 0 of a TCP rendezvous of several roots: waits until `server` holds every id,
/// or ends (its deadline passed: its error names the ranks that never came).
fn gathered(
    server: ServerHandle,
    ids: &RootIds,
) -> Result<(Vec<[u8; ID_LEN]>, Option<ServerHandle>), RendezvousError> {
    loop {
        if let Some(all) = lock(ids).iter().copied().collect::<Option<Vec<_>>>() {
            return Ok((all, Some(server)));
        }
        if server.is_finished() {
            server.wait()?;
            let (addr, detail) = (String::new(), "the server ended without every id".into());
            return Err(RendezvousError::Protocol { addr, detail });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// An exchange's own error as the caller's `E` (through [`Error`]).
fn lift<T, X: Into<Error>, E: From<Error>>(r: Result<T, X>) -> Result<T, E> {
    r.map_err(|e| E::from(e.into()))
}

/// [`RendezvousError::Custom`]: the closure's error and its sources, as text.
fn custom_failed(rank: usize, e: &(dyn std::error::Error + 'static)) -> RendezvousError {
    let mut reason = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        reason.push_str(": ");
        reason.push_str(&s.to_string());
        source = s.source();
    }
    RendezvousError::Custom { rank, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &[u8] = b"unit-test-token-0123456789";

    fn id() -> [u8; ID_LEN] {
        std::array::from_fn(|i| i as u8)
    }

    /// A raw rank that authenticates as `rank` and reads the id, but never acknowledges it.
    fn take_id_without_ack(port: u16, rank: u32, world: u32) -> (TcpStream, [u8; ID_LEN]) {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        wire::bound_waits(&s, Duration::from_secs(5)).unwrap();
        let mut r = &s;
        let sn = wire::parse_hello(&wire::read_frame(&mut r).unwrap(), wire::MAGIC).unwrap();
        let cn = wire::nonce().unwrap();
        let session = wire::Session::new((wire::MAGIC, TOKEN), sn, cn, rank, world);
        wire::write_frame(&mut r, &session.auth_frame()).unwrap();
        let reply = wire::read_frame(&mut r).unwrap();
        assert_eq!(reply[0], wire::ID);
        let mut masked = [0u8; ID_LEN];
        masked.copy_from_slice(&reply[1..1 + ID_LEN]);
        (s, session.mask(&masked))
    }

    /// A rank whose acknowledgement is lost has the id: rank 0 does not report it missing.
    #[test]
    fn a_lost_acknowledgement_does_not_fail_rank_0() {
        let server = TcpRendezvous::new("127.0.0.1", 0, TOKEN)
            .timeout(Duration::from_secs(20))
            .io_timeout(Duration::from_millis(300))
            .serve(3, id())
            .unwrap();
        let port = server.local_addr().port();
        let (s, got) = take_id_without_ack(port, 1, 3);
        assert_eq!(got, id());
        drop(s); // the ACK never comes
        let two = TcpRendezvous::new("127.0.0.1", port, TOKEN)
            .fetch(2, 3)
            .unwrap();
        assert_eq!(two, id());
        let t0 = Instant::now();
        server.wait().unwrap();
        // It waited a grace period for the missing ACK, not its whole 20 s deadline.
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    }

    /// A rank whose id is still being delivered on another connection retries (it is not
    /// told "duplicate"), and gets the id once that connection's deadline has passed.
    #[test]
    fn an_in_progress_delivery_is_retried_not_fatal() {
        let io = Duration::from_millis(500);
        let server = TcpRendezvous::new("127.0.0.1", 0, TOKEN)
            .timeout(Duration::from_secs(20))
            .io_timeout(io)
            .serve(2, id())
            .unwrap();
        let port = server.local_addr().port();
        // The first connection holds rank 1's delivery, waiting for an ACK it never sends.
        let (held, _) = take_id_without_ack(port, 1, 2);
        let t0 = Instant::now();
        let got = TcpRendezvous::new("127.0.0.1", port, TOKEN)
            .timeout(Duration::from_secs(5))
            .fetch(1, 2)
            .unwrap();
        assert_eq!(got, id());
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(3), "{took:?}");
        drop(held);
        server.wait().unwrap();
    }

    /// The refusal of an authenticated peer carries a MAC the client checks.
    #[test]
    fn refusals_after_authentication_are_authenticated() {
        let (sn, cn) = (wire::nonce().unwrap(), wire::nonce().unwrap());
        let session =
            |token: &'static [u8], rank| wire::Session::new((wire::MAGIC, token), sn, cn, rank, 2);
        let f = session(TOKEN, 1).refuse(wire::R_DUPLICATE, 2, 1);
        assert!(session(TOKEN, 1).refuse_is_authentic(&f));
        assert!(!session(b"another-token-0123456", 1).refuse_is_authentic(&f));
        assert!(!session(TOKEN, 2).refuse_is_authentic(&f));
        let mut flipped = f.clone();
        flipped[1] = wire::R_WORLD;
        assert!(!session(TOKEN, 1).refuse_is_authentic(&flipped));
        let bare = wire::refuse(wire::R_DUPLICATE, 2, 1);
        assert!(!session(TOKEN, 1).refuse_is_authentic(&bare));
        assert_eq!(wire::parse_refuse(&f), wire::parse_refuse(&bare));
    }
}
