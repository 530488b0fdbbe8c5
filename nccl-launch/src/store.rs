//! A client of PyTorch's c10d `TCPStore`, the key-value store torchrun's agent serves on
//! `MASTER_ADDR:MASTER_PORT`, and the id exchange and desync board built on it.
//!
//! Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`), PyTorch's own workers bind nothing:
//! they connect to the agent's store and exchange what they need through it. [`StoreRendezvous`]
//! does the same for the NCCL unique id: rank 0 sets it under a key unique to the job's run id
//! and restart count (so a restarted job never reads the id of its previous attempt), and the
//! other ranks wait for that key. No token is needed: the store is the job's boundary, as it
//! is for PyTorch.
//!
//! # Wire format
//! As PyTorch's `TCPStore` client speaks it (`torch/csrc/distributed/c10d/TCPStore.cpp`,
//! with the query types of `TCPStoreBackend.hpp`; both the libuv server, torchrun's default,
//! and the older one answer it). Numbers are in the host's byte order, which is
//! little-endian on every platform PyTorch ships for; strings and byte vectors are a `u64`
//! length and the bytes. Each request is a query-type byte and its arguments:
//!
//! | query | type | arguments | answer |
//! |---|---|---|---|
//! | `VALIDATE` | 0 | `u32` magic `0x3C85F7CE` | none (a wrong magic closes the connection) |
//! | `SET` | 1 | key, value | none |
//! | `COMPARE_SET` | 2 | key, expected, desired | the value now stored |
//! | `GET` | 3 | key | the value |
//! | `ADD` | 4 | key, `i64` delta | the new `i64` value |
//! | `CHECK` | 5 | `u64` count, keys | `u8`: 0 all present, 1 not |
//! | `WAIT` | 6 | `u64` count, keys | `u8` 0 (stop waiting) once all are present |
//! | `DELETE_KEY` | 8 | key | `i64`: how many keys were deleted (0 or 1) |
//! | `CANCEL_WAIT` | 12 | none | `u8` 1 (wait canceled), after a 0 if the wait had just ended |
//! | `PING` | 13 | `u32` nonce | the same `u32` |
//!
//! # Keys
//! PyTorch's C++ client puts `/` before every key it sends (its `TCPStore`'s `keyPrefix_`),
//! so Python's `store.set("k", ..)` is the key `/k` on the server. [`StoreClient`] does the
//! same: `set("k")` is Python's `store.get("k")`, and the reverse, under the same names. The
//! id exchange and the desync board use keys under `nccl-safe/<run id>/attempt_<restart>/`,
//! apart from any key of the job's own.
//!
//! # Older servers
//! `PING` and `CANCEL_WAIT` are the newest queries; a server from before them drops a
//! client that sends one. When the first `PING` closes the connection, the client connects
//! again and speaks without them ([`StoreClient::answers_ping`] is then `false`): a `CHECK`
//! of no key stands for the ping, and a wait that times out moves to a fresh connection
//! instead of being canceled. The oldest server this client speaks to is PyTorch 2.2's
//! (the first with `VALIDATE`, which moved every other query type up by one); CI checks it
//! against the servers (libuv and the older one) of PyTorch 2.2.2 and of the current
//! release. A 2.1 server reads the handshake as another query and never answers it:
//! [`StoreClient::connect`] then fails with [`StoreError::Timeout`] after its deadline.
//!
//! Every read of [`StoreClient`] ends by a deadline (one per request), every length the
//! server sends is checked against [`MAX_VALUE_LEN`] before anything is allocated, and a
//! server that answers garbage or closes mid-answer gives a [`StoreError`] naming its
//! address and the request.

use super::common::{RendezvousError, ID_LEN};
pub use super::common::{StoreError, MAX_VALUE_LEN};
use super::desync::clean_post;
use super::env::ProcessEnv;
use super::wire::{connect_any, Deadlined};
use crate::error::Result as LaunchResult;
use nccl_safe::diag::DesyncPost;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The magic a client sends in its `VALIDATE` query.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// Default deadline of one request (and of connecting).
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(30);

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const DELETE_KEY: u8 = 8;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;

const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// One connection to a c10d `TCPStore` (see the [module docs](self) for the protocol).
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    stream: TcpStream,
    timeout: Duration,
    deadline: Option<Instant>,
    /// Whether the server answers `PING` (and `CANCEL_WAIT`): PyTorch's servers before
    /// those queries drop a client that sends them.
    modern: bool,
}

/// A key as PyTorch's C++ client sends it: every key of its `TCPStore` starts with `/`
/// (its `keyPrefix_`), so that `StoreClient::set("k")` is Python's `store.get("k")`.
fn wire_key(key: &str) -> Vec<u8> {
    [b"/", key.as_bytes()].concat()
}

/// `host:port`, with brackets around an IPv6 host.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl StoreClient {
    /// Connects to the store at `addr` (`host:port`), validates (sending the magic) and
    /// pings it (checking the echo), each step ending within `timeout`.
    pub fn connect(addr: &str, timeout: Duration) -> Result<StoreClient, StoreError> {
        Self::connect_by(addr, timeout, None)
    }

    fn connect_by(
        addr: &str,
        timeout: Duration,
        deadline: Option<Instant>,
    ) -> Result<StoreClient, StoreError> {
        let mut c = Self::open(addr, timeout, deadline, true)?;
        match c.ping() {
            // A server without PING (older PyTorch) drops the client: connect again and
            // speak without it (`ping` is then a query every release answers).
            Err(StoreError::Closed { .. }) => {
                let mut old = Self::open(addr, timeout, deadline, false)?;
                old.ping()?;
                Ok(old)
            }
            Err(e) => Err(e),
            Ok(()) => Ok(c),
        }
    }

    /// A connection to `addr`, validated (no answer comes to that), each step ending within
    /// `timeout` and by `deadline`.
    fn open(
        addr: &str,
        timeout: Duration,
        deadline: Option<Instant>,
        modern: bool,
    ) -> Result<StoreClient, StoreError> {
        let fail = |source| StoreError::Connect {
            addr: addr.to_string(),
            source,
        };
        let addrs = addr.to_socket_addrs().map_err(fail)?;
        let stream = connect_any(addrs, timeout, deadline).map_err(fail)?;
        let _ = stream.set_nodelay(true);
        let c = StoreClient {
            addr: addr.to_string(),
            stream,
            timeout: timeout.max(Duration::from_millis(1)),
            deadline,
            modern,
        };
        c.send(
            "VALIDATE",
            &[&[VALIDATE][..], &VALIDATION_MAGIC.to_le_bytes()].concat(),
        )?;
        Ok(c)
    }

    /// Whether the server answers `PING` and `CANCEL_WAIT` (PyTorch's servers since those
    /// queries were added); an older one is spoken to without them.
    pub fn answers_ping(&self) -> bool {
        self.modern
    }

    /// The store's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sets a deadline no request goes past (on top of each request's own timeout).
    pub fn bounded_by(mut self, deadline: Instant) -> StoreClient {
        self.deadline = Some(deadline);
        self
    }

    fn op_deadline(&self, t: Duration) -> Instant {
        let d = Instant::now() + t;
        self.deadline.map_or(d, |o| o.min(d))
    }

    fn err(&self, call: &str) -> impl Fn(io::Error) -> StoreError + '_ {
        let call = call.to_string();
        move |e| match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => StoreError::Timeout {
                addr: self.addr.clone(),
                call: call.clone(),
                timeout: self.timeout,
            },
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => StoreError::Closed {
                addr: self.addr.clone(),
                call: call.clone(),
            },
            _ => StoreError::Io {
                addr: self.addr.clone(),
                call: call.clone(),
                source: e,
            },
        }
    }

    fn protocol(&self, call: &str, detail: String) -> StoreError {
        StoreError::Protocol {
            addr: self.addr.clone(),
            call: call.to_string(),
            detail,
        }
    }

    fn send(&self, call: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let by = self.op_deadline(self.timeout);
        let mut s = Deadlined::new(&self.stream, by);
        s.write_all(bytes)
            .and_then(|()| s.flush())
            .map_err(self.err(call))
    }

    fn read_exact_by(&self, call: &str, buf: &mut [u8], by: Instant) -> Result<(), StoreError> {
        Deadlined::new(&self.stream, by)
            .read_exact(buf)
            .map_err(self.err(call))
    }

    fn read_n<const N: usize>(&self, call: &str, by: Instant) -> Result<[u8; N], StoreError> {
        let mut b = [0u8; N];
        self.read_exact_by(call, &mut b, by)?;
        Ok(b)
    }

    fn read_bytes(&self, call: &str, by: Instant) -> Result<Vec<u8>, StoreError> {
        let mut len = [0u8; 8];
        self.read_exact_by(call, &mut len, by)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_VALUE_LEN as u64 {
            return Err(StoreError::TooLarge {
                addr: self.addr.clone(),
                call: call.to_string(),
                what: "answer",
                len,
            });
        }
        let mut v = vec![0u8; len as usize];
        self.read_exact_by(call, &mut v, by)?;
        Ok(v)
    }

    fn put_bytes(
        &self,
        q: &mut Vec<u8>,
        call: &str,
        what: &'static str,
        b: &[u8],
    ) -> Result<(), StoreError> {
        if b.len() > MAX_VALUE_LEN {
            return Err(StoreError::TooLarge {
                addr: self.addr.clone(),
                call: call.to_string(),
                what,
                len: b.len() as u64,
            });
        }
        q.extend_from_slice(&(b.len() as u64).to_le_bytes());
        q.extend_from_slice(b);
        Ok(())
    }

    /// Sends query `kind` of `key` (`op` names it in errors), then `values` and `tail`.
    fn key_query(
        &self,
        (kind, op): (u8, &str),
        key: &str,
        values: &[&[u8]],
        tail: &[u8],
    ) -> Result<(), StoreError> {
        let mut q = vec![kind];
        self.put_bytes(&mut q, op, "key", &wire_key(key))?;
        for v in values {
            self.put_bytes(&mut q, op, "value", v)?;
        }
        self.send(op, &[&q[..], tail].concat())
    }

    fn keys_query(&self, kind: u8, call: &str, keys: &[&str]) -> Result<Vec<u8>, StoreError> {
        let mut q = vec![kind];
        q.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            self.put_bytes(&mut q, call, "key", &wire_key(k))?;
        }
        Ok(q)
    }

    /// Checks that the store answers: sends a nonce and expects it back (on a server
    /// without `PING`, a `CHECK` of no key, which every release answers).
    pub fn ping(&mut self) -> Result<(), StoreError> {
        if !self.modern {
            return self.check(&[]).map(|_| ());
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let nonce = std::process::id().rotate_left(16) ^ nanos;
        self.send("PING", &[&[PING][..], &nonce.to_le_bytes()].concat())?;
        let got = u32::from_le_bytes(self.read_n("PING", self.op_deadline(self.timeout))?);
        if got != nonce {
            return Err(self.protocol("PING", format!("the nonce {got:#x} instead of {nonce:#x}")));
        }
        Ok(())
    }

    /// Stores `value` under `key` (replacing any value).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.key_query((SET, &format!("SET {key:?}")), key, &[value], &[])
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], timeout)?;
        self.get_now(key)
    }

    /// The value of `key`, which must be set already (the store may answer an empty value
    /// otherwise, or create the key).
    fn get_now(&mut self, key: &str) -> Result<Vec<u8>, StoreError> {
        let op = format!("GET {key:?}");
        self.key_query((GET, &op), key, &[], &[])?;
        self.read_bytes(&op, self.op_deadline(self.timeout))
    }

    /// Deletes `key`; `true` when it was set.
    pub fn delete_key(&mut self, key: &str) -> Result<bool, StoreError> {
        let op = format!("DELETE_KEY {key:?}");
        self.key_query((DELETE_KEY, &op), key, &[], &[])?;
        Ok(i64::from_le_bytes(self.read_n(&op, self.op_deadline(self.timeout))?) > 0)
    }

    /// Sets `key` to `desired` if it holds `expected` (or, with `expected` empty, if it is
    /// unset), and answers the server's reply, which is not always what the key holds:
    ///
    /// - key set: the value it holds afterwards (`desired` if it held `expected`, else the
    ///   value it held, unchanged);
    /// - key unset and `expected` empty: `desired`, now stored;
    /// - key unset and `expected` not empty: `expected` echoed back, though the key stays
    ///   unset (PyTorch's TCPStore server answers so). Compare the reply with `desired`,
    ///   never with `expected`, to learn whether the swap happened.
    pub fn compare_set(
        &mut self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let op = format!("COMPARE_SET {key:?}");
        self.key_query((COMPARE_SET, &op), key, &[expected, desired], &[])?;
        self.read_bytes(&op, self.op_deadline(self.timeout))
    }

    /// Adds `delta` to the integer under `key` (0 when unset); returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let op = format!("ADD {key:?}");
        self.key_query((ADD, &op), key, &[], &delta.to_le_bytes())?;
        Ok(i64::from_le_bytes(
            self.read_n(&op, self.op_deadline(self.timeout))?,
        ))
    }

    /// Whether every key in `keys` is set, without waiting.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool, StoreError> {
        let op = format!("CHECK {keys:?}");
        let q = self.keys_query(CHECK, &op, keys)?;
        self.send(&op, &q)?;
        match self.read_n::<1>(&op, self.op_deadline(self.timeout))?[0] {
            READY => Ok(true),
            NOT_READY => Ok(false),
            b => Err(self.protocol(
                &op,
                format!("the byte {b}, neither ready (0) nor not ready (1)"),
            )),
        }
    }

    /// Waits until every key in `keys` is set, at most `timeout`; then the wait is canceled
    /// on the server and [`StoreError::WaitTimeout`] returned.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let op = format!("WAIT {keys:?}");
        let q = self.keys_query(WAIT, &op, keys)?;
        self.send(&op, &q)?;
        let by = self.op_deadline(timeout);
        match self.read_n::<1>(&op, by).map(|[b]| b) {
            Ok(STOP_WAITING) => return Ok(()),
            Ok(b) => {
                return Err(self.protocol(&op, format!("the byte {b} instead of stop-waiting (0)")))
            }
            Err(StoreError::Timeout { .. }) => {}
            Err(e) => return Err(e),
        }
        let timed_out = |c: &Self| StoreError::WaitTimeout {
            addr: c.addr.clone(),
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout,
            hint: String::new(),
        };
        if !self.modern {
            // No CANCEL_WAIT on this server: its answer could still come on this
            // connection, so the client moves to a fresh one.
            *self = Self::open(&self.addr, self.timeout, self.deadline, false)?;
            return Err(timed_out(self));
        }
        // Timed out: cancel the wait; the server answers canceled, after a stop-waiting if
        // the keys appeared meanwhile.
        self.send("CANCEL_WAIT", &[CANCEL_WAIT])?;
        let by = self.op_deadline(self.timeout);
        let [mut b] = self.read_n("CANCEL_WAIT", by)?;
        let appeared = b == STOP_WAITING;
        if appeared {
            [b] = self.read_n("CANCEL_WAIT", by)?;
        }
        if b != WAIT_CANCELED {
            let detail = format!("the byte {b} instead of wait-canceled (1)");
            return Err(self.protocol("CANCEL_WAIT", detail));
        }
        if appeared {
            Ok(())
        } else {
            Err(timed_out(self))
        }
    }
}

/// Counts the communicators this process joined with an id from a store rendezvous
/// ([`StoreRendezvous::joined`]). That count is the job's, not the process's: every rank
/// makes its communicators in the same order, and an init is collective (it completes on
/// every rank; when it fails on one, the job's communicator is lost on all). So a second communicator uses fresh keys, while an exchange that
/// failed anywhere (a timeout, a lost connection, a join that never completed) is retried
/// under the key its peers retry under too, whichever rank failed and where.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The NCCL id exchange through torchrun's agent store (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct StoreRendezvous {
    addr: String,
    prefix: String,
    timeout: Duration,
    io_timeout: Duration,
    /// The process's count of joined communicators this one has (from [`Self::from_env`]),
    /// advanced by [`Self::joined`].
    generation: Option<u64>,
}

impl StoreRendezvous {
    /// The exchange through the store at `addr` (`host:port`), under keys starting with
    /// `prefix` (unique to the job and its attempt).
    pub fn new(addr: impl Into<String>, prefix: impl Into<String>) -> StoreRendezvous {
        StoreRendezvous {
            addr: addr.into(),
            prefix: prefix.into(),
            timeout: super::common::DEFAULT_TIMEOUT,
            io_timeout: DEFAULT_STORE_TIMEOUT,
            generation: None,
        }
    }

    /// Under torchrun with the agent's store (`TORCHELASTIC_USE_AGENT_STORE=True`): the
    /// store at `MASTER_ADDR:MASTER_PORT`, keys under
    /// `nccl-safe/<TORCHELASTIC_RUN_ID>/attempt_<TORCHELASTIC_RESTART_COUNT>/<n>/`, where
    /// `n` counts the communicators this process joined with such an id (see
    /// [`joined`](Self::joined)): the same on every rank, so a retry after a failed
    /// exchange or a failed join uses the same key as its peers. `None` for other launchers.
    ///
    /// Call [`joined`](Self::joined) once the communicator made with the id is
    /// initialized, and on rank 0 [`retract`](Self::retract) when it is not;
    /// [`crate::ProcessLauncher`] does both.
    pub fn from_env(env: &ProcessEnv) -> Option<StoreRendezvous> {
        let e = env.elastic.as_ref().filter(|e| e.use_agent_store)?;
        let n = GENERATION.load(Ordering::Acquire);
        let mut r = StoreRendezvous::new(
            host_port(&env.master_addr, env.master_port),
            format!("nccl-safe/{}/attempt_{}/{n}/", e.run_id, e.restart_count),
        );
        r.generation = Some(n);
        Some(r)
    }

    /// The communicator made with this exchange's id is initialized (an init is
    /// collective, so its peers' are too): the process's next exchange uses the next key.
    /// Until then a retry uses this one, as its peers' retries do.
    pub fn joined(&self) {
        if let Some(n) = self.generation {
            GENERATION.fetch_max(n + 1, Ordering::AcqRel);
        }
    }

    /// Rank 0, when the communicator made with the id it published was not initialized:
    /// deletes the id, so a peer that retries waits for the next one rank 0 publishes
    /// under the same key, instead of reading this stale one and joining a communicator
    /// that no longer forms. Bounded by the io timeout.
    pub fn retract(&self) -> LaunchResult<()> {
        let mut c = self.connect()?;
        c.delete_key(&self.id_key())?;
        Ok(())
    }

    /// Sets how long a rank waits for rank 0's id (default 300 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the deadline of each request other than that wait (default 30 s).
    pub fn io_timeout(mut self, io_timeout: Duration) -> Self {
        self.io_timeout = io_timeout;
        self
    }

    /// The store's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The key the id is stored under.
    pub fn id_key(&self) -> String {
        format!("{}unique_id", self.prefix)
    }

    fn connect(&self) -> Result<StoreClient, StoreError> {
        StoreClient::connect(&self.addr, self.io_timeout)
    }

    /// Rank 0: stores `id` (with the world size) under [`id_key`](Self::id_key).
    pub fn publish(&self, world_size: usize, id: &[u8; ID_LEN]) -> LaunchResult<()> {
        let world = u32::try_from(world_size).map_err(|_| RendezvousError::InvalidRank {
            rank: 0,
            world_size,
        })?;
        let mut c = self.connect()?;
        c.set(&self.id_key(), &[&world.to_le_bytes()[..], id].concat())?;
        // A round trip, so the value is known to be stored when this returns.
        c.ping()?;
        Ok(())
    }

    /// Ranks other than 0: waits for rank 0's id, checking the world size.
    pub fn read(&self, rank: usize, world_size: usize) -> LaunchResult<[u8; ID_LEN]> {
        let key = self.id_key();
        let mut c = self.connect()?;
        let v = c.get(&key, self.timeout).map_err(|mut e| {
            if let StoreError::WaitTimeout { hint, .. } = &mut e {
                *hint = format!(
                    "rank {rank} waited for rank 0 to publish the unique id; check that rank 0 started and reached \
                     the rendezvous (its own error says why not)"
                );
            }
            e
        })?;
        if v.len() == 12 + ID_LEN {
            let n = u32::from_le_bytes([v[4], v[5], v[6], v[7]]) as usize;
            return Err(RendezvousError::RootsMismatch {
                addr: self.addr.clone(),
                rank,
                published: Some(n),
                expected: 1,
            }
            .into());
        }
        if v.len() != 4 + ID_LEN {
            return Err(StoreError::Protocol {
                addr: self.addr.clone(),
                call: format!("GET {key:?}"),
                detail: format!(
                    "a value of {} bytes, not a {}-byte world size and id",
                    v.len(),
                    4 + ID_LEN
                ),
            }
            .into());
        }
        let world = u32::from_le_bytes([v[0], v[1], v[2], v[3]]) as usize;
        if world != world_size {
            return Err(self.world_refused(rank, world, world_size).into());
        }
        let mut id = [0u8; ID_LEN];
        id.copy_from_slice(&v[4..]);
        Ok(id)
    }

    /// The refusal of a value published for `world` ranks, read by a rank of a job of
    /// `world_size`.
    fn world_refused(&self, rank: usize, world: usize, world_size: usize) -> RendezvousError {
        RendezvousError::Refused {
            addr: self.addr.clone(),
            rank,
            reason: super::common::Refusal::WorldSizeMismatch {
                server: world,
                client: world_size,
            },
        }
    }

    /// The key of root `root`'s id: [`id_key`](Self::id_key) for root 0, under it for the
    /// others.
    pub fn root_key(&self, root: usize) -> String {
        match root {
            0 => self.id_key(),
            i => format!("{}unique_id/{i}", self.prefix),
        }
    }

    /// The rank that makes root `root`'s id of a job with `roots` ids (more than one):
    /// stores it under [`root_key`](Self::root_key) with the world size, the number of
    /// roots and its number (140 bytes, so that a reader of one id refuses it).
    pub(crate) fn publish_root(
        &self,
        world_size: usize,
        roots: usize,
        root: usize,
        id: &[u8; ID_LEN],
    ) -> LaunchResult<()> {
        let numbers = [world_size, roots, root].map(|n| u32::try_from(n).ok());
        let [Some(world), Some(n), Some(i)] = numbers else {
            return Err(RendezvousError::InvalidRank {
                rank: 0,
                world_size,
            }
            .into());
        };
        let mut c = self.connect()?;
        let value = [
            &world.to_le_bytes()[..],
            &n.to_le_bytes(),
            &i.to_le_bytes(),
            id,
        ]
        .concat();
        c.set(&self.root_key(root), &value)?;
        c.ping()?;
        Ok(())
    }

    /// Rank `rank` of a job with `roots` ids (more than one): waits for every root's id and
    /// reads them, checking the world size and the number of roots (a value of one id, or
    /// of another number, is [`RendezvousError::RootsMismatch`]).
    pub(crate) fn read_roots(
        &self,
        rank: usize,
        world_size: usize,
        roots: usize,
    ) -> LaunchResult<Vec<[u8; ID_LEN]>> {
        let deadline = Instant::now() + self.timeout;
        let mut c = self.connect()?;
        let mut ids = Vec::with_capacity(roots.min(1 << 16));
        // Root by root, so that a root 0 of another count is told before any wait.
        for root in 0..roots {
            let key = &self.root_key(root);
            let left = deadline.saturating_duration_since(Instant::now());
            let v = c.get(key, left).map_err(|mut e| {
                if let StoreError::WaitTimeout { hint, .. } = &mut e {
                    let maker = nccl_safe::scalable_root_rank(world_size, roots, root);
                    *hint = format!(
                        "rank {rank} waited for rank {} to publish the unique id of root {root} of {roots}; check \
                         that it started and reached the rendezvous (its own error says why not)",
                        maker.unwrap_or(0)
                    );
                }
                e
            })?;
            let mismatch = |n| RendezvousError::RootsMismatch {
                addr: self.addr.clone(),
                rank,
                published: Some(n),
                expected: roots,
            };
            if root == 0 && v.len() == 4 + ID_LEN {
                return Err(mismatch(1).into());
            }
            if v.len() != 12 + ID_LEN {
                return Err(StoreError::Protocol {
                    addr: self.addr.clone(),
                    call: format!("GET {key:?}"),
                    detail: format!(
                        "a value of {} bytes, not a world size, count, number and id of {} bytes",
                        v.len(),
                        12 + ID_LEN
                    ),
                }
                .into());
            }
            let le =
                |at: usize| u32::from_le_bytes([v[at], v[at + 1], v[at + 2], v[at + 3]]) as usize;
            let (world, n, i) = (le(0), le(4), le(8));
            if world != world_size {
                return Err(self.world_refused(rank, world, world_size).into());
            }
            if n != roots {
                return Err(mismatch(n).into());
            }
            if i != root {
                return Err(StoreError::Protocol {
                    addr: self.addr.clone(),
                    call: format!("GET {key:?}"),
                    detail: format!("root {i}'s id under root {root}'s key"),
                }
                .into());
            }
            let mut id = [0u8; ID_LEN];
            id.copy_from_slice(&v[12..]);
            ids.push(id);
        }
        Ok(ids)
    }

    /// The rank that made root `root`'s id, when the communicator made with it was not
    /// initialized: deletes it, as [`retract`](Self::retract) does root 0's.
    pub(crate) fn retract_root(&self, root: usize) -> LaunchResult<()> {
        let mut c = self.connect()?;
        c.delete_key(&self.root_key(root))?;
        Ok(())
    }

    /// The job's desync board on the same store, under the same prefix.
    pub fn board(&self, world_size: usize) -> StoreBoard {
        StoreBoard {
            addr: self.addr.clone(),
            prefix: format!("{}desync/", self.prefix),
            world_size,
            io_timeout: self.io_timeout.min(Duration::from_secs(2)),
        }
    }
}

/// The desync board kept in the c10d store: each rank's post under
/// `<prefix>desync/<rank>`; control characters in posts read back are replaced with `?`.
#[derive(Debug, Clone)]
pub struct StoreBoard {
    addr: String,
    prefix: String,
    world_size: usize,
    io_timeout: Duration,
}

impl StoreBoard {
    fn key(&self, rank: usize) -> String {
        format!("{}{rank}", self.prefix)
    }

    /// Posts `post` as rank `rank`'s latest, giving up at `deadline`.
    pub fn post_by(
        &self,
        rank: usize,
        post: &DesyncPost,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let mut c = StoreClient::connect_by(&self.addr, self.io_timeout, Some(deadline))?;
        c.set(&self.key(rank), &nccl_safe::seam::encode_post(post))?;
        c.ping()
    }

    /// Every rank's latest post, rank-indexed, giving up at `deadline`.
    pub fn fetch_by(&self, deadline: Instant) -> Result<Vec<Option<DesyncPost>>, StoreError> {
        let mut c = StoreClient::connect_by(&self.addr, self.io_timeout, Some(deadline))?;
        let mut posts = Vec::with_capacity(self.world_size.min(1 << 16));
        for r in 0..self.world_size {
            let key = self.key(r);
            if !c.check(&[&key])? {
                posts.push(None);
                continue;
            }
            let v = c.get_now(&key)?;
            let post = nccl_safe::seam::decode_post(&v).ok_or_else(|| {
                c.protocol(
                    &format!("GET {key:?}"),
                    "a value that is not a desync post".into(),
                )
            })?;
            posts.push(Some(clean_post(post)));
        }
        Ok(posts)
    }
}

super::desync::remote_board_by!(StoreBoard);
