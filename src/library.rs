//! The loaded NCCL: discovery, version, and the function table every call goes through.
//!
//! A [`Library`] is built in exactly one way: a lookup closure fills a
//! [`nccl_sys::FunctionTable`] (see [`Library::from_lookup`]). For NVIDIA's `libnccl.so.2`
//! the closure is `dlsym` over a library opened with libloading; for the in-process host
//! provider it is the provider's own symbol lookup. Everything above this module sees only
//! the table and the [`Provider`] kind.
//!
//! Every NCCL call in the crate goes through `nccl_call!` (required entry points) or
//! [`Library::optional`] + `nccl_call!` (newer ones), and its result through
//! [`Library::check`], which turns a failure into an [`Error`] carrying NCCL's error string,
//! its last-error text, the call, the rank and the caller.

use std::ffi::{c_void, CStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nccl_sys::{ncclComm_t, ncclResult_t, FunctionTable};
use once_cell::sync::OnceCell;

use crate::error::{Error, NcclError, Result, ResultCode, Source, Tried};
use crate::version::Version;

/// Which implementation backs a [`Library`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Provider {
    /// NVIDIA's NCCL, loaded from a shared library; buffers live in GPU memory.
    Nccl,
    /// The in-process host provider (CPU memory, ranks as threads); see the `host` module.
    Host,
}

/// A loaded NCCL: its function table, version and origin.
///
/// Shared by `Arc`: every communicator holds one, so the library outlives its users.
/// A dlopened NCCL is never unloaded (its helper threads may outlive the last
/// communicator), so entry points stay valid for the life of the process.
pub struct Library {
    table: FunctionTable,
    version: Version,
    provider: Provider,
    path: Option<PathBuf>,
    source: Option<Source>,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library")
            .field("provider", &self.provider)
            .field("version", &self.version)
            .field("path", &self.path)
            .field("source", &self.source)
            .finish()
    }
}

/// Where a checked NCCL call came from: filled into the error when it fails.
#[derive(Debug, Clone, Copy)]
pub struct CallContext {
    /// The communicator, for `ncclGetLastError` (null for calls without one).
    pub comm: ncclComm_t,
    /// The communicator's rank, when known.
    pub rank: Option<usize>,
    /// The user's line that issued the operation, when known.
    pub caller: Option<&'static std::panic::Location<'static>>,
}

impl CallContext {
    /// A call made on no communicator (version, unique id, group start/end).
    pub const NONE: CallContext = CallContext {
        comm: std::ptr::null_mut(),
        rank: None,
        caller: None,
    };

    /// A call made on no communicator (yet) from `caller`, for `rank` when known.
    pub(crate) fn at(rank: Option<usize>, caller: &'static std::panic::Location<'static>) -> Self {
        CallContext {
            rank,
            caller: Some(caller),
            ..CallContext::NONE
        }
    }
}

/// Calls a required NCCL entry point through a [`Library`]'s table and checks its result.
///
/// `nccl_call!(lib, ncclAllReduce(args..), ctx)` evaluates to `Result<()>`. The call is an
/// unsafe FFI call, so the invocation must sit inside an `unsafe` block whose `SAFETY`
/// comment says why the arguments are valid.
#[macro_export]
#[doc(hidden)]
macro_rules! nccl_call {
    ($lib:expr, $f:ident ( $($arg:expr),* $(,)? ), $ctx:expr) => {{
        let lib: &$crate::Library = $lib;
        let raw = (lib.table().$f)($($arg),*);
        lib.check(stringify!($f), raw, $ctx)
    }};
}

static DEFAULT: OnceCell<Arc<Library>> = OnceCell::new();

impl Library {
    /// The process-wide default NCCL, found by [`Discovery`] on first use and then shared.
    ///
    /// A failure is not remembered: a later call searches again (after the user installed
    /// NCCL or set `NCCL_LIBRARY`, say).
    pub fn load() -> Result<Arc<Library>> {
        DEFAULT
            .get_or_try_init(|| Discovery::new().load())
            .map(Arc::clone)
    }

    /// The in-process host provider (see the `host` module): NCCL's API over CPU memory,
    /// ranks as threads. One instance per process.
    #[cfg(feature = "host")]
    pub fn host() -> Arc<Library> {
        static HOST: OnceCell<Arc<Library>> = OnceCell::new();
        Arc::clone(HOST.get_or_init(|| {
            // SAFETY: the host provider's lookup returns its own `extern "C"` functions,
            // with NCCL's signatures, living for the whole process.
            match unsafe { Library::from_lookup(Provider::Host, None, crate::host::lookup) } {
                Ok(lib) => lib,
                Err(e) => unreachable!("the host provider exports every required symbol: {e}"),
            }
        }))
    }

    /// A host provider that reports NCCL `major.minor` and hides entry points added after
    /// it, to test code paths for older NCCL releases. A new instance per call.
    #[cfg(feature = "host")]
    pub fn host_as_version(major: u32, minor: u32) -> Result<Arc<Library>> {
        // SAFETY: as in `host`.
        unsafe {
            Library::from_lookup(
                Provider::Host,
                None,
                crate::host::lookup_as_version(major, minor),
            )
        }
    }

    /// Loads NCCL from exactly this file (no search): [`Discovery::path`]. When the process
    /// already holds an NCCL from another file, this is [`Error::AnotherNcclLoaded`].
    pub fn load_from(path: impl AsRef<Path>) -> Result<Arc<Library>> {
        Discovery::new().path(path.as_ref()).load()
    }

    /// Builds a library from a symbol lookup: the single way tables are filled.
    ///
    /// `ncclGetVersion` is looked up and called first, so a too-old library is reported
    /// as such rather than as a list of missing symbols.
    ///
    /// # Safety
    /// Every non-null pointer `lookup` returns must be the NCCL entry point of that name,
    /// with NCCL's C signature, callable from any thread for the rest of the process.
    pub unsafe fn from_lookup(
        provider: Provider,
        path: Option<PathBuf>,
        lookup: impl FnMut(&CStr) -> *const c_void,
    ) -> Result<Arc<Library>> {
        // SAFETY: forwarded from the caller.
        unsafe { Library::build(provider, path, None, lookup) }
    }

    /// [`Library::from_lookup`], recording how discovery found the library.
    ///
    /// # Safety
    /// As [`Library::from_lookup`].
    unsafe fn build(
        provider: Provider,
        path: Option<PathBuf>,
        source: Option<Source>,
        mut lookup: impl FnMut(&CStr) -> *const c_void,
    ) -> Result<Arc<Library>> {
        let where_ = path
            .clone()
            .unwrap_or_else(|| PathBuf::from("<in-process>"));
        let get_version = lookup(c"ncclGetVersion");
        if get_version.is_null() {
            return Err(Error::MissingSymbols {
                path: where_,
                names: vec!["ncclGetVersion"],
            });
        }
        // SAFETY: by the caller's contract this is ncclGetVersion: `ncclResult_t (int*)`.
        let get_version: unsafe extern "C" fn(*mut i32) -> ncclResult_t =
            unsafe { std::mem::transmute::<*const c_void, _>(get_version) };
        let mut code = 0i32;
        // SAFETY: `code` is a valid, writable int for the duration of the call.
        let raw = unsafe { get_version(&mut code) };
        let version = match (raw, Version::from_code(code)) {
            (nccl_sys::bindings::ncclSuccess, Some(v)) => v,
            _ => {
                return Err(Error::LibraryLoad {
                    path: where_,
                    reason: format!("ncclGetVersion failed (result {raw}, version code {code})"),
                })
            }
        };
        if version < Version::MIN_SUPPORTED {
            return Err(Error::VersionTooOld {
                path: where_,
                found: version,
                min: Version::MIN_SUPPORTED,
            });
        }
        // SAFETY: forwarded from the caller's contract on `lookup`.
        let table = unsafe { FunctionTable::load(lookup) }.map_err(|m| Error::MissingSymbols {
            path: where_.clone(),
            names: m.names,
        })?;
        Ok(Arc::new(Library {
            table,
            version,
            provider,
            path,
            source,
        }))
    }

    /// The library's NCCL version (`ncclGetVersion`).
    pub fn version(&self) -> Version {
        self.version
    }

    /// Which implementation this is.
    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// The file it was loaded from (`None` for in-process providers).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// How [`Discovery`] found it: [`Source::AlreadyLoaded`] when the process had mapped
    /// it before the search. `None` for in-process providers and [`Library::from_lookup`].
    pub fn source(&self) -> Option<Source> {
        self.source
    }

    /// The raw function table, for calling NCCL features this crate does not wrap.
    pub fn table(&self) -> &FunctionTable {
        &self.table
    }

    /// Whether the library exports the named entry point (required ones always).
    pub fn has(&self, symbol: &str) -> bool {
        nccl_sys::REQUIRED_SYMBOLS.contains(&symbol)
            || self.table.present_optional().contains(&symbol)
    }

    /// Every optional entry point with whether this library has it, in table order.
    pub fn optional_features(&self) -> Vec<(&'static str, bool)> {
        let present = self.table.present_optional();
        nccl_sys::OPTIONAL_SYMBOLS
            .iter()
            .map(|s| (s.name, present.contains(&s.name)))
            .collect()
    }

    /// An optional entry point, or [`Error::Unsupported`] naming it, the release that
    /// introduced it and the loaded release.
    #[inline]
    pub fn optional<F: Copy>(&self, f: Option<F>, symbol: &'static str) -> Result<F> {
        match f {
            Some(f) => Ok(f),
            None => Err(self.unsupported(symbol)),
        }
    }

    #[cold]
    fn unsupported(&self, symbol: &'static str) -> Error {
        let (major, minor) = nccl_sys::optional_since(symbol).unwrap_or((u32::MAX, 0));
        Error::Unsupported {
            symbol,
            needs: Version::new(major, minor, 0),
            found: self.version,
        }
    }

    /// Checks an NCCL result: `Ok` for `ncclSuccess`, else the full error (see [`Self::error_for`]).
    #[inline]
    pub fn check(&self, call: &'static str, raw: ncclResult_t, ctx: CallContext) -> Result<()> {
        if raw == nccl_sys::bindings::ncclSuccess {
            Ok(())
        } else {
            Err(self.error_for(call, raw, ctx).into())
        }
    }

    /// Builds the error for a failed call: code, `ncclGetErrorString`, `ncclGetLastError`
    /// (of the call's communicator, or the global one) and the context.
    #[cold]
    #[inline(never)]
    pub fn error_for(&self, call: &'static str, raw: ncclResult_t, ctx: CallContext) -> NcclError {
        let code = ResultCode::from_raw(raw).unwrap_or(ResultCode::Unknown(raw));
        // SAFETY: ncclGetErrorString accepts any result value and returns a static string
        // (or null, handled by `c_text`).
        let message = c_text(unsafe { (self.table.ncclGetErrorString)(raw) })
            .unwrap_or_else(|| format!("NCCL error {raw}"));
        // SAFETY: ncclGetLastError takes a communicator or null and returns a string that
        // stays valid until the next NCCL call on this thread; `c_text` copies it at once.
        // A communicator whose init failed is passed as null by the callers.
        let last_error = c_text(unsafe { (self.table.ncclGetLastError)(ctx.comm) })
            .filter(|s| !s.trim().is_empty());
        NcclError {
            call,
            code,
            message,
            last_error,
            rank: ctx.rank,
            caller: ctx.caller,
        }
    }

    /// `ncclGetErrorString` for a result code.
    pub fn error_string(&self, code: ResultCode) -> String {
        // SAFETY: as in `error_for`.
        c_text(unsafe { (self.table.ncclGetErrorString)(code.to_raw()) }).unwrap_or_default()
    }
}

/// Copies a C string returned by NCCL; `None` for null.
fn c_text(p: *const std::ffi::c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: NCCL returns NUL-terminated strings that live at least until the next call
    // on this thread; we copy before returning.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Opens one candidate. `Ok(None)` (with the reason pushed to `tried`) when it is absent
/// or not loadable; `Err` for a library that loaded but is unusable (too old, missing
/// symbols), which stops the search: that is a broken install the user must hear about.
fn try_open(source: Source, path: &Path, tried: &mut Vec<Tried>) -> Result<Option<Arc<Library>>> {
    let is_bare_name = path.components().count() == 1 && source == Source::SystemLoader;
    // An already-mapped library is only looked up (by the name the loader holds), never
    // loaded again, even if its file has since gone.
    let mapped = source == Source::AlreadyLoaded;
    let no_load = if mapped { libc::RTLD_NOLOAD } else { 0 };
    let mut passed_over = |outcome: String| {
        let location = path.to_path_buf();
        tried.push(Tried {
            source,
            location,
            outcome,
        });
        Ok(None)
    };
    if !is_bare_name && !mapped && !path.is_file() {
        let why = if path.exists() {
            "not a file"
        } else {
            "no such file"
        };
        return passed_over(why.into());
    }
    // SAFETY: opening a library runs its initialisers; we only open files named like (or
    // pointed to as) NCCL, whose initialisers have no preconditions.
    let opened = unsafe {
        libloading::os::unix::Library::open(
            Some(path.as_os_str()),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL | no_load,
        )
    };
    let handle = match opened {
        Ok(h) => h,
        Err(e) => match std::error::Error::source(&e) {
            Some(cause) => return passed_over(format!("{e}: {cause}")),
            None => return passed_over(e.to_string()),
        },
    };
    let loaded_path = if is_bare_name {
        resolved_path(&handle).unwrap_or_else(|| path.to_path_buf())
    } else {
        path.to_path_buf()
    };
    let lookup = |name: &CStr| -> *const c_void {
        // SAFETY: we only read the symbol's address; it is typed by the FunctionTable.
        match unsafe { handle.get::<*const c_void>(name) } {
            Ok(sym) => sym.into_raw() as *const c_void,
            Err(_) => std::ptr::null(),
        }
    };
    // SAFETY: the symbols come from an NCCL library (checked by its version call) whose
    // exported functions have nccl.h's signatures; the handle is leaked below, so they
    // stay valid for the life of the process.
    let lib = unsafe { Library::build(Provider::Nccl, Some(loaded_path), Some(source), lookup) }?;
    // Never dlclose NCCL: its proxy and bootstrap threads may outlive the communicators.
    std::mem::forget(handle);
    Ok(Some(lib))
}

/// The file the loader actually opened for a bare name (from `dladdr` on a symbol).
fn resolved_path(handle: &libloading::os::unix::Library) -> Option<PathBuf> {
    // SAFETY: only the address is read.
    let sym = unsafe { handle.get::<*const c_void>(c"ncclGetVersion") }.ok()?;
    let addr = sym.into_raw() as *const c_void;
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr writes a Dl_info for an address inside a loaded object; `info` is
    // zeroed, sized and aligned as Dl_info.
    let ok = unsafe { libc::dladdr(addr, info.as_mut_ptr()) };
    if ok == 0 {
        return None;
    }
    // SAFETY: dladdr returned non-zero, so it filled `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// The libnccl files the process has mapped, in load order (the dynamic linker's list of
/// loaded objects, read with `dl_iterate_phdr`). A copy of NCCL linked statically into
/// another library has no file of its own and is not seen.
pub(crate) fn mapped_nccl() -> Vec<PathBuf> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> std::ffi::c_int {
        // SAFETY: `data` is the `Vec` passed below, alive and borrowed only by this call.
        let found = unsafe { &mut *data.cast::<Vec<PathBuf>>() };
        // SAFETY: the loader passes a valid `dl_phdr_info` for the duration of the call.
        let name = unsafe { (*info).dlpi_name };
        if !name.is_null() {
            // SAFETY: `dlpi_name` is a NUL-terminated string owned by the loader.
            let name = unsafe { CStr::from_ptr(name) };
            use std::os::unix::ffi::OsStrExt;
            let path = Path::new(std::ffi::OsStr::from_bytes(name.to_bytes()));
            let is_nccl = path
                .file_name()
                .is_some_and(|f| f.as_encoded_bytes().starts_with(b"libnccl.so"));
            if is_nccl {
                found.push(path.to_path_buf());
            }
        }
        0
    }
    let mut found: Vec<PathBuf> = Vec::new();
    // SAFETY: the callback matches dl_iterate_phdr's signature and only reads the info it
    // is given; `found` outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut found as *mut Vec<PathBuf>).cast()) };
    found
}

/// Whether two paths name one file (after symbolic links).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

type EnvFn = dyn Fn(&str) -> Option<OsString> + Send + Sync;

/// The search for `libnccl.so.2`, in this order, stopping at the first library that loads:
///
/// 0. a libnccl the process has already mapped (loaded by PyTorch's `libtorch_cuda.so`, by
///    cudarc for another crate, by a C++ library), found with `dl_iterate_phdr`: it is
///    used as it is ([`Source::AlreadyLoaded`]), so that a process never holds two NCCLs.
///    A pin below that names a different file is [`Error::AnotherNcclLoaded`]; one that
///    names the same file is used;
/// 1. a path given in code ([`Discovery::path`]);
/// 2. `NCCL_LIBRARY` (a file);
/// 3. `NCCL_HOME`, `NCCL_ROOT`, `CUDA_HOME`: their `lib64/` and `lib/` folders;
/// 4. the active Python environment: `$VIRTUAL_ENV/lib/python3*/site-packages/nvidia/nccl/lib`,
///    then `$CONDA_PREFIX/lib` and its `site-packages/nvidia/nccl/lib`;
/// 5. the dynamic loader's own search for `libnccl.so.2`, then `libnccl.so`.
///
/// A path given in code or in `NCCL_LIBRARY` is a pin: when set, nothing else is tried,
/// so a wrong pin is reported instead of silently loading another NCCL. A library that
/// loads but is too old or incomplete stops the search with that error.
pub struct Discovery {
    explicit: Option<PathBuf>,
    env: Option<Box<EnvFn>>,
    system: bool,
}

impl Default for Discovery {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discovery")
            .field("explicit", &self.explicit)
            .field("custom_env", &self.env.is_some())
            .field("system", &self.system)
            .finish()
    }
}

/// One place [`Discovery`] will look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Which source produced it.
    pub source: Source,
    /// A file path, or a bare name for the system loader.
    pub path: PathBuf,
}

impl Discovery {
    /// The default search over the process environment.
    pub fn new() -> Discovery {
        Discovery {
            explicit: None,
            env: None,
            system: true,
        }
    }

    /// Pins the search to this file.
    pub fn path(mut self, path: impl Into<PathBuf>) -> Discovery {
        self.explicit = Some(path.into());
        self
    }

    /// Reads variables through `env` instead of the process environment (for tests and
    /// for programs that carry their own configuration).
    pub fn env(
        mut self,
        env: impl Fn(&str) -> Option<OsString> + Send + Sync + 'static,
    ) -> Discovery {
        self.env = Some(Box::new(env));
        self
    }

    /// Whether to end with the system loader's own search (default: yes).
    pub fn system_search(mut self, on: bool) -> Discovery {
        self.system = on;
        self
    }

    fn var(&self, key: &str) -> Option<OsString> {
        let v = match &self.env {
            Some(f) => f(key),
            None => std::env::var_os(key),
        };
        v.filter(|v| !v.is_empty())
    }

    /// The candidates in search order (files need not exist).
    pub fn candidates(&self) -> Vec<Candidate> {
        let mut out = Vec::new();
        let mut push = |source, path: PathBuf| out.push(Candidate { source, path });
        if let Some(p) = &self.explicit {
            push(Source::Explicit, p.clone());
            return out;
        }
        if let Some(p) = self.var("NCCL_LIBRARY") {
            push(Source::NcclLibrary, PathBuf::from(p));
            return out;
        }
        for (var, source) in [
            ("NCCL_HOME", Source::NcclHome),
            ("NCCL_ROOT", Source::NcclRoot),
            ("CUDA_HOME", Source::CudaHome),
        ] {
            if let Some(root) = self.var(var) {
                let root = PathBuf::from(root);
                for lib in ["lib64", "lib"] {
                    push(source, root.join(lib).join("libnccl.so.2"));
                }
            }
        }
        if let Some(venv) = self.var("VIRTUAL_ENV") {
            for sp in site_packages(Path::new(&venv)) {
                push(Source::VirtualEnv, sp.join("nvidia/nccl/lib/libnccl.so.2"));
            }
        }
        if let Some(conda) = self.var("CONDA_PREFIX") {
            let conda = PathBuf::from(conda);
            push(Source::CondaPrefix, conda.join("lib/libnccl.so.2"));
            for sp in site_packages(&conda) {
                push(Source::CondaPrefix, sp.join("nvidia/nccl/lib/libnccl.so.2"));
            }
        }
        if self.system {
            push(Source::SystemLoader, PathBuf::from("libnccl.so.2"));
            push(Source::SystemLoader, PathBuf::from("libnccl.so"));
        }
        out
    }

    /// Runs the search; [`Error::LibraryNotFound`] lists every candidate and why it failed.
    pub fn load(&self) -> Result<Arc<Library>> {
        let mut tried = Vec::new();
        let candidates = self.candidates();
        let pin = candidates
            .first()
            .filter(|c| matches!(c.source, Source::Explicit | Source::NcclLibrary));
        match mapped_nccl().into_iter().next() {
            Some(loaded) => match pin {
                // The pin is honoured under its own name: it is the same file.
                Some(pin) if same_file(&pin.path, &loaded) => {}
                Some(pin) if pin.path.is_file() => {
                    return Err(Error::AnotherNcclLoaded {
                        loaded,
                        requested: pin.path.clone(),
                        pin: pin.source,
                    })
                }
                // A pin naming no file is reported as not found, beside what is loaded.
                Some(_) => tried.push(Tried {
                    source: Source::AlreadyLoaded,
                    location: loaded,
                    outcome: "mapped, but the pin names another file".into(),
                }),
                None => {
                    if let Some(lib) = try_open(Source::AlreadyLoaded, &loaded, &mut tried)? {
                        return Ok(lib);
                    }
                }
            },
            None => tried.push(Tried {
                source: Source::AlreadyLoaded,
                location: PathBuf::from("libnccl.so*"),
                outcome: "none mapped in this process".into(),
            }),
        }
        for c in candidates {
            if let Some(lib) = try_open(c.source, &c.path, &mut tried)? {
                return Ok(lib);
            }
        }
        Err(Error::LibraryNotFound { tried })
    }
}

/// `<prefix>/lib/python3*/site-packages`, sorted, newest Python first.
fn site_packages(prefix: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(prefix.join("lib"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages"))
        .collect();
    found.sort();
    found.reverse();
    if found.is_empty() {
        // Say where we would have looked, so the error names it.
        found.push(prefix.join("lib/python3/site-packages"));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> + Send + Sync + 'static {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn candidates_follow_the_documented_order() {
        let d = Discovery::new().env(env_of(&[
            ("NCCL_HOME", "/h"),
            ("NCCL_ROOT", "/r"),
            ("CUDA_HOME", "/c"),
            ("CONDA_PREFIX", "/conda"),
        ]));
        let c: Vec<_> = d
            .candidates()
            .into_iter()
            .map(|c| (c.source, c.path))
            .collect();
        let sources: Vec<_> = c.iter().map(|(s, _)| *s).collect();
        assert_eq!(
            sources,
            vec![
                Source::NcclHome,
                Source::NcclHome,
                Source::NcclRoot,
                Source::NcclRoot,
                Source::CudaHome,
                Source::CudaHome,
                Source::CondaPrefix,
                Source::CondaPrefix,
                Source::SystemLoader,
                Source::SystemLoader
            ]
        );
        assert_eq!(c[0].1, PathBuf::from("/h/lib64/libnccl.so.2"));
        assert_eq!(c[6].1, PathBuf::from("/conda/lib/libnccl.so.2"));
        assert_eq!(c[9].1, PathBuf::from("libnccl.so"));
    }

    #[test]
    fn a_pin_is_the_only_candidate() {
        let d = Discovery::new().env(env_of(&[
            ("NCCL_LIBRARY", "/x/libnccl.so.2"),
            ("NCCL_HOME", "/h"),
        ]));
        assert_eq!(
            d.candidates(),
            vec![Candidate {
                source: Source::NcclLibrary,
                path: "/x/libnccl.so.2".into()
            }]
        );
        let d = Discovery::new()
            .path("/y.so")
            .env(env_of(&[("NCCL_LIBRARY", "/x")]));
        assert_eq!(d.candidates()[0].source, Source::Explicit);
        assert_eq!(d.candidates().len(), 1);
    }

    #[test]
    fn not_found_lists_every_path_and_how_to_install() {
        let err = Discovery::new()
            .env(env_of(&[
                ("NCCL_HOME", "/nonexistent-home"),
                ("VIRTUAL_ENV", "/nonexistent-venv"),
            ]))
            .system_search(false)
            .load()
            .unwrap_err();
        let Error::LibraryNotFound { tried } = &err else {
            panic!("expected LibraryNotFound, got {err:?}")
        };
        assert_eq!(tried.len(), 4);
        // Nothing of the unit tests loads NVIDIA's NCCL.
        assert_eq!(tried[0].source, Source::AlreadyLoaded);
        assert_eq!(tried[0].outcome, "none mapped in this process");
        let text = err.to_string();
        assert!(
            text.contains("/nonexistent-home/lib64/libnccl.so.2: no such file"),
            "{text}"
        );
        assert!(
            text.contains(
                "/nonexistent-venv/lib/python3/site-packages/nvidia/nccl/lib/libnccl.so.2"
            ),
            "{text}"
        );
        assert!(text.contains("pip install nvidia-nccl-cu12"), "{text}");
        assert!(text.contains("NCCL_LIBRARY"), "{text}");
    }

    #[test]
    fn a_file_that_is_not_a_library_is_reported_with_the_loader_error() {
        let dir = std::env::temp_dir().join(format!("nccl-safe-notlib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("libnccl.so.2");
        std::fs::write(&f, b"not an ELF file").unwrap();
        let err = Library::load_from(&f).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(&f.display().to_string()), "{text}");
        assert!(!text.contains("no such file"), "{text}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
