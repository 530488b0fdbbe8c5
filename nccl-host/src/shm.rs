//! Host communicators whose ranks live in several processes of one machine: a shared
//! memory segment per communicator, named from the unique id, with one staging slot per
//! rank and a barrier whose waits have deadlines and watch the peers' processes.
//!
//! Segment layout: a [`Header`], then one [`RankInfo`] per rank, then `nranks` staging
//! slots of `slot` bytes. Every collective runs in rounds of at most one slot per rank:
//! each rank copies its part in, a barrier, reductions split so that each rank reduces
//! `1/nranks` of the round in place, a barrier, each rank copies its result out, a
//! barrier. The element arithmetic is [`super::dtype::reduce`], as for ranks in threads.
//!
//! The segment's name is removed from `/dev/shm` as soon as every rank has mapped it (and
//! on every failed join), so a crash later leaves nothing behind; a segment older than the
//! init deadline whose id's maker process is gone is swept by the next init on the machine.
//!
//! A wait fails (and the communicator with it, on every rank) when a peer's process is
//! gone (once seen alive from this process: pids of another namespace are not watched), when a peer destroyed or aborted its communicator, when ranks disagree on the
//! operation, or at the deadline (`NCCL_SAFE_HOST_TIMEOUT_MS`); every error names the rank.

use core::ffi::c_int;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

use nccl_sys::bindings::*;

use super::defs::{wait_limit, CollPost, Collective, Fail, IdBytes};
use super::dtype::{self, RedKind};
use nccl_sys::{BlockSource, Extent};

/// The second half of a unique id's magic for communicators that may span processes
/// (`defs::ID_MAGIC` ends in `\x01` for thread-only ids).
pub(crate) const SHARED_TAG: u8 = 0x02;

const MAGIC: u64 = 0x6e63_636c_7368_6d31; // "ncclshm1"
const DIR: &str = "/dev/shm";
const PREFIX: &str = "nccl-safe-";
/// Largest rank count of a shared communicator.
const MAX_RANKS: usize = 1024;
/// Bytes of one rank's staging slot (a multiple of every element size); overridden by
/// `NCCL_SAFE_HOST_SHM_SLOT_BYTES`.
const DEFAULT_SLOT: usize = 1 << 20;
/// Bytes reduced per step (the partial result stays in cache).
const STEP: usize = 32 << 10;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    nranks: AtomicU32,
    joined: AtomicU32,
    slot: AtomicU64,
    creator: AtomicU32,
    bar_count: AtomicU32,
    /// The futex word: bumped when a barrier completes or the segment is failed.
    bar_gen: AtomicU32,
    _pad: u32,
    /// 0 while healthy, else `kind << 32 | rank` of the first failure.
    failed: AtomicU64,
    /// The operation sequence number that failed.
    failed_seq: AtomicU64,
    /// When a rank's revoke or abort failed the communicator while it waited in a
    /// collective: `count << 32 | rank` of the ranks that had not reached it then (the
    /// first of them), so that the peers' error names the stuck rank, not the one whose
    /// watchdog fired first; 0 when none was behind.
    behind: AtomicU64,
}

#[repr(C)]
struct RankInfo {
    pid: AtomicU32,
    /// 0 absent, 1 joined, 2 left (destroyed its communicator).
    state: AtomicU32,
    /// Barriers entered, so a timeout names the ranks that did not come.
    epoch: AtomicU64,
    /// The operations it runs, by sequence number parity (a fast rank publishes its next
    /// operation while a slow one still checks the current one).
    ops: [OpDesc; 2],
    /// Bumped (and woken) by a peer that changed one of this rank's send/recv channels.
    bell: AtomicU32,
    _pad32: u32,
    _pad: [u64; 5],
}

/// One direction of send/recv between two ranks: the sender posts a chunk when the
/// channel is empty, the receiver takes it.
#[repr(C)]
struct Chan {
    posted: AtomicU64,
    taken: AtomicU64,
    /// Bytes in the posted chunk.
    len: AtomicU64,
    /// The whole message's bytes and data type, `bytes << 8 | dtype`.
    msg: AtomicU64,
    _pad: [u64; 4],
}

const CHAN: usize = core::mem::size_of::<Chan>();
/// Largest communicator across processes with send/recv (channels grow as nranks²).
const MAX_P2P_RANKS: usize = 64;
/// The failure sequence number of a send/recv.
const P2P_SEQ: u64 = u64::MAX - 1;

/// Data bytes of one send/recv channel for `nranks` ranks (0: none).
fn chan_bytes(nranks: usize) -> usize {
    if nranks > MAX_P2P_RANKS {
        return 0;
    }
    ((16 << 20) / (nranks * nranks)).clamp(4096, 256 << 10) / 64 * 64
}

#[repr(C)]
struct OpDesc {
    /// Sequence number + 1 (0 = none yet).
    seq: AtomicU64,
    /// kind | dtype << 8 | red << 16 | (root + 1) << 32
    desc: AtomicU64,
    count: AtomicU64,
    scalar: AtomicU64,
    /// The user's `file:line` behind the call, UTF-8, NUL-padded (truncated from the
    /// left when longer), so that a mismatch names the line every rank called from.
    caller: [AtomicU64; CALLER_WORDS],
}

/// Words of [`OpDesc::caller`].
const CALLER_WORDS: usize = 12;

/// Writes `file:line` into a description's caller words (all zero when unknown).
fn put_caller(words: &[AtomicU64; CALLER_WORDS], caller: Option<&std::panic::Location<'_>>) {
    let mut bytes = [0u8; CALLER_WORDS * 8];
    if let Some(c) = caller {
        let text = format!("{}:{}", c.file(), c.line());
        let text = text.as_bytes();
        let keep = &text[text.len().saturating_sub(bytes.len())..];
        bytes[..keep.len()].copy_from_slice(keep);
    }
    for (w, b) in words.iter().zip(bytes.chunks_exact(8)) {
        w.store(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])), Relaxed);
    }
}

/// Reads a description's caller words back: `None` when unknown.
fn get_caller(words: &[AtomicU64; CALLER_WORDS]) -> Option<String> {
    let bytes: Vec<u8> = words
        .iter()
        .flat_map(|w| w.load(Relaxed).to_le_bytes())
        .collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    (end > 0).then(|| String::from_utf8_lossy(&bytes[..end]).into_owned())
}

const HEADER: usize = 128;
const INFO: usize = core::mem::size_of::<RankInfo>();

/// Why a shared communicator failed (the high half of [`Header::failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    Abort = 1,
    Died = 2,
    Left = 3,
    Timeout = 4,
    Mismatch = 5,
    P2p = 6,
    Revoked = 7,
}

fn why_of(k: u64) -> Option<Why> {
    use Why::*;
    [Abort, Died, Left, Timeout, Mismatch, P2p, Revoked]
        .into_iter()
        .find(|&w| w as u64 == k)
}

/// (offset of the slots, offset of the send/recv channels, total bytes).
fn layout(nranks: usize, slot: usize) -> Option<(usize, usize, usize)> {
    let data = (HEADER + nranks * INFO).div_ceil(4096) * 4096;
    let chans = data.checked_add(nranks.checked_mul(slot)?)?;
    let n2 = if chan_bytes(nranks) > 0 {
        nranks * nranks
    } else {
        0
    };
    let len = chans.checked_add(n2.checked_mul(CHAN + chan_bytes(nranks))?)?;
    Some((data, chans, len))
}

/// Bytes of each rank's slot for `nranks` ranks: `NCCL_SAFE_HOST_SHM_SLOT_BYTES` or
/// [`DEFAULT_SLOT`], sized by [`slot_for`].
fn slot_bytes(nranks: usize) -> usize {
    let asked = std::env::var("NCCL_SAFE_HOST_SHM_SLOT_BYTES").ok();
    slot_for(asked.and_then(|v| v.trim().parse().ok()), nranks)
}

/// A slot of `asked` bytes (a multiple of 64, at least 4096; [`DEFAULT_SLOT`] for `None`),
/// and at least enough that half a slot (a multiple of 64 bytes) holds one 8-byte element
/// of every rank's block: a round of an all-to-all.
fn slot_for(asked: Option<usize>, nranks: usize) -> usize {
    asked
        .map_or(DEFAULT_SLOT, |b| (b / 64 * 64).max(4096))
        .max((nranks * 8).next_multiple_of(64) * 2)
}

/// A system call's failure as a typed NCCL error with its context.
fn sys_fail(what: impl std::fmt::Display, e: std::io::Error) -> Fail {
    Fail::new(
        ncclSystemError,
        format!("host provider shared memory: {what}: {e}"),
    )
}

/// Whether process `pid` still runs (a zombie counts as gone).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !matches!(
            s.rsplit_once(')')
                .and_then(|(_, r)| r.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        // No /proc: ask the kernel.
        // SAFETY: kill with signal 0 sends nothing; it only checks the pid exists.
        Err(_) => unsafe { libc::kill(pid as libc::pid_t, 0) == 0 },
    }
}

/// Waits (at most `d`) while `word` holds `val`; a spurious or early return is handled by
/// the caller's loop.
fn futex_wait(word: &AtomicU32, val: u32, d: Duration) {
    let ts = libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    };
    futex(word, libc::FUTEX_WAIT, val, &ts);
}

/// Wakes every waiter on `word`.
fn futex_wake(word: &AtomicU32) {
    futex(word, libc::FUTEX_WAKE, i32::MAX as u32, core::ptr::null());
}

fn futex(word: &AtomicU32, op: c_int, val: u32, timeout: *const libc::timespec) {
    // SAFETY: `word` is a live, aligned u32 in a shared mapping (so no FUTEX_PRIVATE flag);
    // FUTEX_WAIT only reads it, FUTEX_WAKE touches no memory; `timeout` is null or live.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), op, val, timeout, 0usize, 0) };
}

/// Removes segments in `/dev/shm` whose id's maker process is gone and that no init can
/// still be waiting on (left by a job whose ranks all died before they had all joined).
fn sweep() {
    let stale = wait_limit() + Duration::from_secs(60);
    let Ok(dir) = std::fs::read_dir(DIR) else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > stale);
        if old && pid.is_some_and(|p| !alive(p)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// One rank's view of a shared communicator's segment.
#[derive(Debug)]
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    data: usize,
    slot: usize,
    nranks: usize,
    rank: usize,
    path: String,
    /// Rounds run so far (the same on every rank): its parity picks the slots' half.
    rounds: AtomicU64,
    /// The latest operation's sequence number.
    seq: AtomicU64,
    /// Which peers' processes were seen alive from this process.
    seen: Vec<std::sync::atomic::AtomicBool>,
    /// Offset of the send/recv channels.
    chans: usize,
    /// The communicator's unique id.
    id: IdBytes,
    /// Splits and shrinks of this communicator so far (the same on every rank).
    children: AtomicU64,
    /// Peers that leave or die are not seen ([`super::fault::Fault::SilentPeers`]).
    pub(crate) silent: bool,
    /// One-sided signals: those this rank sent to each rank (`0..nranks`), then those it
    /// took from each (`nranks..2 nranks`); see [`Segment::rma_post`].
    rma: Vec<AtomicU64>,
    /// This rank revoked its communicator: its own waits end, its peers' go on (NCCL's
    /// revoke sets only this rank's abort flags, init.cc:2662 of v2.29.7-1).
    revoked_here: std::sync::atomic::AtomicBool,
}

// SAFETY: the mapping is process-wide memory accessed through atomics (header, rank
// infos) or under the barrier protocol (slots); the pointer is never freed before drop.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // Signals to this rank that no wait took (a wait never made, or cut short).
        let mine = format!("{}-rma-{}-", self.path, self.rank);
        if let Ok(dir) = std::fs::read_dir(DIR) {
            for e in dir.flatten() {
                if e.path().to_str().is_some_and(|p| p.starts_with(&mine)) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        // SAFETY: `base..base+len` is our mapping; nothing borrowed from it outlives self.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Whether `id` was made for communicators that may span processes.
pub(crate) fn is_shared(id: &IdBytes) -> bool {
    id[..15] == super::defs::ID_MAGIC[..15] && id[15] == SHARED_TAG
}

/// The path of `id`'s segment in `/dev/shm`.
pub(crate) fn name_of(id: &IdBytes) -> String {
    use sha2::Digest;
    let h = sha2::Sha256::digest(id);
    let pid = u32::from_le_bytes([id[16], id[17], id[18], id[19]]);
    let hex: String = h[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("{DIR}/{PREFIX}{pid}-{hex}")
}

impl Segment {
    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a Header (at least `HEADER` bytes, page aligned).
        unsafe { &*(self.base as *const Header) }
    }

    fn info(&self, r: usize) -> &RankInfo {
        debug_assert!(r < self.nranks);
        // SAFETY: rank infos follow the header, `nranks` of them, inside the mapping.
        unsafe { &*(self.base.add(HEADER + r * INFO) as *const RankInfo) }
    }

    /// Rank `r`'s description of operation `seq`.
    fn op(&self, r: usize, seq: u64) -> &OpDesc {
        &self.info(r).ops[(seq % 2) as usize]
    }

    fn slot_ptr(&self, r: usize) -> *mut u8 {
        // SAFETY: slot r lies inside the mapping (checked by `layout` at join).
        unsafe { self.base.add(self.data + r * self.slot) }
    }

    /// This rank's rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The id of this communicator's next split or shrink child (`what` tells them apart):
    /// every rank derives the same one without talking to the others.
    pub(crate) fn child_id(&self, what: &str) -> IdBytes {
        let k = self.children.fetch_add(1, Relaxed);
        self.derived_id(k, what)
    }

    /// The id of this communicator's `n`-th grow (1, 2, ...), the same on every rank of
    /// every process, and without taking a child number: the root's `ncclCommGetUniqueId`
    /// and every existing rank's `ncclCommGrow` derive it alike, as NCCL derives the grow
    /// handle's magic from the parent's (`hashCombine(comm->magic, comm->childCount)`,
    /// bootstrap.cc:455, init.cc:2917).
    pub(crate) fn grow_id(&self, n: u64) -> IdBytes {
        self.derived_id(u64::MAX - n, "grow")
    }

    fn derived_id(&self, k: u64, what: &str) -> IdBytes {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(self.id);
        h.update(k.to_le_bytes());
        h.update(what.as_bytes());
        let d = h.finalize();
        // The magic, the shared tag and the maker's pid stay; the rest is the digest.
        let mut id = self.id;
        for (i, b) in id[20..].iter_mut().enumerate() {
            *b = d[i % d.len()] ^ (i / d.len()) as u8;
        }
        id
    }

    /// Every rank's `(color, key)` of split `seq`, through this communicator.
    pub(crate) fn exchange_split(
        &self,
        seq: u64,
        color: i32,
        key: i32,
    ) -> Result<Vec<(i32, i32)>, Fail> {
        let mine = [color, key];
        let mut all = vec![0i32; 2 * self.nranks];
        let post = CollPost {
            kind: Collective::AllGather,
            send: mine.as_ptr() as usize,
            recv: all.as_mut_ptr() as usize,
            count: 2,
            dtype: ncclInt32,
            red: RedKind::Sum,
            scalar: Vec::new(),
            root: 0,
            caller: None,
        };
        self.run_coll(seq, &post)?;
        Ok(all.chunks(2).map(|c| (c[0], c[1])).collect())
    }

    /// Joins (creating when first) the segment of `id` as `rank` of `nranks`, waiting for
    /// every rank until `deadline`, or until `cancel` is set (the rank's communicator was
    /// torn down while it joined: the peers are told it left). On a failure the segment's
    /// name is removed, so that nothing stays in `/dev/shm`.
    pub(crate) fn join(
        id: &IdBytes,
        nranks: usize,
        rank: usize,
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<Segment, Fail> {
        if nranks > MAX_RANKS {
            let m = format!(
                "a communicator across processes has at most {MAX_RANKS} ranks, not {nranks}"
            );
            return Err(Fail::new(ncclInvalidArgument, m));
        }
        let path = name_of(id);
        let r = Self::join_inner(id, &path, nranks, rank, deadline, cancel);
        if r.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        r
    }

    fn join_inner(
        id: &IdBytes,
        path: &str,
        nranks: usize,
        rank: usize,
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<Segment, Fail> {
        let torn_down = || {
            let m = format!("rank {rank}'s communicator was torn down during its initialization");
            Fail::new(ncclRemoteError, m)
        };
        let slot = slot_bytes(nranks);
        let created = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path);
        let (file, creator) = match created {
            Ok(f) => (f, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => (
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(path)
                    .map_err(|e| sys_fail(format!("open {path}"), e))?,
                false,
            ),
            Err(e) => return Err(sys_fail(format!("create {path}"), e)),
        };
        if creator {
            sweep();
            let Some((_, _, len)) = layout(nranks, slot) else {
                return Err(Fail::new(ncclInvalidArgument, "segment too large"));
            };
            file.set_len(len as u64)
                .map_err(|e| sys_fail(format!("size {path} to {len} bytes"), e))?;
            // Reserve the pages now: a full /dev/shm is this error, not a SIGBUS later.
            // SAFETY: a valid open descriptor and a range inside the file's size.
            let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
            if rc != 0 && rc != libc::EOPNOTSUPP && rc != libc::EINVAL {
                let e = std::io::Error::from_raw_os_error(rc);
                return Err(sys_fail(
                    format!("reserve {len} bytes for {path} (is /dev/shm full?)"),
                    e,
                ));
            }
        }
        // Wait until the creator sized the file and wrote the header.
        let len = loop {
            let l = file
                .metadata()
                .map_err(|e| sys_fail(format!("stat {path}"), e))?
                .len() as usize;
            if l >= 4096 {
                break l;
            }
            if cancel.load(Acquire) {
                return Err(torn_down());
            }
            if Instant::now() >= deadline {
                let m = format!("the shared memory segment {path} was never sized by its creator");
                return Err(Fail::new(ncclTimeout, m));
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        // SAFETY: mapping `len` bytes of a regular file we hold open, shared and writable.
        let base = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(sys_fail(format!("map {path}"), e));
        }
        let mut seg = Segment {
            base: base.cast(),
            len,
            data: 0,
            slot: 0,
            nranks,
            rank,
            path: path.to_string(),
            rounds: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            seen: (0..nranks)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            chans: 0,
            id: *id,
            children: AtomicU64::new(0),
            silent: false,
            rma: (0..2 * nranks).map(|_| AtomicU64::new(0)).collect(),
            revoked_here: std::sync::atomic::AtomicBool::new(false),
        };
        let h = seg.header();
        if creator {
            h.nranks.store(nranks as u32, Relaxed);
            h.slot.store(slot as u64, Relaxed);
            h.creator.store(std::process::id(), Relaxed);
            h.magic.store(MAGIC, Release);
        }
        while h.magic.load(Acquire) != MAGIC {
            if cancel.load(Acquire) {
                return Err(torn_down());
            }
            if Instant::now() >= deadline {
                let m = format!(
                    "the shared memory segment {path} was never initialized by its creator"
                );
                return Err(Fail::new(ncclTimeout, m));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let theirs = h.nranks.load(Relaxed) as usize;
        if theirs != nranks {
            let m = format!("ranks disagree on nranks for one unique id ({theirs} vs {nranks})");
            return Err(Fail::new(ncclInvalidArgument, m));
        }
        let slot = h.slot.load(Relaxed) as usize;
        let Some((data, chans, _)) = layout(nranks, slot).filter(|&(.., need)| need <= len) else {
            let m = format!("shared memory segment {path} is smaller than its header says");
            return Err(Fail::new(ncclInternalError, m));
        };
        seg.data = data;
        seg.chans = chans;
        seg.slot = slot;
        let me = seg.info(rank);
        if me
            .pid
            .compare_exchange(0, std::process::id(), AcqRel, Acquire)
            .is_err()
        {
            let m = format!("rank {rank} joined the same unique id twice");
            return Err(Fail::new(ncclInvalidArgument, m));
        }
        me.state.store(1, Release);
        let h = seg.header();
        if h.joined.fetch_add(1, AcqRel) as usize + 1 == nranks {
            // Everyone has the segment mapped: its name is no longer needed.
            let _ = std::fs::remove_file(path);
            futex_wake(&h.bar_gen);
        }
        // Wait for every rank (the futex word is bumped by the last one).
        loop {
            let g = h.bar_gen.load(Acquire);
            // Also marks the peers' processes seen alive; a peer gone after every rank
            // joined fails the first operation instead.
            let gone = seg.peer_gone();
            if h.joined.load(Acquire) as usize >= nranks {
                return Ok(seg);
            }
            if let Some((why, r)) = gone {
                return Err(seg.fail_err(why, r, u64::MAX));
            }
            if cancel.load(Acquire) {
                // As a destroy during the init: the peers waiting for it fail at once.
                seg.info(rank).state.store(2, Release);
                return Err(torn_down());
            }
            if Instant::now() >= deadline {
                let missing: Vec<usize> = (0..nranks)
                    .filter(|&r| seg.info(r).state.load(Acquire) == 0)
                    .collect();
                return Err(Fail::new(
                    ncclTimeout,
                    format!(
                        "communicator initialization did not complete within {:?} (NCCL_SAFE_HOST_TIMEOUT_MS): rank(s) {missing:?} never joined",
                        wait_limit()
                    ),
                ));
            }
            futex_wait(&h.bar_gen, g, Duration::from_millis(20));
        }
    }

    /// Marks the communicator failed (the first reason wins) and wakes every waiter.
    fn fail(&self, why: Why, rank: usize, seq: u64) {
        let h = self.header();
        if h.failed
            .compare_exchange(0, (why as u64) << 32 | rank as u64, AcqRel, Acquire)
            .is_ok()
        {
            if matches!(why, Why::Revoked | Why::Abort) && rank == self.rank {
                // Inside a collective this rank's epoch is ahead of the ranks that never
                // reached it.
                let mine = self.info(rank).epoch.load(Acquire);
                let late: Vec<usize> = (0..self.nranks)
                    .filter(|&r| self.info(r).epoch.load(Acquire) < mine)
                    .collect();
                if let Some(&first) = late.first() {
                    h.behind
                        .store((late.len() as u64) << 32 | first as u64, Release);
                }
            }
            h.failed_seq.store(seq, Release);
        }
        h.bar_gen.fetch_add(1, AcqRel);
        futex_wake(&h.bar_gen);
    }

    /// [`Segment::fail`], then the communicator's error (the first failure's).
    fn fail_err(&self, why: Why, rank: usize, seq: u64) -> Fail {
        self.fail(why, rank, seq);
        self.failure()
            .unwrap_or_else(|| Fail::new(ncclRemoteError, "a rank is gone"))
    }

    /// The rank whose process the communicator saw gone (it died or was killed) and its
    /// pid, when that is why the communicator failed.
    pub(crate) fn dead_peer(&self) -> Option<(usize, u32)> {
        let f = self.header().failed.load(Acquire);
        let r = (f & 0xffff_ffff) as usize;
        (why_of(f >> 32)? == Why::Died && r < self.nranks)
            .then(|| (r, self.info(r).pid.load(Acquire)))
    }

    /// Rank `r`'s pid when its process is gone (seen alive once, not now).
    pub(crate) fn died(&self, r: usize) -> Option<u32> {
        let pid = self.info(r).pid.load(Acquire);
        (r < self.nranks
            && pid != 0
            && pid != std::process::id()
            && self.seen[r].load(Relaxed)
            && !alive(pid))
        .then_some(pid)
    }

    /// Every peer whose process the communicator has seen gone (alive once, not now) or
    /// that left it (destroyed or aborted its communicator), with its pid: the failure
    /// records of the whole clique, not only the first one that failed it.
    pub(crate) fn dead_peers(&self) -> Vec<(usize, u32)> {
        let me = std::process::id();
        (0..self.nranks)
            .filter(|&r| r != self.rank)
            .filter_map(|r| {
                let i = self.info(r);
                let pid = i.pid.load(Acquire);
                let left = i.state.load(Acquire) == 2;
                let died = pid != 0 && pid != me && self.seen[r].load(Relaxed) && !alive(pid);
                (left || died).then_some((r, pid))
            })
            .chain(self.dead_peer())
            .chain(self.stuck_peer())
            .collect()
    }

    /// The ranks that had not reached the collective in which a rank's revoke or abort
    /// failed the communicator: (the first of them, how many), if any.
    fn behind(&self) -> Option<(usize, usize)> {
        let b = self.header().behind.load(Acquire);
        let (count, first) = ((b >> 32) as usize, (b & 0xffff_ffff) as usize);
        (count > 0 && first < self.nranks).then_some((first, count))
    }

    /// The rank that had not reached the collective in which a peer's revoke or abort
    /// (its watchdog's, say) failed the communicator, when it was the only one: stuck or
    /// gone, so counted with [`dead_peers`](Self::dead_peers).
    fn stuck_peer(&self) -> Option<(usize, u32)> {
        let (r, n) = self.behind()?;
        (n == 1 && r != self.rank).then(|| (r, self.info(r).pid.load(Acquire)))
    }

    /// The ranks that have not reached the collective this rank waits in (their barrier
    /// count is behind this rank's), else those a peer's revoke or abort found behind
    /// (the first of them): what the provider knows of a rank that is stuck, for a report
    /// that has no desync board to ask, or whose board is gone.
    pub(crate) fn behind_now(&self) -> Vec<usize> {
        let mine = self.info(self.rank).epoch.load(Acquire);
        let late: Vec<usize> = (0..self.nranks)
            .filter(|&r| self.info(r).epoch.load(Acquire) < mine)
            .collect();
        if !late.is_empty() {
            return late;
        }
        self.behind().map(|(r, _)| r).into_iter().collect()
    }

    /// The error every rank reports once the communicator failed, if it did.
    pub(crate) fn failure(&self) -> Option<Fail> {
        let h = self.header();
        let f = h.failed.load(Acquire);
        if f == 0 {
            return None;
        }
        let (why, r) = (why_of(f >> 32)?, (f & 0xffff_ffff) as usize);
        let seq = h.failed_seq.load(Acquire);
        let at = match seq {
            u64::MAX => "during initialization".to_string(),
            P2P_SEQ => "in a send/recv".to_string(),
            _ => format!("at collective #{seq}"),
        };
        let pid = if r < self.nranks {
            self.info(r).pid.load(Acquire)
        } else {
            0
        };
        let behind = match self.behind() {
            Some((b, 1)) => format!(
                "; rank {b} (pid {}) had not reached that collective: it is stuck or gone",
                self.info(b).pid.load(Acquire)
            ),
            Some((b, n)) => format!(
                "; {n} ranks had not reached that collective, rank {b} first: stuck or gone"
            ),
            None => String::new(),
        };
        let remote = |what: String| {
            Fail::new(
                ncclRemoteError,
                format!("rank {r} (pid {pid}) {what}{behind}"),
            )
        };
        Some(match why {
            Why::Abort => remote("called ncclCommAbort".to_string()),
            Why::Died => remote(format!("died: its process is gone ({at})")),
            Why::Revoked => remote(format!("revoked its communicator ({at})")),
            Why::Left => remote(format!("destroyed its communicator while the others waited for it ({at})")),
            Why::Timeout => Fail::new(
                ncclTimeout,
                format!(
                    "rank {r} (pid {pid}) did not reach {} by the deadline (the caller's timeout, at most {:?}: NCCL_SAFE_HOST_TIMEOUT_MS); the communicator was aborted",
                    if seq == P2P_SEQ { "its matching send/recv".to_string() } else { format!("collective #{seq}") },
                    wait_limit()
                ),
            ),
            Why::P2p => Fail::new(
                ncclInvalidUsage,
                format!("a send and its receive disagree on the size or data type (rank {r} received it)"),
            ),
            Why::Mismatch => Fail::new(
                ncclInvalidUsage,
                self.mismatch(seq).map(|m| m.1).unwrap_or_else(|| {
                    format!("ranks disagree on collective #{seq}: rank {r} called something else")
                }),
            ),
        })
    }

    /// A peer whose process is gone or that left (not yet recorded as the failure).
    fn peer_gone(&self) -> Option<(Why, usize)> {
        if self.silent {
            return None;
        }
        let me = std::process::id();
        for r in 0..self.nranks {
            let i = self.info(r);
            let pid = i.pid.load(Acquire);
            if i.state.load(Acquire) == 2 {
                return Some((Why::Left, r));
            }
            if pid != 0 && pid != me {
                // Only a process seen alive from here can be declared gone: a peer in
                // another pid namespace (a container sharing /dev/shm) is never seen, and
                // its failures surface at the deadline instead.
                if alive(pid) {
                    self.seen[r].store(true, Relaxed);
                } else if self.seen[r].load(Relaxed) {
                    return Some((Why::Died, r));
                }
            }
        }
        None
    }

    /// Whether every rank entered the barrier this rank entered as its `epoch`-th (each
    /// rank counts its own before it joins one, after its part of the round is written).
    fn all_entered(&self, epoch: u64) -> bool {
        (0..self.nranks).all(|r| self.info(r).epoch.load(Acquire) >= epoch)
    }

    /// Waits until every rank entered this barrier; fails on a failed communicator, a
    /// gone peer, or the deadline.
    fn barrier(&self, seq: u64, deadline: Instant) -> Result<(), Fail> {
        let h = self.header();
        let me = self.info(self.rank);
        let epoch = me.epoch.fetch_add(1, AcqRel) + 1;
        if let Some(f) = self.failure_here() {
            return Err(f);
        }
        let gen = h.bar_gen.load(Acquire);
        if h.bar_count.fetch_add(1, AcqRel) as usize + 1 == self.nranks {
            h.bar_count.store(0, Release);
            h.bar_gen.fetch_add(1, AcqRel);
            futex_wake(&h.bar_gen);
            return Ok(());
        }
        let mut spins = 0u32;
        let mut next_check = Instant::now() + Duration::from_millis(10);
        loop {
            let g = h.bar_gen.load(Acquire);
            // The word moves when the barrier completes and when the communicator fails.
            // A barrier every rank entered has completed, failure or not: a peer that
            // passed it may abort or revoke right after (its part of the collective done),
            // and this rank's part still completes, as a kernel that had its peer's data.
            if let Some(f) = self.failure_here() {
                if self.all_entered(epoch) {
                    return Ok(());
                }
                return Err(f);
            }
            if g != gen {
                return Ok(());
            }
            if spins < 64 {
                spins += 1;
                std::thread::yield_now();
                continue;
            }
            let now = Instant::now();
            if now >= next_check {
                next_check = now + Duration::from_millis(10);
                if let Some((why, r)) = self.peer_gone() {
                    // A peer that passed this barrier may leave or die right after it:
                    // only a barrier that is still incomplete fails.
                    if h.bar_gen.load(Acquire) != gen && self.failure().is_none() {
                        return Ok(());
                    }
                    return Err(self.fail_err(why, r, seq));
                }
                if now >= deadline {
                    let late = (0..self.nranks)
                        .find(|&r| self.info(r).epoch.load(Acquire) < epoch)
                        .unwrap_or(self.rank);
                    return Err(self.fail_err(Why::Timeout, late, seq));
                }
            }
            futex_wait(&h.bar_gen, g, Duration::from_millis(5));
        }
    }

    /// This rank destroys its communicator: peers waiting for it fail at once.
    pub(crate) fn leave(&self) {
        // Peers notice it at their next liveness check (no wake-up: the barrier's word
        // only moves when a barrier completes or the communicator fails).
        self.info(self.rank).state.store(2, Release);
        let _ = std::fs::remove_file(&self.path);
    }

    /// This rank aborts its communicator: every peer's communicator fails.
    pub(crate) fn abort(&self) {
        self.fail(Why::Abort, self.rank, self.seq.load(Acquire));
        let _ = std::fs::remove_file(&self.path);
    }

    /// This rank revokes its communicator (`ncclCommRevoke`): its own wait in a collective
    /// ends; the peers' waits for it go on, as in NCCL, where a revoke sets only this
    /// rank's abort flags (init.cc:2662 of v2.29.7-1) and a peer that waits for its
    /// kernels ends only with its own revoke or abort (or the provider's deadline). Unlike
    /// [`abort`](Self::abort) the segment stays as it was.
    pub(crate) fn revoke(&self) {
        self.revoked_here.store(true, Release);
    }

    /// Whether this rank revoked its communicator ([`revoke`](Self::revoke)).
    pub(crate) fn is_revoked_here(&self) -> bool {
        self.revoked_here.load(Acquire)
    }

    /// [`failure`](Self::failure), or this rank's own revoke: what ends this rank's waits.
    fn failure_here(&self) -> Option<Fail> {
        if self.revoked_here.load(Acquire) {
            return Some(Fail::new(
                ncclRemoteError,
                "this rank revoked its communicator while the operation waited (its abort flags end its own wait; its peers' go on)",
            ));
        }
        self.failure()
    }

    /// When the ranks' published operations differ: the ranks that differ from the
    /// majority, and the error text naming them and listing what every rank called.
    fn mismatch(&self, seq: u64) -> Option<(usize, String)> {
        let read = |r: usize| {
            let i = self.op(r, seq);
            (
                i.seq.load(Acquire),
                i.desc.load(Acquire),
                i.count.load(Acquire),
            )
        };
        let all: Vec<_> = (0..self.nranks).map(read).collect();
        if all.iter().all(|d| *d == all[0]) {
            return None;
        }
        let describe = |&(s, d, c): &(u64, u64, u64)| {
            let kind = ((d & 0xff) as u8)
                .checked_sub(1)
                .and_then(Collective::from_index);
            let red = match kind {
                Some(k) if k.reduces() => format!(", {}", dtype::red_name((d >> 16) & 0xff)),
                _ => String::new(),
            };
            // The root is stored plus one: 0 for none.
            let root = match d >> 32 {
                0 => String::new(),
                r => format!(", root={}", r - 1),
            };
            let dt = dtype::name(((d >> 8) & 0xff) as ncclDataType_t);
            let kind = kind.map_or("nothing", Collective::name);
            format!(
                "collective #{} {kind}(count={c}, {dt}{red}{root})",
                s.wrapping_sub(1)
            )
        };
        let majority = all
            .iter()
            .max_by_key(|d| all.iter().filter(|e| e == d).count())
            .copied()
            .unwrap_or(all[0]);
        let culprits: Vec<usize> = (0..self.nranks).filter(|&r| all[r] != majority).collect();
        let lines: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(r, d)| {
                // Read after the description: the rank published both before its seq.
                let at = match get_caller(&self.op(r, seq).caller) {
                    Some(line) => format!(" at {line}"),
                    None => String::new(),
                };
                format!("rank {r}: {}{at}", describe(d))
            })
            .collect();
        Some((
            culprits.first().copied().unwrap_or(self.rank),
            format!(
                "ranks disagree on collective #{seq}: rank(s) {culprits:?} called something else; {}",
                lines.join("; ")
            ),
        ))
    }

    /// Checks every rank called the same collective as this one (after the first
    /// barrier: every rank's description is published).
    fn check(&self, seq: u64) -> Result<(), Fail> {
        match self.mismatch(seq) {
            None => Ok(()),
            Some((first, text)) => {
                self.fail(Why::Mismatch, first, seq);
                Err(Fail::new(ncclInvalidUsage, text))
            }
        }
    }

    /// Runs this rank's part of collective `seq`.
    pub(crate) fn run_coll(&self, seq: u64, p: &CollPost) -> Result<(), Fail> {
        if let Some(f) = self.failure_here() {
            return Err(f);
        }
        let deadline = super::defs::call_deadline();
        let es = dtype::size_of(p.dtype).ok_or_else(|| {
            Fail::new(ncclInvalidArgument, format!("unknown datatype {}", p.dtype))
        })?;
        self.seq.store(seq, Release);
        let me = self.op(self.rank, seq);
        let red = p.red as u64;
        let desc = (p.kind.index() as u64 + 1)
            | (p.dtype as u64) << 8
            | red << 16
            | ((p.root + 1) as u64) << 32;
        me.desc.store(desc, Relaxed);
        me.count.store(p.count as u64, Relaxed);
        let mut sc = [0u8; 8];
        let k = p.scalar.len().min(8);
        sc[..k].copy_from_slice(&p.scalar[..k]);
        me.scalar.store(u64::from_le_bytes(sc), Relaxed);
        put_caller(&me.caller, p.caller);
        me.seq.store(seq + 1, Release);
        let r = self.rounds(seq, p, es, deadline);
        // A failure on this rank fails the communicator for everyone.
        if r.is_err() && self.failure().is_none() && !self.revoked_here.load(Acquire) {
            self.fail(Why::Abort, self.rank, seq);
        }
        r
    }

    /// Collective `seq` in rounds, from its data movement ([`Collective::source`]). A round
    /// moves elements `lo..hi` of every block (`count` elements) of the send buffers:
    /// each rank copies its blocks' part into its slot (block `b` at `b * per_round`), a
    /// barrier; for a reduction, each rank reduces `1/nranks` of the round's elements of
    /// every slot into its own slot, a barrier; then each rank copies every block of its
    /// receive buffer's part out of the slot that holds it.
    fn rounds(&self, seq: u64, p: &CollPost, es: usize, deadline: Instant) -> Result<(), Fail> {
        let n = self.nranks;
        let me = self.rank;
        let root = p.root as usize;
        let count = p.count;
        let bytes = |e: usize| e * es;
        let (send, recv) = p.kind.extents();
        let blocks = |ext: Extent, r: usize| ext.elements(1, n, r == root).unwrap_or(0);
        // Block j of our receive buffer comes from `sources[j]`.
        let sources: Vec<BlockSource> = (0..blocks(recv, me))
            .map(|j| p.kind.source(me, j, root))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                // Point-to-point calls go through the pair channels, never the slots.
                Fail::new(
                    ncclInternalError,
                    "a point-to-point call posted as a collective",
                )
            })?;
        // Rounds alternate between the two halves of every slot, so a rank may copy the
        // next round in while the others still copy the last one out: two barriers per
        // round of a reduction, one per round of a copy. A half holds one part of every
        // block of the widest send buffer (`join` makes it hold at least one element).
        let half = self.slot / 2 / 64 * 64;
        let width = (0..n).map(|r| blocks(send, r)).max().unwrap_or(1).max(1);
        let per_round = (half / es / width).max(1);
        let reduces = p.kind.reduces();
        // Every rank's PreMulSum scalar, read after the first barrier (published before it).
        let mut scalars: Vec<Vec<u8>> = Vec::new();
        let mut lo = 0usize;
        let mut first = true;
        loop {
            let off = (self.rounds.fetch_add(1, Relaxed) % 2) as usize * half;
            // SAFETY: both halves lie inside every slot.
            let sp = |r: usize| unsafe { self.slot_ptr(r).add(off) } as usize;
            let hi = (lo + per_round).min(count);
            let m = hi - lo;
            // Where element e of block b of the round lies in a slot.
            let at = |b: usize, e: usize| bytes(b * per_round + e);
            // SAFETY (every copy below): user buffers hold what NCCL's contract says for
            // this collective (lengths checked in `api::coll`); slot r is written only by
            // its owner, before the round's first barrier (copy in) or between its two
            // barriers (its share of a reduction, which no one else reads then), and read
            // by others only after that barrier, until they enter the next round's first
            // barrier (the round after uses the other half); `width` parts of `m` elements
            // fit half a slot. A round writes only elements lo..hi of a receive block,
            // whose in-place send elements were copied in before its first barrier.
            for b in 0..blocks(send, me) {
                // SAFETY: as above; block b's part of our send buffer into our own slot.
                unsafe { copy(p.send + bytes(b * count + lo), sp(me) + at(b, 0), bytes(m)) };
            }
            self.barrier(seq, deadline)?;
            if first {
                self.check(seq)?;
                if p.red == RedKind::PreMulSum {
                    scalars = (0..n)
                        .map(|r| {
                            self.op(r, seq).scalar.load(Acquire).to_le_bytes()[..es.min(8)].to_vec()
                        })
                        .collect();
                }
                first = false;
            }
            // A reduction's elements of the round, `width * m`, in shares of `share`: the
            // result of element f lives in slot `f / share`.
            let share = (width * m).div_ceil(n).max(1);
            if reduces {
                let (a, b) = (
                    (me * share).min(width * m),
                    ((me + 1) * share).min(width * m),
                );
                let step = (STEP / es).max(1);
                let mut acc = vec![0u8; bytes(step.min(b - a))];
                let mut f = a;
                while f < b {
                    // Elements f..g lie in one block of every slot.
                    let (blk, e) = (f / m, f % m);
                    let g = (f + step).min(b).min((blk + 1) * m);
                    let out = &mut acc[..bytes(g - f)];
                    let ins: smallvec::SmallVec<[&[u8]; 8]> = (0..n)
                        // SAFETY: as above; these elements of every slot are read only by
                        // this rank, and written (below) only by this rank in its own slot.
                        .map(|q| unsafe {
                            core::slice::from_raw_parts(
                                (sp(q) + at(blk, e)) as *const u8,
                                out.len(),
                            )
                        })
                        .collect();
                    if !dtype::reduce(p.dtype, p.red, &ins, &scalars, out) {
                        let m = "malformed reduction (short PreMulSum scalar)";
                        return Err(Fail::new(ncclInternalError, m));
                    }
                    drop(ins);
                    // SAFETY: as above; `out` is ours, written back to our own slot's share.
                    unsafe { copy(out.as_ptr() as usize, sp(me) + at(blk, e), out.len()) };
                    f = g;
                }
                self.barrier(seq, deadline)?;
            }
            for (j, src) in sources.iter().enumerate() {
                let dst = p.recv + bytes(j * count + lo);
                // SAFETY (both arms): as above; the slots are complete for this round
                // (the last barrier), and `dst` is part lo..hi of our receive block j.
                match src.rank {
                    Some(q) => unsafe { copy(sp(q) + at(src.block, 0), dst, bytes(m)) },
                    None => {
                        let mut f = src.block * m;
                        while f < (src.block + 1) * m {
                            let q = f / share;
                            let g = ((q + 1) * share).min((src.block + 1) * m);
                            let e = f - src.block * m;
                            unsafe { copy(sp(q) + at(src.block, e), dst + bytes(e), bytes(g - f)) };
                            f = g;
                        }
                    }
                }
            }
            lo = hi;
            if lo >= count {
                return Ok(());
            }
        }
    }
}

/// One-sided signals across processes: each put or signal is a file of its own beside the
/// segment's name (`<segment>-rma-<to>-<from>-<n>`, written under another name and renamed,
/// so a reader sees it whole), read and removed by the receiver's wait. A put never waits
/// for its peer, as NCCL's does not. The files carry the maker's pid like the segment's
/// name, so [`sweep`] removes those a dead job left.
impl Segment {
    fn rma_name(&self, to: usize, from: usize, n: u64) -> String {
        format!("{}-rma-{to}-{from}-{n}", self.path)
    }

    /// Posts a signal to rank `to`, with a put's data: the destination window's
    /// registration order, the byte offset into it, the bytes.
    pub(crate) fn rma_post(
        &self,
        to: usize,
        data: Option<(u64, usize, &[u8])>,
    ) -> Result<(), Fail> {
        use std::io::Write;
        let n = self.rma[to].fetch_add(1, AcqRel);
        let (order, off, bytes) = data.map_or((u64::MAX, 0, &[][..]), |(o, f, b)| (o, f, b));
        let mut head = Vec::with_capacity(24 + bytes.len());
        head.extend_from_slice(&order.to_le_bytes());
        head.extend_from_slice(&(off as u64).to_le_bytes());
        head.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        let (tmp, name) = (
            format!("{}-tmp", self.rma_name(to, self.rank, n)),
            self.rma_name(to, self.rank, n),
        );
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&head)?;
            f.write_all(bytes)?;
            std::fs::rename(&tmp, &name)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            sys_fail(format!("post a one-sided signal in {name}"), e)
        })?;
        self.ring(to);
        Ok(())
    }

    /// Waits until `(from, count)` signals each arrived (the same peer named twice counts
    /// the sum), then takes them, returning their puts' data in order; fails on a failed
    /// communicator, a gone peer, `aborted` (this process's abort), or the deadline (which
    /// fails the communicator, as a collective's).
    pub(crate) fn rma_take(
        &self,
        wants: &[(usize, usize)],
        deadline: Instant,
        aborted: impl Fn() -> Option<Fail>,
    ) -> Result<Vec<(u64, usize, Vec<u8>)>, Fail> {
        let mut need = vec![0u64; self.nranks];
        for &(p, c) in wants {
            need[p] += c as u64;
        }
        let taken = |p: usize| self.rma[self.nranks + p].load(Acquire);
        let present = |p: usize| {
            (0..need[p])
                .all(|k| std::path::Path::new(&self.rma_name(self.rank, p, taken(p) + k)).exists())
        };
        let bell = &self.info(self.rank).bell;
        loop {
            let ring = bell.load(Acquire);
            if (0..self.nranks).all(present) {
                break;
            }
            if let Some(f) = self.failure().or_else(&aborted) {
                return Err(f);
            }
            if let Some((why, r)) = self.peer_gone() {
                return Err(self.fail_err(why, r, P2P_SEQ));
            }
            if Instant::now() >= deadline {
                let late = (0..self.nranks).find(|&p| !present(p)).unwrap_or(self.rank);
                return Err(self.fail_err(Why::Timeout, late, P2P_SEQ));
            }
            futex_wait(bell, ring, Duration::from_millis(10));
        }
        let mut data = Vec::new();
        for (p, &count) in need.iter().enumerate() {
            for k in 0..count {
                let name = self.rma_name(self.rank, p, taken(p) + k);
                let raw = std::fs::read(&name).map_err(|e| sys_fail(format!("read {name}"), e))?;
                let _ = std::fs::remove_file(&name);
                let word = |i: usize| {
                    u64::from_le_bytes(raw[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]))
                };
                if raw.len() < 24 || raw.len() as u64 != 24 + word(2) {
                    return Err(Fail::new(
                        ncclSystemError,
                        format!("{name} is not a whole signal"),
                    ));
                }
                if word(0) != u64::MAX {
                    data.push((word(0), word(1) as usize, raw[24..].to_vec()));
                }
            }
            self.rma[self.nranks + p].fetch_add(count, AcqRel);
        }
        Ok(data)
    }
}

/// One send or receive of a group (or a plain call), run by [`Segment::run_p2p`].
pub(crate) struct P2pWork {
    pub peer: usize,
    pub is_send: bool,
    pub ptr: usize,
    pub bytes: usize,
    pub dtype: ncclDataType_t,
}

impl Segment {
    fn chan(&self, src: usize, dst: usize) -> (&Chan, *mut u8) {
        let cb = chan_bytes(self.nranks);
        let at = self.chans + (src * self.nranks + dst) * (CHAN + cb);
        // SAFETY: channel (src, dst) lies inside the mapping (checked by `layout` at join).
        unsafe {
            let p = self.base.add(at);
            (&*(p as *const Chan), p.add(CHAN))
        }
    }

    fn ring(&self, r: usize) {
        let b = &self.info(r).bell;
        b.fetch_add(1, AcqRel);
        futex_wake(b);
    }

    /// Runs this rank's sends and receives, all progressing together (so a ring of sends
    /// and receives in one group never waits on itself), chunk by chunk through the
    /// channels of each pair.
    pub(crate) fn run_p2p(&self, work: &[P2pWork]) -> Result<(), Fail> {
        if let Some(f) = self.failure_here() {
            return Err(f);
        }
        let cb = chan_bytes(self.nranks);
        if cb == 0 {
            let n = self.nranks;
            let m =
                format!("send/recv across processes needs at most {MAX_P2P_RANKS} ranks, not {n}");
            return Err(Fail::new(ncclInvalidUsage, m));
        }
        let me = self.rank;
        let deadline = super::defs::call_deadline();
        // Bytes moved so far, and whether the (possibly empty) message is complete.
        let mut moved = vec![0usize; work.len()];
        let mut done = vec![false; work.len()];
        let bell = &self.info(me).bell;
        let mut next_check = Instant::now() + Duration::from_millis(10);
        loop {
            let rung = bell.load(Acquire);
            let mut progressed = false;
            for (i, w) in work.iter().enumerate() {
                // Messages on one channel go one after the other.
                let queued = work[..i]
                    .iter()
                    .zip(&done[..i])
                    .any(|(o, d)| !d && o.peer == w.peer && o.is_send == w.is_send);
                if done[i] || queued {
                    continue;
                }
                let msg = (w.bytes as u64) << 8 | (w.dtype as u64 & 0xff);
                let l = if w.is_send {
                    let (c, data) = self.chan(me, w.peer);
                    if c.posted.load(Acquire) != c.taken.load(Acquire) {
                        continue;
                    }
                    let l = (w.bytes - moved[i]).min(cb);
                    // SAFETY: the channel is empty, so only this sender touches its data;
                    // the user's buffer holds `bytes` (NCCL's contract).
                    unsafe { copy(w.ptr + moved[i], data as usize, l) };
                    c.len.store(l as u64, Relaxed);
                    c.msg.store(msg, Relaxed);
                    c.posted.fetch_add(1, Release);
                    l
                } else {
                    let (c, data) = self.chan(w.peer, me);
                    if c.posted.load(Acquire) == c.taken.load(Acquire) {
                        continue;
                    }
                    let l = c.len.load(Relaxed) as usize;
                    let sent = c.msg.load(Relaxed);
                    if sent != msg || moved[i] + l > w.bytes {
                        let (peer, bytes, dt) = (w.peer, w.bytes, w.dtype);
                        let (sent, sent_dt) = (sent >> 8, sent & 0xff);
                        let text = format!("ncclSend from rank {peer} ({sent} bytes, dtype {sent_dt}) does not match ncclRecv on rank {me} ({bytes} bytes, dtype {dt})");
                        self.fail(Why::P2p, me, P2P_SEQ);
                        return Err(Fail::new(ncclInvalidUsage, text));
                    }
                    // SAFETY: the chunk was posted (Acquire above) and stays until taken.
                    unsafe { copy(data as usize, w.ptr + moved[i], l) };
                    c.taken.fetch_add(1, Release);
                    l
                };
                moved[i] += l;
                done[i] = moved[i] == w.bytes;
                self.ring(w.peer);
                progressed = true;
            }
            if done.iter().all(|&d| d) {
                return Ok(());
            }
            if progressed {
                continue;
            }
            if let Some(f) = self.failure_here() {
                return Err(f);
            }
            let now = Instant::now();
            if now >= next_check {
                next_check = now + Duration::from_millis(10);
                if let Some((why, r)) = self.peer_gone() {
                    return Err(self.fail_err(why, r, P2P_SEQ));
                }
                if now >= deadline {
                    let late = work
                        .iter()
                        .zip(&done)
                        .find(|(_, d)| !**d)
                        .map_or(me, |(w, _)| w.peer);
                    return Err(self.fail_err(Why::Timeout, late, P2P_SEQ));
                }
            }
            futex_wait(bell, rung, Duration::from_millis(5));
        }
    }
}

/// Copies `len` bytes (regions may overlap, as in-place forms do).
///
/// # Safety
/// Both ranges are valid for `len` bytes.
unsafe fn copy(src: usize, dst: usize, len: usize) {
    if len > 0 && src != dst {
        // SAFETY: forwarded to the caller.
        unsafe { core::ptr::copy(src as *const u8, dst as *mut u8, len) };
    }
}

/// A unique id for communicators whose ranks may be in several processes of this machine.
pub(crate) fn shared_id() -> ncclUniqueId {
    let mut id = super::defs::fresh_id();
    id.internal[15] = SHARED_TAG as core::ffi::c_char;
    id
}

#[cfg(test)]
mod tests {
    #[test]
    fn half_a_slot_holds_an_element_of_every_ranks_block() {
        for asked in [None, Some(0), Some(4096), Some(5000)] {
            for n in (1..=super::MAX_RANKS).step_by(7).chain([super::MAX_RANKS]) {
                let half = super::slot_for(asked, n) / 2 / 64 * 64;
                assert!(
                    half >= n * 8,
                    "{n} ranks, {asked:?}: half a slot is {half} bytes"
                );
            }
        }
    }
}
