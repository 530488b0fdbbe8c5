//! Differential checks: the same call sequence on NCCL built from source and on the host
//! provider (`tests/nccl_source*.rs`).
//!
//! Each row of ARCHITECTURE.md's contract table that this path can exercise is a scenario:
//! raw calls through `nccl_sys::FunctionTable`, each rank on its own thread and fake device,
//! which writes down what it saw (return codes, whether an out-pointer was written, the
//! asynchronous state). The scenario runs on NCCL built from source and on the host
//! provider (as NCCL 2.28), and the two traces must be equal: a difference fails the test
//! and names the row. The ranks are sequenced by barriers where NCCL's answer depends on
//! timing (a rank's job cannot end before its peer arrives), so every line is deterministic.
#![allow(non_upper_case_globals)]

use core::ffi::{c_int, c_void};
use std::sync::{Barrier, Mutex};
use std::time::Duration;

use cudarc::driver::CudaContext;
use nccl_sys::bindings::*;
use nccl_sys::FunctionTable;

use super::fakes::source_nccl;
use super::within;

/// The NCCL a test binary checks, and the host provider's emulation of it.
pub struct Target {
    /// The tag built from source, without its `v` ("2.28.9-1").
    pub version: &'static str,
    /// The release the host provider emulates (`host::lookup_as_version`).
    pub host: (u32, u32),
    /// `sizeof(ncclConfig_t)` in that release's header.
    pub config_size: usize,
    /// `NCCL_VERSION_CODE` of that release.
    pub code: u32,
}

/// The communicator config of `target`'s NCCL, every field unset (NCCL's
/// `NCCL_CONFIG_INITIALIZER`) but `blocking`.
fn config(target: &Target, blocking: c_int) -> ncclConfig_t {
    // SAFETY: plain data; all-zero is a valid value, and every int is then set.
    let mut c: ncclConfig_t = unsafe { core::mem::zeroed() };
    let base = &mut c as *mut ncclConfig_t as *mut u8;
    let first = core::mem::offset_of!(ncclConfig_t, blocking);
    for off in (first..core::mem::size_of::<ncclConfig_t>()).step_by(4) {
        let is_ptr = [
            core::mem::offset_of!(ncclConfig_t, netName),
            core::mem::offset_of!(ncclConfig_t, commName),
        ]
        .iter()
        .any(|p| (*p..*p + 8).contains(&off));
        if !is_ptr {
            // SAFETY: an i32 field of the struct, inside it.
            unsafe {
                base.add(off)
                    .cast::<i32>()
                    .write(nccl_sys::NCCL_CONFIG_UNDEF_INT)
            };
        }
    }
    c.size = target.config_size;
    c.magic = NCCL_API_MAGIC;
    c.version = target.code;
    c.blocking = blocking;
    c
}

pub fn rc(r: ncclResult_t) -> String {
    match r {
        ncclSuccess => "Success".into(),
        ncclInProgress => "InProgress".into(),
        ncclInvalidArgument => "InvalidArgument".into(),
        ncclInvalidUsage => "InvalidUsage".into(),
        ncclSystemError => "SystemError".into(),
        ncclInternalError => "InternalError".into(),
        ncclRemoteError => "RemoteError".into(),
        ncclUnhandledCudaError => "UnhandledCudaError".into(),
        other => format!("code {other}"),
    }
}

/// The ranks' barrier: threads of one process, or processes (a file per rank and turn in
/// a folder they share, bounded).
pub enum Seq {
    /// The barrier, and the id one rank hands to the others.
    Threads(Barrier, Mutex<Option<ncclUniqueId>>),
    Files {
        dir: std::path::PathBuf,
        n: usize,
        rank: usize,
        turn: std::sync::atomic::AtomicUsize,
    },
}

impl Seq {
    /// Hands `id` (a grow's) to the other ranks, which read it after the next barrier.
    pub fn hand(&self, id: ncclUniqueId) {
        match self {
            Seq::Threads(_, handed) => *handed.lock().unwrap() = Some(id),
            Seq::Files { dir, .. } => {
                std::fs::write(dir.join("handed"), id.internal.map(|b| b as u8)).unwrap()
            }
        }
    }

    /// The id a rank handed before the last barrier.
    pub fn handed(&self) -> ncclUniqueId {
        match self {
            Seq::Threads(_, handed) => handed.lock().unwrap().expect("an id was handed"),
            Seq::Files { dir, .. } => {
                let bytes = std::fs::read(dir.join("handed")).expect("an id was handed");
                ncclUniqueId {
                    internal: core::array::from_fn(|i| bytes[i] as core::ffi::c_char),
                }
            }
        }
    }

    pub fn wait(&self) {
        match self {
            Seq::Threads(b, _) => {
                b.wait();
            }
            Seq::Files { dir, n, rank, turn } => {
                let t = turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                std::fs::write(dir.join(format!("{t}-{rank}")), b"").unwrap();
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                while (0..*n).any(|r| !dir.join(format!("{t}-{r}")).exists()) {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "rank {rank}: the other processes never reached barrier {t}"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

/// One rank's view of the run: what it saw, in order.
pub struct Rank<'a> {
    pub target: &'a Target,
    pub t: &'a FunctionTable,
    pub r: usize,
    /// The world size.
    pub n: usize,
    pub id: ncclUniqueId,
    /// Every rank waits here (threads: a barrier; processes: files).
    pub seq: &'a Seq,
    pub trace: Vec<String>,
}

impl Rank<'_> {
    fn note(&mut self, what: impl Into<String>) {
        self.trace.push(what.into());
    }

    /// Non-blocking init: notes its return and whether the handle was written in the call.
    pub fn init(&mut self, n: usize, r: usize) -> ncclComm_t {
        let mut comm: ncclComm_t = core::ptr::null_mut();
        let mut c = config(self.target, 0);
        // SAFETY: valid out-pointer and config; the id is this run's.
        let got = unsafe {
            (self.t.ncclCommInitRankConfig)(&mut comm, n as c_int, self.id, r as c_int, &mut c)
        };
        self.note(format!(
            "init: {}, handle written in the call: {}",
            rc(got),
            !comm.is_null()
        ));
        comm
    }

    /// A non-blocking config of the target's NCCL, every other field unset.
    pub fn config(&self) -> ncclConfig_t {
        config(self.target, 0)
    }

    /// The asynchronous state, once (`ncclCommGetAsyncError`).
    pub fn state(&mut self, comm: ncclComm_t, what: &str) {
        let mut e = ncclSuccess;
        // SAFETY: a live handle, a valid out-pointer.
        let got = unsafe { (self.t.ncclCommGetAsyncError)(comm, &mut e) };
        self.note(format!("{what}: state {} (call {})", rc(e), rc(got)));
    }

    /// Polls the asynchronous state until it leaves ncclInProgress (bounded).
    pub fn settle(&mut self, comm: ncclComm_t, what: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let mut e = ncclSuccess;
            // SAFETY: as in `state`.
            let got = unsafe { (self.t.ncclCommGetAsyncError)(comm, &mut e) };
            if e != ncclInProgress || got != ncclSuccess {
                self.note(format!("{what}: settled {} (call {})", rc(e), rc(got)));
                return;
            }
            if std::time::Instant::now() > deadline {
                self.note(format!("{what}: still in progress after 30 s"));
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn count(&mut self, comm: ncclComm_t, what: &str) {
        let mut n: c_int = -1;
        // SAFETY: as in `state`.
        let got = unsafe { (self.t.ncclCommCount)(comm, &mut n) };
        self.note(format!("{what}: ncclCommCount {} -> {n}", rc(got)));
    }

    pub fn call(&mut self, what: &str, got: ncclResult_t) {
        self.note(format!("{what}: {}", rc(got)));
    }

    /// A call whose answer NCCL leaves to a race: any of `either` is noted as one line
    /// naming them all, so that NCCL and the host provider agree whichever side of the
    /// race each ran on; any other answer is noted as itself, and then differs.
    pub fn call_racing(&mut self, what: &str, got: ncclResult_t, either: &[ncclResult_t]) {
        if either.contains(&got) {
            let names: Vec<_> = either.iter().map(|&e| rc(e)).collect();
            self.note(format!("{what}: one of {}", names.join(", ")));
        } else {
            self.call(what, got);
        }
    }

    pub fn check(&mut self, what: &str, v: impl std::fmt::Debug) {
        self.note(format!("{what}: {v:?}"));
    }
}

/// Runs `scenario` on `n` ranks (threads, fake devices 0..n) of one provider; each
/// rank's trace.
pub fn run(
    target: &Target,
    t: &FunctionTable,
    cuda: bool,
    n: usize,
    scenario: impl Fn(&mut Rank) + Sync,
) -> Vec<Vec<String>> {
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { (t.ncclGetUniqueId)(&mut id) }, ncclSuccess);
    let seq = Seq::Threads(Barrier::new(n), Mutex::new(None));
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (scenario, seq) = (&scenario, &seq);
                sc.spawn(move || {
                    // NCCL takes the thread's current device (its runtime's
                    // cudaGetDevice): the fake driver's current context.
                    let _ctx = cuda.then(|| {
                        let ctx = CudaContext::new(r).unwrap();
                        ctx.bind_to_thread().unwrap();
                        ctx
                    });
                    let mut rank = Rank {
                        target,
                        t,
                        r,
                        n,
                        id,
                        seq,
                        trace: Vec::new(),
                    };
                    debug_assert!(rank.n > rank.r);
                    scenario(&mut rank);
                    rank.trace
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// Runs `scenario` on NCCL and on the host provider and fails, naming `row`, where
/// their traces differ.
pub fn same(
    target: &'static Target,
    row: &str,
    n: usize,
    scenario: impl Fn(&mut Rank) + Sync + Send + Copy + 'static,
) {
    let lib = source_nccl(target.version);
    // The provider's launch answered as NCCL's (ncclInProgress with two ranks or more).
    nccl_safe::host::set_launch_in_progress(true);
    // SAFETY: the host provider's lookup returns functions with NCCL's signatures.
    let host = unsafe {
        FunctionTable::load(nccl_safe::host::lookup_as_version(
            target.host.0,
            target.host.1,
        ))
    }
    .expect("the host provider's table");
    let nccl = within(Duration::from_secs(120), {
        let lib = lib.clone();
        move || run(target, lib.table(), true, n, scenario)
    });
    let stand_in = within(Duration::from_secs(120), move || {
        run(target, &host, false, n, scenario)
    });
    for (r, lines) in nccl.iter().enumerate() {
        eprintln!("row `{row}`, rank {r} on NCCL {}:", target.version);
        for l in lines {
            eprintln!("  {l}");
        }
    }
    for r in 0..n {
        assert_eq!(
            nccl[r], stand_in[r],
            "contract row `{row}`, rank {r}: NCCL {} (left) and the host provider \
             (right) differ",
            target.version
        );
    }
}

pub fn buf(n: usize) -> Vec<f32> {
    vec![1.0; n]
}

pub fn ptr(v: &mut [f32]) -> *mut c_void {
    v.as_mut_ptr().cast()
}

/// The variable that makes a test binary one rank of a differential row in processes:
/// `PROVIDER:RANK:N:DIR:ID` (the id's bytes in hex).
const CHILD: &str = "NCCL_SAFE_DIFF_CHILD";

/// [`same`] in threads, then the same scenario with each rank in a process of its own, on
/// NCCL and on the host provider (`test`: the calling test's name, which the children
/// run): NCCL's bootstrap across processes and the provider's shared segment must answer
/// as each other. In a child (`NCCL_SAFE_DIFF_CHILD` set) it runs that child's rank only.
pub fn same_in_processes(
    target: &'static Target,
    test: &str,
    row: &str,
    n: usize,
    scenario: impl Fn(&mut Rank) + Sync + Send + Copy + 'static,
) {
    if let Ok(spec) = std::env::var(CHILD) {
        child(target, &spec, scenario);
        return;
    }
    same(target, row, n, scenario);
    let nccl = processes(target, test, "nccl", n);
    let stand_in = processes(target, test, "host", n);
    for r in 0..n {
        assert_eq!(
            nccl[r], stand_in[r],
            "contract row `{row}` in processes, rank {r}: NCCL {} (left) and the host \
             provider (right) differ",
            target.version
        );
    }
}

/// One rank of a row in processes: its trace, a line each behind `DIFF `.
fn child(target: &'static Target, spec: &str, scenario: impl Fn(&mut Rank)) {
    let mut it = spec.splitn(5, ':');
    let (provider, r, n, dir, hex) = (
        it.next().unwrap(),
        it.next().unwrap().parse::<usize>().unwrap(),
        it.next().unwrap().parse::<usize>().unwrap(),
        it.next().unwrap(),
        it.next().unwrap(),
    );
    let mut id = ncclUniqueId { internal: [0; 128] };
    for (i, b) in id.internal.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as core::ffi::c_char;
    }
    let lib;
    let host;
    let (t, _ctx) = if provider == "nccl" {
        lib = source_nccl(target.version);
        let ctx = CudaContext::new(r).unwrap();
        ctx.bind_to_thread().unwrap();
        (lib.table(), Some(ctx))
    } else {
        nccl_safe::host::set_launch_in_progress(true);
        // SAFETY: the host provider's lookup returns functions with NCCL's signatures.
        host = unsafe {
            FunctionTable::load(nccl_safe::host::lookup_as_version(
                target.host.0,
                target.host.1,
            ))
        }
        .expect("the host provider's table");
        (&host, None)
    };
    let seq = Seq::Files {
        dir: dir.into(),
        n,
        rank: r,
        turn: Default::default(),
    };
    let mut rank = Rank {
        target,
        t,
        r,
        n,
        id,
        seq: &seq,
        trace: Vec::new(),
    };
    scenario(&mut rank);
    // The test harness's "test NAME ... " has no newline of its own.
    println!();
    for line in rank.trace {
        println!("DIFF {line}");
    }
}

/// Runs the calling test's row with each of `n` ranks in a child process on `provider`
/// ("nccl" or "host"); each rank's trace.
fn processes(target: &Target, test: &str, provider: &str, n: usize) -> Vec<Vec<String>> {
    // NCCL's bootstrap root runs in this process until `lib` is dropped, after the
    // children ended.
    let lib = (provider == "nccl").then(|| source_nccl(target.version));
    let id = match &lib {
        Some(lib) => {
            let mut id = ncclUniqueId { internal: [0; 128] };
            // SAFETY: a valid out-pointer.
            assert_eq!(
                unsafe { (lib.table().ncclGetUniqueId)(&mut id) },
                ncclSuccess
            );
            id
        }
        None => nccl_safe::host::shared_unique_id(),
    };
    let hex: String = id
        .internal
        .iter()
        .map(|&b| format!("{:02x}", b as u8))
        .collect();
    let dir = std::env::temp_dir().join(format!(
        "nccl-safe-diff-{}-{provider}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let children: Vec<_> = (0..n)
        .map(|r| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", test, "--nocapture", "--test-threads", "1"])
                .env(CHILD, format!("{provider}:{r}:{n}:{}:{hex}", dir.display()))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let traces = children
        .into_iter()
        .enumerate()
        .map(|(r, mut child)| {
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while child.try_wait().unwrap().is_none() {
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{provider}, rank {r} of {n} in its own process: {}\n{text}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            text.lines()
                .filter_map(|l| l.strip_prefix("DIFF ").map(str::to_string))
                .collect()
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    drop(lib);
    traces
}
