//! The desync board: a small service rank 0 hosts for the life of a multi-process job, to
//! which each rank posts what it was last doing when its clique times out, and from which
//! every rank reads the others' posts to build the cross-process desync report.
//!
//! It speaks the rendezvous's wire format and authentication (length-prefixed frames of at
//! most 4 KiB, the job token proved by HMAC-SHA-256 over fresh nonces, see
//! [`super::rendezvous`]), with its own magic `nccl-safe-board1`, which begins every MAC, so
//! neither protocol takes the other's frames. [`ProcessLauncher::init`](super::ProcessLauncher::init)
//! hosts it on `MASTER_PORT + 1` ([`BOARD_PORT_OFFSET`]) under Slurm and mpirun, and fails
//! when it cannot bind it; under torchrun the board is kept in the agent's store instead
//! ([`super::store::StoreBoard`]).
//!
//! One request per connection, after the handshake (`HELLO`, `AUTH` as in the rendezvous;
//! a wrong token, world size or rank gets a `REFUSE`):
//! - `POST | post | HMAC(token, magic | "post" | sn | cn | rank | post)`, answered by
//!   `ACK | HMAC(token, magic | "posted" | sn | cn | rank | post)`;
//! - `FETCH | HMAC(token, magic | "fetch" | sn | cn)`, answered by `BOARD | world` and one
//!   frame per rank `ENTRY | present | post | HMAC(token, magic | "entry" | sn | cn | rank |
//!   present | post)`.
//!
//! Each connection has one deadline for all its reads and writes (2 s by default), on both
//! sides; garbage, oversized frames and failed MACs only drop that connection. The
//! descriptor budget, connection limits, short tokens and the addresses bound are as in
//! the rendezvous (its module docs). A client tries every address of the board in turn
//! until its deadline (a post: twice the connection deadline), through connection errors,
//! a busy board and every answer that proves nothing (a wrong-token refusal, another
//! protocol, a failed MAC); only a refusal carrying the board's MAC ends it early, and
//! [`RendezvousError::BoardTimeout`] carries the last error. The exit of rank 0's process
//! waits (up to 1 s) for a request the board is serving, once its peer has proved the
//! token: a stranger's connection never holds it up.
//!
//! Posts are text from other processes: control characters (terminal escape sequences,
//! carriage returns, bidirectional overrides) are replaced with `?` where a post is received,
//! by the server and by a fetching client alike, so a report never prints them.

use super::common::RendezvousError;
use super::common::{check_token, dial, listen, refused, retry, Background, Conn};
use super::wire::{self, N};
use crate::lock;
use nccl_safe::diag::DesyncPost;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The board listens on the rendezvous port plus this.
pub const BOARD_PORT_OFFSET: u16 = 1;
/// Default bound on each connect, read and write of the board.
pub const DEFAULT_BOARD_IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the exit of rank 0's process waits for a connection the board is serving.
const SERVE_AT_EXIT: Duration = Duration::from_secs(1);
/// How long it waits for a connection whose peer has not proven the token yet.
const HANDSHAKE_AT_EXIT: Duration = Duration::from_millis(250);

const MAGIC: &[u8; 16] = b"nccl-safe-board1";
const POST: u8 = 16;
const FETCH: u8 = 17;
const BOARD: u8 = 18;
const ENTRY: u8 = 19;

fn post_mac(s: &wire::Session, body: &[u8]) -> [u8; N] {
    s.keyed(b"post", &[&s.rank.to_be_bytes(), body])
}

fn fetch_mac(s: &wire::Session) -> [u8; N] {
    s.keyed(b"fetch", &[])
}

fn entry_mac(s: &wire::Session, rank: u32, e: &[u8]) -> [u8; N] {
    s.keyed(b"entry", &[&rank.to_be_bytes(), e])
}

fn posted_mac(s: &wire::Session, body: &[u8]) -> [u8; N] {
    s.keyed(b"posted", &[&s.rank.to_be_bytes(), body])
}

/// How long a fetch of a board of `world_size` ranks may take.
fn fetch_time(io_timeout: Duration, world_size: usize) -> Duration {
    io_timeout.saturating_mul(4 + u32::try_from(world_size / 64).unwrap_or(u32::MAX))
}

/// `post` with every control character (and bidirectional override) replaced by `?`.
pub(crate) fn clean_post(post: DesyncPost) -> DesyncPost {
    let bad =
        |c: char| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !post.text.chars().any(bad) {
        return post;
    }
    DesyncPost {
        text: post
            .text
            .chars()
            .map(|c| if bad(c) { '?' } else { c })
            .collect(),
        ..post
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Rank 0's running desync board. Dropping it (or [`stop`](Self::stop)) closes the listener.
#[derive(Debug)]
pub struct DesyncBoard(Background<Option<()>>);

struct BoardServer {
    world_size: usize,
    token: Vec<u8>,
    posts: Mutex<Vec<Option<DesyncPost>>>,
}

impl DesyncBoard {
    /// Listens on `addr` (port 0: any free port) and serves a board of `world_size` ranks to
    /// peers holding `token`, from a background thread, until dropped.
    pub fn serve(
        addr: impl ToSocketAddrs,
        world_size: usize,
        token: impl Into<Vec<u8>>,
    ) -> Result<DesyncBoard, RendezvousError> {
        if world_size == 0 || u32::try_from(world_size).is_err() {
            return Err(RendezvousError::InvalidRank {
                rank: 0,
                world_size,
            });
        }
        let token = token.into();
        check_token(&token)?;
        let addrs: Vec<SocketAddr> = (addr.to_socket_addrs())
            .map_err(|source| RendezvousError::Resolve {
                addr: "the desync board's address".into(),
                source,
            })?
            .collect();
        let name = match addrs.first() {
            Some(a) => a.to_string(),
            None => "the desync board's address".into(),
        };
        let listeners = listen(&addrs, name, "desync board")?;
        let server = Arc::new(BoardServer {
            world_size,
            token,
            posts: Mutex::new(vec![None; world_size]),
        });
        let handle = move |stream: &TcpStream, conn: &wire::Admission| {
            // Errors only mean this peer is dropped; the board goes on.
            let _ = server.handle(stream, conn);
        };
        let run = move |listeners, stop: &AtomicBool| {
            let thread = "nccl-desync-peer";
            wire::serve(listeners, wire::LIMITS, stop, thread, || None, handle)
        };
        Background::spawn("nccl-desync-board", listeners, run).map(DesyncBoard)
    }

    /// The first address bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }

    /// Every address bound: each `addr` stands for that could be bound.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.0.local_addrs
    }

    /// Stops serving and closes the listener (within a few milliseconds).
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for DesyncBoard {
    fn drop(&mut self) {
        self.0.join(true);
    }
}

impl BoardServer {
    fn handle(&self, s: &TcpStream, conn: &wire::Admission) -> io::Result<()> {
        wire::bound_waits(s, DEFAULT_BOARD_IO_TIMEOUT)?;
        // One deadline for the whole connection, whatever the peer's pace.
        let start = Instant::now();
        let mut s = wire::Deadlined::new(s, start + DEFAULT_BOARD_IO_TIMEOUT);
        // A peer's handshake in flight when this process exits (rank 0 that failed first,
        // while the others, failed by the same peer's abort, come to read why) holds the
        // exit for `HANDSHAKE_AT_EXIT` at most: long enough for a token holder's, short
        // for a stranger's.
        let handshake = nccl_safe::seam::posting(Instant::now() + HANDSHAKE_AT_EXIT);
        let Some(session) =
            wire::accept_peer(&mut s, MAGIC, &self.token, conn, self.world_size, 0)?
        else {
            return Ok(());
        };
        // A token holder's request in flight when this process exits is served to its end:
        // exit waits for it.
        let _serving = nccl_safe::seam::posting(Instant::now() + SERVE_AT_EXIT);
        drop(handshake);
        // A token holder's fetch sends one frame per rank: as long as a client gives it.
        s.extend_to(start + fetch_time(DEFAULT_BOARD_IO_TIMEOUT, self.world_size));
        let req = wire::read_frame(&mut s)?;
        match req.first() {
            Some(&POST) if req.len() > N => {
                let (body, mac) = req[1..].split_at(req.len() - 1 - N);
                if !wire::ct_eq(mac, &post_mac(&session, body)) {
                    return Err(invalid("bad post MAC"));
                }
                let post =
                    nccl_safe::seam::decode_post(body).ok_or_else(|| invalid("not a post"))?;
                let post = clean_post(post);
                lock(&self.posts)[session.rank as usize] = Some(post);
                let ack = [&[wire::ACK][..], &posted_mac(&session, body)].concat();
                wire::write_frame(&mut s, &ack)
            }
            Some(&FETCH) if req.len() == 1 + N => {
                if !wire::ct_eq(&req[1..], &fetch_mac(&session)) {
                    return Err(invalid("bad fetch MAC"));
                }
                let posts = lock(&self.posts).clone();
                let head = [&[BOARD][..], &session.world.to_be_bytes()].concat();
                wire::write_frame(&mut s, &head)?;
                for (r, p) in posts.iter().enumerate() {
                    let mut e = vec![u8::from(p.is_some())];
                    if let Some(p) = p {
                        e.extend_from_slice(&nccl_safe::seam::encode_post(p));
                    }
                    let mac = entry_mac(&session, r as u32, &e);
                    wire::write_frame(&mut s, &[&[ENTRY][..], &e, &mac].concat())?;
                }
                Ok(())
            }
            _ => Err(invalid("not a board request")),
        }
    }
}

/// A rank's connection details for the desync board: where it is, the job's size and
/// token. Each [`post`](Self::post) or [`fetch`](Self::fetch) is one short connection.
#[derive(Debug, Clone)]
pub struct BoardClient {
    addr: String,
    world_size: usize,
    token: wire::Token,
    io_timeout: Duration,
}

impl BoardClient {
    /// The board at `addr` (`host:port`) of a job of `world_size` ranks holding `token`.
    pub fn new(addr: impl Into<String>, world_size: usize, token: impl Into<Vec<u8>>) -> Self {
        BoardClient {
            addr: addr.into(),
            world_size,
            token: wire::Token(token.into()),
            io_timeout: DEFAULT_BOARD_IO_TIMEOUT,
        }
    }

    /// Sets the deadline of one connection: its connect and all its reads and writes
    /// (default 2 s).
    pub fn io_timeout(mut self, io_timeout: Duration) -> Self {
        self.io_timeout = io_timeout;
        self
    }

    /// The board's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Posts `post` as rank `rank`'s latest (replacing its earlier one), trying again until
    /// twice the connection deadline has passed.
    pub fn post(&self, rank: usize, post: &DesyncPost) -> Result<(), RendezvousError> {
        self.post_by(rank, post, Instant::now() + 2 * self.io_timeout)
    }

    /// Every rank's latest post, rank-indexed (`None`: that rank posted nothing).
    pub fn fetch(&self) -> Result<Vec<Option<DesyncPost>>, RendezvousError> {
        self.fetch_by(Instant::now() + fetch_time(self.io_timeout, self.world_size))
    }

    fn protocol(&self, addr: &str, detail: &str) -> RendezvousError {
        RendezvousError::Protocol {
            addr: addr.to_string(),
            detail: format!("desync board: {detail}"),
        }
    }

    fn io(&self, addr: &str, what: &str) -> impl FnOnce(io::Error) -> RendezvousError {
        let context = format!("desync board at {addr}: {what}");
        move |source| RendezvousError::Io { context, source }
    }

    /// Runs `request` on an authenticated connection as `rank` (its handshake bounded by
    /// the connection deadline), on each address of the board in turn, until it succeeds,
    /// the board refuses with proof of the token, or `deadline` passes
    /// ([`RendezvousError::BoardTimeout`] with the last error). A busy board, a connection
    /// error, and every answer that proves nothing (a wrong-token refusal, another
    /// protocol, a failed MAC) are tried again.
    fn exchange<T>(
        &self,
        rank: usize,
        (action, deadline): (&'static str, Instant),
        mut request: impl FnMut(Conn, &str) -> Result<T, RendezvousError>,
    ) -> Result<T, RendezvousError> {
        let (Ok(r32), Ok(w32)) = (u32::try_from(rank), u32::try_from(self.world_size)) else {
            return Err(RendezvousError::InvalidRank {
                rank,
                world_size: self.world_size,
            });
        };
        check_token(&self.token)?;
        let start = Instant::now();
        let resolve = || {
            let addrs = self.addr.to_socket_addrs();
            let addrs = addrs.map_err(|source| RendezvousError::Resolve {
                addr: self.addr.clone(),
                source,
            })?;
            Ok(addrs.collect())
        };
        let attempt = |to, named: &str| {
            let by = (Instant::now() + self.io_timeout).min(deadline);
            let proto = ("desync board", MAGIC);
            let c = dial(
                to,
                named,
                proto,
                &self.token,
                (r32, w32),
                self.io_timeout,
                by,
            )?;
            request(c, named)
        };
        let timed_out = |last_error| RendezvousError::BoardTimeout {
            addr: self.addr.clone(),
            action,
            elapsed: start.elapsed(),
            last_error,
        };
        let pause = Duration::from_millis(200);
        retry(&self.addr, resolve, deadline, pause, attempt, timed_out)
    }

    /// The error for a frame from `addr` that is not the expected answer: a refusal, else a
    /// protocol error.
    fn refused_or(
        &self,
        c: &Conn,
        addr: &str,
        frame: &[u8],
        rank: usize,
        detail: &str,
    ) -> RendezvousError {
        refused(frame, &c.session, addr, rank).unwrap_or_else(|| self.protocol(addr, detail))
    }

    /// [`post`](Self::post) with its own deadline: each try's connection is bounded by the
    /// connection deadline, and the tries by `deadline`.
    fn post_by(
        &self,
        rank: usize,
        post: &DesyncPost,
        deadline: Instant,
    ) -> Result<(), RendezvousError> {
        let body = nccl_safe::seam::encode_post(post);
        self.exchange(rank, ("post to", deadline), |c, addr| {
            let mut s = c.io();
            let req = [&[POST][..], &body, &post_mac(&c.session, &body)].concat();
            // A refusal (e.g. wrong token) arrives instead of the ACK; the request may then
            // be unread, so a failed write is not yet an error.
            let sent = wire::write_frame(&mut s, &req);
            let reply = wire::read_frame(&mut s);
            let ack = [&[wire::ACK][..], &posted_mac(&c.session, &body)].concat();
            match (sent, reply) {
                (_, Ok(r)) if wire::ct_eq(&r, &ack) => Ok(()),
                (_, Ok(r)) if r.first() == Some(&wire::ACK) => {
                    let addr = addr.to_string();
                    Err(RendezvousError::ServerAuthentication { addr })
                }
                (_, Ok(r)) => {
                    Err(self.refused_or(&c, addr, &r, rank, "unexpected reply to a post"))
                }
                (Err(e), Err(_)) | (Ok(()), Err(e)) => Err(self.io(addr, "posting")(e)),
            }
        })
    }

    /// [`fetch`](Self::fetch) with its own deadline, for the whole fetch and its tries.
    fn fetch_by(&self, deadline: Instant) -> Result<Vec<Option<DesyncPost>>, RendezvousError> {
        self.exchange(0, ("fetch", deadline), |mut c, addr| {
            // A token holder's board sends one frame per rank: as long as the fetch has.
            c.extend_to(deadline);
            self.read_board(&c, addr)
        })
    }

    fn read_board(&self, c: &Conn, addr: &str) -> Result<Vec<Option<DesyncPost>>, RendezvousError> {
        let mut s = c.io();
        let req = [&[FETCH][..], &fetch_mac(&c.session)].concat();
        let sent = wire::write_frame(&mut s, &req);
        let head = match (sent, wire::read_frame(&mut s)) {
            (_, Ok(h)) => h,
            (Err(e), Err(_)) | (Ok(()), Err(e)) => return Err(self.io(addr, "fetching")(e)),
        };
        let want = c.session.world.to_be_bytes();
        if head.len() != 5 || head[0] != BOARD || head[1..] != want {
            return Err(self.refused_or(c, addr, &head, 0, "unexpected reply to a fetch"));
        }
        let mut posts = Vec::with_capacity(self.world_size.min(1 << 16));
        for r in 0..self.world_size {
            let f = wire::read_frame(&mut s).map_err(self.io(addr, "reading an entry"))?;
            if f.len() < 2 + N || f[0] != ENTRY {
                return Err(self.protocol(addr, "not a board entry"));
            }
            let (e, mac) = f[1..].split_at(f.len() - 1 - N);
            if !wire::ct_eq(mac, &entry_mac(&c.session, r as u32, e)) {
                let addr = addr.to_string();
                return Err(RendezvousError::ServerAuthentication { addr });
            }
            posts.push(match e[0] {
                0 => None,
                _ => Some(clean_post(
                    nccl_safe::seam::decode_post(&e[1..])
                        .ok_or_else(|| self.protocol(addr, "bad post"))?,
                )),
            });
        }
        Ok(posts)
    }
}

/// `RemoteBoard` for a desync board client of this crate, whose inherent `post_by` and
/// `fetch_by` fail with the launchers' errors (boxed for the core as a `BoardError`).
macro_rules! remote_board_by {
    ($client:ty) => {
        impl nccl_safe::diag::RemoteBoard for $client {
            fn post(
                &self,
                rank: usize,
                post: &nccl_safe::diag::DesyncPost,
                deadline: std::time::Instant,
            ) -> nccl_safe::diag::BoardResult<()> {
                Ok(self
                    .post_by(rank, post, deadline)
                    .map_err(crate::Error::from)?)
            }

            fn fetch(
                &self,
                deadline: std::time::Instant,
            ) -> nccl_safe::diag::BoardResult<Vec<Option<nccl_safe::diag::DesyncPost>>> {
                Ok(self.fetch_by(deadline).map_err(crate::Error::from)?)
            }
        }
    };
}
pub(crate) use remote_board_by;

remote_board_by!(BoardClient);
