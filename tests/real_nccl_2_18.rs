//! NVIDIA's libnccl.so.2 2.18.3, the oldest release nccl-safe supports: every required
//! symbol resolves, and entry points added later report `Unsupported`.
//! (A separate test binary, so it never shares a process with the 2.32 library.)

mod common;

use nccl_safe::{Error, Library, Version};

#[test]
fn required_symbols_resolve_and_newer_ones_are_unsupported() {
    let lib = Library::load_from(common::real_nccl("2.18.3")).expect("2.18.3 loads");
    assert_eq!(lib.version(), Version::new(2, 18, 3));
    for name in nccl_sys::REQUIRED_SYMBOLS {
        assert!(lib.has(name), "{name}");
    }
    assert!(lib.optional_features().iter().all(|(_, present)| !present));
    for (symbol, f_missing, needs) in [
        (
            "ncclAlltoAll",
            lib.table().ncclAlltoAll.is_none(),
            Version::new(2, 28, 0),
        ),
        (
            "ncclCommShrink",
            lib.table().ncclCommShrink.is_none(),
            Version::new(2, 27, 0),
        ),
        (
            "ncclMemAlloc",
            lib.table().ncclMemAlloc.is_none(),
            Version::new(2, 19, 0),
        ),
    ] {
        assert!(f_missing, "{symbol} should be absent from 2.18.3");
        let err = match symbol {
            "ncclAlltoAll" => lib.optional(lib.table().ncclAlltoAll, symbol).map(|_| ()),
            "ncclCommShrink" => lib.optional(lib.table().ncclCommShrink, symbol).map(|_| ()),
            _ => lib.optional(lib.table().ncclMemAlloc, symbol).map(|_| ()),
        }
        .unwrap_err();
        match &err {
            Error::Unsupported {
                symbol: s,
                needs: n,
                found,
            } => {
                assert_eq!(*s, symbol);
                assert_eq!(*n, needs);
                assert_eq!(*found, Version::new(2, 18, 3));
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
        assert!(err.to_string().contains("2.18.3"), "{err}");
    }
}
