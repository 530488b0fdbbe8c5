//! NVIDIA's libnccl.so.2 2.18.3, the oldest release nccl-safe supports: every required
//! symbol resolves, and entry points added later report `Unsupported`.
//! (A separate test binary, so it never shares a process with the 2.32 library.)

mod support;

use nccl_safe::{Error, Library, Version};

#[test]
fn required_symbols_resolve_and_newer_ones_are_unsupported() {
    let lib = Library::load_from(support::real_nccl("2.18.3")).expect("2.18.3 loads");
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

#[test]
fn fp8_nccl_memory_and_registration_are_unsupported_on_2_18() {
    let lib = Library::load_from(support::real_nccl("2.18.3")).expect("2.18.3 loads");
    let found = Version::new(2, 18, 3);
    let fp8 = nccl_safe::DataType::Float8e4m3.check_supported(&lib);
    assert!(
        matches!(fp8, Err(Error::Unsupported { symbol: "ncclFloat8e4m3", needs, found: f })
            if needs == Version::new(2, 24, 0) && f == found),
        "{fp8:?}"
    );
    assert!(nccl_safe::DataType::Bfloat16.check_supported(&lib).is_ok());
    let mem = nccl_safe::NcclMemory::<f32>::alloc_zeros_in(&lib, 4, nccl_safe::Stream::Host);
    assert!(
        matches!(mem, Err(Error::Unsupported { symbol: "ncclMemAlloc", needs, .. })
            if needs == Version::new(2, 19, 0)),
        "{mem:?}"
    );
    for (symbol, absent) in [
        ("ncclCommRegister", lib.table().ncclCommRegister.is_none()),
        (
            "ncclCommWindowRegister",
            lib.table().ncclCommWindowRegister.is_none(),
        ),
    ] {
        assert!(absent, "{symbol} should be absent from 2.18.3");
    }
}

/// The one-sided calls (`ncclPutSignal`, `ncclSignal`, `ncclWaitSignal`) came with 2.29:
/// absent from 2.18.3, and `Unsupported` naming 2.29 and the release found (the gate each
/// of `Window::put_signal`, `Communicator::signal` and `Window::wait_signal` passes first).
#[test]
fn one_sided_calls_are_unsupported_on_2_18() {
    let lib = Library::load_from(support::real_nccl("2.18.3")).expect("2.18.3 loads");
    let t = lib.table();
    let gates = [
        (
            "ncclPutSignal",
            lib.optional(t.ncclPutSignal, "ncclPutSignal").map(drop),
        ),
        (
            "ncclSignal",
            lib.optional(t.ncclSignal, "ncclSignal").map(drop),
        ),
        (
            "ncclWaitSignal",
            lib.optional(t.ncclWaitSignal, "ncclWaitSignal").map(drop),
        ),
    ];
    for (symbol, r) in gates {
        match r {
            Err(Error::Unsupported {
                symbol: s,
                needs,
                found,
            }) if s == symbol
                && needs == Version::new(2, 29, 0)
                && found == Version::new(2, 18, 3) => {}
            other => panic!("{symbol}: expected Unsupported, got {other:?}"),
        }
    }
}

/// Joining a grown communicator needs `ncclCommGrow` (2.29): on NVIDIA's 2.18.3 it is
/// `Unsupported` before anything reaches NCCL (no device needed: the gate comes first).
#[test]
fn join_grown_is_unsupported_on_2_18() {
    let lib = Library::load_from(support::real_nccl("2.18.3")).expect("2.18.3 loads");
    let id = nccl_safe::UniqueId::from_bytes(&[0u8; 128]).unwrap();
    let e = nccl_safe::Communicator::join_grown_in(
        &lib,
        &nccl_safe::CommDevice::Host,
        2,
        1,
        &id,
        &nccl_safe::Config::new(),
    )
    .unwrap_err();
    match e {
        Error::Unsupported {
            symbol: "ncclCommGrow",
            needs,
            found,
        } => {
            assert_eq!(needs, Version::new(2, 29, 0));
            assert_eq!(found, Version::new(2, 18, 3));
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

/// Suspend, resume, the memory figures (2.30), the properties (2.29), scalable init (2.23)
/// and the parameters (2.30) are absent from NVIDIA's 2.18.3 and `Unsupported` through the
/// one gate the safe calls use, naming the release that introduced each (their safe calls
/// take that gate first: a scalable init with no ids is `Unsupported`, not refused).
#[test]
fn suspend_mem_stats_and_properties_are_unsupported_on_2_18() {
    let lib = Library::load_from(support::real_nccl("2.18.3")).expect("2.18.3 loads");
    let t = lib.table();
    let gates = [
        (
            "ncclCommSuspend",
            lib.optional(t.ncclCommSuspend, "ncclCommSuspend").map(drop),
            30,
        ),
        (
            "ncclCommResume",
            lib.optional(t.ncclCommResume, "ncclCommResume").map(drop),
            30,
        ),
        (
            "ncclCommMemStats",
            lib.optional(t.ncclCommMemStats, "ncclCommMemStats")
                .map(drop),
            30,
        ),
        (
            "ncclCommQueryProperties",
            lib.optional(t.ncclCommQueryProperties, "ncclCommQueryProperties")
                .map(drop),
            29,
        ),
        (
            "ncclCommInitRankScalable",
            nccl_safe::Communicator::init_rank_scalable_in(
                &lib,
                &nccl_safe::CommDevice::Host,
                1,
                0,
                &[],
                &nccl_safe::Config::new(),
            )
            .map(drop),
            23,
        ),
        (
            "ncclParamGetParameter",
            lib.param("NCCL_DEBUG").map(drop),
            30,
        ),
        (
            "ncclParamGetAllParameterKeys",
            lib.param_names().map(drop),
            30,
        ),
        ("ncclParamBind", lib.bind_param("NCCL_DEBUG").map(drop), 30),
    ];
    for (symbol, r, minor) in gates {
        match r {
            Err(Error::Unsupported {
                symbol: s,
                needs,
                found,
            }) if s == symbol
                && needs == Version::new(2, minor, 0)
                && found == Version::new(2, 18, 3) => {}
            other => panic!("{symbol}: expected Unsupported, got {other:?}"),
        }
    }
}
