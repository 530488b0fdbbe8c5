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

/// One rank's view of the run: what it saw, in order.
pub struct Rank<'a> {
    pub target: &'a Target,
    pub t: &'a FunctionTable,
    pub r: usize,
    /// The world size.
    pub n: usize,
    pub id: ncclUniqueId,
    pub seq: &'a Barrier,
    /// An id one rank hands to the others (a grow's), between barriers.
    pub handed: &'a Mutex<Option<ncclUniqueId>>,
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
    let seq = Barrier::new(n);
    let handed = Mutex::new(None);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (scenario, seq, handed) = (&scenario, &seq, &handed);
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
                        handed,
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
