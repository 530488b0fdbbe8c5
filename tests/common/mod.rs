//! Shared helpers of the integration tests.
#![allow(dead_code)]

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
