//! NVIDIA's real libnccl.so.2 (2.32.3, from the nvidia-nccl-cu12 wheel), without a GPU:
//! loading from every discovery source, version, symbols, error strings, unique ids, and
//! the error a communicator init gives on a machine with no GPU.

mod support;

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::os::unix::fs::symlink;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use nccl_safe::error::Source;
use nccl_safe::{nccl_call, CallContext, Discovery, Error, Library, Provider, ResultCode, Version};

const WHEEL: &str = "2.32.3";

fn env_of(
    pairs: Vec<(&'static str, PathBuf)>,
) -> impl Fn(&str) -> Option<OsString> + Send + Sync + 'static {
    let map: HashMap<&str, OsString> = pairs
        .into_iter()
        .map(|(k, v)| (k, v.into_os_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn expected_version() -> Version {
    Version::new(2, 32, 3)
}

#[test]
fn loads_from_nccl_library_and_reads_the_wheels_version() {
    let lib_path = support::real_nccl(WHEEL);
    let lib = Discovery::new()
        .env(env_of(vec![("NCCL_LIBRARY", lib_path.clone())]))
        .system_search(false)
        .load()
        .expect("load from NCCL_LIBRARY");
    assert_eq!(lib.version(), expected_version());
    assert_eq!(lib.provider(), Provider::Nccl);
    assert_eq!(lib.path(), Some(lib_path.as_path()));
}

/// Run by [`discovery_sources_in_a_fresh_process`]: a process that has mapped no NCCL yet.
#[test]
#[ignore = "run in a fresh process by discovery_sources_in_a_fresh_process"]
fn child_loads_from_an_activated_virtualenv_layout() {
    fresh_child();
    let real = support::real_nccl(WHEEL);
    let venv = support::temp_dir("venv");
    let libdir = venv.join("lib/python3.11/site-packages/nvidia/nccl/lib");
    std::fs::create_dir_all(&libdir).unwrap();
    symlink(&real, libdir.join("libnccl.so.2")).unwrap();
    let d = Discovery::new()
        .env(env_of(vec![("VIRTUAL_ENV", venv.clone())]))
        .system_search(false);
    let c = d.candidates();
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].source, Source::VirtualEnv);
    let lib = d.load().expect("load from VIRTUAL_ENV");
    assert_eq!(lib.path(), Some(libdir.join("libnccl.so.2").as_path()));
    assert_eq!(lib.source(), Some(Source::VirtualEnv));
    assert_eq!(lib.version(), expected_version());
    std::fs::remove_dir_all(&venv).ok();
}

/// Run by [`discovery_sources_in_a_fresh_process`].
#[test]
#[ignore = "run in a fresh process by discovery_sources_in_a_fresh_process"]
fn child_loads_from_nccl_home_lib() {
    fresh_child();
    let real = support::real_nccl(WHEEL);
    let home = support::temp_dir("ncclhome");
    std::fs::create_dir_all(home.join("lib")).unwrap();
    symlink(&real, home.join("lib/libnccl.so.2")).unwrap();
    let lib = Discovery::new()
        .env(env_of(vec![("NCCL_HOME", home.clone())]))
        .system_search(false)
        .load()
        .expect("load from NCCL_HOME");
    assert_eq!(lib.path(), Some(home.join("lib/libnccl.so.2").as_path()));
    assert_eq!(lib.version(), expected_version());
    std::fs::remove_dir_all(&home).ok();
}

#[test]
fn a_wrong_nccl_library_pin_is_an_error_listing_it() {
    let err = Discovery::new()
        .env(env_of(vec![(
            "NCCL_LIBRARY",
            PathBuf::from("/nonexistent/libnccl.so.2"),
        )]))
        .load()
        .unwrap_err();
    // The process's own NCCL (mapped or not, by the tests beside this one), then the pin.
    assert!(
        matches!(err, Error::LibraryNotFound { ref tried } if tried.len() == 2
        && tried[0].source == Source::AlreadyLoaded)
    );
    assert!(err
        .to_string()
        .contains("[NCCL_LIBRARY] /nonexistent/libnccl.so.2: no such file"));
}

/// Set in the child processes of the fresh-process tests.
const CHILD_VAR: &str = "NCCL_SAFE_TEST_FRESH_CHILD";

/// Runs the ignored test `child` alone in a new process of this test binary, where no NCCL
/// is mapped yet (the tests of this binary load NVIDIA's, and discovery prefers what the
/// process already holds), and fails with its output unless it passes.
fn in_fresh_process(child: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            child,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "1")
        .output()
        .expect("spawn the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{child} failed:\n{text}");
    assert!(text.contains("1 passed"), "{child} did not run:\n{text}");
}

/// The libnccl files `/proc/self/maps` lists, each once.
fn mapped_nccls() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut files: Vec<String> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|f| {
            f.rsplit('/')
                .next()
                .is_some_and(|n| n.starts_with("libnccl.so"))
        })
        .map(str::to_string)
        .collect();
    files.sort();
    files.dedup();
    files
}

/// A child's first step: it runs under its parent and no NCCL is mapped yet.
fn fresh_child() {
    assert!(
        std::env::var_os(CHILD_VAR).is_some(),
        "run by its parent test, in a fresh process"
    );
    assert_eq!(mapped_nccls(), Vec::<String>::new(), "a fresh process");
}

#[test]
fn discovery_sources_in_a_fresh_process() {
    in_fresh_process("child_loads_from_an_activated_virtualenv_layout");
    in_fresh_process("child_loads_from_nccl_home_lib");
    in_fresh_process("child_nothing_mapped_is_the_first_line_of_the_listing");
}

#[test]
fn one_nccl_per_process() {
    in_fresh_process("child_the_nccl_another_library_mapped_is_used_and_no_other");
}

/// Run by [`discovery_sources_in_a_fresh_process`].
#[test]
#[ignore = "run in a fresh process by discovery_sources_in_a_fresh_process"]
fn child_nothing_mapped_is_the_first_line_of_the_listing() {
    fresh_child();
    let err = Discovery::new()
        .env(env_of(vec![("NCCL_HOME", PathBuf::from("/nonexistent"))]))
        .system_search(false)
        .load()
        .unwrap_err();
    let Error::LibraryNotFound { tried } = &err else {
        panic!("expected LibraryNotFound, got {err:?}")
    };
    assert_eq!(tried[0].source, Source::AlreadyLoaded);
    assert_eq!(tried[0].outcome, "none mapped in this process");
    assert!(
        err.to_string()
            .contains("[already loaded by the process] libnccl.so*: none mapped in this process"),
        "{err}"
    );
}

/// Another library of the process (PyTorch's `libtorch_cuda.so`, cudarc for another crate)
/// has mapped NVIDIA's 2.18.3; nccl-safe's search points at 2.32.3.
#[test]
#[ignore = "run in a fresh process by one_nccl_per_process"]
fn child_the_nccl_another_library_mapped_is_used_and_no_other() {
    fresh_child();
    let old = support::real_nccl("2.18.3");
    let new = support::real_nccl(WHEEL);
    let c_old = std::ffi::CString::new(old.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: loading NVIDIA's NCCL runs its initialisers, which have no preconditions;
    // the handle is kept for the life of the process, as other code would.
    let handle = unsafe { libc::dlopen(c_old.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!handle.is_null(), "dlopen {}", old.display());
    assert_eq!(mapped_nccls(), vec![old.display().to_string()]);

    // The search (a virtualenv with 2.32.3 active) uses the mapped 2.18.3, and says so.
    let venv = support::temp_dir("venv-beside");
    let libdir = venv.join("lib/python3.11/site-packages/nvidia/nccl/lib");
    std::fs::create_dir_all(&libdir).unwrap();
    symlink(&new, libdir.join("libnccl.so.2")).unwrap();
    let lib = Discovery::new()
        .env(env_of(vec![("VIRTUAL_ENV", venv.clone())]))
        .load()
        .expect("the mapped NCCL");
    assert_eq!(lib.version(), Version::new(2, 18, 3));
    assert_eq!(lib.source(), Some(Source::AlreadyLoaded));
    assert_eq!(lib.path(), Some(old.as_path()));

    // A pin naming another file is a typed error naming both files.
    for (err, pin) in [
        (Library::load_from(&new).unwrap_err(), Source::Explicit),
        (
            Discovery::new()
                .env(env_of(vec![("NCCL_LIBRARY", new.clone())]))
                .load()
                .unwrap_err(),
            Source::NcclLibrary,
        ),
    ] {
        match &err {
            Error::AnotherNcclLoaded {
                loaded,
                requested,
                pin: p,
            } => {
                assert_eq!(loaded, &old);
                assert_eq!(requested, &new);
                assert_eq!(*p, pin);
            }
            other => panic!("expected AnotherNcclLoaded, got {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains(&old.display().to_string()), "{text}");
        assert!(text.contains(&new.display().to_string()), "{text}");
    }

    // A pin naming the same file (through a link) is honoured under its own name.
    let link = venv.join("pinned-libnccl.so.2");
    symlink(&old, &link).unwrap();
    let pinned = Library::load_from(&link).expect("the same file");
    assert_eq!(pinned.source(), Some(Source::Explicit));
    assert_eq!(pinned.version(), Version::new(2, 18, 3));

    // And after all of it, the process still holds exactly one NCCL.
    assert_eq!(mapped_nccls(), vec![old.display().to_string()]);
    std::fs::remove_dir_all(&venv).ok();
}

#[test]
fn every_optional_symbol_of_2_31_and_older_resolves() {
    let lib = Library::load_from(support::real_nccl(WHEEL)).unwrap();
    let features = lib.optional_features();
    for s in nccl_sys::OPTIONAL_SYMBOLS {
        let present = features.iter().any(|(n, p)| *n == s.name && *p);
        if s.since <= (2, 31) {
            assert!(
                present,
                "{} (since {:?}) should resolve in NCCL 2.32.3",
                s.name, s.since
            );
        }
    }
    assert!(lib.has("ncclAlltoAll") && lib.has("ncclCommShrink") && lib.has("ncclAllReduce"));
    assert!(lib
        .optional(lib.table().ncclAlltoAll, "ncclAlltoAll")
        .is_ok());
}

#[test]
fn error_strings_for_every_result_code() {
    let lib = Library::load_from(support::real_nccl(WHEEL)).unwrap();
    let codes = [
        ResultCode::UnhandledCudaError,
        ResultCode::SystemError,
        ResultCode::InternalError,
        ResultCode::InvalidArgument,
        ResultCode::InvalidUsage,
        ResultCode::RemoteError,
        ResultCode::InProgress,
        ResultCode::Timeout,
    ];
    let mut seen = HashSet::new();
    for code in codes {
        let s = lib.error_string(code);
        assert!(!s.is_empty(), "{code:?}");
        assert!(seen.insert(s.clone()), "{code:?} repeats {s:?}");
        let err = lib.error_for("ncclTest", code.to_raw(), CallContext::NONE);
        assert_eq!(err.code, code);
        assert!(Error::from(err).to_string().contains(&s));
    }
    assert!(lib
        .error_string(ResultCode::UnhandledCudaError)
        .to_lowercase()
        .contains("cuda"));
    assert!(lib
        .error_string(ResultCode::InvalidArgument)
        .to_lowercase()
        .contains("invalid argument"));
    assert!(lib.check("ncclTest", 0, CallContext::NONE).is_ok());
}

fn unique_id(lib: &Library) -> [u8; 128] {
    let mut id = nccl_sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid, writable ncclUniqueId.
    unsafe { nccl_call!(lib, ncclGetUniqueId(&mut id), CallContext::NONE) }
        .expect("ncclGetUniqueId");
    id.internal.map(|c| c as u8)
}

#[test]
fn unique_ids_are_128_bytes_and_differ() {
    let lib = Library::load_from(support::real_nccl(WHEEL)).unwrap();
    let a = unique_id(&lib);
    let b = unique_id(&lib);
    assert_eq!(a.len(), 128);
    assert_ne!(a, b);
    assert!(a.iter().any(|&x| x != 0));
}

/// Without a GPU, init fails with a CUDA error and NCCL's last-error text; with one (the
/// test then runs on a GPU machine), a one-rank init succeeds and is destroyed.
#[test]
fn comm_init_fails_without_a_gpu_and_succeeds_with_one() {
    let gpus = nccl_launch::cuda_device_count();
    let lib = Library::load_from(support::real_nccl(WHEEL)).unwrap();
    let id = unique_id(&lib);
    let lib2 = std::sync::Arc::clone(&lib);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
        let raw_id = nccl_sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: `comm` is writable; the id came from ncclGetUniqueId; 1 rank, rank 0.
        let r = unsafe {
            nccl_call!(
                &lib,
                ncclCommInitRank(&mut comm, 1, raw_id, 0),
                CallContext::NONE
            )
        };
        let _ = tx.send(r.map(|()| comm as usize));
    });
    let result = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("ncclCommInitRank hung for 120 s");
    if gpus > 0 {
        let comm =
            result.unwrap_or_else(|e| panic!("one-rank init on a machine with {gpus} GPU(s): {e}"));
        assert_ne!(comm, 0);
        let comm = comm as nccl_sys::ncclComm_t;
        // SAFETY: `comm` came from the successful init above and is torn down once here.
        let r = unsafe { nccl_call!(&lib2, ncclCommDestroy(comm), CallContext::NONE) };
        r.expect("ncclCommDestroy");
        eprintln!("init with {gpus} GPU(s): ok");
        return;
    }
    let err = result.expect_err("ncclCommInitRank cannot succeed without a GPU");
    let nccl = err.as_nccl().expect("an NCCL error");
    assert_eq!(nccl.call, "ncclCommInitRank");
    assert_eq!(nccl.code, ResultCode::UnhandledCudaError, "{err}");
    let last = nccl.last_error.as_deref().expect("NCCL's last error text");
    assert!(err.to_string().contains(last), "{err}");
    eprintln!("init error as users see it: {err}");
}

#[test]
fn fp8_is_supported_and_nccl_memory_needs_a_cuda_stream() {
    let lib = Library::load_from(support::real_nccl(WHEEL)).expect("the wheel loads");
    for d in [
        nccl_safe::DataType::Float8e4m3,
        nccl_safe::DataType::Float8e5m2,
    ] {
        assert!(d.check_supported(&lib).is_ok(), "{d:?}");
    }
    assert!(lib.table().ncclCommRegister.is_some() && lib.table().ncclCommWindowRegister.is_some());
    // The one-sided calls (2.29) resolve.
    let t = lib.table();
    assert!(t.ncclPutSignal.is_some() && t.ncclSignal.is_some() && t.ncclWaitSignal.is_some());
    // Refused before NCCL (or CUDA) is touched: NVIDIA's NCCL allocates device memory.
    let mem = nccl_safe::NcclMemory::<f32>::alloc_zeros_in(&lib, 4, nccl_safe::Stream::Host);
    match mem {
        Err(Error::InvalidArgument {
            call: "ncclMemAlloc",
            reason,
        }) => {
            assert!(reason.contains("CUDA stream"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// NCCL 2.32.3's parameter API needs no GPU: the registry's parameters as typed values, a
/// name outside it (`NCCL_COMM_BLOCKING` too: NCCL reads it with the older `NCCL_PARAM`,
/// which registers nothing) `UnknownParam`, a wrong type `InvalidArgument` (c_api.cc).
#[test]
fn parameters_of_the_real_nccl() {
    let lib = Library::load_from(support::real_nccl(WHEEL)).expect("the wheel loads");
    let names = lib.param_names().unwrap();
    for n in [
        "NCCL_DEBUG_FILE",
        "NCCL_DEBUG_TIMESTAMP_FORMAT",
        "NCCL_DEBUG_TIMESTAMP_LEVELS",
    ] {
        assert!(names.iter().any(|k| k == n), "{n}: {names:?}");
    }
    for n in &names {
        lib.param(n).unwrap();
    }
    for n in ["NCCL_NO_SUCH_PARAM", "NCCL_COMM_BLOCKING"] {
        assert!(
            matches!(lib.param(n), Err(Error::UnknownParam { ref name }) if name == n),
            "{n}"
        );
        assert!(
            matches!(lib.bind_param(n), Err(Error::UnknownParam { .. })),
            "{n}"
        );
    }
    let levels = lib.bind_param("NCCL_DEBUG_TIMESTAMP_LEVELS").unwrap();
    let bits = levels.get::<u32>().unwrap();
    assert_eq!(levels.raw().unwrap(), bits.to_ne_bytes());
    assert!(matches!(
        levels.get::<u64>(),
        Err(Error::InvalidArgument {
            call: "ncclParamGetU64",
            ..
        })
    ));
    let format = lib.bind_param("NCCL_DEBUG_TIMESTAMP_FORMAT").unwrap();
    let text = format.get::<String>().unwrap();
    assert_eq!(text, lib.param("NCCL_DEBUG_TIMESTAMP_FORMAT").unwrap());
    let mut raw = text.into_bytes();
    raw.push(0);
    assert_eq!(format.raw().unwrap(), raw);
    if std::env::var_os("NCCL_DEBUG_TIMESTAMP_FORMAT").is_none() {
        assert_eq!(
            lib.param("NCCL_DEBUG_TIMESTAMP_FORMAT").unwrap(),
            "[%F %T] "
        );
    }
    assert!(format.get::<i32>().is_err());
}
