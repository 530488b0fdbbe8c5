//! The rendezvous wire format: length-prefixed frames, HMAC-SHA-256, nonces.
//!
//! Every frame is a big-endian `u32` length followed by that many bytes, at most
//! [`MAX_FRAME`]; a longer prefix is refused before anything is allocated.

use super::fds::{self, Budget, Socket};
use crate::lock;
use sha2::{Digest, Sha256};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Largest frame body either side accepts.
pub(crate) const MAX_FRAME: usize = 4096;
/// Magic and protocol version at the start of the server's hello.
pub(crate) const MAGIC: &[u8; 16] = b"nccl-safe-rdzv/1";
/// Length of nonces and MACs.
pub(crate) const N: usize = 32;

/// Frame kinds (the first body byte).
pub(crate) const HELLO: u8 = 1;
pub(crate) const AUTH: u8 = 2;
pub(crate) const ID: u8 = 3;
pub(crate) const REFUSE: u8 = 4;
pub(crate) const ACK: u8 = 5;
/// A scalable init's frames (rank 0 serving several ids, see the rendezvous's docs).
pub(crate) const WANT: u8 = 6;
pub(crate) const PUT: u8 = 7;
pub(crate) const IDS: u8 = 8;

/// Set in the world size a peer sends when the job has several roots: a peer of one root
/// (or an older nccl-safe) is then refused with `R_WORLD` at once, each side seeing why.
pub(crate) const SEVERAL_ROOTS: u32 = 1 << 31;
/// Ids in one `IDS` frame (so a frame stays under [`MAX_FRAME`]).
pub(crate) const IDS_PER_FRAME: usize = 24;

/// Refusal codes carried in a REFUSE frame.
pub(crate) const R_TOKEN: u8 = 1;
pub(crate) const R_WORLD: u8 = 2;
pub(crate) const R_RANGE: u8 = 3;
pub(crate) const R_DUPLICATE: u8 = 4;
pub(crate) const R_BUSY: u8 = 5;
pub(crate) const R_IN_PROGRESS: u8 = 6;
pub(crate) const R_ROOTS_PENDING: u8 = 7;

/// The job token; its `Debug` is `<redacted>`.
#[derive(Clone)]
pub(crate) struct Token(pub Vec<u8>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::ops::Deref for Token {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

pub(crate) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    w.write_all(&[&len.to_be_bytes()[..], body].concat())?;
    w.flush()
}

pub(crate) fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame length {len} exceeds the {MAX_FRAME}-byte limit"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// HMAC-SHA-256 (RFC 2104) of the concatenation of `parts` under `key`.
pub(crate) fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; N] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..N].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Compares two byte strings in time that depends only on their lengths.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// 32 unpredictable bytes from the operating system (`getrandom(2)`: no file is opened).
pub(crate) fn nonce() -> io::Result<[u8; N]> {
    let mut n = [0u8; N];
    let mut got = 0;
    while got < N {
        let rest = &mut n[got..];
        // SAFETY: getrandom writes at most `rest.len()` bytes into `rest`.
        let r = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        match usize::try_from(r) {
            Ok(k) => got += k,
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(n)
}

/// What every MAC of one connection is taken over: the protocol (its magic), the token,
/// both nonces, and the rank and world the client claims.
#[derive(Clone, Copy)]
pub(crate) struct Session<'a> {
    magic: &'a [u8; 16],
    token: &'a [u8],
    sn: [u8; N],
    cn: [u8; N],
    pub rank: u32,
    pub world: u32,
}

impl<'a> Session<'a> {
    /// The session of one connection of the protocol of `magic`.
    pub(crate) fn new(
        (magic, token): (&'a [u8; 16], &'a [u8]),
        sn: [u8; N],
        cn: [u8; N],
        rank: u32,
        world: u32,
    ) -> Self {
        Session {
            magic,
            token,
            sn,
            cn,
            rank,
            world,
        }
    }

    /// `HMAC(token, magic | label | sn | cn | parts)`: the magic names the protocol, so a
    /// MAC of the rendezvous is never one of the desync board's, or the reverse.
    pub(crate) fn keyed(&self, label: &[u8], parts: &[&[u8]]) -> [u8; N] {
        let mut all: Vec<&[u8]> = vec![self.magic, label, &self.sn, &self.cn];
        all.extend_from_slice(parts);
        hmac(self.token, &all)
    }

    /// `HMAC(token, magic | label | sn | cn | rank | world | tail)`.
    fn mac(&self, label: &[u8], tail: &[u8]) -> [u8; N] {
        let (rank, world) = (self.rank.to_be_bytes(), self.world.to_be_bytes());
        self.keyed(label, &[&rank, &world, tail])
    }

    /// The MAC a client proves it holds the token with.
    pub(crate) fn client_mac(&self) -> [u8; N] {
        self.mac(b"client", &[])
    }

    /// The MAC the server proves it holds the token with, over the encrypted id.
    pub(crate) fn server_mac(&self, ct: &[u8]) -> [u8; N] {
        self.mac(b"server", ct)
    }

    /// Client side, step 2: the `AUTH` frame proving the token for `rank` of `world`.
    pub(crate) fn auth_frame(&self) -> Vec<u8> {
        let (rank, world) = (self.rank.to_be_bytes(), self.world.to_be_bytes());
        [&[AUTH][..], &rank, &world, &self.cn, &self.client_mac()].concat()
    }

    /// A `REFUSE` frame sent after the peer authenticated: followed by
    /// `HMAC(token, magic | "refuse" | sn | cn | rank | world | frame)`, so a relay cannot
    /// forge it.
    pub(crate) fn refuse(&self, code: u8, a: u32, b: u32) -> Vec<u8> {
        let v = refuse(code, a, b);
        [&v[..], &self.mac(b"refuse", &v)].concat()
    }

    /// Whether `frame` is a `REFUSE` frame carrying a valid MAC (see [`Session::refuse`]).
    pub(crate) fn refuse_is_authentic(&self, frame: &[u8]) -> bool {
        frame.len() == 10 + N && ct_eq(&frame[10..], &self.mac(b"refuse", &frame[..10]))
    }

    /// `id` XORed with the keystream of `label` and id number `index` (HMAC in counter
    /// mode); its own inverse.
    fn mask_at(&self, label: &[u8], index: u32, id: &[u8; 128]) -> [u8; 128] {
        let mut out = *id;
        for (i, chunk) in out.chunks_mut(N).enumerate() {
            let ks = self.keyed(label, &[&index.to_be_bytes(), &(i as u32).to_be_bytes()]);
            for (o, k) in chunk.iter_mut().zip(ks) {
                *o ^= k;
            }
        }
        out
    }

    /// Server: `WANT` asks a root rank for the id of root `root` of `roots`.
    pub(crate) fn want(&self, roots: u32, root: u32) -> Vec<u8> {
        let body = [&roots.to_be_bytes()[..], &root.to_be_bytes()].concat();
        [&[WANT][..], &body, &self.mac(b"want", &body)].concat()
    }

    /// Client: the `(roots, root)` of an authentic `WANT` frame.
    pub(crate) fn parse_want(&self, frame: &[u8]) -> Option<(u32, u32)> {
        if frame.len() != 1 + 8 + N || frame[0] != WANT {
            return None;
        }
        let body = &frame[1..9];
        if !ct_eq(&frame[9..], &self.mac(b"want", body)) {
            return None;
        }
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        Some((be(&body[..4]), be(&body[4..])))
    }

    /// Client: `PUT` sends root `root`'s id, masked, with a MAC of the client's.
    pub(crate) fn put(&self, root: u32, id: &[u8; 128]) -> Vec<u8> {
        let body = [&root.to_be_bytes()[..], &self.mask_at(b"put", root, id)].concat();
        [&[PUT][..], &body, &self.mac(b"put", &body)].concat()
    }

    /// Server: the id of an authentic `PUT` frame for root `root`.
    pub(crate) fn parse_put(&self, frame: &[u8], root: u32) -> Option<[u8; 128]> {
        if frame.len() != 1 + 4 + 128 + N || frame[0] != PUT {
            return None;
        }
        let body = &frame[1..5 + 128];
        if body[..4] != root.to_be_bytes() || !ct_eq(&frame[5 + 128..], &self.mac(b"put", body)) {
            return None;
        }
        let mut ct = [0u8; 128];
        ct.copy_from_slice(&body[4..]);
        Some(self.mask_at(b"put", root, &ct))
    }

    /// Server: the `IDS` frames carrying every id of a scalable init, masked,
    /// [`IDS_PER_FRAME`] to a frame, each `roots | first | count | ids | MAC`.
    pub(crate) fn ids_frames(&self, ids: &[[u8; 128]]) -> Vec<Vec<u8>> {
        let roots = ids.len() as u32;
        (ids.chunks(IDS_PER_FRAME).enumerate())
            .map(|(c, chunk)| {
                let first = (c * IDS_PER_FRAME) as u32;
                let mut body = [roots, first, chunk.len() as u32]
                    .map(u32::to_be_bytes)
                    .concat();
                for (k, id) in chunk.iter().enumerate() {
                    body.extend_from_slice(&self.mask_at(b"ids", first + k as u32, id));
                }
                [&[IDS][..], &body, &self.mac(b"ids", &body)].concat()
            })
            .collect()
    }

    /// Client: `(roots, first, ids)` of an authentic `IDS` frame.
    pub(crate) fn parse_ids(&self, frame: &[u8]) -> Option<(u32, u32, Vec<[u8; 128]>)> {
        if frame.len() < 1 + 12 + N || frame[0] != IDS {
            return None;
        }
        let (body, mac) = frame[1..].split_at(frame.len() - 1 - N);
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let (roots, first, count) = (be(&body[..4]), be(&body[4..8]), be(&body[8..12]));
        if body.len() != 12 + 128 * count as usize || !ct_eq(mac, &self.mac(b"ids", body)) {
            return None;
        }
        let ids = (body[12..].chunks(128).enumerate())
            .map(|(k, ct)| {
                let mut c = [0u8; 128];
                c.copy_from_slice(ct);
                self.mask_at(b"ids", first.wrapping_add(k as u32), &c)
            })
            .collect();
        Some((roots, first, ids))
    }

    /// XORs `id` with a keystream derived from the token and both nonces (HMAC in counter
    /// mode), so the id does not cross the network in clear. Its own inverse.
    pub(crate) fn mask(&self, id: &[u8; 128]) -> [u8; 128] {
        let mut out = *id;
        for (i, chunk) in out.chunks_mut(N).enumerate() {
            let ks = self.keyed(b"stream", &[&(i as u32).to_be_bytes()]);
            for (o, k) in chunk.iter_mut().zip(ks) {
                *o ^= k;
            }
        }
        out
    }
}

/// Connects to the first of `addrs` that answers, each try bounded by `timeout` and all of
/// them by `deadline`.
pub(crate) fn connect_any(
    addrs: impl IntoIterator<Item = SocketAddr>,
    timeout: Duration,
    deadline: Option<Instant>,
) -> io::Result<TcpStream> {
    let mut last = io::Error::new(
        io::ErrorKind::AddrNotAvailable,
        "the name resolved to no address",
    );
    for a in addrs {
        let left = deadline.map_or(timeout, |d| {
            d.saturating_duration_since(Instant::now()).min(timeout)
        });
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Puts an accepted or connected stream in blocking mode with every read and write bounded
/// by `t`.
pub(crate) fn bound_waits(s: &TcpStream, t: Duration) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))?;
    let _ = s.set_nodelay(true);
    Ok(())
}

/// A stream whose reads and writes, together, end by one deadline: before each call the
/// socket's timeout is set to the time left, so a peer sending one byte at a time cannot
/// stretch a frame (or a whole handshake) past it.
pub(crate) struct Deadlined<'a> {
    s: &'a TcpStream,
    deadline: Instant,
}

impl<'a> Deadlined<'a> {
    pub(crate) fn new(s: &'a TcpStream, deadline: Instant) -> Self {
        Deadlined { s, deadline }
    }

    /// Moves the deadline to `deadline` (for an authenticated peer whose request takes
    /// longer than a handshake).
    pub(crate) fn extend_to(&mut self, deadline: Instant) {
        self.deadline = self.deadline.max(deadline);
    }

    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the connection's deadline passed",
            ));
        }
        Ok(left)
    }
}

fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "the connection's deadline passed")
    } else {
        e
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.s).read(buf).map_err(timed_out)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.s).write(buf).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        (&mut &*self.s).flush()
    }
}

/// How many connections a server keeps open at once: in all, and not yet authenticated
/// from one source (see [`serve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub total: usize,
    pub per_peer: usize,
}

/// The default [`Limits`].
pub(crate) const LIMITS: Limits = Limits {
    total: 256,
    per_peer: 64,
};

/// Where a connection comes from, for the per-source cap: its IPv4 address, or the /64
/// prefix of its IPv6 address (one host commonly holds a whole /64).
fn source(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut seg = v6.segments();
                seg[4..].fill(0);
                IpAddr::V6(Ipv6Addr::from(seg))
            }
        },
        v4 => v4,
    }
}

struct Entry {
    id: u64,
    /// Which server of the process accepted it.
    server: u64,
    source: IpAddr,
    authenticated: bool,
    /// The socket, shared with the connection's thread, to shut it down when evicted.
    socket: Arc<Socket>,
}

/// Every connection the servers of this process hold, oldest first.
static OPEN: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Which of the `open` connections that `within` selects to close to make room: one that
/// has not authenticated, of the source holding the most of those (ties: the source of
/// the oldest), its oldest. A stranger's connections go before a rank's pending one as
/// long as the stranger holds more of them from one source.
fn victim(open: &[Entry], within: impl Fn(&Entry) -> bool) -> Option<usize> {
    let mut sources: Vec<(IpAddr, usize, usize)> = Vec::new(); // (source, count, oldest)
    for (i, e) in open.iter().enumerate() {
        if e.authenticated || !within(e) {
            continue;
        }
        match sources.iter_mut().find(|s| s.0 == e.source) {
            Some(s) => s.1 += 1,
            None => sources.push((e.source, 1, i)),
        }
    }
    let best = sources
        .iter()
        .max_by_key(|s| (s.1, std::cmp::Reverse(s.2)))?;
    Some(best.2)
}

/// Closes the connection at `i` of `open`: its thread sees the end of the stream and lets
/// go of the socket, whose descriptor then returns to the budget.
fn evict(open: &mut Vec<Entry>, i: usize) {
    let e = open.remove(i);
    let _ = e.socket.shutdown(Shutdown::Both);
}

/// When the servers hold their whole descriptor budget: closes an eighth of it (at least
/// one connection, each chosen by [`victim`]), unless connections closed before are still
/// being let go of. Closing several at once lets the accepts drain a backlog a stranger
/// filled at the pace of `accept`, not at one connection per close.
fn make_room(budget: &Budget) {
    let mut open = lock(&OPEN);
    if budget.open() > open.len() {
        return;
    }
    for _ in 0..(budget.cap / 8).max(1) {
        match victim(&open, |_| true) {
            Some(i) => evict(&mut open, i),
            None => break,
        }
    }
}

/// Registers a connection of `server` from `peer`, making room under `limits` (at most
/// `per_source` unauthenticated connections from one source, `limits.total` in all);
/// `None` when the server's connections have all authenticated.
fn admit(
    server: u64,
    socket: &Arc<Socket>,
    peer: IpAddr,
    limits: Limits,
    per_source: usize,
) -> Option<Admission> {
    let source = source(peer);
    let mut open = lock(&OPEN);
    let strangers = |e: &Entry| e.server == server && !e.authenticated && e.source == source;
    if open.iter().filter(|e| strangers(e)).count() >= per_source {
        if let Some(i) = open.iter().position(strangers) {
            evict(&mut open, i);
        }
    }
    if open.iter().filter(|e| e.server == server).count() >= limits.total.max(1) {
        let i = victim(&open, |e| e.server == server)?;
        evict(&mut open, i);
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    open.push(Entry {
        id,
        server,
        source,
        authenticated: false,
        socket: Arc::clone(socket),
    });
    Some(Admission { id })
}

/// One admitted connection's place among the open ones; freed when dropped.
pub(crate) struct Admission {
    id: u64,
}

impl Admission {
    /// The peer proved it holds the token: it is no longer evicted to make room.
    pub(crate) fn authenticated(&self) {
        if let Some(e) = lock(&OPEN).iter_mut().find(|e| e.id == self.id) {
            e.authenticated = true;
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        lock(&OPEN).retain(|e| e.id != self.id);
    }
}

/// Serves the non-blocking `listeners` until `stop` is set or `tick`, called before each
/// accept, returns a result.
///
/// Each accept first takes a descriptor of the process's budget ([`fds`](super::fds));
/// when the servers hold it all, one connection that has not authenticated is closed (of
/// the source holding the most, see [`victim`]) and the accept waits until its descriptor
/// is back. Each connection is then admitted under `limits`: a source past its share of
/// unauthenticated connections (`per_peer`, and at most a quarter of the budget) loses its
/// oldest one, and a server holding `total` connections closes one that has not
/// authenticated; a rank authenticates one round trip after connecting, so a stranger's
/// idle or slow connections cannot keep it out. Only when all of a server's connections
/// have authenticated is the newcomer told `R_BUSY` in place of the hello (it retries
/// until its deadline). Each admitted connection is handed to `handle` on a thread of its
/// own named `peer_thread` (an error there only drops that peer). With nothing to accept
/// (or a transient error such as `EMFILE`) it sleeps 5 ms.
pub(crate) fn serve<T>(
    listeners: Vec<TcpListener>,
    limits: Limits,
    stop: &AtomicBool,
    peer_thread: &str,
    mut tick: impl FnMut() -> Option<T>,
    handle: impl Fn(&TcpStream, &Admission) + Send + Sync + 'static,
) -> Option<T> {
    static SERVERS: AtomicU64 = AtomicU64::new(1);
    let server = SERVERS.fetch_add(1, Ordering::Relaxed);
    let budget = fds::budget();
    let per_source = limits.per_peer.max(1).min((budget.cap / 4).max(1));
    let handle = Arc::new(handle);
    let mut first = 0;
    while !stop.load(Ordering::Acquire) {
        if let Some(t) = tick() {
            return Some(t);
        }
        let Some(held) = budget.take() else {
            make_room(budget);
            thread::sleep(Duration::from_micros(200));
            continue;
        };
        // The listeners in turn, from a different one each time, so none starves another.
        first = (first + 1) % listeners.len().max(1);
        let (back, front) = listeners.split_at(first);
        let Some((stream, peer)) = front.iter().chain(back).find_map(|l| l.accept().ok()) else {
            drop(held);
            thread::sleep(Duration::from_millis(5));
            continue;
        };
        let socket = Arc::new(Socket::new(stream, held));
        let Some(admission) = admit(server, &socket, peer.ip(), limits, per_source) else {
            let _ = socket.set_nonblocking(false);
            let _ = socket.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = write_frame(&mut &**socket, &refuse(R_BUSY, 0, 0));
            continue;
        };
        let handle = Arc::clone(&handle);
        // A failed spawn drops the closure, and with it the socket and the admission.
        let _ = (thread::Builder::new().name(peer_thread.into()))
            .spawn(move || handle(&socket, &admission));
    }
    None
}

/// Client side, step 1: the server nonce of a `HELLO` frame carrying `magic`.
pub(crate) fn parse_hello(frame: &[u8], magic: &[u8; 16]) -> Option<[u8; N]> {
    if frame.len() != 1 + magic.len() + N || frame[0] != HELLO || &frame[1..17] != magic {
        return None;
    }
    let mut sn = [0u8; N];
    sn.copy_from_slice(&frame[17..]);
    Some(sn)
}

/// Server side, steps 1 and 2 on an admitted connection: sends `HELLO` with `magic`, reads
/// the `AUTH` frame and marks `conn` authenticated. A wrong token is refused (`R_TOKEN`,
/// without a MAC); a world size other than `world_size` (`R_WORLD`) or a rank outside
/// `first_rank..world_size` (`R_RANGE`), with one. `Ok(None)`: the peer was refused; `Err`:
/// not an `AUTH` frame at all (drop the peer).
pub(crate) fn accept_peer<'a>(
    s: &mut (impl Read + Write),
    magic: &'a [u8; 16],
    token: &'a [u8],
    conn: &Admission,
    world_size: usize,
    first_rank: usize,
) -> io::Result<Option<Session<'a>>> {
    let ours = u32::try_from(world_size).unwrap_or(u32::MAX);
    accept_peer_as(s, (magic, token), conn, (world_size, ours), first_rank)
}

/// [`accept_peer`] where the world size peers send is `wire_world` (the world size, with
/// [`SEVERAL_ROOTS`] set for a scalable init's rendezvous).
pub(crate) fn accept_peer_as<'a>(
    s: &mut (impl Read + Write),
    (magic, token): (&'a [u8; 16], &'a [u8]),
    conn: &Admission,
    (world_size, ours): (usize, u32),
    first_rank: usize,
) -> io::Result<Option<Session<'a>>> {
    let sn = nonce()?;
    write_frame(s, &[&[HELLO][..], magic, &sn].concat())?;
    let auth = read_frame(s)?;
    if auth.len() != 1 + 4 + 4 + N + N || auth[0] != AUTH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an authentication frame",
        ));
    }
    let rank = u32::from_be_bytes([auth[1], auth[2], auth[3], auth[4]]);
    let world = u32::from_be_bytes([auth[5], auth[6], auth[7], auth[8]]);
    let mut cn = [0u8; N];
    cn.copy_from_slice(&auth[9..9 + N]);
    let session = Session::new((magic, token), sn, cn, rank, world);
    if !ct_eq(&auth[9 + N..], &session.client_mac()) {
        write_frame(s, &refuse(R_TOKEN, 0, 0))?;
        return Ok(None);
    }
    conn.authenticated();
    let plain = u32::try_from(world_size).unwrap_or(u32::MAX);
    let refusal = if world != ours || u32::try_from(world_size).is_err() {
        session.refuse(R_WORLD, ours, world)
    } else if !(first_rank..world_size).contains(&(rank as usize)) {
        session.refuse(R_RANGE, plain, rank)
    } else {
        return Ok(Some(session));
    };
    write_frame(s, &refusal)?;
    Ok(None)
}

/// A `REFUSE` frame with its code and two numbers, as sent before the peer authenticated
/// (a wrong token, or busy).
pub(crate) fn refuse(code: u8, a: u32, b: u32) -> Vec<u8> {
    [&[REFUSE, code][..], &a.to_be_bytes(), &b.to_be_bytes()].concat()
}

/// The code and numbers of a `REFUSE` frame (with or without its MAC).
pub(crate) fn parse_refuse(frame: &[u8]) -> Option<(u8, usize, usize)> {
    if (frame.len() != 10 && frame.len() != 10 + N) || frame[0] != REFUSE {
        return None;
    }
    let a = u32::from_be_bytes([frame[2], frame[3], frame[4], frame[5]]) as usize;
    let b = u32::from_be_bytes([frame[6], frame[7], frame[8], frame[9]]) as usize;
    Some((frame[1], a, b))
}

/// Whether a frame read in place of the hello is the server's busy refusal.
pub(crate) fn is_busy(frame: &[u8]) -> bool {
    matches!(parse_refuse(frame), Some((R_BUSY, _, _)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc4231() {
        // Test case 1 and 2 of RFC 4231.
        assert_eq!(
            hex(&hmac(&[0x0b; 20], &[b"Hi There"])),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(&hmac(b"Jefe", &[b"what do ya want ", b"for nothing?"])),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block is hashed first.
        assert_eq!(
            hex(&hmac(
                &[0xaa; 131],
                &[b"Test Using Larger Than Block-Size Key - Hash Key First"]
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn frames_round_trip_and_bound_length() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"abc").unwrap();
        assert_eq!(read_frame(&mut &buf[..]).unwrap(), b"abc");
        let huge = u32::MAX.to_be_bytes();
        assert_eq!(
            read_frame(&mut &huge[..]).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert!(write_frame(&mut Vec::new(), &[0; MAX_FRAME + 1]).is_err());
    }

    /// A scalable init's frames come back as sent, and a frame changed in any byte, cut
    /// short, or read in another session is refused (`None`).
    #[test]
    fn root_frames_round_trip_and_refuse_tampering() {
        let (sn, cn) = (nonce().unwrap(), nonce().unwrap());
        let s = Session::new((MAGIC, b"token-token-token"), sn, cn, 2, 3 | SEVERAL_ROOTS);
        let other = Session::new((MAGIC, b"token-token-token"), sn, cn, 1, 3 | SEVERAL_ROOTS);
        let want = s.want(3, 1);
        assert_eq!(s.parse_want(&want), Some((3, 1)));
        assert_eq!(other.parse_want(&want), None);
        let put = s.put(1, &[9; 128]);
        assert_eq!(s.parse_put(&put, 1), Some([9; 128]));
        assert_eq!(s.parse_put(&put, 2), None);
        assert_ne!(&put[5..5 + 128], &[9; 128][..], "the id crosses masked");
        let ids: Vec<[u8; 128]> = (0..30u8).map(|i| [i; 128]).collect();
        let frames = s.ids_frames(&ids);
        assert_eq!(frames.len(), 2);
        assert!(frames.iter().all(|f| f.len() <= MAX_FRAME));
        let mut back = Vec::new();
        for f in &frames {
            let (n, first, got) = s.parse_ids(f).unwrap();
            assert_eq!((n, first as usize), (30, back.len()));
            back.extend(got);
        }
        assert_eq!(back, ids);
        for f in [&want, &put, &frames[1]] {
            for at in [1, f.len() / 2, f.len() - 1] {
                let mut bad = f.clone();
                bad[at] ^= 1;
                assert!(s.parse_want(&bad).is_none() && s.parse_ids(&bad).is_none());
                assert!(s.parse_put(&bad, 1).is_none());
            }
            assert!(s.parse_ids(&f[..f.len() - 1]).is_none());
            assert!(s.parse_want(&f[..f.len() - 1]).is_none());
            assert!(s.parse_put(&f[..f.len() - 1], 1).is_none());
        }
        assert!(s.parse_ids(&[IDS]).is_none());
    }

    #[test]
    fn mask_is_an_involution() {
        let id = [7u8; 128];
        let (sn, cn) = (nonce().unwrap(), nonce().unwrap());
        let s = Session::new((MAGIC, b"t"), sn, cn, 1, 2);
        let m = s.mask(&id);
        assert_ne!(m, id);
        assert_eq!(s.mask(&m), id);
    }
}
