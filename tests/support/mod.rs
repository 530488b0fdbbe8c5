//! The integration tests' helpers, in one place (each test binary says `mod support;`):
//!
//! * here: bounds on a test's waits ([`within`], [`until`]), NVIDIA's NCCL wheels
//!   ([`real_nccl`]) and temporary folders;
//! * [`ranks`] (the host provider): ranks as threads, element values every dtype holds
//!   exactly, and teardown accounting;
//! * [`fakes`] (the host provider): the fake CUDA driver (`fakes/cuda.c`) and the host
//!   provider presented as NCCL; NCCL built from source over the fake CUDA runtime;
//! * [`differential`]: a call sequence run on NCCL built from source and on the host
//!   provider, each rank's trace compared;
//! * [`c10d`]: a PyTorch `TCPStore` server written from its protocol, which can misbehave.
#![allow(dead_code)]

pub mod c10d;
#[cfg(feature = "host")]
pub mod differential;
#[cfg(feature = "host")]
pub mod fakes;
#[cfg(feature = "host")]
pub mod ranks;
#[cfg(feature = "host")]
#[allow(unused_imports)] // each binary uses some
pub use ranks::{assert_balanced, run_ranks, settled_stats, El};

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::Duration;

use std::path::PathBuf;

/// NVIDIA's libnccl.so.2 of `version`, as fetched by `scripts/fetch-nccl.sh`.
///
/// Panics (failing the test, never skipping it) when it is absent: run the README's test
/// command, `scripts/test.sh`, which fetches it.
pub fn real_nccl(version: &str) -> PathBuf {
    let dir = std::env::var_os("NCCL_SAFE_TEST_NCCL_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/nccl-safe")))
        .expect("set NCCL_SAFE_TEST_NCCL_DIR or HOME");
    let lib = dir.join(version).join("nvidia/nccl/lib/libnccl.so.2");
    assert!(
        lib.is_file(),
        "{} is missing: run scripts/test.sh (it fetches NVIDIA's NCCL {version} from PyPI)",
        lib.display()
    );
    lib
}

/// The abort bound of the exit tests' children (the GPU test and its fake-driver twin):
/// the exit guard waits this long for the abort blocked behind the stuck stream, then ends
/// the process with its own status. Above NVIDIA's real abort time (about 1 s on an H100,
/// on an H100 with NCCL 2.28.9), and short enough that the parent's 60 s bound holds.
pub const EXIT_CHILD_ABORT_TIMEOUT: Duration = Duration::from_secs(2);

/// Starts this test binary's ignored test `name` as a child process with `var=value`.
pub fn spawn_child(name: &str, var: &str, value: &str) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--nocapture"])
        .env(var, value)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits (at most `limit`, then kills it and fails) for a child of [`spawn_child`], and
/// checks that it printed `mark` and ended with its own status `code`, never a signal.
/// The time it took.
pub fn check_child_exit(
    mut child: std::process::Child,
    mark: &str,
    code: i32,
    limit: Duration,
) -> Duration {
    use std::os::unix::process::ExitStatusExt;
    let start = std::time::Instant::now();
    let ended = loop {
        if child.try_wait().unwrap().is_some() {
            break true;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ended, "the child did not end within {limit:?}: {text}");
    assert!(
        text.contains(mark),
        "the child did not reach its exit: {text}"
    );
    assert_eq!(out.status.signal(), None, "killed by a signal: {text}");
    assert_eq!(out.status.code(), Some(code), "{text}");
    start.elapsed()
}

/// A fresh, empty temporary folder for one test.
pub fn temp_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "nccl-safe-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create temp dir");
    d
}

/// Runs `f` on another thread and fails the test if it does not return within `limit`
/// (a hang becomes a failure instead of a stuck test run).
pub fn within<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(r)) => {
            let _ = h.join();
            r
        }
        Ok(Err(p)) => resume_unwind(p),
        Err(_) => panic!("did not finish within {limit:?} (hang)"),
    }
}

/// Polls `f` until it is true or `limit` passes; the time it took.
pub fn until(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}
